"""The BlockSpaceManager: unit tests of each method, then a hypothesis state machine that drives it
with random allocate / append / fork / swap out / swap in / free and checks the books after every step."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tinyserve.block import Device, OutOfBlocksError
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()


def make_group(request_id: str, prompt_len: int, block_size: int, num_seqs: int = 1) -> SequenceGroup:
    """A waiting group whose ``num_seqs`` sequences share one prompt of ``prompt_len`` tokens."""
    prompt = list(range(100, 100 + prompt_len))
    seqs = [Sequence(next(_ids), None, prompt, block_size) for _ in range(num_seqs)]
    return SequenceGroup(request_id, seqs, SamplingParams(n=num_seqs), 0.0)


def admit(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING


def blocks(bm: BlockSpaceManager, seq: Sequence):
    return bm.block_tables[seq.seq_id]


# -- admission ----------------------------------------------------------------------------------


def test_can_allocate_ok_later_never_with_a_watermark():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2
    # 32 tokens = 8 blocks: leaves exactly the 2-block watermark free.
    assert bm.can_allocate(make_group("a", 32, 4)) == AllocStatus.OK
    # 33 tokens = 9 blocks: would eat into the watermark even on an empty cache.
    assert bm.can_allocate(make_group("b", 33, 4)) == AllocStatus.NEVER
    admit(bm, make_group("c", 12, 4))  # 3 blocks taken, 7 free
    assert bm.can_allocate(make_group("d", 32, 4)) == AllocStatus.LATER
    assert bm.can_allocate(make_group("e", 20, 4)) == AllocStatus.OK  # 7 - 5 = 2 >= 2
    assert bm.can_allocate(make_group("f", 21, 4)) == AllocStatus.LATER


def test_without_watermark_a_prompt_may_take_every_block():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=3, num_cpu_blocks=0, watermark=0.0)
    assert bm.can_allocate(make_group("a", 6, 2)) == AllocStatus.OK
    assert bm.can_allocate(make_group("b", 7, 2)) == AllocStatus.NEVER


@pytest.mark.parametrize("watermark", [-0.1, 1.0])
def test_bad_watermark_is_refused(watermark):
    with pytest.raises(ValueError, match="watermark"):
        BlockSpaceManager(4, 8, 8, watermark=watermark)


def test_allocate_gives_every_waiting_sequence_the_same_fresh_blocks():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 9, 4, num_seqs=2)
    bm.allocate(g)
    a, b = g.get_seqs()
    assert bm.get_block_table(a) == bm.get_block_table(b)
    assert len(bm.get_block_table(a)) == 3 and len(set(bm.get_block_table(a))) == 3
    assert all(block.ref_count == 2 for block in blocks(bm, a))
    assert blocks(bm, a) is not blocks(bm, b)  # separate lists, so one can grow alone
    assert bm.get_num_free_gpu_blocks() == 5
    assert bm.get_block_device(a) == Device.GPU


def test_allocate_refuses_one_shared_table_for_samples_that_have_generated_tokens():
    # Two samples with different generated tokens (a multi-sample group preempted by recompute)
    # would write different K/V into the same slots.
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 5, 4, num_seqs=2)
    for i, seq in enumerate(g.get_seqs()):
        seq.append_token_id(7 + i)
    with pytest.raises(ValueError, match="'a'.*swapped, not recomputed"):
        bm.allocate(g)
    assert bm.get_num_free_gpu_blocks() == 8 and not bm.block_tables  # nothing was taken
    lone = make_group("b", 5, 4)
    lone.get_seqs()[0].append_token_id(7)
    bm.allocate(lone)  # one sequence with generated tokens is a plain recompute: fine
    assert len(bm.get_block_table(lone.get_seqs()[0])) == 2


def _peak_demand(block_size: int, prompt_len: int, n: int, max_len: int) -> int:
    """Play a group's whole life on a roomy manager (prefill, fork into n samples, decode until
    each has max_len tokens) and record the most blocks the scheduler's checks ever ask for:
    what the group holds plus what can_append_slot wants before a decode, or plus the block per
    sample that can_swap_in reserves, were it swapped out before that decode."""
    bm = BlockSpaceManager(block_size, 1000, 1000, watermark=0.0)
    g = make_group("g", prompt_len, block_size)
    parent = g.get_seqs()[0]
    bm.allocate(g)
    parent.status = SequenceStatus.RUNNING
    peak = 1000 - bm.get_num_free_gpu_blocks()
    parent.append_token_id(1)  # the prefill samples the first token ...
    for i in range(1, n):  # ... of each sample
        child = parent.fork(next(_ids))
        child.output_token_ids[-1] = 1 + i
        g.add(child)
        bm.fork(parent, child)
    seqs = g.get_seqs()
    while seqs[0].get_len() < max_len:
        held = 1000 - bm.get_num_free_gpu_blocks()
        wants = sum(bm._needs_new_block(s) for s in seqs)
        assert bm.can_append_slot(g) == (bm.get_num_free_gpu_blocks() >= wants)
        peak = max(peak, held + wants, held + len(seqs))
        for i, s in enumerate(seqs):
            bm.append_slot(s)
            s.append_token_id(100 + i)
    return peak


@pytest.mark.parametrize("block_size", [1, 2, 4, 5])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_worst_case_num_blocks_is_the_peak_the_scheduler_can_ask_for(block_size, n):
    bm = BlockSpaceManager(block_size, 8, 0)
    for prompt_len in range(1, 12):
        for max_len in range(prompt_len + 1, prompt_len + 14):
            assert bm.worst_case_num_blocks(prompt_len, n, max_len) == _peak_demand(block_size, prompt_len, n,
                                                                                    max_len), \
                (prompt_len, max_len)


# -- growth -------------------------------------------------------------------------------------


def test_append_slot_takes_a_new_block_only_when_a_token_starts_one():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 3, 2)
    admit(bm, g)
    seq = g.get_seqs()[0]
    table = bm.get_block_table(seq)
    seq.append_token_id(1)  # 4 tokens: fits the second block
    assert bm.can_append_slot(g)
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq) == table
    seq.append_token_id(2)  # 5 tokens: needs a third block
    assert bm.append_slot(seq) is None
    assert bm.get_block_table(seq)[:2] == table and len(bm.get_block_table(seq)) == 3
    assert bm.get_num_free_gpu_blocks() == 1


def test_can_append_slot_is_false_when_no_block_is_left():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=2, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 4, 2)
    admit(bm, g)
    seq = g.get_seqs()[0]
    seq.append_token_id(1)
    assert not bm.can_append_slot(g)
    with pytest.raises(OutOfBlocksError, match="GPU"):
        bm.append_slot(seq)


def test_fork_shares_blocks_and_the_first_writer_copies_the_last_one():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 6, 4, num_seqs=1)
    admit(bm, g)
    parent = g.get_seqs()[0]
    parent.append_token_id(1)  # 7 tokens, still in block 2 of 2
    bm.append_slot(parent)
    child = parent.fork(next(_ids))
    g.add(child)
    bm.fork(parent, child)
    shared = bm.get_block_table(parent)
    assert bm.get_block_table(child) == shared
    assert [b.ref_count for b in blocks(bm, parent)] == [2, 2]

    child.append_token_id(2)  # 8 tokens: writes into the shared second block -> copy it
    assert bm.can_append_slot(g)
    src, dst = bm.append_slot(child)
    assert src == shared[1] and dst not in shared
    assert bm.get_block_table(child) == [shared[0], dst]
    assert [b.ref_count for b in blocks(bm, parent)] == [2, 1]
    parent.append_token_id(3)  # the parent now owns its last block alone: no copy
    assert bm.append_slot(parent) is None
    assert bm.get_block_table(parent) == shared

    parent.append_token_id(4)
    parent.append_token_id(5)  # 9 tokens: a new third block, the shared first one is untouched
    assert bm.append_slot(parent) is None
    assert blocks(bm, parent)[0].ref_count == 2


def test_can_append_slot_counts_the_copies_shared_last_blocks_need():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=1, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 2, 4)
    admit(bm, g)
    parent = g.get_seqs()[0]
    child = parent.fork(next(_ids))
    g.add(child)
    bm.fork(parent, child)
    parent.append_token_id(1)  # fits the block's free slots, but the block is shared
    assert not bm.can_append_slot(g)


def test_free_returns_blocks_and_is_idempotent():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    g = make_group("a", 8, 4, num_seqs=2)
    admit(bm, g)
    a, b = g.get_seqs()
    bm.free(a)
    assert bm.get_num_free_gpu_blocks() == 2  # still held by b
    bm.free(a)
    assert bm.get_num_free_gpu_blocks() == 2
    bm.free(b)
    assert bm.get_num_free_gpu_blocks() == 4
    assert all(block.ref_count == 0 for block in bm.gpu_allocator.blocks)
    with pytest.raises(KeyError):
        bm.get_block_table(a)
    assert bm.get_block_device(a) is None


def test_the_plain_manager_never_shares_blocks_between_requests():
    # Two requests with the same prompt get blocks of their own: sharing between requests is
    # prefix caching's job (prefix_cache.PrefixCachingBlockSpaceManager, tests/test_prefix_caching.py).
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    first, second = make_group("a", 4, 2), make_group("b", 4, 2)  # the same 4 prompt tokens
    admit(bm, first)
    admit(bm, second)
    a, b = (bm.get_block_table(g.get_seqs()[0]) for g in (first, second))
    assert set(a).isdisjoint(b) and len(a) == len(b) == 2
    assert bm.get_num_free_gpu_blocks() == 0


# -- swapping -----------------------------------------------------------------------------------


def test_swap_out_and_in_move_shared_blocks_once_and_keep_the_sharing():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    g = make_group("a", 3, 2)
    admit(bm, g)
    parent = g.get_seqs()[0]
    parent.append_token_id(1)
    bm.append_slot(parent)
    child = parent.fork(next(_ids))
    g.add(child)
    bm.fork(parent, child)
    child.append_token_id(2)
    bm.append_slot(child)  # child: [b0, b1, new]; parent: [b0, b1]
    before = {s.seq_id: bm.get_block_table(s) for s in g.get_seqs()}
    distinct_gpu = set(before[parent.seq_id]) | set(before[child.seq_id])

    assert bm.can_swap_out(g)
    out_map = bm.swap_out(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.SWAPPED
    assert set(out_map) == distinct_gpu  # each physical block moves once
    assert len(set(out_map.values())) == len(out_map)
    for s in g.get_seqs():
        assert bm.get_block_device(s) == Device.CPU
        assert bm.get_block_table(s) == [out_map[b] for b in before[s.seq_id]]
    assert bm.get_num_free_gpu_blocks() == 8
    assert bm.get_num_free_cpu_blocks() == 8 - len(distinct_gpu)
    assert [b.ref_count for b in blocks(bm, child)] == [2, 2, 1]

    assert bm.can_swap_in(g)
    in_map = bm.swap_in(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
    assert set(in_map) == set(out_map.values())
    for s in g.get_seqs():
        assert bm.get_block_device(s) == Device.GPU
        assert bm.get_block_table(s) == [in_map[out_map[b]] for b in before[s.seq_id]]
    assert bm.get_num_free_cpu_blocks() == 8
    assert [b.ref_count for b in blocks(bm, child)] == [2, 2, 1]


def test_swap_out_without_room_raises_a_clear_error_and_changes_nothing():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=1, watermark=0.0)
    g = make_group("a", 4, 2)
    admit(bm, g)
    seq = g.get_seqs()[0]
    table = bm.get_block_table(seq)
    assert not bm.can_swap_out(g)
    with pytest.raises(OutOfBlocksError, match="swap space"):
        bm.swap_out(g)
    assert bm.get_block_table(seq) == table
    assert (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()) == (2, 1)


def test_can_swap_in_reserves_a_block_per_sequence_and_the_watermark():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=10, num_cpu_blocks=4, watermark=0.1)  # 1 block
    g = make_group("a", 4, 2)  # 2 blocks
    admit(bm, g)
    bm.swap_out(g)
    g.get_seqs()[0].status = SequenceStatus.SWAPPED
    hog = make_group("hog", 12, 2)  # 6 blocks, leaving 4 free
    admit(bm, hog)
    assert bm.can_swap_in(g)  # 4 free - (2 blocks + 1 per sequence) = 1 >= watermark of 1
    extra = make_group("x", 1, 2)
    admit(bm, extra)  # 3 free
    assert not bm.can_swap_in(g)


def test_a_group_that_grew_into_the_watermark_can_come_back_to_an_empty_gpu():
    bm = BlockSpaceManager(block_size=1, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.2)  # 2 blocks
    g = make_group("a", 7, 1)
    admit(bm, g)
    seq = g.get_seqs()[0]
    seq.append_token_id(1)
    bm.append_slot(seq)  # decodes may use the watermark: 8 blocks now
    seq.append_token_id(2)
    bm.swap_out(g)
    seq.status = SequenceStatus.SWAPPED
    other = make_group("b", 1, 1)
    admit(bm, other)
    assert not bm.can_swap_in(g)  # 9 free - 9 needed < 2, while someone runs
    bm.free(other.get_seqs()[0])
    assert bm.can_swap_in(g)  # on an empty GPU the watermark protects nobody


def test_a_sequence_preempted_by_recompute_is_never_refused_for_the_watermark():
    bm = BlockSpaceManager(block_size=1, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    g = make_group("a", 7, 1)
    seq = g.get_seqs()[0]
    for t in (1, 2):
        seq.append_token_id(t)  # 9 tokens, as it had when it was preempted
    assert bm.can_allocate(g) == AllocStatus.OK  # empty GPU: 10 - 9 >= 0
    admit(bm, make_group("b", 1, 1))
    assert bm.can_allocate(g) == AllocStatus.LATER  # not NEVER: it has run, it will fit again
    fresh = make_group("c", 9, 1)
    assert bm.can_allocate(fresh) == AllocStatus.NEVER  # a new prompt must leave the watermark
    grown = make_group("d", 10, 1)
    grown.get_seqs()[0].append_token_id(1)
    assert bm.can_allocate(grown) == AllocStatus.NEVER  # 11 blocks: more than the cache


# -- the state machine --------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations on a BlockSpaceManager, checked against an independent model: a dict of
    block tables as lists of (device, block number)."""

    @initialize(block_size=st.integers(1, 4), num_gpu=st.integers(1, 12), num_cpu=st.integers(0, 12),
                watermark=st.sampled_from([0.0, 0.1, 0.25]))
    def setup(self, block_size, num_gpu, num_cpu, watermark):
        self.bs, self.num_gpu, self.num_cpu = block_size, num_gpu, num_cpu
        self.bm = BlockSpaceManager(block_size, num_gpu, num_cpu, watermark=watermark)
        self.wm = int(watermark * num_gpu)
        self.groups: list[SequenceGroup] = []
        self.model: dict[int, list[tuple[Device, int]]] = {}  # seq_id -> table
        self.next_id = 0
        self.token = itertools.count(1)

    # helpers -------------------------------------------------------------------------------

    def _seqs(self, status: SequenceStatus) -> list[tuple[SequenceGroup, Sequence]]:
        return [(g, s) for g in self.groups for s in g.get_seqs(status)]

    def _groups(self, status: SequenceStatus) -> list[SequenceGroup]:
        # Groups whose live sequences all have this status (a group moves as a whole).
        return [g for g in self.groups if all(s.status == status for s in g.get_unfinished_seqs())]

    def _reserve(self) -> int:
        # The watermark is waived only when nothing is on the GPU.
        return 0 if not any(d == Device.GPU for t in self.model.values() for d, _ in t) else self.wm

    def _holders(self, key: tuple[Device, int]) -> int:
        return sum(key in table for table in self.model.values())

    def _distinct(self, group: SequenceGroup) -> set[tuple[Device, int]]:
        return {k for s in group.get_unfinished_seqs() for k in self.model[s.seq_id]}

    def _check_map(self, group, mapping, src_dev, dst_dev, before):
        src_keys = {n for d, n in self._distinct_before(before) if d == src_dev}
        assert set(mapping) == src_keys
        assert len(set(mapping.values())) == len(mapping)
        for s in group.get_unfinished_seqs():
            self.model[s.seq_id] = [(dst_dev, mapping[n]) for _, n in before[s.seq_id]]

    @staticmethod
    def _distinct_before(before):
        return {k for table in before.values() for k in table}

    # rules -----------------------------------------------------------------------------------

    @rule(prompt_len=st.integers(1, 14))
    def allocate(self, prompt_len):
        seq = Sequence(self.next_id, None, [next(self.token) for _ in range(prompt_len)], self.bs)
        self.next_id += 1
        group = SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams(), 0.0)
        need = -(-prompt_len // self.bs)
        free = self.bm.get_num_free_gpu_blocks()
        expected = (AllocStatus.NEVER if self.num_gpu - need < self.wm
                    else AllocStatus.OK if free - need >= self._reserve() else AllocStatus.LATER)
        assert self.bm.can_allocate(group) == expected
        if expected != AllocStatus.OK:
            return
        self.bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        self.groups.append(group)
        table = self.bm.get_block_table(seq)
        assert len(table) == need
        assert len(set(table)) == need
        for n in table:  # the new blocks must all have been free a moment ago
            assert self._holders((Device.GPU, n)) == 0, f"allocated GPU block {n}, which is still mapped"
        self.model[seq.seq_id] = [(Device.GPU, n) for n in table]

    @rule(pick=st.integers(0, 10_000))
    def append(self, pick):
        running = self._seqs(SequenceStatus.RUNNING)
        if not running:
            return
        group, seq = running[pick % len(running)]
        seq.append_token_id(next(self.token))
        # The group may grow when every running sequence that needs a block (a new one, or a copy
        # of a shared last block) can get one.
        needed = sum(len(self.model[s.seq_id]) < s.n_blocks or self._holders(self.model[s.seq_id][-1]) > 1
                     for s in group.get_seqs(SequenceStatus.RUNNING))
        assert self.bm.can_append_slot(group) == (self.bm.get_num_free_gpu_blocks() >= needed)
        table = self.model[seq.seq_id]
        new_block = len(table) < seq.n_blocks
        shared = not new_block and self._holders(table[-1]) > 1
        needs = new_block or shared
        if needs and self.bm.get_num_free_gpu_blocks() == 0:
            # No room: the scheduler would preempt instead. Take the token back.
            seq.output_token_ids.pop()
            last = seq.logical_token_blocks[-1]
            last.token_ids.pop()
            if not last.token_ids:
                seq.logical_token_blocks.pop()
            return
        result = self.bm.append_slot(seq)
        if shared:
            assert result is not None, "copy-on-write missed: the last block was shared"
            src, dst = result
            assert src == table[-1][1]
            assert self._holders((Device.GPU, dst)) == 0
            self.model[seq.seq_id] = table[:-1] + [(Device.GPU, dst)]
        else:
            assert result is None, "copy-on-write of a block nobody else holds"
            if new_block:
                new = self.bm.get_block_table(seq)[-1]
                assert self._holders((Device.GPU, new)) == 0
                self.model[seq.seq_id] = table + [(Device.GPU, new)]

    @rule(pick=st.integers(0, 10_000))
    def fork(self, pick):
        running = self._seqs(SequenceStatus.RUNNING)
        if not running:
            return
        group, parent = running[pick % len(running)]
        child = parent.fork(self.next_id)
        self.next_id += 1
        group.add(child)
        self.bm.fork(parent, child)
        self.model[child.seq_id] = list(self.model[parent.seq_id])

    @rule(pick=st.integers(0, 10_000))
    def swap_out(self, pick):
        groups = self._groups(SequenceStatus.RUNNING)
        if not groups:
            return
        group = groups[pick % len(groups)]
        before = {s.seq_id: list(self.model[s.seq_id]) for s in group.get_unfinished_seqs()}
        fits = len(self._distinct(group)) <= self.bm.get_num_free_cpu_blocks()
        assert self.bm.can_swap_out(group) == fits
        if not fits:
            with pytest.raises(OutOfBlocksError, match="swap space"):
                self.bm.swap_out(group)
            return  # and nothing moved: the invariants check it
        mapping = self.bm.swap_out(group)
        for s in group.get_unfinished_seqs():
            s.status = SequenceStatus.SWAPPED
        self._check_map(group, mapping, Device.GPU, Device.CPU, before)

    @rule(pick=st.integers(0, 10_000))
    def swap_in(self, pick):
        groups = self._groups(SequenceStatus.SWAPPED)
        if not groups:
            return
        group = groups[pick % len(groups)]
        before = {s.seq_id: list(self.model[s.seq_id]) for s in group.get_unfinished_seqs()}
        need = len(self._distinct(group)) + len(group.get_unfinished_seqs())
        expected = self.bm.get_num_free_gpu_blocks() - need >= self._reserve()
        assert self.bm.can_swap_in(group) == expected
        if not expected:
            return
        mapping = self.bm.swap_in(group)
        for s in group.get_unfinished_seqs():
            s.status = SequenceStatus.RUNNING
        self._check_map(group, mapping, Device.CPU, Device.GPU, before)

    @rule(pick=st.integers(0, 10_000))
    def free(self, pick):
        live = [(g, s) for g in self.groups for s in g.get_unfinished_seqs()]
        if not live:
            return
        group, seq = live[pick % len(live)]
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        del self.model[seq.seq_id]
        if group.is_finished():
            self.groups.remove(group)

    # invariants --------------------------------------------------------------------------------

    @invariant()
    def books_balance(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        assert set(bm.block_tables) == set(self.model)
        for seq_id, table in bm.block_tables.items():
            assert [(b.device, b.block_number) for b in table] == self.model[seq_id]
            assert len({b.device for b in table}) <= 1, "a block table spans two devices"
        for alloc, total in ((bm.gpu_allocator, self.num_gpu), (bm.cpu_allocator, self.num_cpu)):
            dev = alloc.device
            free = [b.block_number for b in alloc.free_blocks]
            assert len(free) == len(set(free)), f"a {dev.name} block is on the free list twice"
            mapped = {n for table in self.model.values() for d, n in table if d == dev}
            assert mapped.isdisjoint(free), f"{dev.name} blocks both free and mapped: {mapped & set(free)}"
            assert len(free) + len(mapped) == total
            for block in alloc.blocks:
                assert block.ref_count == self._holders((dev, block.block_number)), (
                    f"{dev.name} block {block.block_number}: ref count {block.ref_count}")
        assert bm.get_num_free_gpu_blocks() == len(bm.gpu_allocator.free_blocks)
        assert bm.get_num_free_cpu_blocks() == len(bm.cpu_allocator.free_blocks)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for group in self.groups:
            for seq in group.get_unfinished_seqs():
                self.bm.free(seq)
        assert self.bm.block_tables == {}
        assert self.bm.get_num_free_gpu_blocks() == self.num_gpu
        assert self.bm.get_num_free_cpu_blocks() == self.num_cpu
        assert all(b.ref_count == 0 for b in self.bm.gpu_allocator.blocks + self.bm.cpu_allocator.blocks)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
