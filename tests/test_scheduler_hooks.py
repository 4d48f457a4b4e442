"""The scheduler's documented hooks: each one changes behaviour exactly as its docstring says.

- ``BlockSpaceManager(allocator=...)``: the allocator decides which free block goes out next,
  so it changes block numbers and nothing else. A stack allocator written here from scratch
  (duck-typed, no subclass) must agree with the package's ``StackBlockAllocator``.
- ``Scheduler(choose_victim=...)``: which running group is preempted.
- ``Scheduler(can_admit=...)``: an extra admission rule (Orca's reservation) on A-E.
- ``Scheduler(block_manager=...)`` and ``sim.simulate(..., scheduler=...)`` carry them all.

Expected values are worked out by hand from the rules (derivations in the comments).
"""

from __future__ import annotations

import math

import pytest

from tinyserve import presets, sim
from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager, StackBlockAllocator
from tinyserve.config import CacheConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup


def seed_run(**hooks) -> list[sim.RoundRecord]:
    p = presets.seed_rounds("swap")
    return sim.simulate(p.requests, p.scheduler_config, p.cache_config,
                        scheduler=Scheduler(p.scheduler_config, p.cache_config, **hooks))


def with_allocator(allocator) -> BlockSpaceManager:
    cc = presets.seed_rounds().cache_config
    return BlockSpaceManager(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.watermark, allocator=allocator)


def decisions(records: list[sim.RoundRecord]) -> list[tuple]:
    """Everything a round decided except which block numbers it used."""
    return [(r.phase, r.batch, r.preempted, r.swapped_out, r.swapped_in, r.finished, r.waiting, r.running,
             r.swapped, r.free_gpu_blocks) for r in records]


