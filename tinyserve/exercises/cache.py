"""Checkers for the exercises of chapter 06: the CacheEngine.

Each ``check_*`` runs the reader's function on random cases plus the edge cases a first attempt
tends to miss, and compares it with what the package does on the same case: the real
``CacheEngine`` sizes blocks, sizes a pool (its CUDA rule run against a pretend device), and
swaps blocks between real tensors; the split-x offsets come from actually rearranging a tensor.
"""

from __future__ import annotations

import random
import reprlib
from collections.abc import Callable

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.exercises.verdict import verdict
from tinyserve.viz.cache import pretend_gpu, to_split_x

_repr = reprlib.Repr()
_repr.maxlist = _repr.maxdict = 8
_repr.maxother = 80


def _show(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}" if x.numel() > 8 else f"tensor({x.tolist()})"
    return _repr.repr(x)


def _mismatch(got: object, want: object) -> str:
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        return f"largest |difference| {(got.double() - want.double()).abs().max().item():.3g}"
    return f"{_show(got)}, expected {_show(want)}"


def run_cases(name: str, fn: Callable, cases: list[tuple[tuple, object]],
              same: Callable[[object, object], bool] = lambda a, b: a == b) -> bool:
    """Call ``fn(*args)`` for each case; a case fails if it raises or returns something else."""
    failures = []
    for args, expected in cases:
        shown = ", ".join(_show(a) for a in args)
        try:
            got = fn(*args)
        except Exception as e:  # the reader's code: report any error as a failed case
            failures.append(f"{name}({shown}) raised {type(e).__name__}: {e}")
            continue
        if not same(got, expected):
            failures.append(f"{name}({shown}) -> {_mismatch(got, expected)}")
    return verdict(name, failures, len(cases))


_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}
_SHAPES = [(30, 3, 64), (32, 32, 128), (32, 8, 128), (80, 8, 128), (2, 2, 4)]  # SmolLM2, Llama-2-7B, 3-8B, 3-70B


def check_block_bytes(fn: Callable[[int, int, int, int, int], int], num_cases: int = 120, seed: int = 0) -> bool:
    """``fn(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)``: bytes of one cache block."""
    rng = random.Random(seed)
    cases = [((bs, *shape, b), None) for shape in _SHAPES for bs in (1, 16) for b in (2, 4)]
    while len(cases) < num_cases:
        cases.append(((rng.choice([1, 4, 8, 16, 32]), rng.randint(1, 96), rng.randint(1, 64),
                       rng.choice([32, 64, 80, 128, 256]), rng.choice([1, 2, 4])), None))
    cases = [(args, CacheEngine.get_cache_block_size(*args[:4], _DTYPES[args[4]])) for args, _ in cases]
    return run_cases("block_bytes", fn, cases)


def check_blocks_for_budget(fn: Callable[[int, int, float, int, int], int], num_cases: int = 200,
                            seed: int = 0) -> bool:
    """``fn(total_bytes, free_bytes, gpu_memory_utilization, activation_bytes, block_bytes)``: how
    many blocks the CUDA sizing rule gives a device that reports ``total_bytes`` of memory, of
    which ``free_bytes`` are free once the weights are loaded (never fewer than 0)."""
    rng = random.Random(seed)
    gib = 2**30
    cases = []
    while len(cases) < num_cases:
        layers, heads, head_dim = rng.choice(_SHAPES[:4])
        dtype = rng.choice([torch.bfloat16, torch.float32])
        bs = rng.choice([8, 16, 32])
        block = CacheEngine.get_cache_block_size(bs, layers, heads, head_dim, dtype)
        total = rng.choice([16, 24, 40, 80, 141]) * gib
        # Sometimes so much is in use that nothing is left for the cache (the answer is then 0).
        used = int(total * rng.choice([0.02, 0.2, 0.5, 0.85, 0.95, rng.random()]))
        util = rng.choice([0.5, 0.8, 0.9, 0.95, 1.0])
        act = rng.choice([0, 256 * 2**20, gib, 3 * gib])
        with pretend_gpu(total, total - used):
            want = CacheEngine.profile_num_gpu_blocks(bs, layers, heads, head_dim, dtype, util, act)
        cases.append(((total, total - used, util, act, block), want))
    return run_cases("blocks_for_budget", fn, cases)


