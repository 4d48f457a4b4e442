"""Chapter 11's heat map of the throughput sweep: tinyserve's speed-up over each baseline.

One panel per transformers baseline (``generate``, ``generate_batch``), a row per workload shape,
a column per tinyserve schedule. The colour is centred on 1x (white: as fast as the baseline), so
cells where tinyserve is slower stand out in blue; a cell below its target is outlined.
"""

from __future__ import annotations

from tinyserve.lab.perf.results import read_results
from tinyserve.lab.perf.sweep import BASELINES, COMPILED, OURS, SCHEDULES, ratio_grid, target
from tinyserve.viz.style import pyplot


def draw_sweep_heatmap(rows: list[dict], systems: tuple[str, ...] = OURS):
    """The heat map of ``systems``' ratios (tinyserve's three schedules unless told otherwise)."""
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    grids = [ratio_grid(rows, b, systems) for b in BASELINES]
    values = [v for _, g in grids for line in g for v in line]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.9), vmax=max(max(values), 1.1))
    cells = grids[0][0]
    labels = [f"{p} prompts, out {o}, ≤{b} running" for p, o, b in cells]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(labels) + 2), sharey=True, layout="constrained")
    for ax, base, (_, grid) in zip(axes, BASELINES, grids):
        im = ax.imshow(grid, cmap="RdBu_r", norm=norm, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                dark = abs(norm(v) - 0.5) > 0.35  # white text on the deepest colours
                ax.text(j, i, f"{v:.2f}×", ha="center", va="center", fontsize=10,
                        color="white" if dark else "black")
                if v < target(cells[i], base):
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5, ls="--",
                                               edgecolor="black"))
        ax.set_xticks(range(len(systems)), [SCHEDULES[s] for s in systems])
        ax.set_title(f"tinyserve ÷ transformers {base}")
    axes[0].set_yticks(range(len(labels)), labels)
    fig.colorbar(im, ax=axes, shrink=0.8, label="throughput ratio (tokens/s)")
    runs = min(r["runs"] for r in rows)
    dtype = rows[0].get("dtype") or "float32"  # the sweeps before bf16 was measured were float32
    fig.suptitle(f"Throughput ratios over workload shapes, {dtype} (median of {runs} run{'s' * (runs > 1)}; "
                 "dashed: below target)")
    return fig


def sweep_figure():
    return draw_sweep_heatmap(read_results("throughput_sweep"))


def bfloat16_sweep_figure():
    return draw_sweep_heatmap(read_results("throughput_sweep_bfloat16"))


def compiled_sweep_figure():
    """The bf16 cells rerun with compiled decode steps beside the eager default (chapter 11.14)."""
    return draw_sweep_heatmap(read_results("throughput_sweep_bfloat16_compiled"), ("tinyserve", COMPILED))
