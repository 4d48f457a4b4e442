"""Deliberately wrong BlockSpaceManagers for chapter 03's core exercise (``check_block_manager``).

Each is the chapter's manager with one slip a first version makes, in one of its six methods;
tests/test_exercises.py expects the checker to reject every one.
"""

from __future__ import annotations

from tinyserve.block import Device
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.sequence import SequenceStatus


class _Manager(BlockSpaceManager):
    """The six methods written out, right unless a subclass says otherwise."""

    def floor(self, seq):
        return self.watermark_blocks if seq.get_output_len() == 0 else 0

    def reserve(self):
        return 0 if self.gpu_allocator.get_num_free_blocks() == self.num_total_gpu_blocks else self.watermark_blocks

    def can_allocate(self, seq_group):
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        if self.num_total_gpu_blocks - seq.n_blocks < self.floor(seq):
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - seq.n_blocks >= self.reserve():
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group):
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        table = [self.gpu_allocator.allocate() for _ in range(waiting[0].n_blocks)]
        for block in table:
            block.ref_count = len(waiting)
        for seq in waiting:
            self.block_tables[seq.seq_id] = list(table)

    def needs(self, seq):
        table = self.block_tables[seq.seq_id]
        return len(table) < seq.n_blocks or table[-1].ref_count > 1

    def can_append_slot(self, seq_group):
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        return sum(self.needs(s) for s in running) <= self.gpu_allocator.get_num_free_blocks()

    def append_slot(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:
            table.append(self.gpu_allocator.allocate())
            return None
        last = table[-1]
        if last.ref_count == 1:
            return None
        copy = self.gpu_allocator.allocate()
        table[-1] = copy
        self.gpu_allocator.free(last)
        return last.block_number, copy.block_number

    def fork(self, parent, child):
        table = self.block_tables[parent.seq_id]
        self.block_tables[child.seq_id] = list(table)
        for block in table:
            block.ref_count += 1

    def free(self, seq):
        for block in self.block_tables.pop(seq.seq_id, []):
            (self.gpu_allocator if block.device == Device.GPU else self.cpu_allocator).free(block)


class _NoWatermark(_Manager):
    """Admits whatever fits in the free blocks: the watermark is forgotten."""

    def floor(self, seq):
        return 0

    def reserve(self):
        return 0


class _ReserveOnEmptyGpu(_Manager):
    """Keeps the watermark free even on an empty GPU, where it protects no running sequence."""

    def reserve(self):
        return self.watermark_blocks


class _NoRecomputeFloor(_Manager):
    """Holds a sequence preempted by recompute to the watermark floor too: one that grew into the
    watermark while it ran is then NEVER, dropped halfway through its answer."""

    def floor(self, seq):
        return self.watermark_blocks


class _OneBlockPerSequence(_Manager):
    """vLLM v0.4's cautious rule: a free block for every running sequence, needed or not."""

    def can_append_slot(self, seq_group):
        return seq_group.num_seqs(SequenceStatus.RUNNING) <= self.gpu_allocator.get_num_free_blocks()


class _CountsFinishedSamples(_Manager):
    """Asks a block for every sample of the group, finished ones included."""

    def can_append_slot(self, seq_group):
        return sum(self.needs(s) for s in seq_group.get_seqs() if s.seq_id in self.block_tables
                   ) + sum(1 for s in seq_group.get_seqs() if s.seq_id not in self.block_tables) \
            <= self.gpu_allocator.get_num_free_blocks()


class _NoCopyOnWrite(_Manager):
    """Writes the new token into a shared last block: the other sample's K/V is overwritten."""

    def needs(self, seq):
        return len(self.block_tables[seq.seq_id]) < seq.n_blocks

    def append_slot(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:
            table.append(self.gpu_allocator.allocate())
        return None


class _CopyLeaksTheOriginal(_Manager):
    """Copies a shared block but keeps its share of the original: the block never comes back."""

    def append_slot(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks or table[-1].ref_count == 1:
            return super().append_slot(seq)
        last, copy = table[-1], self.gpu_allocator.allocate()
        table[-1] = copy
        return last.block_number, copy.block_number


class _CopyPairBackwards(_Manager):
    """Returns the copy-on-write pair as (dst, src): the worker would copy the empty block over."""

    def append_slot(self, seq):
        pair = super().append_slot(seq)
        return pair and (pair[1], pair[0])


class _ForkWithoutOwners(_Manager):
    """Gives the child the parent's blocks without counting it as an owner."""

    def fork(self, parent, child):
        self.block_tables[child.seq_id] = list(self.block_tables[parent.seq_id])


class _ForkSharesTheList(_Manager):
    """Hands the child the parent's very list: a block appended for one appears in both tables."""

    def fork(self, parent, child):
        table = self.block_tables[parent.seq_id]
        self.block_tables[child.seq_id] = table
        for block in table:
            block.ref_count += 1


class _FreeNotTwice(_Manager):
    """Fails (KeyError) when a sequence is freed a second time."""

    def free(self, seq):
        for block in self.block_tables.pop(seq.seq_id):
            (self.gpu_allocator if block.device == Device.GPU else self.cpu_allocator).free(block)


class _FreeOnlyGpu(_Manager):
    """Frees every block into the GPU pool, CPU blocks of a swapped sequence too."""

    def free(self, seq):
        for block in self.block_tables.pop(seq.seq_id, []):
            self.gpu_allocator.free(block)


MISTAKES = {
    "check_block_manager": [_NoWatermark, _ReserveOnEmptyGpu, _NoRecomputeFloor, _OneBlockPerSequence,
                            _CountsFinishedSamples, _NoCopyOnWrite, _CopyLeaksTheOriginal, _CopyPairBackwards,
                            _ForkWithoutOwners, _ForkSharesTheList, _FreeNotTwice, _FreeOnlyGpu],
}
