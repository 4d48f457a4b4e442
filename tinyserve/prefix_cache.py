"""Automatic prefix caching: blocks named by their content, kept after use until evicted.

A full block is identified by a hash of its tokens chained with the hash of the block before
it, so equal hashes mean equal *prefixes*, not just equal blocks. When a new prompt starts with
blocks whose hashes are known, it shares those physical blocks (their ref counts go up) and
skips computing their K/V. A block whose last owner lets go is not wiped: it waits in an LRU
evictor, still findable by its hash, until the pool needs a block and evicts the least recently
used one, forgetting its hash at that moment.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock


def hash_block_tokens(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The name of a full block: its tokens, chained with everything before it."""
    return hash((prev_hash, token_ids))


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a partial last block has none)."""
    hashes: list[int] = []
    prev = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block_tokens(prev, tuple(token_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


class CachedBlockAllocator(BlockAllocator):
    """A BlockAllocator whose free blocks keep their content (and hash) until evicted."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        super().__init__(device, block_size, num_blocks)
        self.cached: dict[int, PhysicalTokenBlock] = {}  # hash -> the block holding that prefix
        self.evictor: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()  # free but cached, LRU first
        self._clock = itertools.count(1)
        self.num_evictions = 0

    def lookup(self, block_hash: int) -> PhysicalTokenBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, block_hash: int | None = None) -> PhysicalTokenBlock:
        hit = self.cached.get(block_hash) if block_hash is not None else None
        if hit is not None:
            if hit.ref_count == 0:
                del self.evictor[hit.block_number]
            hit.ref_count += 1
            hit.last_accessed = next(self._clock)
            return hit
        block = self._take_free_block()
        block.ref_count = 1
        block.last_accessed = next(self._clock)
        if block_hash is not None:
            self.register(block, block_hash)
        return block

    def _take_free_block(self) -> PhysicalTokenBlock:
        if self.free_blocks:
            return self.free_blocks.popleft()
        if self.evictor:
            _, block = self.evictor.popitem(last=False)
            self.forget(block)
            self.num_evictions += 1
            return block
        raise OutOfBlocksError(f"out of {self.device.name} blocks: all {self.num_blocks} blocks of "
                               f"{self.block_size} tokens are in use")

    def register(self, block: PhysicalTokenBlock, block_hash: int) -> None:
        """Name a block by the prefix it holds, unless another block already holds it."""
        if block_hash in self.cached or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def forget(self, block: PhysicalTokenBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.computed = False

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 0:
            raise ValueError(f"double free: {self.device.name} block {block.block_number} is already free")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None and block.computed:
            self.evictor[block.block_number] = block
        else:
            self.forget(block)  # never computed: its content is garbage, so its name must go
            self.free_blocks.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictor)

    def reset(self) -> None:
        """Drop every cached prefix (all blocks must be free)."""
        for block in self.evictor.values():
            self.forget(block)
        self.free_blocks = deque(list(self.free_blocks) + list(self.evictor.values()))
        self.evictor.clear()
