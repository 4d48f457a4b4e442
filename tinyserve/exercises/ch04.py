"""Checkers for chapter 04: iteration-level scheduling (Orca) and vLLM's prefill-or-decode rounds.

``check_orca_batches`` and ``check_finish_rounds`` compare the reader's prediction with the real
Scheduler run by the simulator when memory and budgets never bind. ``check_orca_reservation``
grades an admission rule the reader writes for the real scheduler (``Scheduler(can_admit=...)``):
Orca's, which admits a request only when the slots for its prompt and all of its ``max_tokens``
can be reserved. It is compared, round by round, with the same scheduler under a version of the
rule kept here, on A–E with a small cache and on random workloads.

``check_orca_round`` grades the chapter's main exercise, the orca policy's whole round (a
Scheduler subclass overriding ``_schedule_mixed``): the simulator runs it beside the package's
Scheduler on s0/s1/s2, A–E and random workloads that preempt, and the first round and fact that
differ are named, with the part of the round that alone makes the difference where one does.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch03 import answer_name
from tinyserve.exercises.ch05_round import _error, _simulate_recorded, random_workloads, state_before
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, round_run_difference, scheduler_run
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SequenceGroup
from tinyserve.sim import Request, RoundRecord, simulate

AMPLE_CACHE = CacheConfig(block_size=16, num_gpu_blocks=4096, num_cpu_blocks=0, watermark=0.0)


def _ample_scheduler_config(policy: str) -> SchedulerConfig:
    """Budgets so large that only the policy decides who runs."""
    return SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096, policy=policy)


def _arrival_workloads(num_cases: int, seed: int) -> list[list[Request]]:
    rng = random.Random(seed)
    cases = [presets.orca_example().requests]
    while len(cases) < num_cases:
        n = rng.randint(1, 7)
        cases.append([Request(chr(ord("A") + i), rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 6))
                      for i in range(n)])
    return cases


def _describe_workload(args: tuple) -> str:
    requests, *rest = args
    text = ", ".join(f"{r.request_id}(out={r.output_len}, arrives={r.arrival_round})" for r in requests)
    return text + "".join(f", {x!r}" for x in rest)


def _copies(requests: list[Request]) -> list[Request]:
    return [dataclasses.replace(r) for r in requests]


def finish_round_of(records: list[RoundRecord]) -> dict[str, int]:
    """{request id: the round in which it finished}."""
    return {rid: r.round for r in records for rid in r.finished}


@checker(chapter=4, answer="orca_batches")
def check_orca_batches(fn: Callable[[list[Request]], list[int]], num_cases: int = 30, seed: int = 0) -> bool:
    """``fn(requests)`` returns the batch size of every round under the orca policy, from round 1
    until the last request finishes, when memory and budgets never bind. A request's prefill
    produces its first token; a round in which nobody has arrived yet has batch size 0."""
    cases = [((reqs,), [r.batch_size for r in simulate(reqs, _ample_scheduler_config("orca"), AMPLE_CACHE)])
             for reqs in _arrival_workloads(num_cases, seed)]
    return run_cases("orca_batches", lambda reqs: list(fn(_copies(reqs))), cases, describe=_describe_workload)


@checker(chapter=4, answer="finish_rounds")
def check_finish_rounds(fn: Callable[[list[Request], str], dict[str, int]], num_cases: int = 30,
                        seed: int = 2) -> bool:
    """``fn(requests, policy)`` returns {request id: round of its last token} under policy
    "orca" or "vllm", when memory and budgets never bind."""
    cases = [((reqs, policy), finish_round_of(simulate(reqs, _ample_scheduler_config(policy), AMPLE_CACHE)))
             for reqs in _arrival_workloads(num_cases // 2, seed) for policy in ("orca", "vllm")]
    return run_cases("finish_rounds", lambda reqs, policy: dict(fn(_copies(reqs), policy)), cases,
                     describe=_describe_workload)


# -- Orca's reservation, inside the real scheduler ---------------------------------------------------

def _reservation_blocks(group: SequenceGroup, block_size: int) -> int:
    seq = group.get_seqs()[0]
    return -(-(seq.get_prompt_len() + group.sampling_params.max_tokens) // block_size)


def _model_run(requests: list[Request], scheduler_config: SchedulerConfig,
               cache_config: CacheConfig) -> list[RoundRecord]:
    """The rule, reading the reservations off the scheduler's own queues: every group that is
    running or swapped out holds its reservation until it finishes."""
    holder: list[Scheduler] = []

    def admit(group: SequenceGroup, budget, block_manager) -> bool:
        sched = holder[0]
        held = sum(_reservation_blocks(g, block_manager.block_size) for g in (*sched.running, *sched.swapped)
                   if g is not group)
        return held + _reservation_blocks(group, block_manager.block_size) <= block_manager.num_total_gpu_blocks

    scheduler = Scheduler(scheduler_config, cache_config, can_admit=admit)
    holder.append(scheduler)
    return simulate(requests, scheduler_config, cache_config, scheduler=scheduler)


def reservation_workloads(num_random: int = 12, seed: int = 0) -> list[SimWorkload]:
    """(label, requests, scheduler config, cache config): A–E on 8 blocks of 4, then random ones."""
    ae = presets.orca_example()
    runs = [("A-E, 8 GPU blocks of 4", ae.requests, ae.scheduler_config,
             dataclasses.replace(ae.cache_config, num_gpu_blocks=8))]
    rng = random.Random(seed)
    for i in range(num_random):
        bs = rng.choice([2, 4])
        requests = [Request(f"r{j}", rng.randint(1, 8), rng.randint(1, 12), rng.randint(1, 6))
                    for j in range(rng.randint(3, 8))]
        longest = max(r.prompt_len + r.output_len for r in requests)
        blocks = -(-longest // bs) + rng.randint(0, 8)
        runs.append((f"random workload {i}: {len(requests)} requests, {blocks} GPU blocks of {bs}", requests,
                     SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, policy="orca"),
                     CacheConfig(block_size=bs, num_gpu_blocks=blocks, num_cpu_blocks=32, watermark=0.0)))
    return runs


@checker(chapter=4, answer="OrcaReservation")
def check_orca_reservation(cls: Callable, num_random: int = 12, seed: int = 0) -> bool:
    """``cls()`` makes an admission rule for ``Scheduler(can_admit=...)``: called as
    ``rule(group, budget, block_manager)`` for the group at the head of ``waiting``, it says True
    only if the blocks for the group's prompt plus its ``sampling_params.max_tokens`` tokens,
    added to the blocks reserved by every admitted request that has not finished, fit in the
    GPU's ``num_total_gpu_blocks``. Graded round by round under the orca policy."""
    return check_runs("OrcaReservation in the scheduler", reservation_workloads(num_random, seed),
                      lambda *w: scheduler_run(*w, can_admit=cls()), _model_run)


