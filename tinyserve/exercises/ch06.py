"""Checkers for chapter 06, the CacheEngine.

- ``check_swap_out``: the reader's CacheEngine subclass with its own ``swap_out``, first on pools of
  random numbers against a copy made element by element, then inside the real engine: a tiny
  cache that preempts by swapping must give the tokens of a cache so large nobody is preempted.
- ``check_max_seqs_in_budget``: how many sequences of a given length a memory budget holds at
  once, against the real BlockSpaceManager allocating them in a pool of the CacheEngine's size.
- ``check_split_x_position``: which key element sits at an offset of vLLM's split-x key cache,
  against a real tensor rearranged into that layout.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.exercises.engine_runs import compare, run_engine, same_tokens
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroup

# -- swap-out, on real tensors and in the engine --------------------------------------------------

# A cache this small preempts by swapping on the tiny model (the checker checks it did).
SWAP_RUN = dict(block_size=2, num_gpu_blocks=9, num_cpu_blocks=16, max_model_len=18, preemption_mode="swap")


def _random_pools(engine, gen: torch.Generator) -> None:
    for pool in (engine.gpu_cache, engine.cpu_cache):
        for k, v in pool:
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))


def _snapshot(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in pool]


def _expected_cpu(gpu, cpu, mapping: dict[int, int]):
    """The CPU pool after the swap-out, copied one block of one layer's K or V at a time."""
    out = _snapshot(cpu)
    for (gk, gv), (ck, cv) in zip(gpu, out):
        for src, dst in mapping.items():
            ck[dst] = gk[src]
            cv[dst] = gv[src]
    return out


def _same_pool(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def _swap_cases(cls, num_cases: int, seed: int) -> list[str]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    failures = []
    for case in range(num_cases):
        layers, heads, head_dim, bs = rng.randint(1, 3), rng.randint(1, 3), rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
        num_gpu, num_cpu = rng.randint(2, 12), rng.randint(1, 8)
        n = 0 if case == 0 else rng.randint(1, min(num_gpu, num_cpu))
        mapping = dict(zip(rng.sample(range(num_gpu), n), rng.sample(range(num_cpu), n)))
        shape = f"{layers} layers, {heads} KV heads, head_dim {head_dim}, block_size {bs}"
        try:
            engine = cls(CacheConfig(block_size=bs, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu),
                         layers, heads, head_dim, torch.float32, "cpu")
            _random_pools(engine, gen)
            gpu, cpu = _snapshot(engine.gpu_cache), _snapshot(engine.cpu_cache)
            engine.swap_out(dict(mapping))
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"swap_out({mapping}) ({shape}) raised {type(e).__name__}: {e}")
            continue
        want = _expected_cpu(gpu, cpu, mapping)
        if not _same_pool(engine.gpu_cache, gpu):
            failures.append(f"swap_out({mapping}) ({shape}) changed the GPU pool; a swap-out only reads it")
        elif not _same_pool(engine.cpu_cache, want):
            wrong = sorted({b for (x, y), (w, z) in zip(engine.cpu_cache, want)
                            for b in range(num_cpu) if not (torch.equal(x[b], w[b]) and torch.equal(y[b], z[b]))})
            failures.append(f"swap_out({mapping}) ({shape}): CPU blocks {wrong} do not hold what they should")
    return failures


@checker(chapter=6, answer="PerLayerSwapCacheEngine")
def check_swap_out(cls: type, num_cases: int = 30, seed: int = 0, show: bool = False) -> bool:
    """``cls(cache_config, num_layers, num_kv_heads, head_dim, dtype, device)`` is a CacheEngine
    whose ``swap_out(src_to_dst)`` copies device block ``src`` into CPU block ``dst``, K and V, in
    every layer, reading the pools through ``gpu_cache``/``cpu_cache``.

    The last case runs the tiny model in the real engine with ``Worker(cache_engine=cls)`` and a
    cache so small that sequences are swapped out and back in; its tokens must equal those of a
    cache large enough that nobody is preempted (run only when the other cases pass). ``show``
    prints that run's tokens next to the run without preemption and the package's own swap run."""
    failures = _swap_cases(cls, num_cases, seed)
    if not failures:
        roomy = run_engine("no preemption", max_model_len=SWAP_RUN["max_model_len"])
        tiny = run_engine("your CacheEngine", cache_engine=cls, **SWAP_RUN)
        if roomy.error or tiny.error:
            failures.append(f"the engine run {'without preemption' if roomy.error else 'with your CacheEngine'} "
                            f"raised {roomy.error or tiny.error}")
        elif tiny.swap_outs == 0 or tiny.swap_ins == 0:
            failures.append("the engine run swapped nothing: this check's cache is not small enough")
        else:
            if show:
                compare(roomy, run_engine("package CacheEngine", **SWAP_RUN), tiny, show_moves=True)
            if not same_tokens(tiny, roomy):
                bad = [rid for rid in roomy.tokens if tiny.tokens[rid] != roomy.tokens[rid]]
                failures.append(f"in the engine, after {tiny.swap_outs} swap-outs, requests {bad} produced other "
                                "tokens than without preemption: their K/V did not survive the swap")
    return verdict("swap_out", failures, num_cases + 1)