def _filled_engine(rng: random.Random, num_gpu: int, num_cpu: int) -> CacheEngine:
    layers, heads, head_dim, bs = rng.randint(1, 3), rng.randint(1, 3), rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
    engine = CacheEngine(CacheConfig(block_size=bs, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu),
                         layers, heads, head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    engine._gpu.copy_(torch.randn(engine._gpu.shape, generator=gen))
    engine._cpu.copy_(torch.randn(engine._cpu.shape, generator=gen))
    return engine


def _clone(cache: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in cache]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def check_swap_out(fn: Callable[[list, list, dict[int, int]], None], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(gpu_cache, cpu_cache, src_to_dst)`` copies device block ``src`` into CPU block ``dst``
    in place, for every layer's K and V (each cache is a list of ``(k_cache, v_cache)`` of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``), as ``CacheEngine.swap_out`` does."""
    rng = random.Random(seed)
    failures = []
    for case in range(num_cases):
        num_gpu, num_cpu = rng.randint(2, 12), rng.randint(1, 8)
        n = 0 if case == 0 else rng.randint(1, min(num_gpu, num_cpu))
        mapping = dict(zip(rng.sample(range(num_gpu), n), rng.sample(range(num_cpu), n)))
        engine = _filled_engine(rng, num_gpu, num_cpu)
        gpu, cpu = _clone(engine.gpu_cache), _clone(engine.cpu_cache)
        engine.swap_out(mapping)
        try:
            fn(gpu, cpu, dict(mapping))
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"swap_out(mapping={mapping}) raised {type(e).__name__}: {e}")
            continue
        if not _same(gpu, engine.gpu_cache):
            failures.append(f"mapping {mapping}: the GPU pool changed (a swap-out only reads it)")
        elif not _same(cpu, engine.cpu_cache):
            pairs = [(x, y) for pa, pb in zip(cpu, engine.cpu_cache) for x, y in zip(pa, pb)]
            wrong = [b for b in range(num_cpu) if any(not torch.equal(x[b], y[b]) for x, y in pairs)]
            failures.append(f"mapping {mapping}: CPU blocks {wrong} differ from CacheEngine.swap_out's")
    return verdict("swap_out", failures, num_cases)


def check_split_x_offset(fn: Callable[[int, int, int, int, int, int, int, int], int], num_cases: int = 300,
                         seed: int = 0) -> bool:
    """``fn(block, token, head, d, block_size, num_kv_heads, head_dim, x)``: the element offset of
    key channel ``d`` of ``token`` (inside ``block``) and ``head`` in vLLM's split-x key cache
    ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]``."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        nb, bs, heads = rng.randint(1, 4), rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 4)
        x = rng.choice([2, 4, 8, 16])
        head_dim = x * rng.randint(1, 4)
        # Number every element by its place in tinyserve's layout, rearrange the real tensor, and
        # read where each number ended up.
        plain = torch.arange(nb * bs * heads * head_dim).view(nb, bs, heads, head_dim)
        where = torch.empty(plain.numel(), dtype=torch.long)
        where[to_split_x(plain, x).reshape(-1)] = torch.arange(plain.numel())
        for _ in range(6):
            b, t, h, d = rng.randrange(nb), rng.randrange(bs), rng.randrange(heads), rng.randrange(head_dim)
            cases.append(((b, t, h, d, bs, heads, head_dim, x), int(where[int(plain[b, t, h, d])])))
    return run_cases("split_x_offset", fn, cases[:num_cases])
