"""One scheduling round as a drawing: the three queues, the GPU and CPU pools with each block's
owner, and the block tables (chapters 05 and 09, and the steppers' frames).

``tinyserve.viz.rounds`` draws many rounds at once (timelines) and re-exports these.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.lab.records import request_order, round_caption
from tinyserve.sim import RoundRecord
from tinyserve.viz.style import REQUEST_PALETTE, pick, pyplot


def request_colors(records: Sequence[RoundRecord]) -> dict[str, str]:
    """One fixed colour per request, so a request looks the same in every round's drawing."""
    return {rid: pick(REQUEST_PALETTE, i) for i, rid in enumerate(request_order(records))}


# -- one round: queues and block tables ---------------------------------------------------------

def _owners(tables: dict[str, list[int]]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for key, blocks in tables.items():
        for b in blocks:
            owners.setdefault(b, []).append(key)
    return owners


def _draw_pool(ax, x0: float, y0: float, tables: dict[str, list[int]], num_blocks: int, cols: int,
               colors: dict[str, str], label: str) -> float:
    """Draw a pool of blocks as a grid from (x0, y0) downwards; returns the y below it."""
    plt = pyplot()
    owners = _owners(tables)
    ax.text(x0, y0, label, ha="left", va="bottom", fontsize=8, fontweight="bold")
    for b in range(num_blocks):
        x, y = x0 + b % cols, y0 + 0.15 + b // cols
        who = owners.get(b, [])
        # Block-table keys are request ids, or "id.i" for the i-th sample of a group.
        rid = (who[0] if who[0] in colors else who[0].rsplit(".", 1)[0]) if who else None
        ax.add_patch(plt.Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=colors.get(rid, "#bbb") if rid
                                   else "white", edgecolor="#666", linewidth=0.8))
        if who:
            text = rid if len(who) == 1 else f"{rid}×{len(who)}"
            ax.text(x + 0.5, y + 0.42, text, ha="center", va="center", fontsize=8)
        ax.text(x + 0.93, y + 0.94, str(b), ha="right", va="bottom", fontsize=7, color="#555")
    return y0 + 0.15 + max(1, -(-num_blocks // cols)) + 0.7


def _draw_queue(ax, x0: float, y0: float, width: float, name: str, ids: list[str], record: RoundRecord,
                colors: dict[str, str]) -> None:
    plt = pyplot()
    ax.add_patch(plt.Rectangle((x0, y0), width, 1.5, facecolor="#fafafa", edgecolor="#999", linewidth=0.8))
    ax.text(x0 + 0.1, y0 - 0.05, f"{name} ({len(ids)})", ha="left", va="bottom", fontsize=8, fontweight="bold")
    chip = min(1.6, (width - 0.2) / max(1, len(ids)))
    for i, rid in enumerate(ids):
        in_batch = rid in record.batch
        preempted = rid in record.preempted
        ax.add_patch(plt.Rectangle((x0 + 0.1 + i * chip, y0 + 0.3), chip - 0.1, 0.9,
                                   facecolor=colors.get(rid, "#ddd"),
                                   edgecolor="#e15759" if preempted else "black",
                                   linewidth=2.2 if in_batch or preempted else 0.6,
                                   linestyle="--" if preempted else "-"))
        ax.text(x0 + 0.05 + (i + 0.5) * chip, y0 + 0.75, rid, ha="center", va="center", fontsize=8)


def draw_round(record: RoundRecord, ax=None, title: str | None = None, colors: dict[str, str] | None = None):
    """One round as a drawing: the three queues (batch members outlined bold, preempted ones
    dashed red), then the GPU pool and the CPU swap pool with each block's owner, and the block
    tables as text."""
    plt = pyplot()
    colors = colors if colors is not None else request_colors([record])
    cols = max(4, min(16, max(record.num_gpu_blocks, record.num_cpu_blocks, 1)))
    width = max(cols, 9) + 7.5
    if ax is None:
        rows = -(-record.num_gpu_blocks // cols) + (-(-record.num_cpu_blocks // cols) if record.num_cpu_blocks else 0)
        _, ax = plt.subplots(figsize=(0.5 * width, 0.5 * (rows + 6)))
    qw = (width - 0.6) / 3
    for i, (name, ids) in enumerate((("waiting", record.waiting), ("running", record.running),
                                     ("swapped", record.swapped))):
        _draw_queue(ax, i * (qw + 0.3), 0.5, qw, name, ids, record, colors)
    caption = round_caption(record)
    if record.tokens:
        caption += " · produced " + ", ".join(f"{k}→{v!r}" for k, v in record.tokens.items())
    ax.text(0, 2.45, caption, ha="left", va="center", fontsize=7.5, wrap=True)
    y = 3.2
    y_gpu = y
    y = _draw_pool(ax, 0, y, record.block_tables, record.num_gpu_blocks, cols, colors,
                   f"GPU blocks: {record.free_gpu_blocks} of {record.num_gpu_blocks} free")
    if record.num_cpu_blocks:
        y = _draw_pool(ax, 0, y, record.cpu_block_tables, record.num_cpu_blocks, cols, colors,
                       f"CPU swap blocks: {record.free_cpu_blocks} of {record.num_cpu_blocks} free")
    lines = ["block tables"] + [f"{k}: GPU {v}" for k, v in record.block_tables.items()] + \
            [f"{k}: CPU {v}" for k, v in record.cpu_block_tables.items()]
    if len(lines) == 1:
        lines.append("(none)")
    tx = cols + 0.6
    for i, line in enumerate(lines[:14]):
        ax.text(tx, y_gpu + 0.1 + 0.62 * i, line, ha="left", va="top", fontsize=7.5,
                fontweight="bold" if i == 0 else "normal", family="monospace")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(max(y, y_gpu + 0.62 * min(len(lines), 14) + 0.3), -0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"round {record.round} · {record.phase}", loc="left", fontsize=10)
    return ax.figure


def draw_rounds(records: Sequence[RoundRecord], rounds: Sequence[int], title: str | None = None):
    """Several rounds' drawings stacked, one panel per round (numbered from 1)."""
    by_round = {r.round: r for r in records}
    return draw_round_panels([(None, by_round[n]) for n in rounds], title=title, colors=request_colors(records))


def draw_round_panels(panels: Sequence[tuple[str | None, RoundRecord]], title: str | None = None,
                      colors: dict[str, str] | None = None):
    """``draw_round`` of each ``(panel title, record)``, stacked one under the other (side by side,
    two pools grow too wide to read at a column's width), with one colour per request across them.
    A title of ``None`` names the round and its phase."""
    plt = pyplot()
    records = [record for _, record in panels]
    colors = colors if colors is not None else request_colors(records)
    first = records[0]
    cols = max(4, min(16, max(first.num_gpu_blocks, first.num_cpu_blocks, 1)))
    rows = -(-first.num_gpu_blocks // cols) + (-(-first.num_cpu_blocks // cols) if first.num_cpu_blocks else 0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(0.5 * (max(cols, 9) + 7.5), 0.5 * (rows + 5.4) * len(panels)))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (name, record) in zip(axes, panels):
        draw_round(record, ax=ax, title=name, colors=colors)
    if title:
        fig.suptitle(title, x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig
