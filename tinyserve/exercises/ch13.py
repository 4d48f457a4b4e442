"""Checkers for chapter 13: from v0.4 to v1, the round of ``SchedulerConfig(policy="v1")``.

``check_v1_chunk`` compares the reader's rule for the tokens a prefill brings in one step with the
package's ``Scheduler._v1_chunk`` on the same numbers. ``check_first_token_rounds`` compares the
reader's prediction of the round in which each request's first token comes out, under the vLLM
policy and under v1, with the simulator's, when memory never binds. The main exercise's checker,
``check_v1_round`` (the v1 round itself), runs it beside the package's Scheduler in the
simulator and then in the engine; its workloads and runs are in ``ch13_round``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch03 import answer_name
from tinyserve.exercises.ch04 import AMPLE_CACHE, _copies
from tinyserve.exercises.ch05_round import _culprits, round_failures
from tinyserve.exercises.ch13_round import (
    NOT_THE_V1_ROUND,
    V1_ROUND_METHODS,
    _engine_failures,
    engine_workloads,
    v1_round_workloads,
)
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.scheduler import Scheduler
from tinyserve.scheduler_outputs import SchedulingBudget
from tinyserve.sequence import Sequence
from tinyserve.sim import Request, RoundRecord, simulate

# -- exercise 1: the chunk a prefill brings -----------------------------------------------------------


def _package_chunk(prompt_len: int, num_computed: int, budget_left: int, threshold: int, chunked: bool) -> int:
    """The package's ``_v1_chunk`` on a fresh prompt (never preempted) of ``prompt_len`` tokens."""
    sc = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=4096, policy="v1",
                         enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    sched = Scheduler(sc, CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0))
    seq = Sequence(0, None, list(range(1000, 1000 + prompt_len)), 4)
    return sched._v1_chunk(seq, num_computed, SchedulingBudget(budget_left, 8))


@checker(chapter=13, answer="v1_chunk")
def check_v1_chunk(fn: Callable[[int, int, int, int, bool], int], num_cases: int = 80, seed: int = 0) -> bool:
    """``fn(prompt_len, num_computed, budget_left, threshold, chunked)`` returns how many prompt
    tokens a prefill brings in one v1 step: the ``prompt_len - num_computed`` it still lacks, cut
    to ``long_prefill_token_threshold`` (``threshold``, 0 for none) and, when prompts may be
    chunked (``chunked``), to the ``budget_left`` of the step. (A prompt that may not be chunked
    and brings more than the budget left is the caller's business: it waits.)"""
    rng = random.Random(seed)
    cases = [(24, 0, 10, 0, True), (24, 0, 10, 0, False), (24, 16, 10, 6, True), (5, 0, 10, 8, True),
             (30, 8, 40, 16, False)]
    while len(cases) < num_cases:
        prompt = rng.randint(1, 40)
        cases.append((prompt, rng.randint(0, prompt - 1), rng.randint(1, 32), rng.choice([0, 0, *range(1, 17)]),
                       rng.random() < 0.6))
    return run_cases(answer_name(fn, "v1_chunk"), lambda *args: fn(*args), [(c, _package_chunk(*c)) for c in cases],
                     describe=lambda a: "prompt_len={}, num_computed={}, budget_left={}, threshold={}, chunked={}"
                     .format(*a))


# -- exercise 3: first tokens under each policy --------------------------------------------------------

def _budget_config(token_budget: int, policy: str) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=8, max_model_len=4096, policy=policy)


def first_token_round_of(records: list[RoundRecord], requests: list[Request]) -> dict[str, int]:
    """{request id: the round whose piece completed its prompt} (when nothing is preempted)."""
    need = {r.request_id: r.prompt_len for r in requests}
    done: dict[str, int] = {}
    for rec in records:
        for rid, n in rec.chunk_sizes.items():
            if rid not in done:
                need[rid] -= n
                if need[rid] <= 0:
                    done[rid] = rec.round
    return done


