"""The launch of chapter 08's Triton decode kernel, worked out in Python: grid, tiles, partitions.

``plan_decode`` says, for a batch, what every program of the decode grid does (which query
heads, which tokens, which physical blocks), using the kernel module's own
``choose_num_splits`` and tile rule. ``example_batch`` grows a batch's block tables with the
real BlockSpaceManager, ``random_cache`` fills its slots (NaN elsewhere), and ``example_inputs``
/ ``example_walk`` build the chapter's example. ``tinyserve.viz.attention_kernel`` draws them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tinyserve.attention import triton_paged as tp
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.lab.softmax_walk import ProgramWalk, walk_program
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

H200_SMS = 132  # streaming multiprocessors of an H100/H200 SXM: what choose_num_splits sizes for
EXAMPLE = dict(context_lens=(700, 300, 45), num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)


def partition_layout(max_context_len: int, num_splits: int, tile_tokens: int) -> tuple[int, int]:
    """``(tokens per partition, number of partitions)`` for a context cut into ``num_splits``.

    A partition is a whole number of tiles, so rounding up can leave fewer partitions than asked
    for. The same arithmetic as ``triton_paged.paged_decode_attention``; with one partition the
    kernel is told a huge partition instead, which covers any context.
    """
    max_context_len = max(1, max_context_len)
    per_split = math.ceil(max_context_len / max(1, num_splits))
    partition = tile_tokens * math.ceil(per_split / tile_tokens)
    return partition, math.ceil(max_context_len / partition)


@dataclass
class ProgramWork:
    """What one program of the decode grid does."""

    seq: int
    kv_head: int
    part: int
    q_heads: list[int]        # the query heads it attends for (its rows of the query tile)
    start: int                # tokens [start, end) of the sequence's context
    end: int
    num_tiles: int
    blocks: list[int] = field(default_factory=list)  # physical blocks it reads, in order

    @property
    def empty(self) -> bool:
        """A partition past the end of a short sequence: the program writes weight 0 and stops."""
        return self.end <= self.start


@dataclass
class DecodePlan:
    """The launch of ``paged_decode_kernel`` for one batch."""

    context_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    group: int           # query heads per KV head
    group_pad: int       # rows of the query tile (tl.dot needs at least 16)
    tile_tokens: int     # tokens per loop iteration (TILE_N)
    num_splits: int      # partitions asked for (1 = the single-pass kernel)
    num_parts: int       # partitions launched
    partition_size: int  # the kernel's partition_size argument (2**30 in the single pass)
    programs: list[ProgramWork]

    @property
    def grid(self) -> tuple[int, int, int]:
        return (len(self.context_lens), self.num_kv_heads, self.num_parts)

    @property
    def split(self) -> bool:
        return self.num_parts > 1

    def program(self, seq: int, kv_head: int, part: int = 0) -> ProgramWork:
        return next(p for p in self.programs if (p.seq, p.kv_head, p.part) == (seq, kv_head, part))


def plan_decode(context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                block_tables: list[list[int]] | None = None, *, num_sms: int = 0, num_splits: int | None = None,
                max_context_len: int | None = None, tile_tokens: int | None = None) -> DecodePlan:
    """The grid and partitions ``paged_decode_attention`` launches for this batch.

    ``num_sms`` is the GPU's number of streaming multiprocessors (0, as on the CPU, never splits);
    ``max_context_len`` defaults to the longest context, which is what the backend passes.
    """
    group = num_heads // num_kv_heads
    head_dim_pad = tp.next_pow2(head_dim, 16)
    tile = tile_tokens or tp.default_tile_tokens(head_dim_pad)
    max_ctx = max(1, max_context_len if max_context_len is not None else max(context_lens))
    if num_splits is None:
        num_splits = tp.choose_num_splits(len(context_lens), num_kv_heads, max_ctx, num_sms)
    partition, num_parts = partition_layout(max_ctx, num_splits, tile)
    if num_parts == 1:
        partition = 2**30  # as the kernel is told: one pass, whatever the context
    programs = []
    for s, ctx in enumerate(context_lens):
        table = block_tables[s] if block_tables is not None else None
        for h in range(num_kv_heads):
            for p in range(num_parts):
                start = p * partition
                end = min(ctx, start + partition)
                blocks = []
                if table is not None and end > start:
                    blocks = [table[b] for b in range(start // block_size, math.ceil(end / block_size))]
                programs.append(ProgramWork(s, h, p, list(range(h * group, (h + 1) * group)), start, end,
                                            max(0, math.ceil((end - start) / tile)), blocks))
    return DecodePlan(list(context_lens), num_heads, num_kv_heads, head_dim, block_size, group,
                      tp.next_pow2(group, 16), tile, num_splits, num_parts, partition, programs)


def example_batch(context_lens: tuple[int, ...] = (700, 300, 45), block_size: int = 16,
                  prompt_lens: tuple[int, ...] = (40, 24, 12)) -> tuple[list[list[int]], BlockSpaceManager]:
    """Block tables of a batch grown the way a server grows one, with the real BlockSpaceManager.

    Each sequence's prompt is allocated, then all of them decode one token at a time, round
    robin, until each holds its context; so their blocks interleave in the pool.
    """
    num_blocks = sum(math.ceil(c / block_size) for c in context_lens) + 4
    bm = BlockSpaceManager(block_size, num_blocks, 0, watermark=0.0)
    seqs = []
    for i, (p, ctx) in enumerate(zip(prompt_lens, context_lens)):
        seq = Sequence(i, None, list(range(min(p, ctx))), block_size)
        bm.allocate(SequenceGroup(f"s{i}", [seq], SamplingParams(max_tokens=ctx), 0.0))
        seq.status = SequenceStatus.RUNNING
        seqs.append((seq, ctx))
    while any(seq.get_len() < ctx for seq, ctx in seqs):
        for seq, ctx in seqs:
            if seq.get_len() < ctx:
                seq.append_token_id(0)
                bm.append_slot(seq)
    return [bm.get_block_table(seq) for seq, _ in seqs], bm


def random_cache(block_tables: list[list[int]], context_lens: list[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V caches with random values in every slot a sequence owns and NaN everywhere else, so
    a kernel that reads a slot outside a context gives NaN instead of a plausible number."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    for table, ctx in zip(block_tables, context_lens):
        pos = torch.arange(ctx)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return k.view(cache_shape).to(dtype).to(device), v.view(cache_shape).to(dtype).to(device)


@dataclass
class Example:
    """The chapter's batch, ready for the kernel: block tables from the real BlockSpaceManager,
    NaN-poisoned caches, random queries."""

    context_lens: list[int]
    tables: list[list[int]]
    num_blocks: int
    q: torch.Tensor             # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    lens: torch.Tensor          # [num_seqs] int32
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def example_inputs(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Example:
    ex = EXAMPLE
    lens = list(ex["context_lens"])
    tables, bm = example_batch(ex["context_lens"], ex["block_size"])
    num_blocks = bm.gpu_allocator.num_blocks
    k_cache, v_cache = random_cache(tables, lens, num_blocks, ex["block_size"], ex["num_kv_heads"], ex["head_dim"],
                                    dtype, device, seed)
    q = torch.randn(len(lens), ex["num_heads"], ex["head_dim"], generator=torch.Generator().manual_seed(seed + 1))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return Example(lens, tables, num_blocks, q.to(dtype).to(device), k_cache, v_cache, block_tables,
                   torch.tensor(lens, dtype=torch.int32, device=device), ex["num_heads"], ex["num_kv_heads"],
                   ex["head_dim"], ex["block_size"])


def example_walk(seq: int = 0, kv_head: int = 1, example: Example | None = None) -> tuple[ProgramWalk, Example]:
    """The figure's walk: one program of the example batch, single pass, over its whole context."""
    e = example or example_inputs()
    tile = tp.default_tile_tokens(tp.next_pow2(e.head_dim, 16))
    walk = walk_program(e.q[seq], e.k_cache, e.v_cache, e.tables[seq], kv_head, e.scale, 0, e.context_lens[seq], tile)
    return walk, e
