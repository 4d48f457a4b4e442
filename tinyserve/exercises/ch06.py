"""Checkers for chapter 06, the CacheEngine.

- ``check_cache_engine``: the reader's CacheEngine subclass with its own ``swap_out``, ``swap_in``
  and ``copy``, first on random block maps over pools of random numbers (several layers, three
  float dtypes, the device pool on CUDA where there is one), against the package's CacheEngine
  given the same pools and the same map; a failure names the method, the map, and the first
  block (pool, layer, K or V) that holds the wrong bytes and whose bytes it holds. Then inside
  the real engine: s0, s1 (three samples, so copy-on-write) and s2 on a tiny model and a cache so
  small that sequences are swapped out and back in; the tokens must be the package's.
- ``check_max_seqs_in_budget`` and ``check_split_x_position``, the shorter exercises on sizing and
  on vLLM's key layout, are in ``ch06_sizing.py`` (imported here, so they are this module's too);
  the tensor cases of the core exercise are in ``ch06_moves.py``.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.exercises.ch06_moves import METHODS, random_map, tensor_failures  # noqa: F401 (random_map: as before)
from tinyserve.exercises.ch06_sizing import check_max_seqs_in_budget, check_split_x_position, max_seqs_reference  # noqa: F401 (the shorter exercises' checkers, importable from here)
from tinyserve.exercises.engine_runs import PROMPTS, tiny
from tinyserve.exercises.verdict import checker, verdict
from tinyserve.models.loader import LoadedModel
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker

# -- the core exercise in the engine (its tensor cases: ch06_moves) ----------------------------------

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

