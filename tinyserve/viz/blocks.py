"""Drawings of block tables, made from the live objects of chapters 02 and 03.

A drawing shows, for each sequence, its logical blocks (how full each is) with an arrow to the
physical block that holds it; under them the physical pools (GPU, then CPU swap space) as strips
of cells colored by owner, each with its ref count; and each pool's free list in the order the
allocator will hand blocks out.

Objects change as soon as the next operation runs, so a drawing first takes a ``BlockSnapshot``
(plain numbers, no references to live blocks). ``draw_block_table_history`` lays several
snapshots out one under the other: the before and after of allocate, fork, append_slot, swap.
``draw_pool`` draws one pool from the plain dict of block tables a ``RoundRecord`` carries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from tinyserve.block import BlockAllocator, Device, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sequence import Sequence, SequenceGroup
from tinyserve.sim import seq_key
from tinyserve.viz.figures import figure

CELL_W, CELL_H = 0.9, 0.8   # a cell inside its 1 x 1 grid slot
POOL_COLS = 16              # a pool wider than this wraps onto more rows
ROW_GAP = 1.25              # vertical distance between two rows of cells
FREE_COLOR, UNKNOWN_OWNER = "white", "#bbbbbb"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948",
           "#ff9da7", "#9c755f", "#86bcb6"]


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


def _fixed_color_index(label: str) -> int | None:
    """The book's running examples keep their colors in every figure: s0, s1, s2... and A..E."""
    m = re.fullmatch(r"s(\d+)", label)
    if m:
        return int(m.group(1)) % len(PALETTE)
    if re.fullmatch(r"[A-Z]", label):
        return (ord(label) - ord("A")) % len(PALETTE)
    return None


def owner_colors(labels: Iterable[str]) -> dict[str, str]:
    """A color per owner, stable across the snapshots of one figure ("other" is grey)."""
    labels = list(dict.fromkeys(labels))
    colors: dict[str, str] = {}
    used = set()
    for label in labels:
        i = _fixed_color_index(label)
        if i is not None:
            colors[label] = PALETTE[i]
            used.add(i)
    free = [i for i in range(len(PALETTE)) if i not in used] or list(range(len(PALETTE)))
    k = 0
    for label in labels:
        if label in colors:
            continue
        if label == "other":
            colors[label] = UNKNOWN_OWNER
        else:
            colors[label] = PALETTE[free[k % len(free)]]
            k += 1
    return colors


# -- drawing ------------------------------------------------------------------------------


def _pool_xy(block: int, top: float) -> tuple[float, float]:
    """Lower-left corner of a pool cell; pools wrap after POOL_COLS cells."""
    row, col = divmod(block, POOL_COLS)
    return col, top - row * ROW_GAP - CELL_H


