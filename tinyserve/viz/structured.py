"""Draw what a grammar allowed at each step of a constrained request (chapter 12).

``draw_allowed_tokens`` takes the steps a ``tinyserve.lab.structured.MaskRecorder`` kept: one row
per generated token, the token drawn on the left, a bar of how many tokens the grammar allowed
(log scale, out of the whole vocabulary), and, where the grammar ruled out the token the model
liked best, that token beside the bar.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from tinyserve.lab.structured import GuidedStep

MASKED, FREE = "#d95f02", "#7570b3"


def shown_token(tokenizer, token_id: int | None) -> str:
    """A token as text one can see: a space as ␣, a newline as ⏎, other control characters escaped, quoted."""
    if token_id is None:
        return "(failed)"
    text = tokenizer.decode([token_id]).replace(" ", "␣").replace("\n", "⏎")
    return "'" + "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) + "'"


def draw_allowed_tokens(steps: list[GuidedStep], tokenizer, vocab_size: int, title: str | None = None):
    """One row per step, top to bottom: the token drawn, the number of allowed tokens, and the
    model's own favourite where the grammar masked it. Returns the Figure."""
    n = len(steps)
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.32 * n))
    rows = range(n)
    colors = [MASKED if s.top_masked else FREE for s in steps]
    ax.barh(rows, [s.num_allowed for s in steps], color=colors, height=0.7, log=True)
    ax.set_xscale("log")
    ax.set_xlim(0.6, vocab_size * 8)  # room right of the widest bar for its count
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.axvline(vocab_size, color="grey", lw=1, ls=":")
    for row, s in enumerate(steps):
        note = f"{s.num_allowed:,}"
        if s.top_masked:
            note += f"   model wanted {shown_token(tokenizer, s.wanted[0])}"
        ax.text(s.num_allowed * 1.25, row, note, va="center", ha="left", fontsize=10,
                color=MASKED if s.top_masked else "black",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # over the dotted line
    ax.set_yticks(list(rows), [f"{row + 1}: {shown_token(tokenizer, s.chosen)}" for row, s in enumerate(steps)],
                  fontsize=10, family="monospace")
    ax.set_ylim(n - 0.4, -0.8)  # the first step on top
    ax.set_xlabel("tokens the grammar allows at this step (log scale)", fontsize=11)
    ax.set_ylabel("step: token drawn", fontsize=11)
    ax.tick_params(axis="x", labelsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=FREE, label="the model's own top token is allowed"),
               Patch(color=MASKED, label="the grammar masked the model's top token"),
               Line2D([], [], color="grey", lw=1, ls=":", label=f"the whole vocabulary ({vocab_size:,} tokens)")]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=1, frameon=False, fontsize=10)
    if title:
        ax.set_title(title, fontsize=12, loc="left", pad=62)  # above the legend
    fig.tight_layout()
    return fig
