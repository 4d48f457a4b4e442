"""Solutions to chapter 02's exercises: the BlockAllocator, block counts, the slot mapping
backwards, and an allocator that hands out the lowest number first."""

import heapq
from collections import deque

from tinyserve.block import OutOfBlocksError, PhysicalTokenBlock


class FreeListAllocator:
    """One device's pool: a FIFO free list of blocks, and a reference count on each."""

    def __init__(self, device, block_size, num_blocks):
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_blocks = deque(self.blocks)     # the front goes out next: 0, 1, 2, ... on a fresh pool

    def allocate(self):
        if not self.free_blocks:
            # Running out is the engine's state, not a bad argument: the scheduler should have asked first.
            raise OutOfBlocksError(f"all {self.num_blocks} {self.device.name} blocks are in use")
        block = self.free_blocks.popleft()
        block.ref_count = 1                        # its first owner
        return block

    def free(self, block):
        if block.ref_count == 0:
            # Freeing twice would put the block on the list twice and hand it to two sequences.
            raise ValueError(f"double free of {self.device.name} block {block.block_number}")
        block.ref_count -= 1
        if block.ref_count == 0:                   # the last owner let go
            self.free_blocks.append(block)         # the back: memory freed now is reused last

    def get_num_free_blocks(self):
        return len(self.free_blocks)


def num_blocks(num_tokens, block_size):
    return (num_tokens + block_size - 1) // block_size      # ceiling division


def slot_owner(block_tables, seq_lens, slot, block_size):
    block, offset = divmod(slot, block_size)
    for name, table in block_tables.items():
        if block in table:
            position = table.index(block) * block_size + offset
            # The tail of a sequence's last block is allocated but holds no token yet.
            return (name, position) if position < seq_lens[name] else None
    return None


class LowestFirstAllocator:
    """Hands out the free block with the lowest number: a heap of free block numbers."""

    def __init__(self, device, block_size, num_blocks):
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_numbers = list(range(num_blocks))  # already a heap

    def allocate(self):
        if not self.free_numbers:
            raise OutOfBlocksError(f"all {self.num_blocks} {self.device.name} blocks are in use")
        block = self.blocks[heapq.heappop(self.free_numbers)]
        block.ref_count = 1
        return block

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError(f"double free of {self.device.name} block {block.block_number}")
        block.ref_count -= 1
        if block.ref_count == 0:
            heapq.heappush(self.free_numbers, block.block_number)

    def get_num_free_blocks(self):
        return len(self.free_numbers)
