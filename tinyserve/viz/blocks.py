"""Drawings of block tables, made from the live objects of chapters 02 and 03.

A drawing shows, for each sequence, its logical blocks (how full each is) with an arrow to the
physical block that holds it; under them the physical pools (GPU, then CPU swap space) as strips
of cells colored by owner, each with its ref count; and each pool's free list in the order the
allocator will hand blocks out.

A drawing reads a ``BlockSnapshot`` (``tinyserve.lab.block_snapshot``: plain numbers, no
references to live blocks). ``draw_block_table_history`` lays several
snapshots out one under the other: the before and after of allocate, fork, append_slot, swap.
``draw_pool`` draws one pool from the plain dict of block tables a ``RoundRecord`` carries.
"""

from __future__ import annotations

from tinyserve.block import BlockAllocator, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.lab.block_snapshot import BlockSnapshot, snapshot, snapshot_tables
from tinyserve.lab.block_stories import block_manager_story, seed_tables_example
from tinyserve.sequence import Sequence
from tinyserve.viz.style import FREE_COLOR, UNKNOWN_OWNER, owner_colors, pyplot

CELL_W, CELL_H = 0.9, 0.8   # a cell inside its 1 x 1 grid slot
POOL_COLS = 16              # a pool wider than this wraps onto more rows
ROW_GAP = 1.25              # vertical distance between two rows of cells


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
            ax.text(x + CELL_W / 2, y + CELL_H * 0.22, f"ref {rc}", ha="center", va="center", fontsize=7.5,
                    gid=f"ref:{device}:{n}", zorder=4)
    ax.text(-0.25, top - CELL_H / 2, title, ha="right", va="center", fontsize=9, fontweight="bold")
    bottom = top - (_pool_rows(len(ref_counts)) - 1) * ROW_GAP - CELL_H
    shown = " ".join(map(str, free_list[:24])) + (" …" if len(free_list) > 24 else "")
    ax.text(0, bottom - 0.3, f"{free_label.format(n=len(free_list))}: {shown or '(empty)'}",
            ha="left", va="top", fontsize=8, color="#333333", gid=f"free:{device}")
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
    plt = pyplot()
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
                    ha="center", va="center", fontsize=7.5, zorder=4)
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
    plt = pyplot()

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
    plt = pyplot()

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


# -- the chapters' examples, rebuilt for `make figures` (listed in figures.py) ---------------------


def block_tables_figure():
    alloc, live = seed_tables_example()
    return draw_sequence_tables(alloc, live, title="s0 and s2 after 8 decode steps (s1 has finished)").figure


def block_table_history_figure():
    return draw_block_table_history(block_manager_story(), ncols=1)  # two side by side: too small to read
