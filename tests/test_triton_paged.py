"""The Triton kernels against the PyTorch reference.

Without CUDA the kernels run through Triton's interpreter (slow, so the shapes are small); on a
GPU the same tests run the compiled kernels. Every cache scatters each sequence over shuffled
physical blocks and fills every other slot with NaN, so a kernel that reads outside a
sequence's context, or lets a masked slot into ``softmax @ V``, fails loudly.

Tolerances are per cache dtype. float32: both sides compute in float32 and differ only in the
order of the sums (1e-5). float16/bfloat16: the kernel rounds the softmax weights to the cache
dtype before ``P @ V`` (as flash attention does) and both round the output, so they may differ
by a couple of units in the last place of the output (fp16 eps ~1e-3, bf16 eps ~8e-3).
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyserve.attention import reference
from tinyserve.attention import triton_paged as tp
from tinyserve.attention.backend import get_backend
from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.triton_backend import ROUTES, TritonBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_KV_HEADS = 2
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2),
}


def make_paged(context_lens, block_size, head_dim, num_kv_heads=NUM_KV_HEADS, *, dtype=torch.float32,
               spare_blocks=3, seed=0):
    """Caches holding random K/V for each context over shuffled blocks, NaN everywhere else.

    Returns ``k_cache, v_cache, block_tables [S, max_blocks] int32`` with the table padded by
    block 0, which belongs to some sequence (or is spare): padding must never be read.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_flat = torch.full(shape, float("nan"), dtype=dtype)
    v_flat = torch.full(shape, float("nan"), dtype=dtype)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for s, (n_blocks, ctx) in enumerate(zip(blocks_per_seq, context_lens)):
        table, order = order[:n_blocks], order[n_blocks:]
        tables[s, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache = k_flat.view(num_blocks, block_size, num_kv_heads, head_dim).to(DEVICE)
    v_cache = v_flat.view(num_blocks, block_size, num_kv_heads, head_dim).to(DEVICE)
    return k_cache, v_cache, tables.to(DEVICE)


def random_q(num_seqs, num_heads, head_dim, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)


def test_interpreter_is_used_exactly_when_there_is_no_cuda():
    expect = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    assert tp.INTERPRET is expect


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_interpreter_works_when_triton_was_imported_first():
    # transformers imports torch._dynamo, which imports triton, before anyone sets
    # TRITON_INTERPRET: triton's own @jit helpers (tl.max, tl.sum, tl.zeros) are then compiled-mode
    # functions. The kernels must still run interpreted, with nothing patched behind the scenes.
    code = (
        "import triton, torch\n"
        "import triton.language as tl\n"
        "assert isinstance(tl.max, triton.runtime.JITFunction)  # the stdlib stayed compiled-mode\n"
        "from tinyserve.attention import triton_paged as tp, reference as ref\n"
        "assert tp.INTERPRET\n"
        "k = torch.randn(4, 16, 1, 16); v = torch.randn_like(k); q = torch.randn(2, 2, 16)\n"
        "bt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32); cl = torch.tensor([20, 7], dtype=torch.int32)\n"
        "out = tp.paged_decode_attention(q, k, v, bt, cl, 0.25, num_splits=2)\n"
        "torch.testing.assert_close(out, ref.paged_decode_attention(q, k, v, bt, cl, 0.25))\n"
        "assert isinstance(tl.max, triton.runtime.JITFunction)  # and nobody rewrapped it\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# Each axis (block size, head_dim, GQA group, dtype) meets every value of every other axis at
# least once (a pairwise cover), and each batch mixes the edge contexts: 1 token, a block minus
# one, exactly a block, a block plus one, and many blocks. Batches run from 1 to 8 sequences.
DECODE_CASES = [
    # block_size, head_dim, group, dtype, context_lens
    (8, 64, 1, torch.float32, [1]),
    (8, 128, 3, torch.float16, [7, 8, 9]),
    (8, 128, 4, torch.float32, [1, 7, 8, 9, 61]),
    (16, 128, 1, torch.float16, [15, 16, 17, 100]),
    (16, 64, 3, torch.float32, [1, 15, 16, 17, 33, 64, 95, 130]),
    (16, 64, 4, torch.float16, [200]),
    (32, 64, 1, torch.float16, [31, 32, 33, 1, 150, 64]),
    (32, 128, 3, torch.float32, [100, 31]),
    (32, 64, 4, torch.float32, [1, 32, 33, 31, 97, 250, 7]),
    # Beyond the sweep: bfloat16, and a head_dim that is not a power of two (padded in-kernel).
    (16, 64, 4, torch.bfloat16, [17, 90]),
    (16, 80, 2, torch.float32, [20, 45, 16]),
]


@pytest.mark.parametrize(
    "block_size,head_dim,group,dtype,context_lens", DECODE_CASES,
    ids=[f"bs{c[0]}-d{c[1]}-g{c[2]}-{str(c[3])[6:]}-n{len(c[4])}" for c in DECODE_CASES])
def test_decode_matches_reference(block_size, head_dim, group, dtype, context_lens):
    k_cache, v_cache, tables = make_paged(context_lens, block_size, head_dim, dtype=dtype)
    q = random_q(len(context_lens), NUM_KV_HEADS * group, head_dim, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    out = tp.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=1)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,tile_tokens", [(2, None), (3, 16), (64, 16)])
def test_split_context_equals_single_pass(dtype, num_splits, tile_tokens):
    # Mixed lengths: the shorter sequences leave later partitions empty, which must weigh 0.
    context_lens = [1, 40, 100, 333]
    block_size, head_dim, group = 16, 64, 2
    k_cache, v_cache, tables = make_paged(context_lens, block_size, head_dim, dtype=dtype)
    q = random_q(len(context_lens), NUM_KV_HEADS * group, head_dim, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)

    single = tp.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=1)
    split = tp.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits,
                                      max_context_len=max(context_lens), tile_tokens=tile_tokens)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(split.float(), single.float(), **TOL[dtype])
    torch.testing.assert_close(split.float(), expected.float(), **TOL[dtype])


