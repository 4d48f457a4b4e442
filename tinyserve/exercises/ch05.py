"""Checkers for chapter 05: the vLLM scheduler, preemption and the swapped queue.

``check_scheduler_round`` grades the chapter's main exercise, the reader's vLLM round (a Scheduler
subclass with ``_schedule_vllm`` and its three phases), round by round against the package's
Scheduler, and names the workload, the first round and fact that differ and the method that alone
makes the difference; its workloads and runs are in ``ch05_round``. ``check_admission`` and
``check_preempted`` compare the reader's prediction with the real Scheduler in the same
situation. ``check_victim_policy`` and ``check_cautious_swap_in`` grade components the reader
writes for the real scheduler, a victim policy (``Scheduler(choose_victim=...)``) and a block
manager whose ``can_swap_in`` keeps headroom (``Scheduler(block_manager=...)``), rule by rule on
random states against a version of the rule kept in ``ch05_hooks``, then round by round against
the same scheduler running that version.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import Device
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch03 import answer_name
from tinyserve.exercises.ch05_hooks import (
    _CautiousModel,
    _most_tokens,
    _num_tokens,
    _request_group,
    _swap_state,
    _victim_lists,
    swap_in_workloads,
    victim_workloads,
)
from tinyserve.exercises.ch05_round import (  # noqa: F401  (ROUND_METHODS and the runs: importable from here too)
    ROUND_METHODS,
    RUN_SECONDS,
    RunTooLong,
    _culprits,
    _round_records,
    round_failures,
    round_workloads,
)
from tinyserve.exercises.sched_runs import check_runs, run_with_manager, scheduler_run
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SequenceGroup, SequenceStatus


def _describe_case(case: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items())


# -- predictions ------------------------------------------------------------------------------------

def _admitted(case: dict) -> list[str]:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=case["token_budget"], max_num_seqs=case["max_num_seqs"],
                                      max_model_len=case["token_budget"]),
                      CacheConfig(block_size=case["block_size"], num_gpu_blocks=case["num_free_blocks"],
                                  num_cpu_blocks=0, watermark=0.0))
    for i, (rid, n) in enumerate(case["waiting"]):
        sched.add_seq_group(_request_group(rid, i, n, case["block_size"]))
    _, out = sched.schedule()
    return [s.seq_group.request_id for s in out.scheduled_seq_groups]


def _prompt_len(rng: random.Random, budget: int, free: int, block_size: int, never: bool) -> int:
    """A prompt that fits the budget and the cache on its own, or, if ``never``, one that can never
    run: longer than the budget, or with more blocks than the whole cache (or both)."""
    longest = min(budget, free * block_size)
    if not never:
        return rng.randint(1, longest)
    kinds = ["too long"] + (["too big"] if free * block_size < budget else [])
    if rng.choice(kinds) == "too long":
        return budget + rng.randint(1, 12)
    return rng.randint(free * block_size + 1, budget)  # within the budget, more blocks than the cache


@checker(chapter=5, answer="admission")
def check_admission(fn: Callable[..., list[str]], num_cases: int = 60, seed: int = 3) -> bool:
    """``fn(waiting, token_budget, max_num_seqs, num_free_blocks, block_size)`` returns the ids
    the vLLM policy admits into a prefill round, in order. ``waiting`` is a list of
    (request id, prompt length), front of the queue first; nothing is running, the watermark is
    0, and ``max_model_len`` is the token budget. A prompt that can never run (longer than the
    budget, or needing more blocks than the whole cache) is ignored (section 5.6) and does not
    hold up the prompts behind it. Many cases put one or two such prompts in the queue, ahead
    of others that fit."""
    rng = random.Random(seed)
    cases = [{"waiting": [("a", 30), ("b", 3)], "token_budget": 10, "max_num_seqs": 4, "num_free_blocks": 4,
              "block_size": 5}]
    while len(cases) < num_cases:
        block_size = rng.choice([2, 4, 8])
        budget = rng.randint(8, 40)
        free = rng.randint(2, 10)
        size = rng.randint(1, 6)
        never = {rng.randrange(size)} if size > 1 and len(cases) % 2 else set()
        if never and rng.random() < 0.3:
            never.add(rng.randrange(size))
        waiting = [(f"r{i}", _prompt_len(rng, budget, free, block_size, i in never)) for i in range(size)]
        cases.append({"waiting": waiting, "token_budget": budget, "max_num_seqs": rng.randint(1, 5),
                      "num_free_blocks": free, "block_size": block_size})
    return run_cases(answer_name(fn, "admission"),
                     lambda c: list(fn(list(c["waiting"]), c["token_budget"], c["max_num_seqs"],
                                       c["num_free_blocks"], c["block_size"])),
                     [((case,), _admitted(case)) for case in cases], describe=lambda args: _describe_case(args[0]))


def _preempted(case: dict) -> list[str]:
    """A real decode round: each request holds one block of 4 slots; a prompt of 4 tokens fills
    it, so after its first token it needs a second block, a prompt of 3 does not."""
    running, needs, free = case["running"], case["needs_block"], case["num_free_blocks"]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256,
                                      preemption_mode="recompute"),
                      CacheConfig(block_size=4, num_gpu_blocks=len(running) + free, num_cpu_blocks=0, watermark=0.0))
    for i, rid in enumerate(running):
        sched.add_seq_group(_request_group(rid, i, 4 if needs[rid] else 3, 4))
    _, prefill = sched.schedule()
    sched.postprocess(prefill, lambda group, seq: 7)
    _, out = sched.schedule()
    return list(out.preempted)


@checker(chapter=5, answer="preempted")
def check_preempted(fn: Callable[[list[str], dict[str, bool], int], list[str]], num_cases: int = 40,
                    seed: int = 4) -> bool:
    """``fn(running, needs_block, num_free_blocks)`` returns the ids preempted, in order, in a
    decode round under the package's victim policy. ``running`` is oldest first;
    ``needs_block[id]`` says whether that request needs a new block for its next token; each
    running request holds exactly one block, which is freed if it is preempted (recompute)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        running = [f"r{i}" for i in range(rng.randint(1, 6))]
        case = {"running": running, "needs_block": {rid: rng.random() < 0.6 for rid in running},
                "num_free_blocks": rng.randint(0, 2)}
        cases.append(((case,), _preempted(case)))
    return run_cases(answer_name(fn, "preempted"),
                     lambda c: list(fn(list(c["running"]), dict(c["needs_block"]), c["num_free_blocks"])),
                     cases, describe=lambda args: _describe_case(args[0]))


