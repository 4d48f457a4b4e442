"""The BlockSpaceManager: every sequence's block table, and the decisions that depend on them.

It answers the scheduler's questions (can this prompt be admitted? can every running sequence
grow by one token? can this group be swapped back in?) and carries out its orders (allocate,
append a slot, fork, swap out, swap in, free). It only does bookkeeping on block numbers; the
CacheEngine moves the actual bytes, following the maps returned here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock
from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[PhysicalTokenBlock]
# Builds one device's pool: allocator(device, block_size, num_blocks) -> a BlockAllocator-like object.
AllocatorFactory = Callable[[Device, int, int], BlockAllocator]


class AllocStatus(enum.Enum):
    """Whether a waiting prompt fits: now, after others free memory, or never."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


class BlockSpaceManager:
    """Maps each sequence's logical blocks to physical blocks on the GPU or in CPU swap space.

    ``allocator`` builds each device's pool, ``allocator(device, block_size, num_blocks)``; any
    object with the BlockAllocator interface will do (``allocate``, ``free``,
    ``get_num_free_blocks``, ``num_blocks``). The default is ``BlockAllocator``.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, *, allocator: AllocatorFactory | None = None) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        if allocator is not None and not callable(allocator):
            raise ValueError(f"allocator must be a factory allocator(device, block_size, num_blocks), "
                             f"got {allocator!r}")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        # Admission keeps this many GPU blocks free so that running sequences can still take
        # a new block on their next token; without it, a new prompt could force a preemption
        # in the very next decode round.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        allocator = allocator or BlockAllocator
        self.gpu_allocator = allocator(Device.GPU, block_size, num_gpu_blocks)
        self.cpu_allocator = allocator(Device.CPU, block_size, num_cpu_blocks)
        self.block_tables: dict[int, BlockTable] = {}

    # -- admission -------------------------------------------------------------------------

    def _reserve(self) -> int:
        """Blocks a newcomer must leave free. The watermark is there so that *running* sequences
        can grow; on an empty GPU it protects nobody, and a preempted group that grew into it
        while running could otherwise never come back."""
        free = self.gpu_allocator.get_num_free_blocks()
        return 0 if free == self.num_total_gpu_blocks else self.watermark_blocks

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        required = seq.n_blocks
        # A new prompt that would eat into the watermark even on an empty cache never fits. A
        # sequence preempted by recompute has already run: it needs only the cache itself.
        floor = 0 if seq.get_output_len() > 0 else self.watermark_blocks
        if self.num_total_gpu_blocks - required < floor:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - required >= self._reserve():
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give the group's prompt its blocks; all waiting sequences share them.

        Sharing is only right while the waiting sequences hold the same tokens, that is before
        any of them has sampled. Several sequences that have generated tokens (a multi-sample
        group preempted by recompute) would write different K/V into the same slots, so they
        are refused: the scheduler swaps such groups instead.
        """
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        # >>> fold: validation: several samples that have generated cannot share a table
        if len(waiting) > 1 and any(s.get_output_len() > 0 for s in waiting):
            raise ValueError(
                f"request {seq_group.request_id!r}: {len(waiting)} waiting sequences have already generated "
                "tokens and cannot share one block table; a group with several sequences must be swapped, "
                "not recomputed"
            )
        # <<<
        table = self._prompt_blocks(waiting[0])
        for block in table:
            block.ref_count += len(waiting) - 1  # every waiting sequence owns each block
        for seq in waiting:
            self.block_tables[seq.seq_id] = list(table)

    def _prompt_blocks(self, seq: Sequence) -> BlockTable:
        """One fresh GPU block for each logical block of the prompt. (A subclass may hand out
        blocks it already holds instead: see ``prefix_cache.PrefixCachingBlockSpaceManager``.)"""
        return [self.gpu_allocator.allocate() for _ in range(seq.n_blocks)]

    def worst_case_num_blocks(self, prompt_len: int, num_seqs: int, max_len: int) -> int:
        """The most GPU blocks a group of ``num_seqs`` samples of one prompt can ask for at once,
        when each sample may grow to ``max_len`` tokens.

        A sample of ``len`` tokens (its newest one still without K/V) holds the blocks of
        ``len - 1`` tokens, and before it decodes, or comes back from swap space, the scheduler
        asks for up to one more block per sample (``can_append_slot``, ``can_swap_in``); a sample
        of ``max_len`` tokens has finished and asks for nothing. Right after the prefill the
        samples still share every prompt block; from their second decode on, each owns the
        blocks after the prompt's full ones. A group over this bound could be swapped out and
        never fit back in, even on an empty GPU.
        """
        prompt_blocks = -(-prompt_len // self.block_size)
        if max_len - 1 <= prompt_len:  # the prefill samples the last token: no decode ever runs
            return prompt_blocks
        if max_len - 1 == prompt_len + 1:  # a single decode, while every block is still shared
            return prompt_blocks + num_seqs
        shared = prompt_len // self.block_size
        held = -(-(max_len - 2) // self.block_size)  # blocks of the longest sample that still decodes
        return shared + num_seqs * (held - shared + 1)

    # -- growth ----------------------------------------------------------------------------

    def _needs_new_block(self, seq: Sequence) -> bool:
        table = self.block_tables[seq.seq_id]
        # A fresh block when the newest token starts a new logical block, or a copy when the
        # last block is shared (copy-on-write).
        return len(table) < seq.n_blocks or table[-1].ref_count > 1

    def can_append_slot(self, seq_group: SequenceGroup) -> bool:
        # Exact, where vLLM v0.4 assumed every sequence needs a block: preempting a request
        # that would not have needed memory only costs time.
        needed = sum(self._needs_new_block(s) for s in seq_group.get_seqs(SequenceStatus.RUNNING))
        return self.gpu_allocator.get_num_free_blocks() >= needed

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token.

        Returns ``(src, dst)`` when the last block was shared and had to be copied first
        (copy-on-write), so the worker copies its K/V before writing; otherwise None.
        """
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:
            table.append(self.gpu_allocator.allocate())
            return None
        last = table[-1]
        if last.ref_count == 1:
            return None
        new = self.gpu_allocator.allocate()
        table[-1] = new
        self.gpu_allocator.free(last)
        return last.block_number, new.block_number

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent until one of them writes to it."""
        table = self.block_tables[parent.seq_id]
        self.block_tables[child.seq_id] = list(table)
        for block in table:
            block.ref_count += 1

    # -- growth a chunk at a time (policy="v1") -----------------------------------------------

    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0) -> int:
        """Free GPU blocks it takes to make ``seq``'s table hold its first ``num_tokens`` tokens.

        vLLM V1 allocates only the blocks of the tokens a step computes (``allocate_slots``),
        where v0.4 allocates a whole prompt at admission and one slot per decode.
        ``num_cached_tokens`` (whole blocks) is the head a prefix cache already holds (see
        ``prefix_cache.PrefixCachingBlockSpaceManager``); without one it is 0."""
        return max(0, self._num_blocks(num_tokens) - len(self.block_tables.get(seq.seq_id, [])))

    def can_grow(self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0) -> bool:
        return self.num_blocks_to_grow(seq, num_tokens, num_cached_tokens) <= self.gpu_allocator.get_num_free_blocks()

    def grow(self, seq: Sequence, num_tokens: int, num_cached_tokens: int = 0) -> None:
        """Append GPU blocks to ``seq``'s table (a new table if it has none) until it holds
        ``num_tokens`` tokens."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        table.extend(self._new_blocks(seq, len(table), self._num_blocks(num_tokens)))

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks(self, seq: Sequence, start: int, stop: int) -> BlockTable:
        """Fresh GPU blocks for logical blocks ``start`` to ``stop - 1`` of ``seq``."""
        return [self.gpu_allocator.allocate() for _ in range(start, stop)]

    # -- swapping --------------------------------------------------------------------------

    def _physical_blocks(self, seq_group: SequenceGroup) -> list[PhysicalTokenBlock]:
        # A set by identity: forked sequences share blocks, which move once.
        seen: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_unfinished_seqs():
            for block in self.block_tables.get(seq.seq_id, []):
                seen[id(block)] = block
        return list(seen.values())

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        blocks = self._physical_blocks(seq_group)
        # One extra block per sequence: each will append a token right after coming back.
        required = len(blocks) + seq_group.num_seqs(SequenceStatus.SWAPPED)
        return self.gpu_allocator.get_num_free_blocks() - required >= self._reserve()

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's blocks CPU -> GPU. Returns {cpu block: gpu block}."""
        return self._move(seq_group, SequenceStatus.SWAPPED, self.gpu_allocator)

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return len(self._physical_blocks(seq_group)) <= self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's blocks GPU -> CPU. Returns {gpu block: cpu block}."""
        # >>> fold: no room in swap space: OutOfBlocksError
        if not self.can_swap_out(seq_group):
            raise OutOfBlocksError(
                f"out of CPU swap space: request {seq_group.request_id!r} needs "
                f"{len(self._physical_blocks(seq_group))} CPU blocks but only "
                f"{self.cpu_allocator.get_num_free_blocks()} of {self.num_total_cpu_blocks} are free; "
                "raise num_cpu_blocks (swap space) or use preemption_mode='recompute'"
            )
        # <<<
        return self._move(seq_group, SequenceStatus.RUNNING, self.cpu_allocator)

    def _move(self, seq_group: SequenceGroup, status: SequenceStatus, dst_alloc: BlockAllocator) -> dict[int, int]:
        """Give every block of the group's sequences a block in ``dst_alloc``'s pool and free the
        old one. Returns {old block: new block} for the contents the worker must copy."""
        mapping: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status):
            new_table: BlockTable = []
            for src in self.block_tables[seq.seq_id]:
                if src.block_number in mapping:  # shared with a sequence moved before: moves once
                    dst = mapping[src.block_number]
                    dst.ref_count += 1
                else:
                    dst, needs_copy = self._destination(src, dst_alloc)
                    if needs_copy:
                        mapping[src.block_number] = dst
                new_table.append(dst)
                self._free_block(src)
            self.block_tables[seq.seq_id] = new_table
        return {src: dst.block_number for src, dst in mapping.items()}

    def _destination(self, src: PhysicalTokenBlock, dst_alloc: BlockAllocator) -> tuple[PhysicalTokenBlock, bool]:
        """The block that takes ``src``'s content on the other device, and whether the worker must
        copy it there: always a fresh block and a copy here. (A subclass may find a block that
        already holds the content, and need no copy.)"""
        return dst_alloc.allocate(), True

    # -- release ---------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks (safe to call twice: the second call does nothing)."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        for block in table:
            self._free_block(block)

    def _free_block(self, block: PhysicalTokenBlock) -> None:
        """Drop one owner of a block, in the pool of its device."""
        (self.gpu_allocator if block.device == Device.GPU else self.cpu_allocator).free(block)

    def get_block_table(self, seq: Sequence) -> list[int]:
        return [b.block_number for b in self.block_tables[seq.seq_id]]

    def get_block_device(self, seq: Sequence) -> Device | None:
        table = self.block_tables.get(seq.seq_id)
        return table[0].device if table else None

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()


