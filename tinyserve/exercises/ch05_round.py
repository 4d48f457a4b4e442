"""The runs behind chapter 05's main exercise, the reader's vLLM round (a Scheduler subclass with
``_schedule_vllm`` and its three phases, ``ROUND_METHODS``).

``round_workloads`` are s0/s1/s2, the A–E workload, random workloads on tiny caches, the hooks
and the package's Orca round calling the reader's phases. ``round_failures`` runs each beside the
package's Scheduler, bounded in time, and says for each that differs the first round and fact
(the package's decision and the reader's) and, through ``_culprits``, the one method that alone
makes the difference. The checker, ``check_scheduler_round``, is in ``tinyserve.exercises.ch05``;
chapter 13's v1 round is graded with the same runs.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import threading
from collections.abc import Callable

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch05_hooks import _most_tokens
from tinyserve.exercises.sched_runs import round_run_difference
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SequenceGroup
from tinyserve.sim import Request, make_record, simulate

ROUND_METHODS = ("_schedule_vllm", "_admit_waiting", "_decode_running", "_swap_in_swapped")


def _fewest_running(group: SequenceGroup, budget, block_manager) -> bool:
    """An admission rule for the hook run: at most two groups at a time (chapter 04's seam)."""
    return budget.num_curr_seqs < 2


def round_workloads() -> list[tuple[str, list[Request], SchedulerConfig, CacheConfig, dict]]:
    """The runs ``check_scheduler_round`` compares, each with the Scheduler's hooks it sets:
    s0/s1/s2 under both preemption modes and vLLM's rule, the A–E workload (roomy, then on a
    cache that makes it preempt), random workloads on tiny caches (prompts that can never run,
    swap space that fills up, arrivals over time), a victim policy and an admission rule through
    the hooks, and the Orca round (the package's ``_schedule_mixed``) calling the reader's phases."""
    runs = []
    for mode in ("swap", "recompute", None):
        seed = presets.seed_rounds(mode)
        runs.append((f"s0/s1/s2, preemption_mode={mode!r}", seed.requests, seed.scheduler_config,
                     seed.cache_config, {}))
    ae = presets.orca_example("vllm")
    runs.append(("A-E, policy='vllm'", ae.requests, ae.scheduler_config, ae.cache_config, {}))
    for mode in ("swap", "recompute"):
        runs.append((f"A-E on 7 GPU blocks of 4, preemption_mode={mode!r}", ae.requests,
                     SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=28, preemption_mode=mode),
                     CacheConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=3, watermark=0.0), {}))
    rng = random.Random(7)
    runs += random_workloads(rng, 24, ("swap", "recompute"), min_budget=8)
    # Older requests bring longer prompts, so the group with the most tokens is rarely the newest.
    hooked = [Request(f"r{j}", 8 - j, 10, 1 + j // 3) for j in range(7)]
    sc = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6, max_model_len=16, preemption_mode="swap")
    cc = CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=16, watermark=0.0)
    runs.append(("7 requests, choose_victim=the most tokens (exercise 4's policy)", hooked, sc, cc,
                 {"choose_victim": _most_tokens}))
    runs.append(("7 requests, can_admit=at most two groups running", hooked, sc, cc, {"can_admit": _fewest_running}))
    # A refill longer than what the decodes leave of the budget is prefilled in pieces over rounds,
    # and the package's mixed round hands the pieces to _decode_running.
    for i, mode in enumerate(("recompute", "recompute", "swap")):
        requests = [Request(f"r{j}", rng.randint(3, 8), rng.randint(4, 10), rng.randint(1, 3)) for j in range(7)]
        runs.append((f"policy='orca' (the package's Orca round calling your phases) {i}, preemption_mode={mode!r}",
                     requests, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=5, max_model_len=16,
                                               policy="orca", preemption_mode=mode),
                     CacheConfig(block_size=2, num_gpu_blocks=12, num_cpu_blocks=8, watermark=0.0), {}))
    return runs


def _round_records(cls: type, requests: list[Request], sc: SchedulerConfig, cc: CacheConfig, hooks: dict,
            max_rounds: int) -> tuple[list, str | None]:
    """The simulator's rounds on ``cls(sc, cc, **hooks)``, kept as they happen, so that a run that
    raises (or never ends) still shows the rounds before it, with the error."""
    records = []
    try:
        with _time_limit(RUN_SECONDS):
            _simulate_recorded(cls, requests, sc, cc, hooks, max_rounds, records)
    except Exception as e:  # the reader's code
        return records, _error(cls, e)
    return records, None


RUN_SECONDS = 2.0  # one run takes milliseconds; a loop in a phase that never ends takes forever


class RunTooLong(Exception):
    """A run of the reader's round that went past ``RUN_SECONDS``."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise RunTooLong in the block after ``seconds`` (where the platform allows: the main thread
    on POSIX, as in a notebook; elsewhere the block runs unlimited)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise RunTooLong(f"the run took more than {seconds:g} s (a loop that never ends?)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _simulate_recorded(cls, requests, sc, cc, hooks, max_rounds, records: list) -> None:
    """Run the simulator on ``cls(sc, cc, **hooks)``, appending each round's record to ``records``."""
    scheduler = cls(sc, cc, **hooks)
    postprocess = scheduler.postprocess

    def recording(out, next_token):  # simulate calls it once a round, right after schedule()
        finished = postprocess(out, next_token)
        records.append(make_record(len(records) + 1, scheduler, out, finished))
        return finished

    scheduler.postprocess = recording
    simulate(requests, sc, cc, max_rounds=max_rounds, scheduler=scheduler)


