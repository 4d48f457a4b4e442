"""Solutions to chapter 03's exercises: the BlockSpaceManager's own methods, and copy-on-write counted."""

from tinyserve.block import Device
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.sequence import SequenceStatus


def needs_block(manager, seq):
    """Whether the sequence's newest token needs a GPU block of its own."""
    table = manager.block_tables[seq.seq_id]
    # A fresh block when the newest token starts a logical block; a copy when the last is shared.
    return len(table) < seq.n_blocks or table[-1].ref_count > 1


class CopyOnWriteManager(BlockSpaceManager):
    """The package's constructor, allocators and swapping; admission, growth, forks and frees written here."""

    def can_allocate(self, seq_group):
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        required = seq.n_blocks
        total = self.num_total_gpu_blocks
        free = self.gpu_allocator.get_num_free_blocks()
        # A new prompt may never eat into the watermark; one preempted by recompute ran before
        # and may have grown into it, so it only has to fit in the cache.
        floor = self.watermark_blocks if seq.get_output_len() == 0 else 0
        if total - required < floor:
            return AllocStatus.NEVER
        # The reserve protects running sequences; on an empty GPU there are none.
        reserve = 0 if free == total else self.watermark_blocks
        return AllocStatus.OK if free - required >= reserve else AllocStatus.LATER

    def allocate(self, seq_group):
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        table = [self.gpu_allocator.allocate() for _ in range(waiting[0].n_blocks)]
        for block in table:
            block.ref_count = len(waiting)         # every waiting sequence owns each block
        for seq in waiting:
            self.block_tables[seq.seq_id] = list(table)   # a list of its own: the tables diverge later

    def can_append_slot(self, seq_group):
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        return sum(needs_block(self, seq) for seq in running) <= self.gpu_allocator.get_num_free_blocks()

    def append_slot(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:              # the new token starts a logical block
            table.append(self.gpu_allocator.allocate())
            return None
        last = table[-1]
        if last.ref_count == 1:                    # this sequence's alone: write in place
            return None
        copy = self.gpu_allocator.allocate()       # shared: copy-on-write
        table[-1] = copy
        self.gpu_allocator.free(last)              # one owner fewer; the others keep it
        return last.block_number, copy.block_number

    def fork(self, parent, child):
        table = self.block_tables[parent.seq_id]
        self.block_tables[child.seq_id] = list(table)
        for block in table:
            block.ref_count += 1

    def free(self, seq):
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:                          # freed already (finished, then aborted)
            return
        for block in table:                        # in table order, as the package frees them
            # A swapped sequence's blocks are in CPU memory: each goes back to its own device's pool.
            (self.gpu_allocator if block.device == Device.GPU else self.cpu_allocator).free(block)


def group_blocks(prompt_len, n, num_tokens, block_size):
    if num_tokens == 0:
        return -(-prompt_len // block_size)          # every sample still shares the prompt's blocks
    shared = prompt_len // block_size                # full prompt blocks are never written again
    own = -(-(prompt_len + num_tokens) // block_size) - shared
    return shared + n * own                          # the partial last block was copied per sample
