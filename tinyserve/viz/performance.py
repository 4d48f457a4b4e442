"""Chapter 11's drawings: throughput against transformers, the sweeps, KV utilization, step time.

They read the CSVs the benchmarks commit (``tinyserve.lab.perf.results``); the systems, workloads
and measurements behind them are in ``tinyserve.lab.perf``.
"""

from __future__ import annotations

import numpy as np

from tinyserve.lab.perf.results import SYSTEMS, read_results
from tinyserve.lab.perf.steps import STEP_PARTS
from tinyserve.viz.style import MIN_FONT, PHASE_COLORS, SYSTEM_COLORS, plain_log_ticks, pyplot


def draw_headline(rows: list[dict], ax=None):
    """Bars of tokens/s per system for each headline workload, labelled with tinyserve's ratio."""
    plt = pyplot()
    rows = [r for r in rows if r["experiment"] == "headline"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        rates = [next((r["tokens_per_s"] for r in rows if r["workload"] == w and r["system"] == system), 0)
                 for w in workloads]
        offset = (j - (len(systems) - 1) / 2) * width
        bars = ax.bar(np.arange(len(workloads)) + offset, rates, width, label=system, color=SYSTEM_COLORS[system])
        for bar, w in zip(bars, workloads):
            ours = next(r["tokens_per_s"] for r in rows if r["workload"] == w and r["system"] == "tinyserve")
            if not system.startswith("tinyserve") and bar.get_height():
                ax.annotate(f"{ours / bar.get_height():.2f}×", (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(workloads)), workloads)
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(0, 1.3 * max(r["tokens_per_s"] for r in rows))
    ax.set_title("throughput (numbers: tinyserve, default policy, ÷ that system)")
    ax.legend(fontsize=8, ncol=len(systems), loc="upper center")
    return ax.figure


def draw_sweep(rows: list[dict], experiment: str, x: str, xlabel: str, ax=None):
    """tokens/s of each system against one workload parameter."""
    plt = pyplot()
    rows = [r for r in rows if r["experiment"] == experiment]
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4))
    for system in SYSTEMS:
        pts = sorted((r[x], r["tokens_per_s"]) for r in rows if r["system"] == system)
        if pts:
            ax.plot(*zip(*pts), "o-", label=system, color=SYSTEM_COLORS[system])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return ax.figure


def draw_sweeps(rows: list[dict]):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    req = [r for r in rows if r["experiment"] == "requests"]
    spr = [r for r in rows if r["experiment"] == "spread"]
    draw_sweep(rows, "requests", "num_requests", "number of requests (output lengths drawn at random)", a)
    a.set_title(f"more requests than one batch of {req[0]['batch']}")
    draw_sweep(rows, "spread", "spread", f"output-length spread, max - min ({spr[0]['num_requests']} requests)", b)
    b.set_title("the same mean output length, spread wider")
    fig.tight_layout()
    return fig


def draw_kv_utilization(rows: list[dict], ax=None):
    """Share of allocated KV slots holding a token, per scheme."""
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    labels = [r["scheme"] for r in rows]
    values = [100 * r["utilization"] for r in rows]
    colors = ["#4e79a7" if r["scheme"].startswith("paged") else "#bab0ac" for r in rows]
    bars = ax.barh(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.1f}%", (v, bar.get_y() + bar.get_height() / 2), va="center", xytext=(3, 0),
                    textcoords="offset points", fontsize=8)
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
    ax.set_xlabel("allocated KV slots that hold a token (%)")
    return ax.figure


def draw_step_breakdown(rows: list[dict]):
    """Left, two panels over the same steps: every step's time (log scale) and its batch size.
    Right: where an average prefill round and an average decode round spend their time, part by
    part (log scale)."""
    plt = pyplot()
    fig = plt.figure(figsize=(11, 4.6), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[1.5, 1], height_ratios=[1.4, 1])
    a = fig.add_subplot(grid[0, 0])
    n = fig.add_subplot(grid[1, 0], sharex=a)
    b = fig.add_subplot(grid[:, 1])
    steps = np.array([r["step"] for r in rows])
    total = np.array([1000 * sum(r[p] for p in STEP_PARTS) for r in rows])
    batch = np.array([r["batch_size"] for r in rows])
    phases = PHASE_COLORS
    present = [ph for ph in phases if any(r["phase"] == ph for r in rows)]
    for phase in present:
        pick = np.array([r["phase"] == phase for r in rows])
        a.scatter(steps[pick], total[pick], s=10, color=phases[phase], label=f"{phase} round")
        n.scatter(steps[pick], batch[pick], s=10, color=phases[phase])
    a.set_yscale("log")
    plain_log_ticks(a.yaxis)
    a.set_ylabel("step time (ms)")
    a.tick_params(labelbottom=False)
    n.set_ylabel("sequences\nin the step")
    n.set_xlabel("engine step")
    n.set_ylim(bottom=0)
    height = 0.8 / len(present)
    for j, phase in enumerate(present):
        mine = [r for r in rows if r["phase"] == phase]
        ms = [1000 * sum(r[p] for r in mine) / len(mine) for p in STEP_PARTS]
        b.barh(np.arange(len(STEP_PARTS)) + (j - (len(present) - 1) / 2) * height, ms, height,
               color=phases[phase], label=f"{phase} ({len(mine)} rounds)")
    b.set_yticks(np.arange(len(STEP_PARTS)), STEP_PARTS)
    b.invert_yaxis()
    b.set_xscale("log")
    plain_log_ticks(b.xaxis)
    b.set_xlabel("mean ms per round (log scale)")
    b.set_title("where a round's time goes", fontsize=11)
    a.set_title("every step: its time, and how many sequences it ran", fontsize=11)
    fig.legend(*b.get_legend_handles_labels(), loc="outside lower center", ncol=len(present), fontsize=10,
               frameon=False)
    return fig


def draw_decode_cost(batch_sizes: list[int], step_ms: list[float]):
    """The time of one decode step against the number of sequences in it, with batch 1's time as a
    dotted floor: the fixed part of a step, mostly reading the weights."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(batch_sizes, step_ms, "o-", color=SYSTEM_COLORS["tinyserve"], label="one decode step")
    ax.axhline(step_ms[0], ls=":", color="#8c8c8c", label=f"batch {batch_sizes[0]}: mostly reading the weights")
    ax.set_xlabel("sequences in the batch", fontsize=MIN_FONT + 1)
    ax.set_ylabel("ms per step", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_ylim(0, 1.15 * max(step_ms))
    # under the axes: inside, it sits on the floor line whatever the corner
    ax.legend(fontsize=MIN_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    ax.set_title(f"{batch_sizes[-1]} sequences cost {step_ms[-1] / step_ms[0]:.1f}× one sequence, "
                 f"not {batch_sizes[-1] / batch_sizes[0]:g}×", fontsize=MIN_FONT + 1)
    return fig


def throughput_figure():
    return draw_headline(read_results("throughput"))


def sweeps_figure():
    return draw_sweeps(read_results("throughput"))


def kv_utilization_figure():
    return draw_kv_utilization(read_results("memory"))


def step_breakdown_figure():
    return draw_step_breakdown(read_results("step_times"))