def _error(cls: type, e: Exception) -> str:
    """The error, and the innermost of the reader's methods it came from ("not written yet" for a
    skeleton's NotImplementedError)."""
    mine = {f.__code__ for k in cls.__mro__ if k is not Scheduler and issubclass(k, Scheduler)
            for f in vars(k).values() if hasattr(f, "__code__")}
    frames = [tb.tb_frame.f_code for tb in _tracebacks(e.__traceback__) if tb.tb_frame.f_code in mine]
    where = f" in your {frames[-1].co_name}" if frames else ""
    if isinstance(e, NotImplementedError):
        return f"NotImplementedError{where} (not written yet)"
    return f"{type(e).__name__}{where}: {e}"


def _tracebacks(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _with_only(cls: type, method: str, methods: tuple[str, ...] = ROUND_METHODS) -> type:
    """``cls`` with the package's versions of every round method (of ``methods``) but ``method``."""
    return type(f"only_your_{method}", (cls,), {m: getattr(Scheduler, m) for m in methods if m != method})


def _culprits(cls: type, workload, expected: list, methods: tuple[str, ...] = ROUND_METHODS) -> list[str]:
    """The methods of ``cls`` (among ``methods``, the vLLM round's by default) that, alone among
    the package's others, already depart from it."""
    _, requests, sc, cc, hooks = workload
    found = []
    for method in methods:
        if getattr(cls, method) is getattr(Scheduler, method):
            continue
        mine, error = _round_records(_with_only(cls, method, methods), requests, sc, cc, hooks,
                                     4 * len(expected) + 20)
        if round_run_difference(mine, error, expected) is not None:
            found.append(method)
    return found


def state_before(problem: str, expected: list) -> str:
    """The queues the package's run had when the round a failure names began (after the round
    before it), so that the failure shows the input of the decision that differs; "" for round 1."""
    m = re.match(r"round (\d+)", problem)
    if not m or not 2 <= int(m.group(1)) <= len(expected) + 1:
        return ""
    r = expected[int(m.group(1)) - 2]
    def q(ids):
        return ",".join(ids) or "-"
    return (f" (the package's queues after round {r.round}, before round {r.round + 1}'s arrivals: running "
            f"{q(r.running)}, swapped {q(r.swapped)}, waiting {q(r.waiting)}, {r.free_gpu_blocks} free GPU blocks)")


def round_failures(cls: type, workloads: list, culprits: Callable[[type, tuple, list], list[str]]) -> list[str]:
    """Run every workload (label, requests, configs, hooks) through ``cls`` and the package's
    Scheduler; one line per workload whose rounds differ, naming the first difference and the
    methods ``culprits(cls, workload, expected)`` finds alone to blame. A run that never ends
    stops the others (they would wait as long). Chapter 13's v1 round is graded the same way."""
    failures = []
    for workload in workloads:
        want = _round_records(Scheduler, *workload[1:], 10_000)[0]
        mine, error = _round_records(cls, *workload[1:], 4 * len(want) + 20)
        problem = round_run_difference(mine, error, want)
        if problem is None:
            continue
        stuck = bool(error) and error.startswith("RunTooLong")
        parts = [] if error and error.startswith(("NotImplementedError", "RunTooLong")) else \
            culprits(cls, workload, want)
        where = (f"; with the package's other methods, your {' and your '.join(parts)} alone already "
                 f"differ{'s' if len(parts) == 1 else ''}") if parts else ""
        if stuck:  # every other run would wait as long: one is enough to see it
            where += " (the other workloads were not run)"
        failures.append(f"{workload[0]}: {problem}{state_before(problem, want)}{where}")
        if stuck:
            break
    return failures


def random_workloads(rng: random.Random, count: int, modes: tuple, min_budget: int, **scheduler_fields) -> list:
    """``count`` random workloads on tiny caches (the mode of the i-th is ``modes[i % len(modes)]``),
    as the round checkers' runs: (name, requests, scheduler config, cache config, no hooks). About
    one prompt in seven can never run, and a small swap space makes single sequences recompute."""
    runs = []
    for i in range(count):
        mode = modes[i % len(modes)]
        budget, block_size, gpu = rng.randint(min_budget, 16), rng.choice([2, 4]), rng.randint(4, 10)
        cpu = rng.choice([0, 2, 4, 16])
        limit = min(budget, gpu * block_size)
        requests = []
        for j in range(rng.randint(3, 8)):
            never = rng.random() < 0.15
            prompt = rng.randint(limit + 1, limit + 6) if never else rng.randint(1, max(1, limit - 2))
            requests.append(Request(f"r{j}", prompt, rng.randint(1, 10), rng.randint(1, 4)))
        runs.append((f"random workload {i} ({len(requests)} requests, {gpu} GPU and {cpu} CPU blocks of {block_size}, "
                     f"budget {budget}, preemption_mode={mode!r})", requests,
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=rng.randint(2, 5),
                                     max_model_len=gpu * block_size, preemption_mode=mode, **scheduler_fields),
                     CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
                                 watermark=rng.choice([0.0, 0.0, 0.2])), {}))
    return runs
