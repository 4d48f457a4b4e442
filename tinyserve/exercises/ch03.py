"""Checkers for chapter 03: the BlockSpaceManager.

``check_conservative_manager`` grades a BlockSpaceManager subclass with vLLM v0.4's
``can_append_slot`` rule: on random manager states against ``V04BlockSpaceManager``'s rule
(tinyserve's ``compat="vllm-0.4"`` manager), then inside the real scheduler
(``Scheduler(block_manager=...)``) on s0/s1/s2 and a random workload, against the same
scheduler with that rule. ``check_group_blocks`` compares with the real manager's bookkeeping.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block_manager import BlockSpaceManager, V04BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, run_with_manager, seed_workloads
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request


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


# -- v0.4's conservative can_append_slot -------------------------------------------------------------

class _ConservativeModel(BlockSpaceManager):
    """tinyserve's manager with v0.4's can_append_slot and nothing else changed."""

    can_append_slot = V04BlockSpaceManager.can_append_slot


def _decode_state(cls: type, rng: random.Random) -> tuple[BlockSpaceManager, SequenceGroup]:
    """A manager of class ``cls`` in the middle of a run: a group of samples (some finished), each
    with a new token waiting for its slot, and a neighbour filling the GPU to about the margin."""
    bs = rng.choice([2, 3, 4])
    bm = cls(bs, 40, 16, 0.0)
    group = _sampled_group("g", rng.randint(1, 3 * bs), bs, n=4, seq_id=0)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    seqs = [parent]
    for i in range(1, rng.randint(1, 4)):
        child = parent.fork(i)
        group.add(child)
        bm.fork(parent, child)
        seqs.append(child)
    for t in range(rng.randint(0, 2 * bs)):
        for s in seqs:
            s.append_token_id(t)
            bm.append_slot(s)
    if len(seqs) > 1 and rng.random() < 0.4:  # a sample that has finished no longer runs
        seqs[-1].status = SequenceStatus.FINISHED_STOPPED
        bm.free(seqs[-1])
    for s in group.get_seqs(SequenceStatus.RUNNING):
        s.append_token_id(99)  # the token the next round writes: its slot is what is asked for
    target = max(0, len(group.get_seqs(SequenceStatus.RUNNING)) + rng.randint(-2, 1))
    fill = bm.get_num_free_gpu_blocks() - target
    if fill > 0:
        bm.allocate(_sampled_group("neighbour", fill * bs, bs, seq_id=100))
    return bm, group


def _describe_decode_state(bm: BlockSpaceManager, group: SequenceGroup) -> str:
    """The whole case: every sample of the group, running or finished, whether a running one's
    next token needs a new block (a fresh one or a copy-on-write copy), and the free blocks."""
    samples = []
    for s in group.get_seqs():
        if s.status != SequenceStatus.RUNNING:
            samples.append(f"seq {s.seq_id} finished")
            continue
        table = bm.block_tables[s.seq_id]
        if len(table) < s.n_blocks:
            need = "needs a new block"
        elif table[-1].ref_count > 1:
            need = "needs a copy of its shared last block"
        else:
            need = "needs no new block"
        samples.append(f"seq {s.seq_id} running, {need}")
    running = group.num_seqs(SequenceStatus.RUNNING)
    plural = "s" if len(samples) > 1 else ""
    return (f"a group of {len(samples)} sample{plural} ({'; '.join(samples)}): {running} running, "
            f"{bm.get_num_free_gpu_blocks()} of {bm.num_total_gpu_blocks} GPU blocks free")


def answer_name(answer: object, fallback: str) -> str:
    """The name the reader gave their answer (a class's or a function's), for the checker's
    report; ``fallback`` for one without a name of its own (a lambda, a partial)."""
    name = getattr(answer, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() else fallback


def manager_workloads() -> list[SimWorkload]:
    runs = seed_workloads()
    rng = random.Random(3)
    requests = [Request(f"r{i}", rng.randint(1, 8), rng.randint(1, 10), rng.randint(1, 5)) for i in range(8)]
    runs.append(("8 random requests, 8 GPU blocks of 2", requests,
                 SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=16, preemption_mode="swap"),
                 CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=12, watermark=0.0)))
    return runs


@checker(chapter=3, answer="ConservativeManager")
def check_conservative_manager(cls: type, num_cases: int = 150, seed: int = 0) -> bool:
    """``cls``: a BlockSpaceManager subclass whose ``can_append_slot(group)`` follows vLLM v0.4:
    the group may decode only if there is one free GPU block for every *running* sequence of
    it, whether or not that sequence's next token needs a new block. Graded on random decode
    states, then as the block manager of the real scheduler on s0/s1/s2 and a random workload."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        state_seed = rng.randrange(1 << 30)
        bm, group = _decode_state(_ConservativeModel, random.Random(state_seed))
        cases.append(((state_seed,), bm.can_append_slot(group)))

    def decide(state_seed: int) -> bool:
        bm, group = _decode_state(cls, random.Random(state_seed))
        return bm.can_append_slot(group)

    def describe(args: tuple) -> str:
        bm, group = _decode_state(_ConservativeModel, random.Random(args[0]))
        return _describe_decode_state(bm, group)

    name = answer_name(cls, "ConservativeManager")
    rule_ok = run_cases(f"{name}.can_append_slot", decide, cases, describe=describe,
                        same=lambda got, want: isinstance(got, bool) and got == want)
    engine_ok = check_runs(f"{name} in the scheduler", manager_workloads(),
                           lambda *w: run_with_manager(cls, *w), lambda *w: run_with_manager(_ConservativeModel, *w))
    return rule_ok and engine_ok
