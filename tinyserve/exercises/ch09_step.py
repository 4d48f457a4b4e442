"""The checker of chapter 09's main exercise: the serving loop, ``step`` and ``execute``.

``check_engine_step(cls)`` first plays ``execute`` alone on rounds of cache orders whose blocks
collide (a block swapped out is a swap-in or copy destination; a copy reads a block swapped in),
on caches whose blocks hold numbers that say where they came from. Then it runs ``cls`` and the
package's ``LLMEngine`` side by side on the tiny random Llama, workload by workload
(``ch09_workloads``), and compares every step: the RequestOutputs returned, the scheduler's
queues, the free blocks and what the observers heard. On the first difference it names the
workload, the step and the request, expected against actual, and which of the two methods makes
the difference: it runs your step with the package's execute, and the package's step with yours.
"""

from __future__ import annotations

import functools

import torch

from tinyserve.engine import LLMEngine
from tinyserve.exercises.ch09_workloads import WORKLOADS, Snapshot, Workload, build, difference, play
from tinyserve.exercises.verdict import checker, verdict
from tinyserve.scheduler_outputs import SchedulerOutputs

# -- execute alone: the cache orders ----------------------------------------------------------------

# (swap_out, swap_in, copy): each collides in a way only one order survives.
ORDER_CASES = [
    ({2: 0}, {1: 2}, {}),            # a block swapped out is a swap-in destination
    ({}, {1: 3}, {3: [5]}),          # a copy reads a block just swapped in
    ({4: 2}, {}, {1: [4]}),          # a copy writes into a block just swapped out
    ({2: 0}, {1: 2}, {2: [6]}),      # all three: the copy reads what the swap-in brought
]


def _labels(engine) -> None:
    """Fill every block of the cache with a number naming it: GPU block b holds b + 1, CPU block c
    holds 1001 + c (all layers, keys and values)."""
    cache = engine.executor.cache_engine
    for pool, base in ((cache.gpu_cache, 1), (cache.cpu_cache, 1001)):
        for kv in pool:
            for t in kv:
                for b in range(t.shape[0]):
                    t[b] = base + b


def _contents(engine) -> tuple[list[int], list[int]]:
    cache = engine.executor.cache_engine
    read = lambda pool: [int(pool[0][0][b].flatten()[0]) for b in range(pool[0][0].shape[0])]  # noqa: E731
    return read(cache.gpu_cache), read(cache.cpu_cache)


def _name(value: int) -> str:
    return f"CPU block {value - 1001}'s data" if value > 1000 else f"GPU block {value - 1}'s data"


def _order_failure(engine, reference, case) -> str | None:
    swap_out, swap_in, copy = case
    out = SchedulerOutputs(blocks_to_swap_in=dict(swap_in), blocks_to_swap_out=dict(swap_out),
                           blocks_to_copy={s: list(d) for s, d in copy.items()})
    shown = f"execute([], orders swap_out {swap_out}, swap_in {swap_in}, copy {copy}) (no group scheduled)"
    for e in (engine, reference):
        _labels(e)
    try:
        got = engine.execute([], out)
    except Exception as e:  # the reader's code: any error is a failed case
        return f"{shown} raised {type(e).__name__}: {e}"
    reference.execute([], SchedulerOutputs(blocks_to_swap_in=dict(swap_in), blocks_to_swap_out=dict(swap_out),
                                           blocks_to_copy={s: list(d) for s, d in copy.items()}))
    if got is not None:
        return f"{shown} returned {type(got).__name__}, expected None: no group ran"
    for pool, mine, want in zip(("GPU", "CPU"), _contents(engine), _contents(reference)):
        for block, (a, b) in enumerate(zip(mine, want)):
            if a != b:
                return (f"{shown}: afterwards {pool} block {block} holds {_name(a)}, expected {_name(b)}: "
                        "swap out first, then swap in, then copy, even when no group runs")
    return None


# -- the whole loop, step by step ------------------------------------------------------------------


class _Refused(RuntimeError):
    pass


def _refusing(name: str, fn):
    @functools.wraps(fn)
    def guarded(self, *args, **kwargs):
        if getattr(self, "_checked_as_yours", False):
            raise _Refused(f"you called the package's LLMEngine.{name}; this exercise is yours to write")
        return fn(self, *args, **kwargs)
    return guarded