class StackBlockAllocator(BlockAllocator):
    """vLLM v0.4's ``UncachedBlockAllocator`` order: the free blocks are a stack, so the block
    freed last goes out first (and a fresh pool starts from its highest number)."""

    def allocate(self) -> PhysicalTokenBlock:
        self.free_blocks.rotate(1)  # the back of the free list (freed last) comes to the front
        return super().allocate()


class V04BlockSpaceManager(BlockSpaceManager):
    """The BlockSpaceManager with vLLM v0.4.0's rules (``vllm/core/block_manager_v1.py``), for
    ``SchedulerConfig(compat="vllm-0.4")``. Three methods and the free-list order differ; the
    bookkeeping (allocate, append_slot, fork, swap, free) is the same.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, *, allocator: AllocatorFactory | None = None) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         allocator=allocator or StackBlockAllocator)

    def _reserve(self) -> int:
        # The watermark always holds, even on an empty GPU (can_allocate and can_swap_in).
        return self.watermark_blocks

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        # No lower floor for a sequence preempted by recompute: one that has grown into the
        # watermark is NEVER, and the scheduler drops it as v0.4 does.
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        required = seq.n_blocks
        if self.num_total_gpu_blocks - required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - required >= self._reserve():
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_append_slot(self, seq_group: SequenceGroup) -> bool:
        # v0.4's "simple heuristic": one free block for every running sequence, whether or not
        # its next token needs one.
        return seq_group.num_seqs(SequenceStatus.RUNNING) <= self.gpu_allocator.get_num_free_blocks()
