"""Checkers for chapter 04: iteration-level scheduling (Orca) and vLLM's prefill-or-decode rounds.

``check_orca_batches`` and ``check_finish_rounds`` compare the reader's prediction with the real
Scheduler run by the simulator when memory and budgets never bind. ``check_orca_reservation``
grades an admission rule the reader writes for the real scheduler (``Scheduler(can_admit=...)``):
Orca's, which admits a request only when the slots for its prompt and all of its ``max_tokens``
can be reserved. It is compared, round by round, with the same scheduler under a version of the
rule kept here, on A–E with a small cache and on random workloads.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, scheduler_run
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.scheduler import Scheduler
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
