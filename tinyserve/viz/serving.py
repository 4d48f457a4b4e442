"""Chapter 13's latency under load: the real server, driven by guidellm, under each policy.

``benchmarks/serving.py`` writes ``benchmarks/results/serving.csv`` (one row per policy and
request rate); this draws, against the request rate, the time to first token (p50 solid, p90
dashed) and the time per output token after the first (p50: guidellm's inter-token latency,
vLLM's TPOT), one line per policy, with the goodput targets the benchmark stated.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinyserve.lab.perf.results import RESULTS_DIR, read_results
from tinyserve.viz.style import PALETTE, pyplot

SERVING_LABELS = {"vllm": "v0.4 (vllm)", "orca": "orca", "v1": "v1", "vllm-chunked": "v0.4 + chunked prefill"}


def _targets(results_dir=None) -> tuple[float | None, float | None]:
    """The TTFT and ITL targets of goodput, from ``serving_machine.json`` where it is there."""
    try:
        facts = json.loads((Path(results_dir or RESULTS_DIR) / "serving_machine.json").read_text())
    except (OSError, ValueError):
        return None, None
    return facts.get("ttft_target_s"), facts.get("itl_target_s")


def draw_serving_latency(rows: list[dict], ttft_target_s: float | None = None, itl_target_s: float | None = None):
    """TTFT p50, TTFT p90 and ITL p50 against request rate, a panel each and a line per policy (in the
    CSV's order); one key below the panels, so that no legend sits on the lines."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.1), layout="constrained", sharex=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    rates_all = sorted({r["rate"] for r in rows})
    panels = (("ttft_p50_s", "time to first token, p50 (s)", ttft_target_s, "TTFT"),
              ("ttft_p90_s", "time to first token, p90 (s)", ttft_target_s, "TTFT"),
              ("itl_p50_s", "time per output token, p50 (s)", itl_target_s, "ITL"))
    for ax, (key, title, target, name) in zip(axes, panels):
        for i, policy in enumerate(policies):
            mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in mine], [r[key] for r in mine], "o-", color=PALETTE[i % len(PALETTE)],
                    label=SERVING_LABELS.get(policy, policy))
        if target:  # named in the title and the key: a label on the line would sit on the data
            ax.axhline(target, color="grey", lw=1.2, ls=":", label="goodput target")
            title = f"{title}\ntarget: {name} ≤ {target:g} s"
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates_all, [f"{x:g}" for x in rates_all])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("requests/s (Poisson)")
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=10, frameon=False)
    fig.suptitle("Latency under load through the real server (guidellm, streamed, 2 CPU cores)", fontsize=12)
    return fig


def serving_latency_figure(results_dir=None):
    """``figures/13_serving_latency.png`` from the committed ``serving.csv``."""
    return draw_serving_latency(read_results("serving", results_dir), *_targets(results_dir))
