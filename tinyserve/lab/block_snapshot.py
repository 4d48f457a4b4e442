"""Block tables frozen into plain numbers, so a drawing can show a moment that has passed.

Objects change as soon as the next operation runs, so a view first takes a ``BlockSnapshot``:
for each sequence, how full each logical block is and which physical block holds it; for each
pool, every block's ref count and the free list in the order the allocator hands blocks out.
``snapshot`` reads a live BlockSpaceManager (chapter 03), ``snapshot_tables`` an allocator with
hand-kept tables (chapter 02). ``tinyserve.viz.blocks`` draws the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tinyserve.block import BlockAllocator, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sequence import Sequence, SequenceGroup
from tinyserve.sim import seq_key


@dataclass
class SeqView:
    """One sequence as drawn: tokens per logical block and where each mapped block lives."""

    label: str
    fills: list[int]
    table: list[tuple[str, int]]  # (device name, block number) per logical block that has one


@dataclass
class BlockSnapshot:
    """The state of the block tables and pools at one moment, detached from the live objects."""

    caption: str
    block_size: int
    seqs: list[SeqView]
    ref_counts: dict[str, list[int]]          # device name -> ref count of every block
    free_lists: dict[str, list[int]]          # device name -> free block numbers, next out first
    owners: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # (device, block) -> labels
    note: str = ""

    def labels(self) -> list[str]:
        return [s.label for s in self.seqs]


def _normalize(seqs) -> dict[str, Sequence]:
    """Accept {label: Sequence}, or a list of Sequences (labelled "seq <id>") and SequenceGroups
    (labelled by request id, with ".i" per sample when a group has several)."""
    if isinstance(seqs, dict):
        return dict(seqs)
    out: dict[str, Sequence] = {}
    for item in seqs:
        if isinstance(item, SequenceGroup):
            for s in item.get_seqs():
                out[seq_key(item, s)] = s
        else:
            out[f"seq {item.seq_id}"] = item
    return out


def _snapshot_from(tables: dict[str, tuple[Sequence, list[PhysicalTokenBlock] | None]],
                   allocators: Iterable[BlockAllocator], block_size: int, caption: str,
                   other_tables: Iterable[list[PhysicalTokenBlock]] = (), note: str = "") -> BlockSnapshot:
    views, owners = [], {}
    for label, (seq, table) in tables.items():
        table = table or []
        views.append(SeqView(label, [b.num_tokens for b in seq.logical_token_blocks],
                             [(b.device.name, b.block_number) for b in table]))
        for b in dict.fromkeys((b.device.name, b.block_number) for b in table):
            owners.setdefault(b, []).append(label)
    for table in other_tables:
        for b in dict.fromkeys((b.device.name, b.block_number) for b in table):
            owners.setdefault(b, []).append("other")
    ref_counts, free_lists = {}, {}
    for alloc in allocators:
        ref_counts[alloc.device.name] = [b.ref_count for b in alloc.blocks]
        free_lists[alloc.device.name] = [b.block_number for b in alloc.free_blocks]
    return BlockSnapshot(caption, block_size, views, ref_counts, free_lists, owners, note)


def snapshot(manager: BlockSpaceManager, seqs: dict[str, Sequence] | list, caption: str = "",
             note: str = "") -> BlockSnapshot:
    """Freeze what ``manager`` holds for ``seqs`` (blocks held by other sequences show as "other")."""
    named = _normalize(seqs)
    ids = {s.seq_id for s in named.values()}
    tables = {label: (s, manager.block_tables.get(s.seq_id)) for label, s in named.items()}
    others = [t for sid, t in manager.block_tables.items() if sid not in ids]
    return _snapshot_from(tables, [manager.gpu_allocator, manager.cpu_allocator], manager.block_size,
                          caption, others, note)


def snapshot_tables(allocator: BlockAllocator, tables: dict[str, tuple[Sequence, list[PhysicalTokenBlock]]],
                    caption: str = "", note: str = "") -> BlockSnapshot:
    """Chapter 02's version, before the BlockSpaceManager exists: an allocator and hand-kept tables."""
    return _snapshot_from(tables, [allocator], allocator.block_size, caption, note=note)
