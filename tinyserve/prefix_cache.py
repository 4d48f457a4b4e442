"""Automatic prefix caching: blocks named by their content, kept after use until evicted.

A full block is identified by a hash of its tokens chained with the hash of the block before
it, so equal hashes mean equal *prefixes*, not just equal blocks. When a new prompt starts with
blocks whose hashes are known, it shares those physical blocks (their ref counts go up) and
skips computing their K/V. A block whose last owner lets go is not wiped: it waits in an LRU
evictor, still findable by its hash, until the pool needs a block and evicts the least recently
used one, forgetting its hash at that moment.

It is an extension of chapters 02 and 03, as vLLM v0.4 keeps a ``CachedBlockAllocator`` beside
its ``UncachedBlockAllocator``: ``CachedBlock`` adds a name to ``PhysicalTokenBlock``,
``CachedBlockAllocator`` keeps freed blocks findable, and ``PrefixCachingBlockSpaceManager``
shares them between prompts. The scheduler builds the caching manager when
``CacheConfig(enable_prefix_caching=True)``, and skips the cached head of a prompt at admission.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock
from tinyserve.block_manager import AllocatorFactory, BlockSpaceManager, BlockTable
from tinyserve.sequence import Sequence


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


class CachedBlock(PhysicalTokenBlock):
    """A physical block that can be named by the prefix it holds."""

    def __init__(self, device: Device, block_number: int, block_size: int) -> None:
        super().__init__(device, block_number, block_size)
        self.block_hash: int | None = None  # the chained hash of its tokens, once full
        self.computed = False  # its K/V has been written: a new prompt may reuse it
        self.last_accessed = 0  # the allocator's clock at its last hit (LRU eviction)


class CachedBlockAllocator(BlockAllocator):
    """A BlockAllocator whose free blocks keep their content (and hash) until evicted."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        super().__init__(device, block_size, num_blocks)
        self.blocks: list[CachedBlock] = [CachedBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_blocks: deque[CachedBlock] = deque(self.blocks)
        self.cached: dict[int, CachedBlock] = {}  # hash -> the block holding that prefix
        self.evictor: OrderedDict[int, CachedBlock] = OrderedDict()  # free but cached, LRU first
        self._clock = itertools.count(1)
        self.num_evictions = 0

    def lookup(self, block_hash: int) -> CachedBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, block_hash: int | None = None) -> CachedBlock:
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

    def _take_free_block(self) -> CachedBlock:
        if self.free_blocks:
            return self.free_blocks.popleft()
        if self.evictor:
            _, block = self.evictor.popitem(last=False)
            self.forget(block)
            self.num_evictions += 1
            return block
        raise OutOfBlocksError(f"out of {self.device.name} blocks: all {self.num_blocks} blocks of "
                               f"{self.block_size} tokens are in use")

    def register(self, block: CachedBlock, block_hash: int) -> None:
        """Name a block by the prefix it holds, unless another block already holds it."""
        if block_hash in self.cached or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def forget(self, block: CachedBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.computed = False

    def free(self, block: CachedBlock) -> None:
        super().free(block)  # checks the block and drops an owner; the last one frees it
        if block.ref_count > 0:
            return
        if block.block_hash is not None and block.computed:
            self.free_blocks.pop()  # (the block just freed) it waits in the evictor instead, still findable
            self.evictor[block.block_number] = block
        else:
            self.forget(block)  # never computed: its content is garbage, so its name must go

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictor)

    def reset(self) -> None:
        """Drop every cached prefix (all blocks must be free)."""
        for block in self.evictor.values():
            self.forget(block)
        self.free_blocks = deque(list(self.free_blocks) + list(self.evictor.values()))
        self.evictor.clear()