# -- sizing: sequences per budget -------------------------------------------------------------------

_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}


def max_seqs_reference(budget_bytes: int, seq_len: int, block_size: int, num_layers: int, num_kv_heads: int,
                       head_dim: int, dtype_bytes: int) -> int:
    """Size the pool as the CacheEngine does, then let the real block manager admit sequences of
    ``seq_len`` tokens until it says no."""
    num_blocks = CacheEngine.num_blocks_for_budget(budget_bytes, block_size, num_layers, num_kv_heads, head_dim,
                                                   _DTYPES[dtype_bytes])
    manager = BlockSpaceManager(block_size, num_blocks, 0, watermark=0.0)
    count = 0
    while True:
        group = SequenceGroup(f"r{count}", [Sequence(count, None, [1] * seq_len, block_size)], SamplingParams(), 0.0)
        if manager.can_allocate(group) != AllocStatus.OK:
            return count
        manager.allocate(group)
        count += 1


@checker(chapter=6, answer="max_seqs_in_budget")
def check_max_seqs_in_budget(fn: Callable[..., int], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(budget_bytes, seq_len, block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)``:
    how many sequences of ``seq_len`` tokens a KV cache of ``budget_bytes`` holds at the same time."""
    rng = random.Random(seed)
    cases = [(2**20, 16, 16, 2, 2, 64, 2), (2**20, 17, 16, 2, 2, 64, 2), (1000, 5, 4, 1, 1, 8, 4)]
    while len(cases) < num_cases:
        bs = rng.choice([1, 4, 8, 16, 32])
        layers, heads = rng.randint(1, 4), rng.randint(1, 4)
        head_dim, b = rng.choice([8, 16, 64]), rng.choice([1, 2, 4])
        seq_len = rng.randint(1, 300)
        block = 2 * layers * bs * heads * head_dim * b
        blocks = rng.randint(0, 600)
        cases.append((blocks * block + rng.randint(0, block - 1), seq_len, bs, layers, heads, head_dim, b))
    return run_cases("max_seqs_in_budget", fn, [(c, max_seqs_reference(*c)) for c in cases])


# -- the split-x key layout, read backwards ----------------------------------------------------------

def _split_x(plain: torch.Tensor, x: int) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` rearranged into vLLM's key layout
    ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]``."""
    nb, bs, heads, head_dim = plain.shape
    return plain.view(nb, bs, heads, head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()


@checker(chapter=6, answer="split_x_position")
def check_split_x_position(fn: Callable[..., tuple[int, int, int, int]], num_cases: int = 300,
                           seed: int = 0) -> bool:
    """``fn(offset, block_size, num_kv_heads, head_dim, x)`` -> ``(block, token, head, d)``: the
    key element stored at element ``offset`` of vLLM's split-x key cache
    ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]``: channel ``d`` of the key of the
    ``token``-th token of ``block``, for KV head ``head``."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        nb, bs, heads = rng.randint(1, 4), rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 4)
        x = rng.choice([2, 4, 8, 16])
        head_dim = x * rng.randint(1, 4)
        # Number every element by (block, token, head, d), rearrange the real tensor, read it back.
        shape = (nb, bs, heads, head_dim)
        flat = _split_x(torch.arange(nb * bs * heads * head_dim).view(shape), x).reshape(-1)
        for _ in range(6):
            offset = rng.randrange(flat.numel())
            where = torch.unravel_index(flat[offset], shape)
            cases.append(((offset, bs, heads, head_dim, x), tuple(int(i) for i in where)))
    return run_cases("split_x_position", fn, cases[:num_cases], same=lambda got, want: tuple(got) == want)
