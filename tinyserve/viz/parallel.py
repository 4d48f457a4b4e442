"""Drawings for chapter 10: how a layer is cut across ranks, and what each rank then holds.

``draw_column_row_parallel`` draws one MLP (or attention) block on ``k`` ranks with the real
shard shapes from ``tinyserve.parallel.shard_shapes``; ``draw_memory_per_rank`` stacks the
replicated and sharded weight bytes of a rank (``tinyserve.lab.tp_memory``) for a few model
shapes; ``draw_tp_step_times`` plots measured round times of one rank against several.
"""

from __future__ import annotations

from tinyserve.lab.tp_memory import memory_table
from tinyserve.models.loader import smollm2_135m_config
from tinyserve.parallel import shard_shapes
from tinyserve.viz.style import MIN_FONT, PALETTE, pick, plain_log_ticks, pyplot


def _rank_box(ax, x, y, w, h, color, text, alpha=0.85, fontsize=9.5, text_color="white"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=0.6,
                                alpha=alpha))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def draw_column_row_parallel(hf_config=None, tp_size: int = 3, tokens: int = 5):
    """The MLP of one decoder layer on ``tp_size`` ranks: a column-parallel gate/up, the SwiGLU
    on each rank's own columns, a row-parallel down projection giving partial sums, and the one
    all-reduce that adds them. Attention has the same shape: q/k/v split by heads, o_proj by rows."""
    plt = pyplot()

    cfg = hf_config if hf_config is not None else smollm2_135m_config()
    shapes = shard_shapes(cfg, tp_size)
    t, h = tokens, cfg.hidden_size
    inter = shapes["down_proj"][1]
    fig, ax = plt.subplots(figsize=(11, 1.25 + 1.15 * tp_size))
    row_h = 0.8
    for r in range(tp_size):
        y = (tp_size - 1 - r) * 1.15
        c = pick(PALETTE, r)
        ax.text(-0.25, y + row_h / 2, f"rank {r}", ha="right", va="center", fontsize=9, weight="bold")
        _rank_box(ax, 0.0, y, 1.2, row_h, "#888888", f"x\n[{t}, {h}]\n(every rank)")
        _rank_box(ax, 1.6, y, 1.7, row_h, c, f"gate_up rows {r}/{tp_size}\n{list(shapes['gate_up_proj'])}")
        _rank_box(ax, 3.7, y, 1.5, row_h, c, f"silu(g)·u\n[{t}, {inter}]", alpha=0.6)
        _rank_box(ax, 5.6, y, 1.7, row_h, c, f"down cols {r}/{tp_size}\n{list(shapes['down_proj'])}")
        _rank_box(ax, 7.7, y, 1.4, row_h, c, f"partial z{r}\n[{t}, {h}]", alpha=0.45, text_color="black")
        for x0, x1 in ((1.2, 1.6), (3.3, 3.7), (5.2, 5.6), (7.3, 7.7)):
            ax.annotate("", (x1, y + row_h / 2), (x0, y + row_h / 2), arrowprops=dict(arrowstyle="->", lw=0.8))
    top = (tp_size - 1) * 1.15 + row_h
    _rank_box(ax, 9.6, 0.0, 1.5, top, "#333333", "all-reduce\nz = " + " + ".join(f"z{r}" for r in range(tp_size))
         + f"\n[{t}, {h}]\non every rank", fontsize=9.5)
    for r in range(tp_size):
        y = (tp_size - 1 - r) * 1.15 + row_h / 2
        ax.annotate("", (9.6, y), (9.1, y), arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.text(2.45, top + 0.2, "column-parallel\n(split outputs)", ha="center", fontsize=9)
    ax.text(4.45, top + 0.2, "no communication:\neach rank owns its columns", ha="center", fontsize=9)
    ax.text(6.45, top + 0.2, "row-parallel\n(split inputs)", ha="center", fontsize=9)
    ax.text(8.4, top + 0.2, "partial sums", ha="center", fontsize=9)
    ax.set_xlim(-1.1, 11.3)
    ax.set_ylim(-0.3, top + 0.8)
    ax.axis("off")
    ax.set_title(f"One MLP on {tp_size} ranks ({cfg.num_hidden_layers} layers × 2 blocks = "
                 f"{2 * cfg.num_hidden_layers} all-reduces per forward pass); shapes are [out, in] per rank",
                 fontsize=10)
    fig.tight_layout()
    return fig


def column_row_parallel_figure():
    return draw_column_row_parallel()


def draw_memory_per_rank(shapes: dict | None = None, bytes_per_param: int = 2, gpu_gb: float = 80.0):
    """Stacked bars per model: replicated and sharded weight bytes on one rank, by k."""
    plt = pyplot()

    rows = memory_table(shapes, bytes_per_param)
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.2))
    for ax, name in zip(axes, names):
        mine = [r for r in rows if r["model"] == name]
        xs = [str(r["tp_size"]) for r in mine]
        rep = [r["replicated_GB"] for r in mine]
        shard = [r["sharded_GB"] for r in mine]
        ax.bar(xs, rep, color="#888888", label="replicated (embedding, LM head, norms)")
        ax.bar(xs, shard, bottom=rep, color="#4C72B0", label="sharded (attention, MLP)")
        for x, r in zip(xs, mine):
            ax.text(x, r["total_GB"], f"{r['total_GB']:.3g}", ha="center", va="bottom", fontsize=9.5)
        if max(r["total_GB"] for r in mine) > gpu_gb:
            ax.axhline(gpu_gb, color="#C44E52", ls="--", lw=1)
            ax.text(len(xs) - 0.5, gpu_gb, f"{gpu_gb:.0f} GB GPU", color="#C44E52", ha="right", va="bottom",
                    fontsize=9.5)
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("tensor_parallel_size k")
        ax.margins(y=0.15)
    axes[0].set_ylabel(f"weight GB per rank ({8 * bytes_per_param}-bit)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=MIN_FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def memory_per_rank_figure():
    return draw_memory_per_rank()


def draw_tp_step_times(times: dict[str, dict[str, float]]):
    """``times[label] = {"prefill": s, "decode": s}``: the median model time of a round for each
    measured setup (for example ``"k=1, 1 thread"``), as grouped bars."""
    plt = pyplot()

    labels = list(times)
    phases = list(times[labels[0]])
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [p + (i - (len(labels) - 1) / 2) * width for p in range(len(phases))]
        vals = [times[label][ph] * 1e3 for ph in phases]
        ax.bar(xs, vals, width, color=pick(PALETTE, i), label=str(label))
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=MIN_FONT)
    ax.set_xticks(range(len(phases)), [f"{p} round" for p in phases])
    values = [t for label in labels for t in times[label].values()]
    if max(values) > 8 * min(values):  # one setup far off the others (a busy machine): keep all readable
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    ax.set_ylabel("median model time (ms)")
    # beside the bars, never on them: the legend must not hide a bar's value
    ax.legend(fontsize=MIN_FONT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.margins(y=0.2)
    ax.set_title("One rank vs two on the CPU (measured)", fontsize=11)
    fig.tight_layout()
    return fig