def _yours(cls):
    """A factory of the reader's engines: the instance is marked, so that the package's step and
    execute refuse it, and its worker refuses ``execute_model``."""
    def build(*args, **kwargs):
        engine = cls.__new__(cls)
        engine._checked_as_yours = True
        engine.__init__(*args, **kwargs)

        def refuse(*a, **k):
            raise _Refused("you called the package's Worker.execute_model; your execute carries out the orders "
                           "and runs the model itself (executor.cache_engine, prepare_inputs, run)")
        engine.executor.execute_model = refuse
        return engine
    return build


def _package_execute(self, metas, out):
    """The package's execute, as the checker's own: the reader's step may call it in ``_mixed``."""
    if out.is_empty():
        return None
    return self.executor.execute_model(metas, out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy)


def _mixed(cls, part: str):
    """``cls`` with the package's ``part`` (step or execute) in place of the reader's."""
    package = _package_execute if part == "execute" else getattr(LLMEngine, part)
    return type(f"Your{'Execute' if part == 'step' else 'Step'}", (cls,), {part: package})


def _first_difference(workload: Workload, reference: list[Snapshot], factory) -> tuple[int, str] | None:
    steps, error = play(workload, factory, limit=len(reference) + 1)
    for i, (mine, want) in enumerate(zip(steps, reference), start=1):
        problem = difference(mine, want)
        if problem:
            return i, problem
    if error:
        return len(steps) + 1, error
    if len(steps) != len(reference):
        return min(len(steps), len(reference)) + 1, (f"the run took {len(steps)} steps, expected {len(reference)}: "
                                                    "has_unfinished_requests() says when to stop")
    return None


def _blame(cls, workload: Workload, reference: list[Snapshot]) -> str:
    step_alone = _first_difference(workload, reference, _mixed(cls, "execute")) is None
    execute_alone = _first_difference(workload, reference, _mixed(cls, "step")) is None
    if step_alone and not execute_alone:
        return "your execute makes the difference (your step with the package's execute agrees)"
    if execute_alone and not step_alone:
        return "your step makes the difference (the package's step with your execute agrees)"
    return ""


@checker(chapter=9, answer="ServingLoop")
def check_engine_step(cls: type) -> bool:
    """``cls`` is an ``LLMEngine`` subclass that defines ``step()`` and ``execute(metas, out)``
    from the contracts of section 9.4, with the package's tools (``sample_request``,
    ``take_prompt_logprobs``, ``fork``, ``check_stop``, ``fail``, ``output``, ``release``,
    ``report_step``), the scheduler, the executor's ``cache_engine``, ``prepare_inputs`` and
    ``run``, and the sampler; never the package's ``LLMEngine.step``/``execute`` or
    ``Worker.execute_model``. Every step must return what the package's returns, leave the
    scheduler's queues and free blocks as the package's does, and tell the observers the same."""
    failures, num_cases = [], len(ORDER_CASES) + len(WORKLOADS)
    if not (isinstance(cls, type) and issubclass(cls, LLMEngine)):
        return verdict("engine_step", [f"expected an LLMEngine subclass, got {cls!r}"], num_cases)
    missing = [m for m in ("step", "execute") if getattr(cls, m) is getattr(LLMEngine, m)]
    if missing:
        return verdict("engine_step", [f"{cls.__name__} does not define {' and '.join(missing)}: "
                                       "the serving loop is yours to write"], num_cases)
    originals = {name: LLMEngine.__dict__[name] for name in ("step", "execute")}
    try:
        for name, fn in originals.items():
            setattr(LLMEngine, name, _refusing(name, fn))
        with torch.random.fork_rng():
            _run_checks(cls, failures)
    finally:
        for name, fn in originals.items():
            setattr(LLMEngine, name, fn)
    return verdict("engine_step", failures, num_cases)


def _run_checks(cls, failures: list[str]) -> None:
    """The execute cases, then every workload; each failure appended to ``failures``."""
    try:
        engine = build(WORKLOADS[2], _yours(cls))  # a roomy cache: the cases name blocks up to 6
    except Exception as e:  # the reader's code: any error is a failed case
        failures.append(f"{cls.__name__}(...) raised {type(e).__name__}: {e}")
        return
    reference = build(WORKLOADS[2], LLMEngine)
    for case in ORDER_CASES:
        problem = _order_failure(engine, reference, case)
        if problem:
            failures.append(problem)
    for workload in WORKLOADS:
        expected, _ = play(workload, LLMEngine)
        found = _first_difference(workload, expected, _yours(cls))
        if found is None:
            continue
        step, problem = found
        blame = "" if failures or "package's" in problem else _blame(cls, workload, expected)
        failures.append(f"{workload.name}, step {step}: {problem}" + (f"; {blame}" if blame else ""))