# -- the main exercise: the Orca round ------------------------------------------------------------

# The parts of the reader's round, each with the package's method that does the same work (the
# package's phases are shared with the vLLM round, chapter 05's; the reader's have names of their own).
ORCA_PARTS = {"_schedule_mixed": None, "_orca_decode": "_decode_running", "_orca_swap_in": "_swap_in_swapped",
              "_orca_admit": "_admit_waiting"}
# Chapter 05's round, and the entry point both rounds share: an orca_round must leave them alone, so
# that it joins the reader's scheduler_round (a subclass of its own) by inheritance.
NOT_THE_ORCA_ROUND = ("schedule", "_schedule_vllm", "_admit_waiting", "_decode_running", "_swap_in_swapped")

OrcaWorkload = tuple[str, list[Request], SchedulerConfig, CacheConfig, dict]  # (label, ..., Scheduler hooks)


def _at_most_three_running(group: SequenceGroup, budget, block_manager) -> bool:
    """An admission rule for the hook run (exercise 4's seam): no more than three sequences at a time."""
    return budget.num_curr_seqs < 3


def _holding_most_tokens(running: list[SequenceGroup]) -> SequenceGroup:
    """A victim policy for the hook run: the group holding the most tokens (the first of equals)."""
    return max(running, key=lambda g: g.get_seqs()[0].get_len())


def orca_round_workloads(num_random: int = 24, seed: int = 4) -> list[OrcaWorkload]:
    """The runs ``check_orca_round`` compares, all under ``policy="orca"``: s0/s1/s2 under each
    preemption mode, A–E (roomy, then on caches that make it preempt), the two hooks, and random
    workloads on tiny caches (prompts that can never run, swap space that fills up, arrivals over
    time, token budgets small enough that a refill after recompute is cut into pieces)."""
    runs: list[OrcaWorkload] = []
    for mode in ("swap", "recompute", None):
        seed_preset = presets.seed_rounds(mode, policy="orca")
        runs.append((f"s0/s1/s2, policy='orca', preemption_mode={mode!r}", seed_preset.requests,
                     seed_preset.scheduler_config, seed_preset.cache_config, {}))
    ae = presets.orca_example()
    runs.append(("A-E, policy='orca'", ae.requests, ae.scheduler_config, ae.cache_config, {}))
    for mode in ("swap", "recompute"):
        runs.append((f"A-E on 7 GPU blocks of 4, preemption_mode={mode!r}", ae.requests,
                     SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=28, policy="orca",
                                     preemption_mode=mode),
                     CacheConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=3, watermark=0.0), {}))
    # Older requests bring longer prompts, so the group with the most tokens is rarely the newest.
    hooked = [Request(f"r{j}", 8 - j, 10, 1 + j // 3) for j in range(7)]
    sc = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6, max_model_len=16, policy="orca",
                         preemption_mode="swap")
    cc = CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=16, watermark=0.0)
    runs.append(("7 requests, choose_victim=the most tokens", hooked, sc, cc, {"choose_victim": _holding_most_tokens}))
    roomy = dataclasses.replace(cc, num_gpu_blocks=32)  # the rule, not memory, holds prompts back
    runs.append(("7 requests on 32 GPU blocks of 2, can_admit=at most three sequences running", hooked, sc, roomy,
                 {"can_admit": _at_most_three_running}))
    runs += random_workloads(random.Random(seed), num_random, ("swap", "recompute", None), min_budget=6, policy="orca")
    return runs