# -- exercises 4 and 5: a victim policy and a cautious swap-in (their runs: ch05_hooks) ---------------

@checker(chapter=5, answer="most_tokens_victim")
def check_victim_policy(fn: Callable[[list[SequenceGroup]], SequenceGroup], num_cases: int = 100,
                        seed: int = 0) -> bool:
    """``fn(running)`` for ``Scheduler(choose_victim=...)``: ``running`` lists the running groups
    that still wait for their slot this round (oldest first, starting with the one that needs a
    block); return the group whose running sequences hold the most tokens together (so freeing
    it frees the most blocks), the newest of equals. Graded on random lists, then inside the
    real scheduler on s0/s1/s2 and random workloads."""
    lists = _victim_lists(num_cases, seed)
    cases = [((groups,), _most_tokens(groups).request_id) for groups in lists]
    name = answer_name(fn, "most_tokens_victim")
    rule_ok = run_cases(name, lambda groups: fn(list(groups)).request_id, cases,
                        describe=lambda args: "running " + ", ".join(f"{g.request_id}({_num_tokens(g)} tokens)"
                                                                     for g in args[0]))
    engine_ok = check_runs(f"{name} in the scheduler", victim_workloads(),
                           lambda *w: scheduler_run(*w, choose_victim=fn),
                           lambda *w: scheduler_run(*w, choose_victim=_most_tokens))
    return rule_ok and engine_ok


@checker(chapter=5, answer="CautiousSwapManager")
def check_cautious_swap_in(cls: type, num_cases: int = 150, seed: int = 0) -> bool:
    """``cls``: a BlockSpaceManager subclass whose ``can_swap_in(group)`` lets a swapped group
    back only if the GPU then still has one free block for every sequence already running there
    (so the next decode round cannot preempt anyone at once), on top of the package's own test
    (the group's blocks plus one per returning sequence, keeping the manager's reserve, its
    ``_reserve()``). Graded on random states, then as the scheduler's block manager on s0/s1/s2
    and random workloads that swap."""
    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 30) for _ in range(num_cases)]
    cases = [((s,), _CautiousModel.can_swap_in(*_swap_state(_CautiousModel, random.Random(s)))) for s in seeds]

    def decide(state_seed: int) -> bool:
        bm, group = _swap_state(cls, random.Random(state_seed))
        return bm.can_swap_in(group)

    def describe(args: tuple) -> str:
        bm, group = _swap_state(_CautiousModel, random.Random(args[0]))
        on_gpu = sum(1 for t in bm.block_tables.values() if t and t[0].device == Device.GPU)
        blocks = {b.block_number for s in group.get_seqs() for b in bm.block_tables[s.seq_id]}
        return (f"a group of {group.num_seqs(SequenceStatus.SWAPPED)} sequences on {len(blocks)} CPU blocks, "
                f"{on_gpu} sequences on the GPU, {bm.get_num_free_gpu_blocks()} of {bm.num_total_gpu_blocks} "
                f"GPU blocks free, watermark {bm.watermark_blocks} blocks")

    name = answer_name(cls, "CautiousSwapManager")
    rule_ok = run_cases(f"{name}.can_swap_in", decide, cases, describe=describe,
                        same=lambda got, want: isinstance(got, bool) and got == want)
    engine_ok = check_runs(f"{name} in the scheduler", swap_in_workloads(),
                           lambda *w: run_with_manager(cls, *w), lambda *w: run_with_manager(_CautiousModel, *w))
    return rule_ok and engine_ok


# -- exercise 3, the main one: the vLLM round (its runs: ch05_round) -----------------------------------

@checker(chapter=5, answer="VllmRound")
def check_scheduler_round(cls: type) -> bool:
    """``cls``: a subclass of tinyserve.scheduler.Scheduler whose ``_schedule_vllm``,
    ``_admit_waiting``, ``_decode_running`` and ``_swap_in_swapped`` make the vLLM policy's round
    (``_schedule_mixed`` is chapter 04's and stays the package's). Run through the simulator
    beside the package's Scheduler on every workload of ``round_workloads``, it must decide every
    round alike: batch, pieces, preemptions, swaps, refusals, queues and block tables. A failure
    names the workload, the first round and fact that differ and, where one method alone makes
    the difference (run with the package's other three), that method."""
    name = answer_name(cls, "VllmRound")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        print(f"✗ {name} must be a class that subclasses tinyserve.scheduler.Scheduler, got {cls!r}")
        return False
    if cls._schedule_mixed is not Scheduler._schedule_mixed:
        print(f"✗ {name} overrides _schedule_mixed: that is chapter 04's round (orca_round); leave it to the package")
        return False
    workloads = round_workloads()
    return verdict(name, round_failures(cls, workloads, _culprits), len(workloads))
