"""Chapter 06's core exercise on tensors: the reader's ``swap_out``, ``swap_in`` and ``copy`` on
random block maps over pools of random numbers (several layers, three float dtypes, the device
pool on CUDA where there is one), beside the package's CacheEngine given the same pools and the
same map. A failure names the method, the map, and the first block (pool, layer, K or V) that
holds the wrong bytes, and whose bytes it holds. ``check_cache_engine`` (``ch06.py``) runs these
cases first, then the engine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig

METHODS = ("swap_out", "swap_in", "copy")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The pool each method reads, and the pool it writes.
POOLS = {"swap_out": ("GPU", "CPU"), "swap_in": ("CPU", "GPU"), "copy": ("GPU", "GPU")}


@dataclass
class _Case:
    method: str
    mapping: dict
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 4
    block_size: int = 2
    num_gpu_blocks: int = 5
    num_cpu_blocks: int = 3
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def call(self) -> str:
        return f"{self.method}({self.mapping})"

    def shape(self) -> str:
        return (f"{_n(self.num_layers, 'layer')}, {self.num_gpu_blocks} GPU and {self.num_cpu_blocks} CPU blocks "
                f"of {_n(self.block_size, 'token')}, {_n(self.num_kv_heads, 'KV head')} of {self.head_dim}, "
                f"{str(self.dtype)[6:]}, GPU pool on {self.device}")

    def build(self, cls: type) -> CacheEngine:
        config = CacheConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                             num_cpu_blocks=self.num_cpu_blocks)
        return cls(config, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def random_map(method: str, rng: random.Random, num_gpu: int, num_cpu: int) -> dict:
    """A map the scheduler could send: distinct sources to distinct destinations; for ``copy``,
    each source shared block to one or more fresh ones, never a source itself."""
    if method == "copy":
        blocks = rng.sample(range(num_gpu), rng.randint(2, num_gpu))
        num_src = rng.randint(1, len(blocks) // 2)
        srcs = blocks[:num_src]
        mapping: dict[int, list[int]] = {s: [] for s in srcs}
        for i, dst in enumerate(blocks[num_src:]):  # every source gets a destination, some get more
            mapping[srcs[i] if i < num_src else rng.choice(srcs)].append(dst)
        return mapping
    num_src, num_dst = (num_gpu, num_cpu) if method == "swap_out" else (num_cpu, num_gpu)
    n = rng.randint(1, min(num_src, num_dst))
    return dict(zip(rng.sample(range(num_src), n), rng.sample(range(num_dst), n)))


def _cases(num_cases: int, seed: int) -> list[_Case]:
    rng = random.Random(seed)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    # Empty maps first (most rounds move nothing), then small fixed ones, then random ones.
    cases = [_Case(m, {}) for m in METHODS]
    cases += [_Case("swap_out", {2: 0, 0: 1}), _Case("swap_in", {1: 3, 0: 0}), _Case("copy", {1: [3, 0, 2]})]
    while len(cases) < num_cases:
        num_gpu, num_cpu = rng.randint(2, 10), rng.randint(1, 8)
        method = METHODS[len(cases) % 3]
        cases.append(_Case(method, random_map(method, rng, num_gpu, num_cpu), rng.randint(1, 4), rng.randint(1, 3),
                           rng.choice([2, 4, 8]), rng.choice([1, 2, 4]), num_gpu, num_cpu, rng.choice(FLOATS),
                           devices[len(cases) % len(devices)]))
    return cases


def _pools(engine: CacheEngine) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Both pools, copied to the CPU: {"GPU": [(k, v) per layer], "CPU": [...]}."""
    return {name: [(k.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True)) for k, v in pool]
            for name, pool in (("GPU", engine.gpu_cache), ("CPU", engine.cpu_cache))}


def _fill(engine: CacheEngine, contents) -> None:
    for name, pool in (("GPU", engine.gpu_cache), ("CPU", engine.cpu_cache)):
        for (k, v), (ck, cv) in zip(pool, contents[name]):
            k.copy_(ck)
            v.copy_(cv)