class PrefixCachingBlockSpaceManager(BlockSpaceManager):
    """A BlockSpaceManager whose GPU blocks are shared by every prompt that starts with the same
    full blocks. The GPU pool is a ``CachedBlockAllocator``; ``allocator`` builds the CPU pool only.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, *, allocator: AllocatorFactory | None = None) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark, allocator=allocator)
        self.gpu_allocator: CachedBlockAllocator = CachedBlockAllocator(Device.GPU, block_size, num_gpu_blocks)
        # CPU copies of named GPU blocks, by name. Two requests that share a cached block can be
        # swapped out (or in) one after the other in the same round, and a round's copy list has
        # one destination per source block: the second must share the first one's copy.
        self._cpu_by_hash: dict[int, PhysicalTokenBlock] = {}
        self._cpu_hash: dict[int, int] = {}  # CPU block number -> the name of what it holds

    def _prompt_blocks(self, seq: Sequence) -> BlockTable:
        return self._new_blocks(seq, 0, seq.n_blocks)

    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0) -> int:
        """As the plain manager's, less the cached head's blocks that another request holds
        (a hit in the evictor still takes a block off the free count)."""
        table = self.block_tables.get(seq.seq_id, [])
        hits = prefix_hashes(seq.get_token_ids()[: num_cached_tokens], self.block_size)
        held = sum(1 for h in hits[len(table):] if (block := self.gpu_allocator.lookup(h)) and block.ref_count > 0)
        return super().num_blocks_to_grow(seq, num_tokens) - held

    def grow(self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0) -> None:
        """As vLLM V1 allocates: the blocks of the cached head (``num_cached_tokens``, whole
        blocks) by name, fresh blocks for the rest. A block is named once this step fills it, so
        that a later prompt can share it after its K/V is written (``mark_computed``); a block
        that another request holds under the same name is not shared, as in V1."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        start, stop = len(table), self._num_blocks(num_tokens)
        hashes = prefix_hashes(seq.get_token_ids()[: num_tokens], self.block_size)  # the blocks full after it
        hits = num_cached_tokens // self.block_size
        table.extend(self.gpu_allocator.allocate(hashes[i]) if i < hits else self.gpu_allocator.allocate()
                     for i in range(start, stop))
        for i in range(max(start - 1, hits), len(hashes)):  # the last old block may be full now
            self.gpu_allocator.register(table[i], hashes[i])

    def _new_blocks(self, seq: Sequence, start: int, stop: int) -> BlockTable:
        """Each full block of the prompt (or of the tokens so far) is asked for by name, so a hit
        shares the cached block; a partial last block, which has no name yet, is a fresh one."""
        hashes = prefix_hashes(seq.get_token_ids()[: stop * self.block_size], self.block_size)
        return [self.gpu_allocator.allocate(hashes[i]) if i < len(hashes) else self.gpu_allocator.allocate()
                for i in range(start, stop)]

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading prompt tokens whose K/V already sits in computed cached blocks.

        The last token is always left to compute: its logits are needed to sample."""
        n = 0
        for h in prefix_hashes(seq.get_token_ids(), self.block_size):
            block = self.gpu_allocator.lookup(h)
            if block is None or not block.computed:
                break
            n += self.block_size
        return min(n, seq.get_len() - 1)

    def mark_computed(self, seq: Sequence) -> None:
        """After a round: blocks whose every token now has K/V in the cache become reusable."""
        for block in self.block_tables.get(seq.seq_id, [])[: seq.num_computed_tokens // self.block_size]:
            if block.device == Device.GPU:
                block.computed = True

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:  # the last block has just been filled by decoding: name it
            self._name_full_block(seq, len(table) - 1)
        cow = super().append_slot(seq)
        if seq.get_len() % self.block_size == 0:
            # The newest token fills the last block: named now, as vLLM V1 names it, so that a
            # request preempted before its next step finds it again; computed after this step.
            self._name_full_block(seq, len(self.block_tables[seq.seq_id]) - 1, computed=False)
        return cow

    def _name_full_block(self, seq: Sequence, index: int, computed: bool = True) -> None:
        """A block filled by decoding gets its name once full, so later prompts can share it
        (``computed``: its K/V is written already, else ``mark_computed`` says so later)."""
        block = self.block_tables[seq.seq_id][index]
        if index < 0 or block.block_hash is not None or block.ref_count != 1:
            return
        hashes = prefix_hashes(seq.get_token_ids()[: (index + 1) * self.block_size], self.block_size)
        self.gpu_allocator.register(block, hashes[index])
        block.computed = computed and block.block_hash is not None

    # -- swapping blocks that several requests share ------------------------------------------

    def _destination(self, src: PhysicalTokenBlock, dst_alloc: BlockAllocator) -> tuple[PhysicalTokenBlock, bool]:
        """A block on the other device that already holds src's content is shared, not copied."""
        shared = self._shared_copy(src, dst_alloc)
        if shared is not None:
            return shared, False
        dst = dst_alloc.allocate()  # nobody holds a copy yet: make one (the worker copies it)
        self._name_copy(src, dst)
        return dst, True

    def _name_of(self, block: PhysicalTokenBlock) -> int | None:
        """The prefix a block holds for sure (written, not in flight), or None."""
        if block.device == Device.GPU:
            return block.block_hash if getattr(block, "computed", False) else None
        return self._cpu_hash.get(block.block_number)

    def _shared_copy(self, src: PhysicalTokenBlock, dst_alloc: BlockAllocator) -> PhysicalTokenBlock | None:
        """A block on the other device that already holds (or this round receives) src's content."""
        name = self._name_of(src)
        if name is None:
            return None
        if dst_alloc is self.cpu_allocator:
            copy = self._cpu_by_hash.get(name)
            if copy is not None:
                copy.ref_count += 1
            return copy
        hit = self.gpu_allocator.lookup(name)
        return self.gpu_allocator.allocate(name) if hit is not None and hit.computed else None

    def _name_copy(self, src: PhysicalTokenBlock, dst: PhysicalTokenBlock) -> None:
        name = self._name_of(src)
        if name is None:
            return
        if dst.device == Device.CPU:
            self._cpu_by_hash[name] = dst
            self._cpu_hash[dst.block_number] = name
        else:  # its content arrives by the swap-in copy, before the model runs this round
            self.gpu_allocator.register(dst, name)
            dst.computed = dst.block_hash is not None

    def _forget_if_free(self, block: PhysicalTokenBlock) -> None:
        if block.device == Device.CPU and block.ref_count == 0:
            name = self._cpu_hash.pop(block.block_number, None)
            if name is not None and self._cpu_by_hash.get(name) is block:
                del self._cpu_by_hash[name]

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, its last block first: the evictor takes the blocks freed
        first first, so a request's prefix loses its tail before its head and stays findable as
        long as it can (vLLM V1 frees in this order too; v0.4's evictor breaks ties the same way)."""
        table = self.block_tables.pop(seq.seq_id, None)
        for block in reversed(table or []):
            self._free_block(block)

    def _free_block(self, block: PhysicalTokenBlock) -> None:
        super()._free_block(block)
        self._forget_if_free(block)
