"""Checkers for the exercises of chapter 08: the Triton paged decode kernel.

Each ``check_*`` runs the reader's function on random cases plus the edge cases a first attempt
usually misses, compares with an answer computed independently (a direct softmax, the kernel
module's own ``choose_num_splits``, the launch plan of ``viz.attention_kernel``), prints a
verdict and returns True or False.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from tinyserve.attention.triton_paged import MIN_PARTITION_TOKENS, choose_num_splits
from tinyserve.exercises.verdict import run_cases
from tinyserve.viz.attention_kernel import kv_bytes_per_step, partition_layout

# -- merging two partitions --------------------------------------------------------------------


def _partition(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A partition's normalized output and the log-sum-exp of its scores (an empty one: 0, -inf)."""
    if scores.numel() == 0:
        return torch.zeros(values.shape[-1], dtype=torch.float64), float("-inf")
    return torch.softmax(scores, 0) @ values, float(torch.logsumexp(scores, 0))


def check_merge_partitions(fn: Callable, num_cases: int = 100, seed: int = 0) -> bool:
    """``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)``: merge two partitions of one softmax.

    ``o_a`` (a float64 tensor ``[D]``) is the softmax over partition a's scores applied to its
    values, ``lse_a`` (a float) the natural log of the sum of ``exp(score)`` over partition a;
    likewise b. Return the softmax over both partitions' scores applied to all the values, and
    its log-sum-exp. An empty partition has ``lse = -inf`` and ``o = 0``. Scores may be as large
    as 800, where ``exp`` overflows even in float64.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(num_cases):
        dim = rng.choice([1, 4, 8])
        n_a, n_b = rng.randint(1, 12), rng.randint(1, 12)
        if i % 10 == 1:
            n_a = 0  # an empty partition weighs nothing
        elif i % 10 == 2:
            n_b = 0
        offset = rng.choice([0.0, 0.0, 50.0, 800.0, -800.0])
        spread = rng.choice([1.0, 5.0, 30.0])
        scores = torch.randn(n_a + n_b, generator=gen, dtype=torch.float64) * spread + offset
        if i % 10 == 3:
            scores[n_a:] += 40.0  # one partition dominates completely
        values = torch.randn(n_a + n_b, dim, generator=gen, dtype=torch.float64)
        o_a, lse_a = _partition(scores[:n_a], values[:n_a])
        o_b, lse_b = _partition(scores[n_a:], values[n_a:])
        expected = (torch.softmax(scores, 0) @ values, float(torch.logsumexp(scores, 0)))
        cases.append(((o_a, lse_a, o_b, lse_b), expected))

    def same(got, expected):
        o, lse = got
        o = torch.as_tensor(o, dtype=torch.float64)
        return (o.shape == expected[0].shape and bool(torch.allclose(o, expected[0], rtol=1e-9, atol=1e-9))
                and math.isclose(float(lse), expected[1], rel_tol=1e-12, abs_tol=1e-9))

    def show(args):
        return f"o_a[{len(args[0])}], lse_a={args[1]:.4g}, o_b[{len(args[2])}], lse_b={args[3]:.4g}"

    return run_cases("merge_partitions", fn, cases, describe=show, same=same)


# -- how the context is split ------------------------------------------------------------------


def check_num_splits(fn: Callable[[int, int, int, int], int], num_cases: int = 300, seed: int = 0) -> bool:
    """``fn(num_seqs, num_kv_heads, max_context_len, num_sms) -> int``: how many partitions the
    kernel asks for, as ``triton_paged.choose_num_splits`` decides (keep two programs per SM
    busy; never a partition under MIN_PARTITION_TOKENS tokens)."""
    rng = random.Random(seed)
    cases = [((1, 8, 32768, 132), None), ((256, 8, 32768, 132), None), ((1, 1, 511, 132), None),
             ((1, 1, 512, 132), None), ((33, 8, 4096, 132), None), ((1, 8, 32768, 0), None),
             ((132, 2, 100_000, 132), None), ((131, 2, 100_000, 132), None)]
    while len(cases) < num_cases:
        sms = rng.choice([0, 16, 108, 132, 144])
        ctx = rng.choice([rng.randint(1, 4 * MIN_PARTITION_TOKENS), rng.randint(1, 65536)])
        cases.append(((rng.choice([1, 2, 3, 8, 16, 64, 256]), rng.choice([1, 2, 3, 4, 8]), ctx, sms), None))
    cases = [(args, choose_num_splits(*args)) for args, _ in cases]
    return run_cases("num_splits", fn, cases, same=lambda a, b: a == b)


def check_partition_layout(fn: Callable[[int, int, int], tuple[int, int]], num_cases: int = 300,
                           seed: int = 0) -> bool:
    """``fn(max_context_len, num_splits, tile_tokens) -> (partition_size, num_partitions)``.

    Cut a context of ``max_context_len`` tokens into at most ``num_splits`` partitions of equal
    size, each a whole number of tiles of ``tile_tokens`` tokens and as small as that allows;
    return the partition size and how many partitions it takes to cover the context."""
    rng = random.Random(seed)
    cases = [(1, 1, 16), (64, 1, 64), (65, 1, 64), (100, 64, 16), (700, 2, 64), (1024, 4, 64), (1025, 4, 64)]
    while len(cases) < num_cases:
        tile = rng.choice([16, 32, 64, 128])
        cases.append((rng.randint(1, 40_000), rng.choice([1, 2, 3, 5, 8, 33, 64, 128]), tile))
    cases = [(args, partition_layout(*args)) for args in cases]
    return run_cases("partition_layout", fn, cases, same=lambda a, b: tuple(a) == b)


# -- grouped-query attention: which program serves a query head ---------------------------------


def check_kv_head_of(fn: Callable[[int, int, int], tuple[int, int]], num_cases: int = 300, seed: int = 0) -> bool:
    """``fn(query_head, num_heads, num_kv_heads) -> (kv_head, row)``: the KV head whose program
    attends for this query head, and the row of that program's query tile it occupies. The
    kernel loads rows ``kv_head * group + arange(group)`` with ``group = num_heads // num_kv_heads``."""
    rng = random.Random(seed)
    cases = [(0, 1, 1), (8, 9, 3), (3, 9, 3), (31, 32, 8), (5, 32, 32), (5, 32, 1)]
    while len(cases) < num_cases:
        kv, group = rng.choice([1, 2, 3, 4, 8, 32]), rng.choice([1, 2, 3, 4, 7, 8])
        cases.append((rng.randrange(kv * group), kv * group, kv))
    expected = []
    for head, num_heads, kv in cases:
        group = num_heads // kv
        # The rows each program loads, written as the kernel writes them; find the head among them.
        owners = {kv_head * group + r: (kv_head, r) for kv_head in range(kv) for r in range(group)}
        expected.append(((head, num_heads, kv), owners[head]))
    return run_cases("kv_head_of", fn, expected, same=lambda a, b: tuple(a) == b)


# -- bytes one decode step reads ---------------------------------------------------------------


def check_decode_kv_bytes(fn: Callable[[list[int], int, int, int], int], num_cases: int = 200,
                          seed: int = 0) -> bool:
    """``fn(context_lens, num_kv_heads, head_dim, dtype_bytes) -> int``: the K/V bytes one
    layer's decode step reads from the cache, each cached row once."""
    rng = random.Random(seed)
    cases = [([1], 1, 64, 2), ([4096] * 16, 8, 128, 2), ([5, 5, 3], 3, 64, 4)]
    while len(cases) < num_cases:
        lens = [rng.randint(1, 9000) for _ in range(rng.randint(1, 12))]
        cases.append((lens, rng.choice([1, 2, 3, 8, 32]), rng.choice([64, 80, 128]), rng.choice([1, 2, 4])))
    cases = [(args, kv_bytes_per_step(*args)) for args in cases]
    return run_cases("decode_kv_bytes", fn, cases, same=lambda a, b: a == b)