def _random_contents(case: _Case, gen: torch.Generator):
    def pool(num_blocks):
        shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
        return [(torch.randn(shape, generator=gen).to(case.dtype), torch.randn(shape, generator=gen).to(case.dtype))
                for _ in range(case.num_layers)]
    return {"GPU": pool(case.num_gpu_blocks), "CPU": pool(case.num_cpu_blocks)}


def _whose(block: torch.Tensor, before, pool: str, layer: int, half: int, index: int) -> str:
    """Whose bytes ``block`` holds: a block of ``before`` (the pools before the call), said as
    briefly as the difference from (pool, layer, half, index) allows."""
    if torch.equal(block, before[pool][layer][half][index]):
        return "its own old bytes (it was not written)"
    # The same layer and half first: the likeliest slip is the wrong block.
    order = [(p, ly, h) for p in ("GPU", "CPU") for ly in range(len(before[p])) for h in (0, 1)]
    order.sort(key=lambda o: (o[1] != layer, o[2] != half))
    for p, ly, h in order:
        for b, other in enumerate(before[p][ly][h]):
            if torch.equal(block, other):
                where = "" if (ly, h) == (layer, half) else f" of layer {ly}'s {'KV'[h]}"
                return f"{p} block {b}'s old bytes{where}"
    return "all zeros" if not block.any() else "numbers no block held before the call"


def _first_wrong(case: _Case, got, want, before) -> str | None:
    """The first block (written pool first) where ``got`` differs from ``want``, described."""
    read, written = POOLS[case.method]
    for pool in dict.fromkeys((written, read)):
        if len(got[pool]) != len(want[pool]):
            return f"the {pool} pool has {len(got[pool])} layers, expected {len(want[pool])}"
        for layer, (pair, want_pair) in enumerate(zip(got[pool], want[pool])):
            for half, (t, w) in enumerate(zip(pair, want_pair)):
                name = f"{pool} pool, layer {layer}, {'KV'[half]}"
                if t.shape != w.shape or t.dtype != w.dtype:
                    return f"{name} is {tuple(t.shape)} {t.dtype} after the call, expected {tuple(w.shape)} {w.dtype}"
                for b in range(w.shape[0]):
                    if not torch.equal(t[b], w[b]):
                        return (f"{pool} block {b}, layer {layer}, {'KV'[half]}: holds "
                                f"{_whose(t[b], before, pool, layer, half, b)}, expected "
                                f"{_whose(w[b], before, pool, layer, half, b)}")
    return None


def tensor_failures(cls: type, num_cases: int = 36, seed: int = 0) -> dict[str, list[str]]:
    """Run every case on ``cls`` and on the package's CacheEngine: method -> failure lines."""
    gen = torch.Generator().manual_seed(seed)
    failures: dict[str, list[str]] = {m: [] for m in METHODS}
    for case in _cases(num_cases, seed):
        contents = _random_contents(case, gen)
        package = case.build(CacheEngine)
        _fill(package, contents)
        getattr(package, case.method)(_copy_map(case.mapping))
        try:
            yours = case.build(cls)
            _fill(yours, contents)
        except Exception as e:  # the reader's code: any error is a failed case
            failures[case.method].append(f"building your class ({case.shape()}) raised {type(e).__name__}: {e}")
            continue
        try:
            getattr(yours, case.method)(_copy_map(case.mapping))
        except Exception as e:
            failures[case.method].append(f"{case.call()} ({case.shape()}) raised {type(e).__name__}: {e}")
            continue
        wrong = _first_wrong(case, _pools(yours), _pools(package), contents)
        if wrong:
            failures[case.method].append(f"{case.call()} ({case.shape()}): {wrong}")
    return failures


def _copy_map(mapping: dict) -> dict:
    # Each engine gets its own copy: an answer that empties the map must not spoil the other's.
    return {k: list(v) if isinstance(v, list) else v for k, v in mapping.items()}