def _pool_rows(num_blocks: int) -> int:
    return max(1, -(-num_blocks // POOL_COLS))


def _draw_cell_owners(ax, x: float, y: float, owners: list[str], colors: dict[str, str], gid: str) -> None:
    """A cell split into vertical stripes, one per owner, so a shared block shows every owner."""
    from matplotlib.patches import Rectangle

    fills = [colors.get(o, UNKNOWN_OWNER) for o in owners] or [FREE_COLOR]
    w = CELL_W / len(fills)
    for i, c in enumerate(fills):
        ax.add_patch(Rectangle((x + i * w, y), w, CELL_H, facecolor=c, edgecolor="none", zorder=2))
    ax.add_patch(Rectangle((x, y), CELL_W, CELL_H, facecolor="none", edgecolor="#444444", lw=1.0, gid=gid,
                           zorder=3))


def _draw_pool_at(ax, device: str, ref_counts: list[int], owners: dict[tuple[str, int], list[str]],
                  free_list: list[int], colors: dict[str, str], top: float, title: str,
                  free_label: str = "free list ({n}, next out first)") -> dict[int, tuple]:
    """Draw one pool with its top edge at ``top``; return each block's cell corner."""
    corners = {}
    for n, rc in enumerate(ref_counts):
        x, y = _pool_xy(n, top)
        corners[n] = (x, y)
        own = owners.get((device, n), [])
        if rc > 0 and not own:
            own = ["?"]  # held by something we were not told about
        _draw_cell_owners(ax, x, y, own if rc > 0 else [], colors, gid=f"phys:{device}:{n}")
        ax.text(x + CELL_W / 2, y + CELL_H * 0.62, str(n), ha="center", va="center", fontsize=8,
                fontweight="bold" if rc else "normal", color="black" if rc else "#999999", zorder=4)
        if rc:
            ax.text(x + CELL_W / 2, y + CELL_H * 0.22, f"ref {rc}", ha="center", va="center", fontsize=6.5,
                    gid=f"ref:{device}:{n}", zorder=4)
    ax.text(-0.25, top - CELL_H / 2, title, ha="right", va="center", fontsize=9, fontweight="bold")
    bottom = top - (_pool_rows(len(ref_counts)) - 1) * ROW_GAP - CELL_H
    shown = " ".join(map(str, free_list[:24])) + (" …" if len(free_list) > 24 else "")
    ax.text(0, bottom - 0.3, f"{free_label.format(n=len(free_list))}: {shown or '(empty)'}",
            ha="left", va="top", fontsize=7.5, color="#333333", gid=f"free:{device}")
    return corners


LABEL_H = 0.45  # room above a sequence's blocks for its label


def _seq_layout(snap: BlockSnapshot) -> tuple[dict[str, tuple[float, float]], int, float]:
    """Place sequences left to right (so arrows rarely cross another sequence's blocks),
    wrapping onto a new line when the pool's width is used up. Returns each sequence's
    top-left corner, the number of lines and the layout's width."""
    width = max(_pool_width(snap), 10)
    corners, x, line = {}, 0.0, 0
    for s in snap.seqs:
        w = max(len(s.fills), 2) + 0.5
        if x > 0 and x + w > width + 0.5:
            x, line = 0.0, line + 1
        corners[s.label] = (x, -line * (ROW_GAP + LABEL_H))
        x += w
    return corners, line + 1 if snap.seqs else 0, max(width, max((c[0] + 2 for c in corners.values()), default=0))


def _pool_width(snap: BlockSnapshot) -> int:
    return max((min(len(rc), POOL_COLS) for rc in snap.ref_counts.values()), default=4)


def _height(snap: BlockSnapshot) -> float:
    pools = sum(_pool_rows(len(rc)) * ROW_GAP + 0.9 for rc in snap.ref_counts.values() if rc)
    return _seq_layout(snap)[1] * (ROW_GAP + LABEL_H) + 1.2 + pools + (0.5 if snap.note else 0.1)


def _width(snap: BlockSnapshot) -> float:
    return _seq_layout(snap)[2]


def draw_snapshot(snap: BlockSnapshot, ax=None, colors: dict[str, str] | None = None):
    """Draw one snapshot; returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * _width(snap) + 1.6, 0.5 * _height(snap) + 0.4))
    colors = colors or owner_colors(snap.labels() + ["other"])
    bs = snap.block_size
    seq_corners, lines, width = _seq_layout(snap)
    # Logical blocks: each sequence's row of blocks under its label; fill shows tokens held.
    logical_bottom: dict[tuple[str, int], tuple[float, float]] = {}
    for s in snap.seqs:
        x0, top = seq_corners[s.label]
        ax.text(x0, top, f"{s.label} ({sum(s.fills)} tok)", ha="left", va="top", fontsize=8.5,
                fontweight="bold", color=colors.get(s.label, "black"))
        y = top - LABEL_H - CELL_H
        for j, n in enumerate(s.fills):
            mapped = j < len(s.table)
            x = x0 + j
            ax.add_patch(Rectangle((x, y), CELL_W, CELL_H, facecolor="white", edgecolor="none", zorder=2))
            ax.add_patch(Rectangle((x, y), CELL_W * n / bs, CELL_H, facecolor=colors.get(s.label, UNKNOWN_OWNER),
                                   alpha=0.45, edgecolor="none", zorder=2))
            ax.add_patch(Rectangle((x, y), CELL_W, CELL_H, facecolor="none", gid=f"logical:{s.label}:{j}",
                                   edgecolor="#444444", lw=1.0, linestyle="-" if mapped else "--", zorder=3))
            ax.text(x + CELL_W / 2, y + CELL_H / 2, f"L{j}\n{n}/{bs}" if mapped else f"L{j}\n{n}/{bs}\nno block",
                    ha="center", va="center", fontsize=6.5, zorder=4)
            if mapped:
                logical_bottom[(s.label, j)] = (x + CELL_W / 2, y)
    top = -lines * (ROW_GAP + LABEL_H) - 0.9
    corners: dict[str, dict[int, tuple]] = {}
    for device, rc in snap.ref_counts.items():
        if not rc:
            continue
        corners[device] = _draw_pool_at(ax, device, rc, snap.owners, snap.free_lists.get(device, []), colors,
                                        top, f"{device}\nblocks")
        top -= _pool_rows(len(rc)) * ROW_GAP + 0.9
    # Arrows: logical block -> the physical block that holds it (behind the cells they pass).
    for s in snap.seqs:
        for j, (device, n) in enumerate(s.table):
            if device not in corners or n not in corners[device]:
                continue
            x, y = corners[device][n]
            ax.annotate("", xy=(x + CELL_W / 2, y + CELL_H), xytext=logical_bottom[(s.label, j)],
                        arrowprops=dict(arrowstyle="->", color=colors.get(s.label, UNKNOWN_OWNER), lw=1.1,
                                        alpha=0.8, shrinkA=1, shrinkB=1),
                        gid=f"arrow:{s.label}:{j}", zorder=1)
    if snap.note:
        ax.text(0, top + 0.15, snap.note, ha="left", va="top", fontsize=8, family="monospace", color="#222222")
        top -= 0.4
    ax.set_xlim(-1.6, width + 0.2)
    ax.set_ylim(top + 0.4, 0.15)
    ax.axis("off")
    if snap.caption:
        ax.set_title(snap.caption, fontsize=10, loc="left")
    return ax


def draw_block_tables(manager: BlockSpaceManager, seqs: dict[str, Sequence] | list, ax=None,
                      title: str = ""):
    """Draw the live state of ``manager`` for ``seqs`` ({label: Sequence}, or a list of Sequences
    and SequenceGroups). Returns the axes."""
    return draw_snapshot(snapshot(manager, seqs, title), ax)


def draw_sequence_tables(allocator: BlockAllocator,
                         tables: dict[str, tuple[Sequence, list[PhysicalTokenBlock]]], ax=None, title: str = ""):
    """Chapter 02: sequences with block tables kept by hand over one allocator."""
    return draw_snapshot(snapshot_tables(allocator, tables, title), ax)


def draw_block_table_history(snapshots: list[BlockSnapshot], ncols: int = 1):
    """One panel per snapshot (row by row, ``ncols`` to a row), with the same color for the
    same sequence throughout."""
    import matplotlib.pyplot as plt

    if not snapshots:
        raise ValueError("draw_block_table_history needs at least one snapshot")
    colors = owner_colors([lab for s in snapshots for lab in s.labels()] + ["other"])
    nrows = -(-len(snapshots) // ncols)
    heights = [max(_height(s) for s in snapshots[r * ncols:(r + 1) * ncols]) for r in range(nrows)]
    width = max(_width(s) for s in snapshots)
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * (0.55 * width + 1.6), 0.5 * sum(heights) + 0.5 * nrows),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(snapshots):
            ax.axis("off")
            continue
        draw_snapshot(snapshots[i], ax, colors)
        ax.set_xlim(-1.6, width + 0.2)
        ax.set_ylim(-heights[i // ncols] + 0.4 + 0.15, 0.15)
    fig.tight_layout()
    return fig


def draw_pool(block_tables: dict[str, list[int]], num_blocks: int, ax=None, title: str = "GPU",
              ref_counts: list[int] | dict[int, int] | None = None):
    """One pool from plain block tables (as a ``RoundRecord`` carries them): cells colored by
    owner, ref counts written in, the free blocks listed. Without ``ref_counts``, a block's
    count is the number of tables that hold it. Returns the axes."""
    import matplotlib.pyplot as plt

    owners: dict[tuple[str, int], list[str]] = {}
    for label, table in block_tables.items():
        for n in dict.fromkeys(table):
            if not 0 <= n < num_blocks:
                raise ValueError(f"{label}'s block table names block {n}, outside a pool of {num_blocks}")
            owners.setdefault((title, n), []).append(label)
    if ref_counts is None:
        counts = [0] * num_blocks
        for table in block_tables.values():
            for n in set(table):
                counts[n] += 1
    elif isinstance(ref_counts, dict):
        counts = [ref_counts.get(n, 0) for n in range(num_blocks)]
    else:
        counts = list(ref_counts)
    if len(counts) != num_blocks:
        raise ValueError(f"ref_counts has {len(counts)} entries for {num_blocks} blocks")
    colors = owner_colors(list(block_tables))
    rows = _pool_rows(num_blocks)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * min(max(num_blocks, 4), POOL_COLS) + 2.4, 0.6 * rows * ROW_GAP + 0.9))
    # Plain tables do not say in which order the allocator will hand free blocks out.
    _draw_pool_at(ax, title, counts, owners, [n for n in range(num_blocks) if counts[n] == 0], colors, 0.0, title,
                  free_label="free blocks ({n})")
    from matplotlib.patches import Patch

    if block_tables:
        ax.legend(handles=[Patch(facecolor=colors[k], label=k) for k in block_tables], fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_xlim(-1.6, min(max(num_blocks, 4), POOL_COLS) + 0.2)
    ax.set_ylim(-(rows - 1) * ROW_GAP - CELL_H - 0.8, 0.1)
    ax.axis("off")
    return ax


def draw_slots(block_tables: dict[str, list[int]], seq_lens: dict[str, int], num_blocks: int, block_size: int,
               ax=None):
    """The cache seen slot by slot: one row per physical block, one column per offset. Each slot
    a sequence writes is labelled with its position in that sequence; the small number is the
    slot (block number x block size + offset) that the slot mapping hands the worker."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 * block_size + 2.2, 0.42 * num_blocks + 0.8))
    colors = owner_colors(list(block_tables))
    holder: dict[int, tuple[str, int]] = {}
    for label, table in block_tables.items():
        n = seq_lens[label]
        if n > len(table) * block_size:
            raise ValueError(f"{label} has {n} tokens but its table holds only {len(table) * block_size}")
        for pos in range(n):
            holder[table[pos // block_size] * block_size + pos % block_size] = (label, pos)
    for b in range(num_blocks):
        y = num_blocks - 1 - b
        ax.text(-0.15, y + 0.4, f"block {b}", ha="right", va="center", fontsize=8)
        for off in range(block_size):
            slot = b * block_size + off
            owner = holder.get(slot)
            ax.add_patch(Rectangle((off, y), 0.95, 0.8, gid=f"slot:{slot}", edgecolor="#555555", lw=0.8,
                                   facecolor=colors[owner[0]] if owner else "white", alpha=0.8 if owner else 1))
            ax.text(off + 0.06, y + 0.7, str(slot), ha="left", va="top", fontsize=6, color="#555555")
            if owner:
                ax.text(off + 0.5, y + 0.32, f"{owner[0]}[{owner[1]}]", ha="center", va="center", fontsize=7.5,
                        gid=f"token:{owner[0]}:{owner[1]}")
    ax.legend(handles=[Patch(facecolor=colors[k], label=k) for k in block_tables], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_xlim(-1.6, block_size + 0.1)
    ax.set_ylim(-0.2, num_blocks)
    ax.axis("off")
    ax.set_title("offset in block →", fontsize=8, loc="center")
    return ax


# -- registered figures (the chapters' examples, rebuilt for `make figures`) -----------------------


def seed_tables_example():
    """Chapter 02's example: s0, s1, s2 (5, 5 and 3 prompt tokens, blocks of 4 tokens) over one
    allocator of 8 blocks. They decode one token each per step for 8 steps; s1 stops after 2
    tokens and gives its blocks back, which the others reuse, so tables end up scattered.
    Returns the allocator and the live sequences with their tables."""
    alloc = BlockAllocator(Device.GPU, block_size=4, num_blocks=8)
    seqs = {name: Sequence(i, None, list(range(100 * i, 100 * i + n)), 4)
            for i, (name, n) in enumerate([("s0", 5), ("s1", 5), ("s2", 3)])}
    tables = {name: [alloc.allocate() for _ in range(seq.n_blocks)] for name, seq in seqs.items()}
    stop_after = {"s0": 16, "s1": 2, "s2": 16}
    for step in range(8):
        for name in list(tables):
            seq = seqs[name]
            seq.append_token_id(9000 + step)
            if seq.n_blocks > len(tables[name]):
                tables[name].append(alloc.allocate())
            if seq.get_output_len() == stop_after[name]:
                for block in tables.pop(name):
                    alloc.free(block)
    return alloc, {name: (seqs[name], tables[name]) for name in tables}


@figure("02_block_tables")
def block_tables_figure():
    alloc, live = seed_tables_example()
    return draw_sequence_tables(alloc, live, title="s0 and s2 after 8 decode steps (s1 has finished)").figure


@figure("02_slot_mapping")
def slot_mapping_figure():
    alloc, live = seed_tables_example()
    return draw_slots({k: [b.block_number for b in t] for k, (_, t) in live.items()},
                      {k: s.get_len() for k, (s, _) in live.items()}, alloc.num_blocks, alloc.block_size).figure



def block_manager_story() -> list[BlockSnapshot]:
    """Chapter 03's story on a tiny pool (blocks of 4 tokens, 8 on the GPU, 4 on the CPU):
    allocate A (6 tokens, n=2) and B (4 tokens); fork A into two samples; append a token to each
    sequence (A.0 copies the shared block, A.1 keeps it, B takes a fresh block); swap A out and
    back in; free everything."""
    from tinyserve.sequence import SamplingParams, SequenceStatus

    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a = Sequence(0, None, list(range(100, 106)), 4)
    b = Sequence(1, None, list(range(200, 204)), 4)
    ga = SequenceGroup("A", [a], SamplingParams(n=2, temperature=1.0), 0.0)
    gb = SequenceGroup("B", [b], SamplingParams(), 0.0)
    shots = []
    bm.allocate(ga)
    bm.allocate(gb)
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
    seqs = {"A.0": a, "B": b}
    shots.append(snapshot(bm, seqs, "1. allocate(A), allocate(B): each prompt gets its blocks"))
    child = a.fork(2)
    ga.add(child)
    bm.fork(a, child)
    seqs = {"A.0": a, "A.1": child, "B": b}
    shots.append(snapshot(bm, seqs, "2. fork(A.0, A.1): the sample shares every block, ref counts 2"))
    returned = {}
    for label, seq, token in (("A.0", a, 1), ("A.1", child, 2), ("B", b, 3)):
        seq.append_token_id(token)
        returned[label] = bm.append_slot(seq)
    shots.append(snapshot(bm, seqs, "3. append_slot: A.0 copies the shared block, A.1 keeps it, B takes a new one",
                          note="returned " + ", ".join(f"{k}: {v}" for k, v in returned.items())))
    out = bm.swap_out(ga)
    for s in ga.get_seqs():
        s.status = SequenceStatus.SWAPPED
    shots.append(snapshot(bm, seqs, f"4. swap_out(A): its {len(out)} distinct blocks move to the CPU",
                          note=f"swap_out(A) returned {out}"))
    back = bm.swap_in(ga)
    for s in ga.get_seqs():
        s.status = SequenceStatus.RUNNING
    shots.append(snapshot(bm, seqs, "5. swap_in(A): back on the GPU, in whatever blocks are free",
                          note=f"swap_in(A) returned {back}"))
    for s in (a, child, b):
        bm.free(s)
    shots.append(snapshot(bm, seqs, "6. free all: every block back on the free list, ref counts 0"))
    return shots


@figure("03_block_table_history")
def block_table_history_figure():
    return draw_block_table_history(block_manager_story(), ncols=2)
