"""Three diagrams drawn from real runs (``tinyserve.lab.lifecycles``): a block's life (chapter 03),
a request's queue transitions (chapter 05) and one ``LLMEngine.step`` as a sequence diagram
(chapter 09).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tinyserve.lab.lifecycles import ARRIVES, FINISHED, LIFELINES, BlockState, Call
from tinyserve.viz.style import PALETTE, pick, pyplot, text_size

STATE_COLORS = {"free": "#ffffff", "allocated": "#cfe2f3", "shared": "#f9cb9c", "copied": "#fce5cd",
                "swapped": "#d9d2e9", "back": "#cfe2f3", "freed": "#eeeeee"}


def draw_block_life(states: Sequence[BlockState], title: str = ""):
    """One box per state the block passed through, left to right, each arrow labelled with the
    script line that moved it there."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.9 * len(states) + 0.5, 2.8))
    size = text_size(fig, 9)  # a long life makes a wide figure, shown scaled down: its text grows with it
    w, gap = 1.45, 0.45
    for i, s in enumerate(states):
        x = i * (w + gap)
        ax.add_patch(plt.Rectangle((x, 0), w, 1, facecolor=STATE_COLORS.get(s.state, "white"), edgecolor="#444444",
                                   linewidth=1.2))
        ax.text(x + w / 2, 0.7, s.state, ha="center", va="center", fontsize=size + 1, weight="bold")
        where = "free list" if s.state in ("free", "freed") else f"ref count {s.ref_count}"
        ax.text(x + w / 2, 0.3, f"{s.device} block {s.number}\n{where}", ha="center", va="center", fontsize=size)
        if i:
            ax.annotate("", xy=(x, 0.5), xytext=(x - gap, 0.5), arrowprops={"arrowstyle": "->", "lw": 1.2})
            ax.text(x - gap / 2, 1.1 + 0.36 * (i % 2), s.op, ha="center", va="bottom", fontsize=size,
                    family="monospace")
    ax.set_xlim(-0.2, len(states) * (w + gap))
    ax.set_ylim(-0.2, 1.95)
    ax.axis("off")
    ax.set_title(title or "A block's life: A's last prompt block through chapter 03's script", fontsize=size + 1)
    fig.tight_layout()
    return fig


# Where each queue sits; each move's name, the bend of its arrow and where its label goes.
_NODES = {ARRIVES: (0.0, 1.0), "waiting": (2.0, 1.0), "running": (4.5, 1.0), "swapped": (4.5, -0.9),
          FINISHED: (7.0, 1.0)}
_MOVES = {
    (ARRIVES, "waiting"): ("add_request", 0.0, (1.0, 1.3)),
    ("waiting", "running"): ("admitted (prefill)", -0.3, (3.25, 1.0)),
    ("running", "waiting"): ("preempted: recompute", -0.3, (2.7, 0.3)),
    ("running", "swapped"): ("preempted:\nswap out", 0.3, (3.55, -0.5)),
    ("swapped", "running"): ("swapped in", 0.3, (5.3, 0.05)),
    ("running", FINISHED): ("finished\n(stop, length)", 0.0, (5.75, 1.45)),
    ("waiting", FINISHED): ("ignored: can never fit", -0.42, (4.5, 2.55)),
}