class ReadersStack:
    """A stack of free blocks written from the interface alone, as a reader would."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.stack = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]

    def allocate(self) -> PhysicalTokenBlock:
        if not self.stack:
            raise OutOfBlocksError(f"no free {self.device.name} block")
        block = self.stack.pop()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 0:
            raise ValueError("double free")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.stack.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self.stack)


# -- allocator ----------------------------------------------------------------------------------


def test_a_stack_allocator_changes_the_seed_block_tables_and_nothing_else():
    queue, stack = seed_run(), seed_run(block_manager=with_allocator(StackBlockAllocator))
    assert decisions(stack) == decisions(queue)
    # A queue hands out 0, 1, 2 to s0, s1, s2; a stack pops the highest first: 3, 2, 1. In round 3
    # s0 takes the last free block (queue: 3, stack: 0); s2 is swapped out (the CPU stack gives
    # block 3) and s1 takes the GPU block s2 gave back (queue: 2, stack: 1).
    assert [r.block_tables for r in queue[:3]] == [{"s0": [0], "s1": [1]}, {"s0": [0], "s1": [1], "s2": [2]},
                                                   {"s0": [0, 3], "s1": [1, 2]}]
    assert [r.block_tables for r in stack[:3]] == [{"s0": [3], "s1": [2]}, {"s0": [3], "s1": [2], "s2": [1]},
                                                   {"s0": [3, 0], "s1": [2, 1]}]
    assert queue[2].cpu_block_tables == {"s2": [0]} and stack[2].cpu_block_tables == {"s2": [3]}


def test_a_duck_typed_allocator_runs_in_the_scheduler_like_the_package_one():
    theirs = seed_run(block_manager=with_allocator(ReadersStack))
    ours = seed_run(block_manager=with_allocator(StackBlockAllocator))
    assert [(r.block_tables, r.cpu_block_tables) for r in theirs] == [(r.block_tables, r.cpu_block_tables)
                                                                      for r in ours]
    assert decisions(theirs) == decisions(ours)


def test_the_default_allocator_is_the_queue_and_a_bad_one_is_refused():
    bm = BlockSpaceManager(4, 4, 4)
    assert type(bm.gpu_allocator) is type(bm.cpu_allocator) is BlockAllocator
    assert bm.gpu_allocator.device == Device.GPU and bm.cpu_allocator.device == Device.CPU
    with pytest.raises(ValueError, match="allocator"):
        BlockSpaceManager(4, 4, 4, allocator=42)


# -- block_manager ------------------------------------------------------------------------------


def test_a_given_block_manager_is_used_and_must_match_the_block_size():
    p = presets.seed_rounds()
    bm = with_allocator(None)
    assert Scheduler(p.scheduler_config, p.cache_config, block_manager=bm).block_manager is bm
    with pytest.raises(ValueError, match="block_manager"):
        Scheduler(p.scheduler_config, p.cache_config, block_manager=BlockSpaceManager(4, 4, 4))
    prefix = CacheConfig(block_size=5, num_gpu_blocks=4, num_cpu_blocks=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(p.scheduler_config, prefix, block_manager=bm)


def test_simulate_refuses_a_scheduler_that_already_holds_requests():
    p = presets.seed_rounds()
    busy = Scheduler(p.scheduler_config, p.cache_config)
    busy.add_seq_group(SequenceGroup("x", [Sequence(99, None, [1], 5)], SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="scheduler"):
        sim.simulate(p.requests, p.scheduler_config, p.cache_config, scheduler=busy)


# -- choose_victim ------------------------------------------------------------------------------


def test_a_victim_policy_that_picks_the_oldest_preempts_s1_instead_of_s2():
    # Round 3: one block is free. s0 (6 tokens) takes it for its second block. s1 needs one too:
    # the candidates are [s1, s2] (s1 first, the one that needs it). vLLM's policy preempts the
    # newest, s2, and s1 takes s2's block; "oldest" preempts s1 itself, and s2 (3 prompt tokens
    # + 1, room in its block) decodes without a new block.
    newest, oldest = seed_run(), seed_run(choose_victim=lambda running: running[0])
    assert (newest[2].batch, newest[2].preempted) == (["s0", "s1"], ["s2"])
    assert (oldest[2].batch, oldest[2].preempted) == (["s0", "s2"], ["s1"])
    assert oldest[2].swapped == ["s1"] and oldest[2].cpu_block_tables == {"s1": [0]}
    assert {rid for r in oldest for rid in r.finished} == {"s0", "s1", "s2"}
    assert oldest[-1].free_gpu_blocks == 4 and oldest[-1].free_cpu_blocks == 4


def test_the_victim_policy_sees_the_groups_still_waiting_for_their_slot_oldest_first():
    seen = []
    seed_run(choose_victim=lambda running: seen.append([g.request_id for g in running]) or running[-1])
    assert seen[0] == ["s1", "s2"]


def test_a_victim_that_was_not_offered_is_refused():
    with pytest.raises(ValueError, match="choose_victim"):
        seed_run(choose_victim=lambda running: SequenceGroup("ghost", [Sequence(99, None, [1], 5)],
                                                              SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="choose_victim"):
        Scheduler(presets.seed_rounds().scheduler_config, presets.seed_rounds().cache_config, choose_victim="newest")


# -- can_admit ----------------------------------------------------------------------------------


class OrcaReservation:
    """Admit a request only if the blocks for its prompt plus max_tokens can be reserved next to
    those of every unfinished request admitted before (Orca reserves the worst case up front)."""

    def __init__(self) -> None:
        self.admitted: dict[str, SequenceGroup] = {}

    @staticmethod
    def need(group: SequenceGroup, block_size: int) -> int:
        return math.ceil((group.get_seqs()[0].get_prompt_len() + group.sampling_params.max_tokens) / block_size)

    def __call__(self, group: SequenceGroup, budget, block_manager) -> bool:
        bs = block_manager.block_size
        reserved = sum(self.need(g, bs) for rid, g in self.admitted.items() if rid != group.request_id
                       and not g.is_finished())
        if reserved + self.need(group, bs) > block_manager.num_total_gpu_blocks:
            return False
        self.admitted[group.request_id] = group  # True is the last check: the group is admitted now
        return True


def test_an_orca_reservation_rule_delays_d_and_e_on_a_small_cache():
    # A-E with 4-token prompts on 12 blocks of 4. Reservations: A ceil(14/4)=4, B ceil(19/4)=5,
    # C ceil(9/4)=3, D ceil(12/4)=3, E ceil(16/4)=4. Round 1 admits A, B, C (4+5+3 = 12). D waits
    # until C finishes (round 5: prefill token + 4 decodes), and is admitted in round 6 (4+5+3);
    # E, behind it, waits for A (10 tokens: round 10) and comes in round 11 (5+3+4). Then D
    # finishes in round 6+7 = 13, B in 15, E in 11+11 = 22.
    p = presets.orca_example("orca")
    cc = CacheConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, watermark=0.0)
    plain = sim.simulate(p.requests, p.scheduler_config, cc)
    reserved = sim.simulate(p.requests, p.scheduler_config, cc,
                            scheduler=Scheduler(p.scheduler_config, cc, can_admit=OrcaReservation()))
    admitted = {rid: next(r.round for r in reserved if rid in r.running or rid in r.finished) for rid in "ABCDE"}
    assert admitted == {"A": 1, "B": 1, "C": 1, "D": 6, "E": 11}
    assert {rid: r.round for r in reserved for rid in r.finished} == {"C": 5, "A": 10, "D": 13, "B": 15, "E": 22}
    assert not any(r.preempted for r in reserved)
    # Without the rule D is admitted as soon as it arrives: after round 1 three blocks are held,
    # and round 2's decodes take three more, which leaves six.
    assert plain[1].batch == ["A", "B", "C", "D"] and reserved[1].batch == ["A", "B", "C"]


def test_can_admit_is_asked_about_the_head_of_waiting_after_the_policy_checks():
    asked = []

    def b_runs_alone(group, budget, block_manager):
        asked.append((group.request_id, budget.num_batched_tokens, budget.num_curr_seqs))
        return group.request_id != "B" or budget.num_curr_seqs == 0

    p = presets.orca_example("vllm")
    recs = sim.simulate(p.requests, p.scheduler_config, p.cache_config,
                        scheduler=Scheduler(p.scheduler_config, p.cache_config, can_admit=b_runs_alone))
    # Round 1: A is asked with nothing batched and admitted; B is asked with A's 4 tokens and 1
    # sequence in the budget and refused, so C behind it is not asked (first come, first served).
    # Rounds 2-10 (vllm policy: admission first, then A decodes) ask about B alone. A's tenth
    # token comes in round 10; in round 11 B, C, D and E are admitted together.
    assert asked[:2] == [("A", 0, 0), ("B", 4, 1)]
    assert [rid for rid, *_ in asked] == ["A", "B"] + ["B"] * 9 + ["B", "C", "D", "E"]
    assert recs[0].batch == ["A"] and recs[10].batch == ["B", "C", "D", "E"]
    assert {rid: r.round for r in recs for rid in r.finished} == {"A": 10, "C": 15, "D": 18, "E": 22, "B": 25}
