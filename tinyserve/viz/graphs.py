"""Chapter 11.14's figure: a decode step eager and compiled, batch by batch, and the padding.

Left, the step's time against its batch size from ``benchmarks/results/compiled_step.csv``: the
engine eager and compiled, transformers' decode forward and the machine's floor; a compiled batch
that runs on a larger graph (padded) is drawn hollow. Right, which graph each batch of 1 to 32
sequences runs on: its real rows and the padding rows the graph computes for nothing. The
numbers come from ``tinyserve.lab.graph_costs``; this module only draws them.
"""

from __future__ import annotations

from tinyserve.lab.graph_costs import padding_table, step_rows
from tinyserve.viz.style import MIN_FONT, SYSTEM_COLORS, pyplot

EAGER, COMPILED, FLOOR = "#9db9d6", SYSTEM_COLORS["tinyserve"], "#6f6f6f"
PADDING = "#e8a6a6"


def draw_step_times(ax, rows: list[dict]) -> None:
    """Step time against batch size: eager, compiled (hollow where padded), transformers, floor."""
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["eager_ms"] for r in rows], "s-", color=EAGER, lw=2, label="tinyserve, eager")
    ax.plot(batches, [r["compiled_ms"] for r in rows], "-", color=COMPILED, lw=2.2)
    full = [r for r in rows if r["batch"] == r["graph_size"]]
    padded = [r for r in rows if r["batch"] != r["graph_size"]]
    ax.plot([r["batch"] for r in full], [r["compiled_ms"] for r in full], "o", color=COMPILED, ms=7,
            label="tinyserve, compiled graph")
    if padded:
        ax.plot([r["batch"] for r in padded], [r["compiled_ms"] for r in padded], "o", mfc="white", mec=COMPILED,
                mew=2, ms=7, label="compiled, batch padded up")
    ax.plot(batches, [r["transformers_ms"] for r in rows], "^--", color=SYSTEM_COLORS["generate"], lw=1.6,
            label="transformers' forward")
    ax.plot(batches, [r["floor_ms"] for r in rows], ":", color=FLOOR, lw=2, label="floor (roofline)")
    top = max(max(r["eager_ms"], r["compiled_ms"], r["transformers_ms"]) for r in rows)
    ax.set_ylim(0, 1.1 * top)
    ax.set_xlim(0, max(batches) + 1)
    ax.set_xlabel("sequences in the decode batch", fontsize=MIN_FONT + 1)
    ax.set_ylabel("ms per decode step", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.grid(alpha=0.3)
    dtype = rows[0]["dtype"]
    ax.set_title(f"one decode step ({dtype})", fontsize=MIN_FONT + 1)
    # Below the axes: inside, some corner always holds a line.
    ax.legend(fontsize=MIN_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def draw_padding(ax, table: list[dict]) -> None:
    """For each batch size, the rows its graph computes: real ones, then padding."""
    batches = [r["batch"] for r in table]
    ax.bar(batches, batches, width=0.8, color=COMPILED, label="real rows")
    ax.bar(batches, [r["padded_rows"] for r in table], bottom=batches, width=0.8, color=PADDING, hatch="//",
           edgecolor="white", label="padding rows")
    for size in sorted({r["graph_size"] for r in table}):
        ax.axhline(size, color="#bbbbbb", lw=0.8, zorder=0)
    ax.set_xlim(0.3, max(batches) + 0.7)
    ax.set_ylim(0, 1.08 * max(r["graph_size"] for r in table))
    ax.set_xlabel("sequences in the decode batch", fontsize=MIN_FONT + 1)
    ax.set_ylabel("rows the graph computes", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    worst = max(table, key=lambda r: r["padded_share"])
    ax.set_title(f"graphs of {', '.join(str(s) for s in sorted({r['graph_size'] for r in table}))} rows; "
                 f"at worst {worst['padded_share']:.0%} padding (batch {worst['batch']})", fontsize=MIN_FONT + 1)
    ax.legend(fontsize=MIN_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def draw_compiled_step(rows: list[dict], max_num_seqs: int | None = None):
    """The two panels side by side: ``rows`` of ``compiled_step.csv`` (one dtype), and the
    padding of every batch up to ``max_num_seqs`` (the largest batch measured by default)."""
    if not rows:
        raise ValueError("no rows of compiled_step.csv to draw")
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw=dict(width_ratios=[1.15, 1]))
    draw_step_times(left, rows)
    draw_padding(right, padding_table(max_num_seqs or max(r["batch"] for r in rows)))
    fig.tight_layout(w_pad=3)
    return fig


def compiled_step_figure():
    """The figure from the committed results (for ``figures.REGISTRY``), in their first dtype."""
    rows = step_rows()
    return draw_compiled_step([r for r in rows if r["dtype"] == rows[0]["dtype"]])
