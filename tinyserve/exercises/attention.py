"""Checkers for the exercises of chapter 07: attention over a paged cache, rotary, GQA.

Each ``check_*`` builds random cases (block tables in shuffled order, context lengths that are
and are not multiples of the block size, several GQA ratios) and compares the reader's function
with the package: the reference backend's ``paged_decode_attention``, the model's rotary
embedding, and which KV head a query head reads, found by running real attention on values that
name their head.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.attention.reference import paged_decode_attention
from tinyserve.exercises.cache import run_cases
from tinyserve.exercises.verdict import verdict
from tinyserve.models.llama import RotaryEmbedding, apply_rotary


def _close(atol: float) -> Callable[[object, object], bool]:
    def same(got, want) -> bool:
        return (isinstance(got, torch.Tensor) and got.shape == want.shape
                and bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=0)))
    return same


def _paged_case(rng: random.Random, gen: torch.Generator):
    """A cache of shuffled blocks, one sequence's block table into it, and a context length."""
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_kv_heads = rng.choice([1, 2, 3])
    group = rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([4, 8, 16, 64])
    context_len = rng.randint(1, 5 * block_size + 3)
    num_blocks = -(-context_len // block_size) + rng.randint(1, 6)
    table = rng.sample(range(num_blocks), -(-context_len // block_size))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return k_cache, v_cache, table, context_len, num_kv_heads * group, head_dim


def check_gather_kv(fn: Callable[[torch.Tensor, list[int], int], torch.Tensor], num_cases: int = 80,
                    seed: int = 0) -> bool:
    """``fn(cache, block_table, context_len)`` -> ``[context_len, num_kv_heads, head_dim]``: one
    sequence's keys (or values) in position order, read from ``cache [num_blocks, block_size,
    num_kv_heads, head_dim]`` through its block table."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(num_cases):
        k_cache, _, table, context_len, _, _ = _paged_case(rng, gen)
        # The expected rows come from slot arithmetic, one position at a time.
        bs = k_cache.shape[1]
        want = torch.stack([k_cache[table[p // bs], p % bs] for p in range(context_len)])
        cases.append(((k_cache, table, context_len), want))
    return run_cases("gather_kv", fn, cases, same=_close(0.0))


def check_decode_attention(fn: Callable[..., torch.Tensor], num_cases: int = 80, seed: int = 0) -> bool:
    """``fn(q, k_cache, v_cache, block_table, context_len, scale)`` -> ``[num_heads, head_dim]``:
    the attention output of one decode query ``q [num_heads, head_dim]`` over the sequence's
    ``context_len`` cached tokens, with grouped-query attention when ``num_heads`` is a multiple
    of the cache's ``num_kv_heads``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(num_cases):
        k_cache, v_cache, table, context_len, num_heads, head_dim = _paged_case(rng, gen)
        q = torch.randn(num_heads, head_dim, generator=gen)
        scale = head_dim**-0.5
        want = paged_decode_attention(q[None], k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
                                      torch.tensor([context_len], dtype=torch.int32), scale)[0]
        cases.append(((q, k_cache, v_cache, table, context_len, scale), want))
    return run_cases("decode_attention", fn, cases, same=_close(1e-5))


def check_rotary(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], num_cases: int = 60,
                 seed: int = 0) -> bool:
    """``fn(x, positions, theta)``: rotate ``x [num_tokens, num_heads, head_dim]`` for its token
    positions as Llama does (channel ``i`` pairs with channel ``i + head_dim / 2``; pair ``i``
    turns by ``position * theta ** (-2i / head_dim)``)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(num_cases):
        head_dim = rng.choice([4, 8, 16, 64, 128])
        theta = rng.choice([10_000.0, 100_000.0, 500_000.0, 500.0])
        positions = torch.tensor([rng.randint(0, 2047) for _ in range(rng.randint(1, 6))])
        if rng.random() < 0.2:
            positions[0] = 0  # position 0 is the identity
        x = torch.randn(len(positions), rng.randint(1, 4), head_dim, generator=gen)
        rope = RotaryEmbedding(head_dim, 2048, theta, {"rope_type": "default"})
        cases.append(((x, positions, theta), apply_rotary(x, *rope(positions))))
    # float32 angles of positions in the thousands carry errors near 1e-4 rad, whichever way
    # they are computed; a wrong pairing or frequency is off by O(1).
    return run_cases("rotary", fn, cases, same=_close(2e-3))


def check_kv_head(fn: Callable[[int, int, int], int], seed: int = 0) -> bool:
    """``fn(q_head, num_heads, num_kv_heads)``: which KV head query head ``q_head`` reads.

    The answer is measured, not assumed: one cached token whose value vector is filled with its
    KV head's number, so the attention output of each query head *is* the number it read."""
    failures, num_cases = [], 0
    for num_kv_heads in (1, 2, 3, 4, 8):
        for group in (1, 2, 3, 4, 7):
            num_heads = num_kv_heads * group
            shape = (1, 1, num_kv_heads, 4)
            v_cache = torch.arange(num_kv_heads, dtype=torch.float32)[None, None, :, None].expand(shape).clone()
            out = paged_decode_attention(torch.zeros(1, num_heads, 4), torch.zeros(shape), v_cache,
                                         torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
            truth = out[0, :, 0].round().long().tolist()
            for h in range(num_heads):
                num_cases += 1
                try:
                    got = fn(h, num_heads, num_kv_heads)
                except Exception as e:  # the reader's code: any error is a failed case
                    failures.append(f"kv_head({h}, {num_heads}, {num_kv_heads}) raised {type(e).__name__}: {e}")
                    continue
                if got != truth[h]:
                    failures.append(f"kv_head({h}, {num_heads}, {num_kv_heads}) -> {got!r}, expected {truth[h]}")
    return verdict("kv_head", failures, num_cases)
