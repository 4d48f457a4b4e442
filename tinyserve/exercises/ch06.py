"""Checkers for chapter 06, the CacheEngine.

- ``check_cache_engine``: the reader's CacheEngine subclass with its own ``swap_out``, ``swap_in``
  and ``copy``, first on random block maps over pools of random numbers (several layers, three
  float dtypes, the device pool on CUDA where there is one), against the package's CacheEngine
  given the same pools and the same map; a failure names the method, the map, and the first
  block (pool, layer, K or V) that holds the wrong bytes and whose bytes it holds. Then inside
  the real engine: s0, s1 (three samples, so copy-on-write) and s2 on a tiny model and a cache so
  small that sequences are swapped out and back in; the tokens must be the package's.
- ``check_max_seqs_in_budget``: how many sequences of a given length a memory budget holds at
  once, against the real BlockSpaceManager allocating them in a pool of the CacheEngine's size.
- ``check_split_x_position``: which key element sits at an offset of vLLM's split-x key cache,
  against a real tensor rearranged into that layout.
"""
from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.exercises.engine_runs import PROMPTS, tiny
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.models.loader import LoadedModel
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroup
from tinyserve.worker import Worker

# -- the core exercise: swap_out, swap_in and copy, on tensors and in the engine -------------------

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


# The engine run: s1 draws three samples (they share the prompt's blocks, so its last block is
# copied on write), and a cache of 18 blocks of 2 tokens preempts by swapping (the check checks it).
ENGINE_RUN = dict(block_size=2, num_gpu_blocks=18, num_cpu_blocks=16, max_model_len=24)


def engine_params() -> dict[str, SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return {"s0": greedy, "s1": SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
            "s2": greedy}


@dataclass
class EngineRun:
    """One run of s0/s1/s2: every sample's tokens ({rid: [sample 0's, sample 1's, ...]}), how
    many rounds called each method with a non-empty map, and the error if the run raised."""

    label: str
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)
    error: str | None = None

    def moves(self) -> str:
        return ", ".join(f"{self.calls[m]} {m}" for m in METHODS)


def _counting(cls: type, calls: Counter) -> type:
    """``cls`` with each method counting the calls that move something."""
    def wrap(name):
        def method(self, mapping):
            calls[name] += bool(mapping)
            return getattr(super(counted, self), name)(mapping)
        return method
    counted = type(f"Counting{cls.__name__}", (cls,), {m: wrap(m) for m in METHODS})
    return counted


def engine_run(cache_engine: type = CacheEngine, label: str = "", loaded: LoadedModel | None = None) -> EngineRun:
    """s0, s1 (three samples) and s2 to the end on the tiny model (or ``loaded``) with
    ``Worker(cache_engine=...)`` on the small swapping cache of ``ENGINE_RUN``."""
    loaded = loaded if loaded is not None else tiny()
    run = EngineRun(label or cache_engine.__name__)
    model_config = ModelConfig(model=str(loaded.path or "in-memory"))
    try:
        worker = Worker(model_config, attention_backend="torch", loaded=loaded,
                        cache_engine=_counting(cache_engine, run.calls))
        engine = LLMEngine(model_config,
                           CacheConfig(block_size=ENGINE_RUN["block_size"], num_gpu_blocks=ENGINE_RUN["num_gpu_blocks"],
                                       num_cpu_blocks=ENGINE_RUN["num_cpu_blocks"], watermark=0.0),
                           SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                           max_model_len=ENGINE_RUN["max_model_len"], preemption_mode="swap"),
                           executor=worker)
        params = engine_params()
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, params[rid])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    run.tokens[out.request_id] = [list(c.token_ids) for c in out.outputs]
    except Exception as e:  # the reader's component: report, do not stop the chapter
        run.error = f"{type(e).__name__}: {e}"
    return run


@functools.cache
def package_run() -> EngineRun:
    """The package's CacheEngine on ``ENGINE_RUN`` (once per process: it does not change)."""
    return engine_run(CacheEngine, "the package's")