def _recorded_rounds(cls: type, requests: list[Request], sc: SchedulerConfig, cc: CacheConfig, hooks: dict,
                     max_rounds: int) -> tuple[list[RoundRecord], str | None]:
    """The simulator's rounds on ``cls(sc, cc, **hooks)``, kept as they happen, so that a run that
    raises (or never ends) still shows the rounds before it, with the error."""
    records: list[RoundRecord] = []
    try:
        _simulate_recorded(cls, requests, sc, cc, hooks, max_rounds, records)
    except Exception as e:  # the reader's code; a skeleton's NotImplementedError names the part not written yet
        return records, _error(cls, e)
    return records, None


def _package_phases(self) -> SchedulerOutputs:
    """The package's round, calling the reader's phases by their exercise names."""
    out, budget = SchedulerOutputs(), self._new_budget()
    self._orca_decode(out, budget)
    if not out.preempted:
        self._orca_swap_in(out, budget)
    if not self.swapped:
        self._orca_admit(out, budget)
    return out


def _only_part_yours(cls: type, part: str) -> type:
    """``cls`` with the package's version of every part of the round but ``part``."""
    package = {"_schedule_mixed": _package_phases,
               **{mine: getattr(Scheduler, theirs) for mine, theirs in ORCA_PARTS.items() if theirs}}
    return type(f"only_your_{part}", (cls,), {m: f for m, f in package.items() if m != part})


def _written(cls: type) -> list[str]:
    """The parts of the round ``cls`` defines itself."""
    return [m for m in ORCA_PARTS
            if getattr(cls, m, None) is not None and getattr(cls, m) is not getattr(Scheduler, m, None)]


def _parts_to_blame(cls: type, workload: OrcaWorkload, expected: list[RoundRecord]) -> list[str]:
    """The parts of ``cls`` that, alone among the package's others, already depart from it."""
    _, requests, sc, cc, hooks = workload
    found = []
    for part in _written(cls):
        mine, error = _recorded_rounds(_only_part_yours(cls, part), requests, sc, cc, hooks, 4 * len(expected) + 20)
        if round_run_difference(mine, error, expected) is not None:
            found.append(part)
    return found


@checker(chapter=4, answer="OrcaRound")
def check_orca_round(cls: type) -> bool:
    """``cls``: a subclass of tinyserve.scheduler.Scheduler whose ``_schedule_mixed`` makes the orca
    policy's round: every running group decodes (preempting when blocks run out), swapped groups
    come back if nobody was preempted, then waiting prompts are admitted within the budgets
    while nothing is swapped out. Run through the simulator beside the package's Scheduler on
    every workload of ``orca_round_workloads``, it must decide every round alike: batch, pieces,
    preemptions, swaps, refusals, queues and block tables. A failure names the workload, the
    first round and fact that differ and, where one part alone makes the difference (run with
    the package's versions of the others), that part: ``_schedule_mixed`` or the skeleton's
    ``_orca_decode``, ``_orca_swap_in`` and ``_orca_admit``."""
    name = answer_name(cls, "OrcaRound")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        print(f"✗ {name} must be a class that subclasses tinyserve.scheduler.Scheduler, got {cls!r}")
        return False
    if cls._schedule_mixed is Scheduler._schedule_mixed:
        print(f"✗ {name} does not override _schedule_mixed, the orca policy's round: the package's would run")
        return False
    theirs = [m for m in NOT_THE_ORCA_ROUND if getattr(cls, m) is not getattr(Scheduler, m)]
    if theirs:
        print(f"✗ {name} overrides {', '.join(theirs)}: that is the vLLM round's (chapter 05's scheduler_round); "
              "give your phases names of their own (the skeleton's _orca_decode, _orca_swap_in, _orca_admit)")
        return False
    workloads = orca_round_workloads()
    failures = []
    for workload in workloads:
        want, _ = _recorded_rounds(Scheduler, *workload[1:], 10_000)
        mine, error = _recorded_rounds(cls, *workload[1:], 4 * len(want) + 20)
        problem = round_run_difference(mine, error, want)
        if problem is None:
            continue
        parts = [] if error and error.startswith("NotImplementedError") else _parts_to_blame(cls, workload, want)
        where = (f"; with the package's other parts, your {' and your '.join(parts)} alone already "
                 f"differ{'s' if len(parts) == 1 else ''}") if parts else ""
        failures.append(f"{workload[0]}: {problem}{state_before(problem, want)}{where}")
    return verdict(name, failures, len(workloads))
