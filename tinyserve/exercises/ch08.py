"""Checkers for chapter 08, the Triton paged-attention kernel.

- ``check_decode_kernel``: the reader's decode kernel (the chapter's skeleton with its holes
  filled), run through its launcher ``fn(q, k_cache, v_cache, block_tables, context_lens, scale)``
  on paged caches with shuffled block tables and NaN in every slot no sequence owns, against
  dense attention over each sequence's true K/V (``ch07.dense_causal_attention``). The last case
  plugs it into the real engine as the decode path of an attention backend
  (``DecodeKernelBackend``) on the tiny model, against the package's torch backend.

Without CUDA the kernel runs in Triton's interpreter, on the CPU; with CUDA it compiles and the
cases run on the GPU (``kernel_device``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.reference import TorchBackend
from tinyserve.exercises.ch07 import dense_causal_attention
from tinyserve.exercises.engine_runs import compare, run_engine, same_tokens, tiny
from tinyserve.exercises.verdict import checker, verdict


def kernel_device() -> str:
    """Where a Triton kernel the reader defined runs: on CUDA when it compiles, on the CPU when
    it is interpreted (no CUDA, or ``TRITON_INTERPRET=1``)."""
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


class DecodeKernelBackend:
    """An attention backend whose pure decode batches go to ``decode``, a launcher with the
    signature of ``reference.paged_decode_attention``; stores and prefills stay with the torch
    reference. That is how a new decode kernel enters the engine: ``attention_backend=`` takes
    any object with ``store_kv`` and ``forward``."""

    name = "decode kernel"

    def __init__(self, decode: Callable[..., torch.Tensor]) -> None:
        self.decode = decode
        self.reference = TorchBackend()

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return self.reference.forward(q, k_cache, v_cache, meta, scale)


def _decode_case(rng: random.Random, gen: torch.Generator, device: str):
    block_size = rng.choice([1, 4, 16, 32])
    num_kv_heads, group, head_dim = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([16, 32])
    lens = [rng.randint(1, 70) for _ in range(rng.randint(1, 3))]
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + rng.randint(1, 3)
    order = rng.sample(range(num_blocks), num_blocks)
    tables = [order[sum(needed[:s]):sum(needed[:s + 1])] for s in range(len(lens))]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    ks, vs = [], []
    for n, table in zip(lens, tables):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    want = torch.stack([dense_causal_attention(q[s:s + 1], ks[s], vs[s], scale)[0] for s in range(len(lens))])
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    args = (q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32))
    shown = f"context_lens={lens}, block_size={block_size}, heads {q.shape[1]}/{num_kv_heads}, head_dim {head_dim}"
    return tuple(a.to(device) for a in args) + (scale,), want, shown


@checker(chapter=8, answer="paged_decode")
def check_decode_kernel(fn: Callable[..., torch.Tensor], num_cases: int = 6, seed: int = 0,
                        show: bool = False) -> bool:
    """``fn(q, k_cache, v_cache, block_tables, context_lens, scale)`` -> ``[num_seqs, num_heads,
    head_dim]``, as ``reference.paged_decode_attention``: one new query per sequence against its
    ``context_lens[s]`` cached tokens, found through its block table.

    The last case runs the tiny model in the real engine with ``DecodeKernelBackend(fn)`` and
    compares its greedy tokens with the torch backend's (only when the other cases pass); ``show``
    prints both runs' tokens."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    device = kernel_device()
    failures = []
    for _ in range(num_cases):
        args, want, shown = _decode_case(rng, gen, device)
        try:
            got = fn(*args)
        except Exception as e:  # the reader's kernel: any error is a failed case
            failures.append(f"{shown}: raised {type(e).__name__}: {e}")
            continue
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.double().cpu(), want, atol=1e-5, rtol=1e-5)):
            diff = ((got.double().cpu() - want).abs().nan_to_num(float("inf")).max().item()
                    if isinstance(got, torch.Tensor) and got.shape == want.shape else float("nan"))
            failures.append(f"{shown}: largest |difference| from dense attention {diff:.3g}")
    if not failures:
        loaded = tiny(device)
        package = run_engine("torch backend", loaded=loaded, block_size=4)
        yours = run_engine("your kernel", loaded=loaded, block_size=4, attention_backend=DecodeKernelBackend(fn))
        if show:
            compare(package, yours)
        if not same_tokens(yours, package):
            failures.append(f"in the engine: {yours.error or 'other tokens than the torch backend'}")
    return verdict("decode_kernel", failures, num_cases + 1)
