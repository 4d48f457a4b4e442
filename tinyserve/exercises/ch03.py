"""Checkers for chapter 03: the BlockSpaceManager.

``check_block_manager`` grades the chapter's core component: a BlockSpaceManager subclass that
writes ``can_allocate``, ``allocate``, ``can_append_slot``, ``append_slot`` (copy-on-write
included), ``fork`` and ``free``. It drives the reader's manager and the package's side by side
with the same random stream of operations, as a scheduler would issue them (admissions, forks
into several samples, decode rounds whose preemptions recompute or swap, finished samples, swaps
back in) on tiny caches with and without a watermark, and names the first call whose return
value, block tables, ref counts or free counts differ, with the state before it; then it runs
the reader's manager as the real scheduler's (``Scheduler(block_manager=...)``) on s0/s1/s2 and
random workloads, block tables included. ``check_group_blocks`` compares with the real
manager's bookkeeping.

The scripted scheduler that drives the reader's manager call by call is ``ch03_world``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch03_world import ManagerConfig, answer_name, play_manager
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, run_with_manager, seed_workloads
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request

# Names other modules import from here (chapters 04, 05 and 13's checkers name answers the same way).
__all__ = ["answer_name", "check_block_manager", "check_group_blocks", "manager_difference", "play_manager"]


def _sampled_group(request_id: str, prompt_len: int, block_size: int, n: int = 1, seq_id: int = 0) -> SequenceGroup:
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0)
    return SequenceGroup(request_id, [Sequence(seq_id, None, list(range(prompt_len)), block_size)], params, 0.0)


# -- copy-on-write, counted --------------------------------------------------------------------------

def _blocks_held(prompt_len: int, n: int, num_tokens: int, block_size: int) -> int:
    """Play it on a real manager: allocate, fork n-1 times, each sample appends num_tokens tokens."""
    bm = BlockSpaceManager(block_size, 256, 0, watermark=0.0)
    group = _sampled_group("g", prompt_len, block_size, n=n)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    seqs = [parent]
    for i in range(1, n):
        child = parent.fork(i)
        group.add(child)
        bm.fork(parent, child)
        seqs.append(child)
    for t in range(num_tokens):
        for s in seqs:
            s.append_token_id(t)
            bm.append_slot(s)
    return bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()


@checker(chapter=3, answer="group_blocks")
def check_group_blocks(fn: Callable[[int, int, int, int], int], num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(prompt_len, n, num_tokens, block_size)``: how many distinct GPU blocks a group holds
    when its prompt has been allocated, the sequence forked into ``n`` samples, and every
    sample has then appended ``num_tokens`` tokens, one round at a time, with ``append_slot``
    after each (copy-on-write included)."""
    rng = random.Random(seed)
    cases = []
    for prompt_len, n, tokens, bs in [(5, 2, 1, 4), (4, 2, 1, 4), (8, 3, 0, 4), (3, 1, 6, 4)]:
        cases.append(((prompt_len, n, tokens, bs), _blocks_held(prompt_len, n, tokens, bs)))
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 3, 4, 8])
        prompt_len = rng.randint(1, 5) * bs if rng.random() < 0.3 else rng.randint(1, 30)
        args = (prompt_len, rng.randint(1, 4), rng.choice([0, 1, 2, rng.randint(1, 3 * bs)]), bs)
        cases.append((args, _blocks_held(*args)))
    return run_cases("group_blocks", fn, cases)


# -- the BlockSpaceManager, the chapter's component ----------------------------------------------


def _manager_config(rng: random.Random) -> ManagerConfig:
    return (rng.choice([1, 2, 3, 4]), rng.randint(2, 10), rng.randint(0, 8), rng.choice([0.0, 0.1, 0.2, 0.34]))


def describe_state(state: dict[str, str]) -> str:
    tables = "; ".join(f"{name} {table}" for name, table in state.items() if name != "free")
    return f"tables {tables or 'none'}, {state.get('free', '?')}"


