"""The book's look, in one place: how a drawing gets pyplot, and every colour table.

A request, a phase or a block state has the same colour in every chapter's figures because
they all come from here. ``pyplot()`` imports matplotlib only when something is drawn, so a
module that merely defines drawings stays cheap to import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def pyplot():
    """``matplotlib.pyplot``, imported on first use."""
    import matplotlib.pyplot as plt

    return plt


# -- categorical palettes -----------------------------------------------------------------------

# Strong colours for owners of blocks (sequences, ranks, kernel partitions, shared prefixes).
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948",
           "#ff9da7", "#9c755f", "#86bcb6"]
# Light colours for requests in timelines and packed inputs, where text sits on top.
REQUEST_PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
                   "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
FREE_COLOR, UNKNOWN_OWNER, UNSHARED = "white", "#bbbbbb", "#e6e6e6"


def pick(palette: list[str], i: int) -> str:
    """The ``i``-th colour of a palette, wrapping around."""
    return palette[i % len(palette)]


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


# -- what a request is doing ----------------------------------------------------------------------

PHASE_COLORS = {"prefill": "#f28e2b", "decode": "#4e79a7", "mixed": "#b07aa1"}

# What a request is doing in a round, and how the timeline paints it.
STATES = {
    "prefill": (PHASE_COLORS["prefill"], "prefill (computes its prompt, samples a token)"),
    "decode": (PHASE_COLORS["decode"], "decode (one new token)"),
    "idle": ("#cdd7e3", "idle: holds its place and blocks, computes nothing"),
    "waiting": ("#ececec", "waiting"),
    "preempted": ("#e15759", "preempted this round"),
    "swapped": ("#b07aa1", "swapped out to the CPU"),
    "ignored": ("#555555", "ignored (dropped unfinished)"),
}
FINISH_MARK = "✓"
SWAP_IN_MARK = "↑"

# Where a step's time goes (chapters 09 and 11).
TIME_PART_COLORS = {"schedule": "#4e79a7", "prepare": "#76b7b2", "model": "#f28e2b", "sample": "#59a14f",
                    "process": "#b07aa1"}

# -- what a KV slot holds (chapter 01) ------------------------------------------------------------

SLOT_COLORS = {"used": "#2f7ed8", "internal": "#f28f43", "external": "#c42525", "free": UNSHARED}
SLOT_NAMES = {"used": "holds a token", "internal": "reserved, unused (internal)",
              "external": "free, stranded (external)", "free": "free"}

# -- the systems of chapter 11's benchmarks -------------------------------------------------------

SYSTEM_COLORS = {"tinyserve": "#4e79a7", "tinyserve-orca": "#76b7b2", "generate": "#f28e2b",
                 "generate_batch": "#59a14f"}


# -- legibility -------------------------------------------------------------------------------------

# The smallest text a figure may carry, in points, when its PNG (110 dpi) is shown 900 px wide or less:
# 10 px on screen. tests/test_figure_legibility.py measures every registered figure against it.
MIN_FONT = 10


def plain_log_ticks(axis) -> None:
    """Label a log axis 0.1, 1, 10, 100 rather than 10⁻¹, 10⁰…: no superscripts too small to read,
    and no "6×10⁰" minor labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def text_size(fig, smallest: float = MIN_FONT) -> float:
    """A font size (points) still 10 px on screen when ``fig`` is saved at 110 dpi and scaled down
    to 900 px wide: a wide figure needs larger text (0.8 pt per inch of width), never below ``smallest``."""
    return max(smallest, round(0.82 * fig.get_figwidth(), 1))