def token_difference(mine: EngineRun, want: EngineRun) -> str | None:
    """Where ``mine``'s tokens first depart from ``want``'s, or None if they are the same."""
    if mine.error:
        return f"the engine run raised {mine.error}"
    for rid, samples in want.tokens.items():
        got = mine.tokens.get(rid, [])
        for i, tokens in enumerate(samples):
            other = got[i] if i < len(got) else []
            if other != tokens:
                at = next((j for j, (a, b) in enumerate(zip(other, tokens)) if a != b), min(len(other), len(tokens)))
                name = f"{rid} sample {i}" if len(samples) > 1 else rid
                return (f"{name}'s token {at} is {other[at] if at < len(other) else 'missing'}, "
                        f"the package's {tokens[at] if at < len(tokens) else 'none'}")
    return None


def show_engine_runs(*runs: EngineRun) -> None:
    """Print every run's tokens, sample by sample, and the moves each made."""
    width = max(len(r.label) for r in runs)
    for r in runs:
        if r.error:
            print(f"{r.label:<{width}}  raised {r.error}")
    ok = [r for r in runs if not r.error]
    for rid, samples in (ok[0].tokens.items() if ok else []):
        for i in range(len(samples)):
            for r in ok:
                got = r.tokens.get(rid, [])
                print(f"{rid}.{i} {r.label:<{width}}  {got[i] if i < len(got) else '-'}")
    for r in ok:
        print(f"{r.label:<{width}}  rounds that moved blocks: {r.moves()}")


@checker(chapter=6, answer="SwappingCacheEngine")
def check_cache_engine(cls: type, num_cases: int = 36, seed: int = 0, show: bool = False) -> bool:
    """``cls(cache_config, num_layers, num_kv_heads, head_dim, dtype, device)`` is a CacheEngine
    whose ``swap_out(src_to_dst)`` copies device block ``src`` into CPU block ``dst``,
    ``swap_in(src_to_dst)`` CPU block ``src`` into device block ``dst``, and
    ``copy(src_to_dsts)`` device block ``src`` into each device block of ``dsts``: K and V, in
    every layer, through the pools ``gpu_cache`` and ``cpu_cache`` (one ``(k, v)`` pair per layer).

    The cases are empty maps, three small fixed ones and random ones, on random contents, beside
    the package's CacheEngine. Then (only when they pass) the tiny model serves s0, s1 (three
    samples) and s2 in the real engine with ``Worker(cache_engine=cls)`` on a cache that swaps;
    its tokens must be the package's. ``show`` prints both runs' tokens."""
    by_method = tensor_failures(cls, num_cases, seed)
    wrong = [m for m in METHODS if by_method[m]]
    # The first failure of each wrong method first, so the three lines shown cover them all.
    failures = [by_method[m][0] for m in wrong] + [f for m in wrong for f in by_method[m][1:]]
    num_run = num_cases  # the engine run counts as one more case, run only when the others pass
    if not failures:
        num_run += 1
        want, mine = package_run(), engine_run(cls, "yours")
        if want.error or not all(want.calls[m] for m in METHODS):
            failures.append(f"the package's run moved too little to check ({want.moves()}; {want.error})")
        elif (diff := token_difference(mine, want)) is not None:
            # Which method alone makes the difference: the reader's one, the package's other two.
            alone = [m for m in METHODS
                     if token_difference(engine_run(type(f"Only_{m}", (cls,), {o: getattr(CacheEngine, o)
                                                                             for o in METHODS if o != m})), want)]
            wrong = alone
            blame = (f"; with the package's other methods, your {' and your '.join(alone)} alone already "
                     f"change{'s' if len(alone) == 1 else ''} the tokens") if alone else ""
            failures.append(f"in the engine ({want.moves()}), {diff}{blame}")
        if show and not want.error:
            show_engine_runs(want, mine)
    name = f"your CacheEngine's {', '.join(wrong)}" if wrong else "CacheEngine: swap_out, swap_in, copy"
    return verdict(name, failures, num_run)

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