def draw_queue_transitions(runs: dict[str, Counter], title: str = ""):
    """The queues as boxes and every move between them as an arrow, labelled with its name and
    how many times each run in ``runs`` made it."""
    plt = pyplot()
    from matplotlib.patches import FancyArrowPatch

    fig, ax = plt.subplots(figsize=(10, 4.8))
    boxes = {}
    for name, (x, y) in _NODES.items():
        queue = name not in (ARRIVES, FINISHED)
        boxes[name] = ax.text(x, y, name, ha="center", va="center", fontsize=12, weight="bold",
                              bbox={"boxstyle": "round,pad=0.35", "facecolor": "#cfe2f3" if queue else "#f3f3f3"})
    for (a, b), (label, bend, (lx, ly)) in _MOVES.items():
        (x0, y0), (x1, y1) = _NODES[a], _NODES[b]
        counts = ", ".join(f"{run}: {c[(a, b)]}" for run, c in runs.items() if c[(a, b)])
        # Clipped to the boxes themselves (drawn after them, so their outlines are placed), so an
        # arrowhead ends at a box's edge rather than inside its label.
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, lw=1.3,
                                     connectionstyle=f"arc3,rad={bend}", patchA=boxes[a].get_bbox_patch(),
                                     patchB=boxes[b].get_bbox_patch(), shrinkA=3, shrinkB=3, zorder=4,
                                     color="#222222"))
        ax.text(lx, ly, label + (f"\n{counts}" if counts else "\nnot in these runs"), ha="center", va="center",
                fontsize=9.5, color="#222222" if counts else "#666666")
    ax.set_xlim(-0.6, 7.6)
    ax.set_ylim(-1.4, 3.0)
    ax.axis("off")
    ax.set_title(title or "A request's queues, and how often each move happened", fontsize=11)
    fig.tight_layout()
    return fig


def draw_step_sequence(calls: Sequence[Call], title: str = ""):
    """A sequence diagram: one lifeline per part, one arrow per call (top to bottom, in order),
    indented by how deep in the step it was made; a call of a part to itself loops back."""
    plt = pyplot()
    lanes = [name for name in LIFELINES if any(name in (c.caller, c.callee) for c in calls)] or list(LIFELINES)
    gap = 1.6
    x = {name: i * gap for i, name in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(gap * len(lanes) + 1.2, 0.4 * len(calls) + 1.5))
    size = text_size(fig)  # many lanes make a wide figure, shown scaled down: its text grows with it
    bottom = -(len(calls) + 0.5)
    for i, name in enumerate(lanes):
        ax.plot([x[name], x[name]], [0.2, bottom], color="#999999", lw=0.8, ls="--", zorder=0)
        ax.text(x[name], 0.55, name, ha="center", va="center", fontsize=size, weight="bold",
                bbox={"boxstyle": "round,pad=0.3", "facecolor": pick(PALETTE, i), "alpha": 0.25})
    for row, c in enumerate(calls, start=1):
        y = -row
        method = "sampler(logits, requests)" if c.method == "__call__" else f"{c.method}()"
        label = method + (f" ×{c.count}" if c.count > 1 else "")
        x0, x1 = x[c.caller], x[c.callee]
        if x0 == x1:  # a call to itself: out and back
            ax.annotate("", xy=(x0 + 0.02, y - 0.25), xytext=(x0 + 0.02, y + 0.1),
                        arrowprops={"arrowstyle": "->", "lw": 1.0, "connectionstyle": "arc3,rad=-1.2"})
            ax.text(x0 + 0.3, y - 0.05, label, ha="left", va="center", fontsize=size, family="monospace")
            continue
        ax.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops={"arrowstyle": "->", "lw": 1.1})
        ax.text((x0 + x1) / 2, y + 0.1, label, ha="center", va="bottom", fontsize=size, family="monospace")
    ax.set_xlim(-1.2, max(x.values()) + 1.2)
    ax.set_ylim(bottom, 1.0)
    ax.axis("off")
    ax.set_title(title or "One LLMEngine.step(), call by call", fontsize=size + 1)
    fig.tight_layout()
    return fig


# -- the book's figures -----------------------------------------------------------------------

def fig_block_life():
    from tinyserve.lab.lifecycles import block_life

    return draw_block_life(block_life())


def fig_queue_transitions():
    from tinyserve import presets
    from tinyserve.lab.lifecycles import queue_transitions
    from tinyserve.sim import simulate

    runs = {}
    for mode in ("swap", "recompute"):
        preset = presets.seed_rounds(mode)
        runs[mode] = queue_transitions(simulate(preset.requests, preset.scheduler_config,
                                                              preset.cache_config))
    return draw_queue_transitions(runs)


def fig_step_sequence():
    from tinyserve.lab.lifecycles import story_step_calls

    calls, round_number = story_step_calls()
    return draw_step_sequence(calls, title=f"Round {round_number} of s0/s1/s2 (swap) as one LLMEngine.step(), "
                                           "call by call")
