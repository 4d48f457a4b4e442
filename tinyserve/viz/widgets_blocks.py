"""Chapter 03's stepper: the BlockSpaceManager, one operation at a time.

``BlockOpsStepper(script)`` runs a script of block-manager operations (``lab.block_ops``:
allocate, fork, append with its copy-on-write, swap out and in, free) on a real
BlockSpaceManager, snapshots the manager after each operation, and steps through those
snapshots: the operation and what it returned, every sequence's block table with ref counts,
both pools with their free lists, and the drawing of chapter 03 (``blocks.draw_snapshot``).
"""

from __future__ import annotations

import html

from tinyserve.lab.block_ops import BLOCK_STORY, BlockOp, play_block_script
from tinyserve.lab.block_snapshot import BlockSnapshot, snapshot
from tinyserve.viz import blocks
from tinyserve.viz.stepper import Stepper
from tinyserve.viz.style import owner_colors
from tinyserve.viz.widget_view import pick_steps


def table_lines(snap: BlockSnapshot) -> list[tuple[str, str]]:
    """Each sequence's block table with the ref count of every block, then each pool's free list."""
    lines = []
    for s in snap.seqs:
        if s.table:
            cells = ", ".join(f"{n} (ref {snap.ref_counts[dev][n]})" for dev, n in s.table)
            lines.append((s.label, f"{s.table[0][0]} [{html.escape(cells)}]"))
        else:
            lines.append((s.label, "no blocks"))
    for dev, free in snap.free_lists.items():
        total = len(snap.ref_counts[dev])
        shown = " ".join(map(str, free)) or "none"
        lines.append((f"free {dev}", f"{len(free)} of {total} (next out first: {shown})"))
    return lines


def op_lines(op: BlockOp) -> list[tuple[str, str]]:
    lines = [("operation", html.escape(op.line)), ("call", f"<code>{html.escape(op.call)}</code>"),
             ("returned", f"<code>{html.escape(op.result)}</code>"), ("what happened", html.escape(op.meaning))]
    if not op.done:
        lines.append(("refused", "the manager said no; nothing changed"))
    return lines


class BlockOpsStepper(Stepper):
    """Steps through a block-manager script; the keyword arguments go to ``play_block_script``
    (``requests``, ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``, ``watermark``)."""

    noun = "operation"
    text_spare_lines = 2  # "what happened" is a sentence; on a narrow page it takes two lines

    def __init__(self, script: list[str] | tuple[str, ...] = BLOCK_STORY, draw: bool = True,
                 interval_ms: int = 1200, **manager_kwargs) -> None:
        self.snapshots: list[BlockSnapshot] = []

        def take(manager, seqs, op: BlockOp) -> None:
            n = len(self.snapshots) + 1
            self.snapshots.append(snapshot(manager, seqs, f"{n}. {op.line}: {op.call}",
                                                  note=f"returned {op.result}"))

        self.ops = play_block_script(script, observe=take, **manager_kwargs)
        if not self.ops:
            raise ValueError("script: BlockOpsStepper needs at least one operation")
        # One color per sequence and one frame for every snapshot, so nothing jumps between steps.
        self.colors = owner_colors([lab for s in self.snapshots for lab in s.labels()] + ["other"])
        self.frame_w = max(blocks._width(s) for s in self.snapshots)
        self.frame_h = max(blocks._height(s) for s in self.snapshots)
        self.figsize = (0.55 * self.frame_w + 1.8, 0.5 * self.frame_h + 0.9)
        super().__init__(len(self.ops), draw=draw, interval_ms=interval_ms)

    @property
    def op(self) -> BlockOp:
        return self.ops[self.index]

    @property
    def snapshot(self) -> BlockSnapshot:
        return self.snapshots[self.index]

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        return [op_lines(self.ops[index]), table_lines(self.snapshots[index])]

    def draw_step(self, index: int, fig) -> None:
        ax = fig.add_subplot()
        blocks.draw_snapshot(self.snapshots[index], ax, self.colors)
        ax.set_xlim(-1.6, self.frame_w + 0.2)
        ax.set_ylim(-self.frame_h + 0.55, 0.15)
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)

    def step_title(self, index: int) -> str:
        return f"{index + 1}. {self.ops[index].line}"

    def key_steps(self) -> list[int]:
        # Every operation that changed something, up to nine: the story has eleven.
        changed = [i for i, op in enumerate(self.ops) if op.done and not op.line.startswith("free")]
        return pick_steps(len(self.ops), changed)
