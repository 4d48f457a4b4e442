"""Physical memory, cut into blocks: the allocator that hands them out and takes them back.

A physical block holds the K/V of ``block_size`` tokens in every layer. Several sequences may
share one (a forked sample shares its parent's), so each block counts its owners; it returns to
the free list when the last one lets go.
"""

from __future__ import annotations

import enum
from collections import deque


class Device(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"


class OutOfBlocksError(RuntimeError):
    """Raised when an allocator has no free block left."""


class PhysicalTokenBlock:
    """A block of cache memory on one device, identified by its number in that device's pool."""

    def __init__(self, device: Device, block_number: int, block_size: int) -> None:
        self.device = device
        self.block_number = block_number
        self.block_size = block_size
        self.ref_count = 0

    def __repr__(self) -> str:
        return (f"PhysicalTokenBlock(device={self.device.name}, block_number={self.block_number}, "
                f"ref_count={self.ref_count})")


class BlockAllocator:
    """Hands out the blocks of one device's pool from a free list and tracks ref counts.

    The free list is a queue: the block that has been free longest goes out next, so recently
    used memory is reused last and the block tables in the book are easy to follow.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        # >>> fold: validation
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        # <<<
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_blocks: deque[PhysicalTokenBlock] = deque(self.blocks)

    def allocate(self) -> PhysicalTokenBlock:
        # >>> fold: none free: OutOfBlocksError
        if not self.free_blocks:
            raise OutOfBlocksError(
                f"out of {self.device.name} blocks: all {self.num_blocks} blocks of {self.block_size} "
                "tokens are in use"
            )
        # <<<
        block = self.free_blocks.popleft()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        # >>> fold: validation: the right device, no double free
        if block.device != self.device:
            raise ValueError(f"block {block.block_number} lives on {block.device.name}, not {self.device.name}")
        if block.ref_count == 0:
            raise ValueError(f"double free: {self.device.name} block {block.block_number} is already free")
        # <<<
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)


def slot_for(block_table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of the token at ``position``: its block's number times the block size
    plus its offset inside the block."""
    block_index, offset = divmod(position, block_size)
    # >>> fold: validation
    if block_index >= len(block_table):
        raise IndexError(f"position {position} needs logical block {block_index}, "
                         f"but the block table has only {len(block_table)} blocks")
    # <<<
    return block_table[block_index] * block_size + offset


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots for the tokens at positions ``start .. end-1``."""
    return [slot_for(block_table, p, block_size) for p in range(start, end)]
