"""The rules and runs behind chapter 05's exercises 4 and 5, two components the reader plugs into
the real Scheduler through its constructor: a victim policy (``Scheduler(choose_victim=...)``) and
a block manager whose ``can_swap_in`` keeps headroom (``Scheduler(block_manager=...)``).

Here are the versions of both rules the checkers compare with (``_most_tokens``,
``_CautiousModel``), the random states they are graded on (``_victim_lists``, ``_swap_state``) and
the workloads of their scheduler runs. The checkers, ``check_victim_policy`` and
``check_cautious_swap_in``, are in ``tinyserve.exercises.ch05``. ``_request_group`` (a one-sequence
group of a given prompt) serves chapter 05's other checkers too.
"""

from __future__ import annotations

import random

from tinyserve import presets
from tinyserve.block import Device
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, seed_workloads
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request


def _request_group(request_id: str, seq_id: int, prompt_len: int, block_size: int,
                   num_outputs: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, None, list(range(1000, 1000 + prompt_len)), block_size)
    for t in range(num_outputs):
        seq.append_token_id(t)
    return SequenceGroup(request_id, [seq], SamplingParams(max_tokens=64), arrival_time=float(seq_id))


# -- a victim policy ------------------------------------------------------------------------------

def _num_tokens(group: SequenceGroup) -> int:
    return sum(seq.get_len() for seq in group.get_seqs(SequenceStatus.RUNNING))


def _most_tokens(running: list[SequenceGroup]) -> SequenceGroup:
    """The rule: the most tokens; among equals, the one furthest back in the list (the newest)."""
    best = running[0]
    for group in running[1:]:
        if _num_tokens(group) >= _num_tokens(best):
            best = group
    return best


def _victim_lists(num_cases: int, seed: int) -> list[list[SequenceGroup]]:
    rng = random.Random(seed)
    lists = []
    for _ in range(num_cases):
        groups = []
        for i in range(rng.randint(1, 6)):
            group = _request_group(f"r{i}", i, rng.randint(1, 8), 4, num_outputs=rng.randint(0, 6))
            for seq in group.get_seqs():
                seq.status = SequenceStatus.RUNNING
            groups.append(group)
        lists.append(groups)
    return lists


def victim_workloads() -> list[SimWorkload]:
    runs = seed_workloads()
    rng = random.Random(11)
    for i, mode in enumerate(("swap", "recompute")):
        requests = [Request(f"r{j}", rng.randint(1, 8), rng.randint(2, 12), rng.randint(1, 4)) for j in range(7)]
        runs.append((f"random workload {i}, preemption_mode={mode!r}", requests,
                     SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=20,
                                     preemption_mode=mode),
                     CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=16, watermark=0.0)))
    return runs


# -- a cautious swap-in ---------------------------------------------------------------------------------

class _CautiousModel(BlockSpaceManager):
    """The rule: the package's test, plus one free block for every sequence already on the GPU."""

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        swapped = seq_group.get_seqs(SequenceStatus.SWAPPED)
        cpu_blocks = {b.block_number for seq in swapped for b in self.block_tables[seq.seq_id]}
        on_gpu = sum(1 for seq_id, table in self.block_tables.items() if table and table[0].device == Device.GPU)
        needed = len(cpu_blocks) + len(swapped) + on_gpu
        return self.get_num_free_gpu_blocks() - needed >= self._reserve()


def _swap_state(cls: type, rng: random.Random) -> tuple[BlockSpaceManager, SequenceGroup]:
    """A manager of class ``cls`` with a group (one or two samples) swapped out, and the GPU
    holding a few running sequences, its free blocks near the margin."""
    bs = rng.choice([2, 4])
    total = rng.randint(8, 40)
    bm = cls(bs, total, 64, rng.choice([0.0, 0.0, 0.1]))
    group = SequenceGroup("g", [Sequence(0, None, list(range(rng.randint(1, 3 * bs))), bs)],
                          SamplingParams(n=2, temperature=1.0), 0.0)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    if rng.random() < 0.5:
        child = parent.fork(1)
        group.add(child)
        bm.fork(parent, child)
    bm.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    neighbours = rng.randint(0, 3)
    for i in range(neighbours):  # running neighbours, one sequence each
        if bm.get_num_free_gpu_blocks() > 2:
            bm.allocate(_request_group(f"n{i}", 10 + i, rng.randint(1, 2 * bs), bs))
    # Leave about what the rule needs free, where the package's test and this one part: the
    # group's blocks, one per returning sequence, the reserve, and one per sequence on the GPU
    # (counting the filler that takes up the rest).
    on_gpu = sum(1 for t in bm.block_tables.values() if t and t[0].device == Device.GPU) + 1
    blocks = len({b.block_number for seq in group.get_seqs() for b in bm.block_tables[seq.seq_id]})
    target = blocks + group.num_seqs() + bm.watermark_blocks + rng.randint(-1, on_gpu + 1)
    if bm.get_num_free_gpu_blocks() > target:
        bm.allocate(_request_group("filler", 50, (bm.get_num_free_gpu_blocks() - target) * bs, bs))
    return bm, group


def swap_in_workloads() -> list[SimWorkload]:
    seed = presets.seed_rounds("swap")
    runs = [("s0/s1/s2, preemption_mode='swap'", seed.requests, seed.scheduler_config, seed.cache_config)]
    rng = random.Random(5)
    for i in range(3):
        requests = [Request(f"r{j}", rng.randint(1, 8), rng.randint(2, 12), rng.randint(1, 4)) for j in range(7)]
        runs.append((f"random workload {i}, preemption_mode='swap'", requests,
                     SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=20,
                                     preemption_mode="swap"),
                     CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=24, watermark=0.0)))
    return runs