def test_choose_num_splits():
    # A full GPU (132 SMs) gets the single pass; one long sequence gets split, in partitions of
    # at least MIN_PARTITION_TOKENS; short contexts are never split; no SMs (CPU) never splits.
    assert tp.choose_num_splits(256, 8, 32768, num_sms=132) == 1
    assert tp.choose_num_splits(1, 8, 32768, num_sms=132) == 33
    assert tp.choose_num_splits(1, 8, 1024, num_sms=132) == 1024 // tp.MIN_PARTITION_TOKENS
    assert tp.choose_num_splits(1, 1, 300, num_sms=132) == 1
    assert tp.choose_num_splits(1, 1, 32768, num_sms=0) == 1


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,src_dtype,cache_dtype", [
    (8, 3, 64, torch.float32, torch.float32),
    (16, 2, 80, torch.float32, torch.float16),   # casts on store; head_dim not a power of two
    (32, 1, 128, torch.float16, torch.float16),
])
def test_store_kv_writes_each_token_to_its_slot_only(block_size, num_kv_heads, head_dim, src_dtype,
                                                     cache_dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, num_tokens = 5, 13
    num_slots = num_blocks * block_size
    # Distinct slots, never the last one: a kernel that wrote slot -1 with Python-style
    # wrap-around would hit it, and the poison check below would see it.
    slots = torch.randperm(num_slots - 1, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens
    # Non-contiguous rows, as when K and V are views into one fused projection output.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = fused[:, 0], fused[:, 1]

    poison = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype)
    k_cache, v_cache = poison.clone().to(DEVICE), poison.clone().to(DEVICE)
    tp.store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))

    expected_k = poison.clone().view(num_slots, num_kv_heads, head_dim)
    expected_v = expected_k.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot] = key[t].to(cache_dtype)
            expected_v[slot] = value[t].to(cache_dtype)
    exact = dict(atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(k_cache.cpu().view(num_slots, num_kv_heads, head_dim), expected_k, **exact)
    torch.testing.assert_close(v_cache.cpu().view(num_slots, num_kv_heads, head_dim), expected_v, **exact)


def _run_backend(backend, query_lens, context_lens, tables, k_new, v_new, q, k_cache, v_cache, block_size):
    """Store this step's K/V through the backend, then attend; as a layer of the model would."""
    slots = []
    for qlen, ctx, table in zip(query_lens, context_lens, tables):
        for pos in range(ctx - qlen, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, device=DEVICE)
    backend.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    return backend.forward(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("query_lens,context_lens,route", [
    ([5, 3, 17], [5, 3, 17], "prefill-sdpa"),    # plain prefill: torch SDPA over the new tokens
    ([1, 1, 1], [6, 4, 18], "decode-kernel"),    # decode: the Triton kernel
    ([1, 4], [10, 9], "torch-batched"),          # decode mixed with a prefill over a cached prefix
    ([6, 1], [6, 7], "torch-batched"),           # a plain prefill mixed with a decode (orca)
    ([4], [12], "torch-batched"),                # a later chunk of a chunked prefill
], ids=["prefill", "decode", "prefix+decode", "prefill+decode", "chunk"])
def test_backend_forward_matches_torch_backend(query_lens, context_lens, route, caplog):
    block_size, num_kv_heads, group, head_dim = 4, 3, 3, 64  # SmolLM2's heads
    gen = torch.Generator().manual_seed(5)
    tables, next_block = [], 1  # block 0 stays unused, so padded tables point at poison
    for ctx in context_lens:
        n = math.ceil(ctx / block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # scrambled order
        next_block += n
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(DEVICE)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)

    # The cached prefix (positions before this step's tokens) is the same in both caches.
    prefix = torch.randn(next_block, block_size, num_kv_heads, head_dim, generator=gen)
    caches = {}
    for name in ("torch", "triton"):
        k_cache, v_cache = prefix.clone().to(DEVICE), (prefix * -0.5).to(DEVICE)
        backend = get_backend(name, DEVICE) if name == "torch" else TritonBackend()
        assert backend.name == name
        with caplog.at_level("INFO", logger="tinyserve.attention"):
            out = _run_backend(backend, query_lens, context_lens, tables, k_new, v_new, q, k_cache, v_cache,
                               block_size)
        caches[name] = (out, k_cache, v_cache)
    # The route taken is recorded, and a PyTorch route is said in the log, with its reason.
    assert dict(backend.route_counts) == {route: 1}
    logged = [r.getMessage() for r in caplog.records if r.name == "tinyserve.attention"]
    assert logged == ([] if route == "decode-kernel" else [f"triton backend: {ROUTES[route]}"])
    out_torch, k_torch, v_torch = caches["torch"]
    out_triton, k_triton, v_triton = caches["triton"]
    assert torch.equal(k_triton, k_torch) and torch.equal(v_triton, v_torch)
    assert out_triton.shape == q.shape
    torch.testing.assert_close(out_triton, out_torch, **TOL[torch.float32])


def test_get_backend_triton():
    assert isinstance(get_backend("triton", DEVICE), TritonBackend)
    assert isinstance(get_backend("auto", "cuda"), TritonBackend)


def test_a_fallback_is_logged_once_per_backend(caplog):
    backend = TritonBackend()
    meta = AttentionMetadata.build([4], [12], [[2, 0, 1]], [8, 9, 10, 11], device=DEVICE)
    k_cache = torch.randn(3, 4, 1, 16, device=DEVICE)
    q = torch.randn(4, 2, 16, device=DEVICE)
    with caplog.at_level("INFO", logger="tinyserve.attention"):
        for _ in range(3):  # three layers of one forward pass
            backend.forward(q, k_cache, k_cache, meta, 0.25)
    assert backend.route_counts["torch-batched"] == 3
    assert len([r for r in caplog.records if r.name == "tinyserve.attention"]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the interpreter's")
def test_kernel_benchmark_smoke(tmp_path):
    # Keeps benchmarks/kernel.py runnable between GPU sessions: its tiny interpreted grid writes
    # one CSV row per shape with both timings filled in.
    out = tmp_path / "kernel.csv"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel.py"
    res = subprocess.run([sys.executable, str(script), "--interpret-smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert all(float(r["triton_us"]) > 0 and float(r["ref_us"]) > 0 for r in rows)
