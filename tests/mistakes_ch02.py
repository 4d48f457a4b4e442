"""Deliberately wrong BlockAllocators for chapter 02's core exercise (``check_block_allocator``).

Each is the chapter's allocator with one slip a first version makes; tests/test_exercises.py
expects the checker to reject every one.
"""

from __future__ import annotations

from collections import deque

from tinyserve.block import OutOfBlocksError, PhysicalTokenBlock


class _Allocator:
    """A FIFO free list with reference counts, right unless a subclass says otherwise."""

    def __init__(self, device, block_size, num_blocks):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_blocks = deque(self.blocks)

    def allocate(self):
        if not self.free_blocks:
            raise OutOfBlocksError("no free block")
        block = self.free_blocks.popleft()
        block.ref_count = 1
        return block

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError("double free")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)

    def get_num_free_blocks(self):
        return len(self.free_blocks)


class _Stack(_Allocator):
    """Takes from the back of the free list: the block freed last goes out first (v0.4's order)."""

    def allocate(self):
        if not self.free_blocks:
            raise OutOfBlocksError("no free block")
        block = self.free_blocks.pop()
        block.ref_count = 1
        return block


class _FreedToFront(_Allocator):
    """Puts a freed block at the front of the free list, so recently freed memory goes out first."""

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError("double free")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.appendleft(block)


class _IgnoresOwners(_Allocator):
    """Frees a block at its first owner's free: a forked sample's shared block is pulled away."""

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError("double free")
        block.ref_count = 0
        self.free_blocks.append(block)


class _NoDoubleFreeCheck(_Allocator):
    """A double free goes unnoticed and puts the block on the free list a second time."""

    def free(self, block):
        block.ref_count = max(0, block.ref_count - 1)
        if block.ref_count == 0:
            self.free_blocks.append(block)


class _NoneWhenEmpty(_Allocator):
    """Returns None on an empty pool instead of raising OutOfBlocksError."""

    def allocate(self):
        return super().allocate() if self.free_blocks else None


class _CountsFromZero(_Allocator):
    """Forgets to give the block its first owner: it goes out with ref_count 0, so its first
    free is taken for a double free."""

    def allocate(self):
        if not self.free_blocks:
            raise OutOfBlocksError("no free block")
        return self.free_blocks.popleft()


MISTAKES = {
    "check_block_allocator": [_Stack, _FreedToFront, _IgnoresOwners, _NoDoubleFreeCheck, _NoneWhenEmpty,
                              _CountsFromZero],
}