def manager_difference(cls: type, config: ManagerConfig, seed: int) -> str | None:
    """Where ``cls`` first departs from the package's BlockSpaceManager on one random stream, or
    None: the calls before, the state they left, the call, and what differs (its return value,
    or the tables and free counts it left)."""
    mine, want = play_manager(cls, config, seed), play_manager(BlockSpaceManager, config, seed)
    block_size, num_gpu, num_cpu, watermark = config
    where = f"{num_gpu} GPU and {num_cpu} CPU blocks of {block_size}, watermark {watermark}"
    for k, ((call, got, after), (want_call, expected, want_after)) in enumerate(zip(mine, want)):
        if (call, got, after) == (want_call, expected, want_after):
            continue
        calls = [c for c, _, _ in mine[:k]]
        before = (f"after {'..., ' if len(calls) > 5 else ''}{', '.join(calls[-5:])} "
                  f"({describe_state(want[k - 1][2])})") if k else "on an empty manager"
        head = f"{where}; {before}: {call}"
        if call != want_call:
            return f"{head}, expected {want_call}"
        if got != expected:
            return f"{head} {got}, expected {expected.removeprefix('returned ')}"
        wrong = [f"{name} {after.get(name, 'missing')} instead of {want_after.get(name, 'none')}"
                 for name in dict.fromkeys([*want_after, *after]) if after.get(name) != want_after.get(name)]
        return f"{head} {got} as expected, but left " + "; ".join(
            w.replace("free ", "", 1) if w.startswith("free ") else f"table {w}" for w in wrong)
    if len(mine) != len(want):
        return f"{where}: {len(mine)} calls instead of {len(want)}"
    return None


def manager_workloads() -> list[SimWorkload]:
    runs = seed_workloads()
    rng = random.Random(3)
    requests = [Request(f"r{i}", rng.randint(1, 8), rng.randint(1, 10), rng.randint(1, 5)) for i in range(8)]
    runs.append(("8 random requests, 8 GPU blocks of 2", requests,
                 SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=16, preemption_mode="swap"),
                 CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=12, watermark=0.0)))
    requests = [Request(f"q{i}", rng.randint(1, 9), rng.randint(1, 8), rng.randint(1, 4)) for i in range(8)]
    runs.append(("8 random requests, 10 GPU blocks of 2, watermark 0.2, recompute", requests,
                 SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=18,
                                 preemption_mode="recompute"),
                 CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=4, watermark=0.2)))
    return runs


@checker(chapter=3, answer="CopyOnWriteManager")
def check_block_manager(cls: type, num_cases: int = 300, seed: int = 0) -> bool:
    """``cls``: a subclass of ``tinyserve.block_manager.BlockSpaceManager`` (its constructor,
    allocators, swap methods and getters) that writes the chapter's six methods:
    ``can_allocate(group)`` (OK, LATER or NEVER, with the watermark and its two exemptions),
    ``allocate(group)`` (the prompt's blocks, shared by the group's waiting sequences),
    ``can_append_slot(group)`` (enough free blocks for the running sequences that need one),
    ``append_slot(seq)`` (a new block, nothing, or a copy of a shared last block, returning
    ``(src, dst)``), ``fork(parent, child)`` and ``free(seq)`` (safe to call twice). Graded
    call by call beside the package's manager on random streams of a scheduler's operations,
    then as the real scheduler's block manager on s0/s1/s2 and random workloads."""
    rng = random.Random(seed)
    configs = [((4, 8, 4, 0.0), 11), ((2, 6, 6, 0.0), 12), ((1, 5, 3, 0.2), 13), ((3, 10, 0, 0.1), 14)]
    while len(configs) < num_cases:
        configs.append((_manager_config(rng), rng.randrange(1 << 30)))
    failures = [d for config, stream in configs if (d := manager_difference(cls, config, stream))]
    name = answer_name(cls, "BlockSpaceManager")
    calls_ok = verdict(f"{name}, call by call beside the package's BlockSpaceManager", failures, len(configs))
    engine_ok = check_runs(f"{name} in the scheduler", manager_workloads(),
                           lambda *w: run_with_manager(cls, *w), lambda *w: run_with_manager(BlockSpaceManager, *w),
                           tables=True)
    return calls_ok and engine_ok