def _first_token_workloads(num_cases: int, seed: int) -> list[tuple[list[Request], int]]:
    rng = random.Random(seed)
    # A long prompt arrives while two requests decode: vLLM stops them for it, v1 lets them go on.
    cases = [([Request("A", 4, 8), Request("B", 4, 8), Request("C", 14, 2, 3)], 16),
             ([Request(rid, 6, 3) for rid in "ABCD"], 10)]
    while len(cases) < num_cases:
        budget = rng.randint(8, 24)
        cases.append(([Request(chr(ord("A") + i), rng.randint(1, budget), rng.randint(1, 8), rng.randint(1, 5))
                       for i in range(rng.randint(1, 7))], budget))
    return cases


@checker(chapter=13, answer="first_token_rounds")
def check_first_token_rounds(fn: Callable[[list[Request], int, str], dict[str, int]], num_cases: int = 30,
                             seed: int = 1) -> bool:
    """``fn(requests, token_budget, policy)`` returns {request id: the round in which its first
    token comes out} under policy "vllm" or "v1" (chunked prefill on, no threshold), with a
    cache so large that nobody is preempted, ``max_num_batched_tokens=token_budget`` and room for
    every request at once. Every prompt fits the budget; a request arrives before its
    ``arrival_round`` is scheduled, and the round of its prefill's last piece makes its first token."""
    cases = []
    for reqs, budget in _first_token_workloads(num_cases // 2, seed):
        for policy in ("vllm", "v1"):
            records = simulate(reqs, _budget_config(budget, policy), AMPLE_CACHE)
            cases.append(((reqs, budget, policy), first_token_round_of(records, reqs)))
    return run_cases(answer_name(fn, "first_token_rounds"),
                     lambda reqs, budget, policy: dict(fn(_copies(reqs), budget, policy)), cases,
                     describe=_describe_requests)


def _describe_requests(args: tuple) -> str:
    requests, budget, policy = args
    text = ", ".join(f"{r.request_id}(prompt={r.prompt_len}, out={r.output_len}, arrives={r.arrival_round})"
                     for r in requests)
    return f"[{text}], {budget}, {policy!r}"


# -- exercise 2, the main one: the v1 round (its runs: ch13_round) ------------------------------------

@checker(chapter=13, answer="V1Round")
def check_v1_round(cls: type, loaded=None) -> bool:
    """``cls``: a subclass of tinyserve.scheduler.Scheduler whose ``_schedule_v1``,
    ``_run_running_v1`` and ``_admit_waiting_v1`` make the v1 policy's round: running requests
    first, oldest first, each with its next token or prompt piece while the budget lasts, blocks
    for this step's tokens only, the newest preempted (``self.choose_victim``) when they do not
    fit, and waiting requests admitted with the budget left only in a step that preempted
    nobody, prefix hits counted in whole blocks of all tokens but the last. Run through the
    simulator beside the package's Scheduler on every workload of ``v1_round_workloads``, it must
    decide every step alike: batch, pieces, preemptions, refusals, queues and block tables. A
    failure names the workload, the first round and fact that differ and, where one method
    alone (with the package's other two) makes the difference, that method. Then the engine runs
    it (``LLMEngine(scheduler=cls)``) on ``loaded`` (default: the tiny random Llama) greedily
    beside the package's scheduler, on ``engine_workloads``: the same tokens and steps."""
    name = answer_name(cls, "V1Round")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        print(f"✗ {name} must be a class that subclasses tinyserve.scheduler.Scheduler, got {cls!r}")
        return False
    if cls._schedule_v1 is Scheduler._schedule_v1:
        print(f"✗ {name} does not override _schedule_v1, the v1 policy's round: the package's would run")
        return False
    theirs = [m for m in NOT_THE_V1_ROUND if getattr(cls, m) is not getattr(Scheduler, m)]
    if theirs:
        print(f"✗ {name} overrides {', '.join(theirs)}: that belongs to the other rounds (chapters 04 and 05); "
              "the v1 round is _schedule_v1 and its two phases, _run_running_v1 and _admit_waiting_v1")
        return False
    workloads = v1_round_workloads()
    failures = round_failures(cls, workloads, functools.partial(_culprits, methods=V1_ROUND_METHODS))
    num_cases = len(workloads) + len(engine_workloads())
    if failures:  # the engine would only show the same difference, more slowly
        return verdict(name, failures, len(workloads))
    if loaded is None:
        from tinyserve.exercises.engine_runs import tiny

        loaded = tiny()
    return verdict(name, _engine_failures(cls, loaded), num_cases)
