"""Heat maps of the throughput sweep: tinyserve's speed-up over each transformers baseline.

One panel per baseline (``generate``, ``generate_batch``); a row per workload shape (prompt
lengths / output lengths / most sequences running), a column per tinyserve schedule. The
colour is centred on 1× (white: as fast as the baseline), so cells where tinyserve is slower
stand out in blue.

    python benchmarks/plot_sweep.py      # reads benchmarks/results/throughput_sweep.csv

``make bench`` runs it after ``sweep.py``; it writes ``figures/11_throughput_sweep.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # a script: no window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from tinyserve.lab import perf  # noqa: E402

OURS = ("tinyserve", "tinyserve-orca", "tinyserve-chunked")
LABELS = {"tinyserve": "vllm policy", "tinyserve-orca": "orca policy", "tinyserve-chunked": "chunked prefill"}


def ratio_grid(rows: list[dict], baseline: str) -> tuple[list[str], list[list[float]]]:
    """Row labels and ``[shape][schedule]`` ratios of tinyserve's tokens/s to ``baseline``'s."""
    shapes = list(dict.fromkeys((r["prompts"], r["outputs"], r["max_running"]) for r in rows))
    grid = []
    for shape in shapes:
        by = {r["system"]: r for r in rows if (r["prompts"], r["outputs"], r["max_running"]) == shape}
        grid.append([by[s]["tokens_per_s"] / by[baseline]["tokens_per_s"] for s in OURS])
    labels = [f"{p} prompts, out {o}, ≤{b} running" for p, o, b in shapes]
    return labels, grid


def draw_sweep_heatmap(rows: list[dict]):
    """The figure: one heat map per baseline, every cell annotated with its ratio."""
    baselines = ("generate", "generate_batch")
    grids = [ratio_grid(rows, b) for b in baselines]
    values = [v for _, g in grids for line in g for v in line]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.9), vmax=max(max(values), 1.1))
    labels = grids[0][0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(labels) + 2), sharey=True, layout="constrained")
    for ax, base, (_, grid) in zip(axes, baselines, grids):
        im = ax.imshow(grid, cmap="RdBu_r", norm=norm, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                dark = abs(norm(v) - 0.5) > 0.35  # white text on the deepest colours
                ax.text(j, i, f"{v:.2f}×", ha="center", va="center", fontsize=9, color="white" if dark else "black")
        ax.set_xticks(range(len(OURS)), [LABELS[s] for s in OURS])
        ax.set_title(f"tinyserve ÷ transformers {base}")
    axes[0].set_yticks(range(len(labels)), labels)
    fig.colorbar(im, ax=axes, shrink=0.8, label="throughput ratio (tokens/s)")
    runs = max(r["runs"] for r in rows)
    fig.suptitle(f"Throughput ratios over workload shapes (median of {runs} run{'s' * (runs > 1)})")
    return fig


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=None, help="folder holding throughput_sweep.csv")
    ap.add_argument("--out", type=Path, default=REPO / "figures" / "11_throughput_sweep.png")
    args = ap.parse_args(argv)
    fig = draw_sweep_heatmap(perf.read_results("throughput_sweep", args.results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
