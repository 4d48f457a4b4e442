"""The torch paged-attention reference against dense softmax attention written out here.

Every case scatters each sequence's K/V over shuffled physical blocks of a cache whose other
slots hold NaN, so a kernel that reads outside a sequence's blocks, or lets masked garbage into
``softmax @ V``, fails loudly.
"""

from __future__ import annotations

import math

import pytest
import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.reference import (
    TorchBackend,
    paged_attention,
    paged_decode_attention,
    store_kv,
)

NUM_KV_HEADS = 2


def dense_attention(q, k, v, scale):
    """Causal softmax attention of the last ``len(q)`` positions of a context ``k``/``v``.

    q: [q_len, H, D], k/v: [ctx, Hkv, D]; query head h reads kv head h // (H // Hkv).
    Computed in float64 so it is the exact side of every comparison.
    """
    q_len, num_heads, _ = q.shape
    ctx = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(query_lens, context_lens, block_size, head_dim, group, *, spare_blocks=3, seed=0,
               dtype=torch.float32):
    """Random queries and contexts, with the contexts written into a paged, NaN-poisoned cache."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))

    tables, contexts = [], []
    for n_blocks, ctx in zip(blocks_per_seq, context_lens):
        table, order = order[:n_blocks], order[n_blocks:]
        k = torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):  # the slow obvious way, independent of store_kv
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        contexts.append((k, v))

    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slot_mapping=[])
    return q, k_cache, v_cache, meta, contexts


def dense_batch(q, meta, contexts, scale):
    outs, start = [], 0
    for q_len, (k, v) in zip(meta.query_lens, contexts):
        outs.append(dense_attention(q[start:start + q_len], k, v, scale))
        start += q_len
    return torch.cat(outs)


def context_lens_for(block_size):
    # 1 token, a partial block, exactly one block, several blocks plus a remainder.
    return [1, max(1, block_size - 1), block_size, 3 * block_size + 5, 2 * block_size + 1]


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_matches_dense(block_size, head_dim, group):
    ctx = context_lens_for(block_size)
    q, kc, vc, meta, contexts = make_batch([1] * len(ctx), ctx, block_size, head_dim, group)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, scale), atol=1e-5, rtol=1e-5)
    # The packed-batch entry point agrees with the decode fast path.
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, scale), out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_varlen_prefill_matches_dense(block_size, head_dim, group):
    lens = [7, 1, 2 * block_size + 3, 19]
    q, kc, vc, meta, contexts = make_batch(lens, lens, block_size, head_dim, group, seed=1)
    scale = head_dim ** -0.5
    out = paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_over_cached_prefix_matches_dense(block_size, group):
    # New tokens after a cached prefix (prefix caching) or a later chunk of a chunked prefill.
    context_lens = [block_size + 3, 2 * block_size, 40, 9]
    query_lens = [3, block_size, 17, 9]
    q, kc, vc, meta, contexts = make_batch(query_lens, context_lens, block_size, 64, group, seed=2)
    assert meta.has_prefix
    out = paged_attention(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_dense(block_size):
    # Decodes, a plain prefill and a prefill over a prefix, interleaved in one packed batch.
    query_lens = [1, 12, 1, 5, 1]
    context_lens = [30, 12, 3, 21, 1]
    q, kc, vc, meta, contexts = make_batch(query_lens, context_lens, block_size, 64, 3, seed=3)
    out = TorchBackend().forward(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, 0.125), atol=1e-5, rtol=1e-5)


def test_backend_dispatches_decode_and_prefill():
    backend = TorchBackend()
    assert backend.name == "torch"
    q, kc, vc, meta, contexts = make_batch([1, 1], [9, 20], 8, 64, 2, seed=4)
    assert meta.is_decode
    out = backend.forward(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close(dtype):
    ctx = [5, 40, 17]
    q, kc, vc, meta, contexts = make_batch([5, 1, 4], ctx, 16, 64, 3, seed=5, dtype=dtype)
    out = paged_attention(q, kc, vc, meta, 0.125)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, 0.125), atol=tol, rtol=tol)


def test_padded_block_table_width_is_ignored():
    # Block tables wider than a sequence needs (padded with 0) must not change the result.
    q, kc, vc, meta, contexts = make_batch([1, 1], [3, 50], 4, 64, 1, seed=6)
    wide = torch.cat([meta.block_tables, torch.zeros(2, 5, dtype=torch.int32)], dim=1)
    out = paged_decode_attention(q, kc, vc, wide, meta.context_lens, 0.125)
    torch.testing.assert_close(out.double(), dense_batch(q, meta, contexts, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_store_kv_writes_slots_and_skips_padding(block_size):
    gen = torch.Generator().manual_seed(7)
    num_blocks, head_dim = 6, 64
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, head_dim), -7.0)
    v_cache = torch.full_like(k_cache, -9.0)
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots, generator=gen)[: min(5, num_slots - 1)].tolist()
    slot_mapping = torch.tensor([slots[0], -1, *slots[1:], -1], dtype=torch.int64)
    n = len(slot_mapping)
    key = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen)
    value = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen)

    store_kv(key, value, k_cache, v_cache, slot_mapping)

    written = {}
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            written[slot] = t
    for slot in range(num_slots):
        block, offset = divmod(slot, block_size)
        if slot in written:
            assert torch.equal(k_cache[block, offset], key[written[slot]])
            assert torch.equal(v_cache[block, offset], value[written[slot]])
        else:  # untouched: still the poison
            assert bool((k_cache[block, offset] == -7.0).all())
            assert bool((v_cache[block, offset] == -9.0).all())


def test_store_then_attend_round_trip():
    # Prefill through store_kv, then a decode step appends one token: matches dense attention.
    block_size, head_dim, group = 4, 64, 2
    gen = torch.Generator().manual_seed(8)
    k_cache = torch.zeros(8, block_size, NUM_KV_HEADS, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = [5, 2, 7]
    n = 10
    k = torch.randn(n + 1, NUM_KV_HEADS, head_dim, generator=gen)
    v = torch.randn(n + 1, NUM_KV_HEADS, head_dim, generator=gen)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n + 1)]
    store_kv(k[:n], v[:n], k_cache, v_cache, torch.tensor(slots[:n]))
    store_kv(k[n:], v[n:], k_cache, v_cache, torch.tensor(slots[n:]))
    q = torch.randn(1, NUM_KV_HEADS * group, head_dim, generator=gen)
    out = paged_decode_attention(q, k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
                                 torch.tensor([n + 1], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, 0.125), atol=1e-5, rtol=1e-5)
