"""Chapter 01's drawings: how big the KV cache is, and how much of it reservation wastes.

The numbers come from ``tinyserve.lab.kv_memory`` (the size arithmetic and the memory
simulator that runs one workload through three ways of handing out KV memory); this module
only draws them.
"""

from __future__ import annotations

from tinyserve.lab.kv_memory import MODELS, SCHEME_LABELS, SCHEMES, FragmentationResult, kv_table, measure_fragmentation
from tinyserve.viz.style import MIN_FONT, SLOT_COLORS, SLOT_NAMES, pyplot


def draw_fragmentation(results: dict[str, FragmentationResult], axes=None, only_when_waiting: bool = True):
    """Left: the mean share of the arena in each state, per scheme (by default over the steps
    when some request was kept waiting). Right: the number of sequences running at each step
    (what the waste costs: a smaller batch)."""
    plt = pyplot()

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1.25, 1]})
    else:
        fig = axes[0].figure
    ax, ax2 = axes
    names = [s for s in SCHEMES if s in results]
    for i, s in enumerate(names):
        left = 0.0
        for k, v in results[s].shares(only_when_waiting).items():
            ax.barh(i, v, left=left, color=SLOT_COLORS[k], edgecolor="white", label=SLOT_NAMES[k] if i == 0 else None)
            if v > 0.05:
                ax.text(left + v / 2, i, f"{v:.0%}", ha="center", va="center", fontsize=MIN_FONT,
                        color="black" if k == "free" else "white")
            left += v
    ax.set_yticks(range(len(names)), [SCHEME_LABELS[s] for s in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the KV arena, mean over the steps when a request waits" if only_when_waiting
                  else "share of the KV arena, mean over the run")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=MIN_FONT, frameon=False)
    for s in names:
        r = results[s]
        ax2.plot(r.running, label=f"{SCHEME_LABELS[s].replace(chr(10), ' ')} ({r.steps} steps)", lw=1.2)
    ax2.set_xlabel("step")
    ax2.set_ylabel("sequences running")
    # below the axes like the left one: inside, it would sit on the curves
    ax2.legend(fontsize=MIN_FONT, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def fragmentation_figure():
    return draw_fragmentation(measure_fragmentation())


def draw_kv_sizes(context: int = 2048, ax=None):
    """Bytes per token of each model in fp16, labelled with the cache of one ``context``-token sequence."""
    plt = pyplot()

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 2.8))
    rows = [r for r in kv_table(("float16",), context)]
    names = [r["model"] for r in rows]
    kib = [r["KiB_per_token"] for r in rows]
    ax.barh(range(len(rows)), kib, color="#2f7ed8")
    for i, r in enumerate(rows):
        s = MODELS[r["model"]]
        ax.text(r["KiB_per_token"] + 8, i,
                f"{r['KiB_per_token']:.1f} KiB/token = 2·{s.num_layers}·{s.num_kv_heads}·{s.head_dim}·2 B\n"
                f"one {context}-token sequence: {r['MiB_per_seq']:.0f} MiB",
                va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(kib) * 2.1)
    ax.set_xlabel("KV cache per token (KiB, fp16)")
    ax.figure.tight_layout()
    return ax.figure


def kv_sizes_figure():
    return draw_kv_sizes()
