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
    """TTFT p50/p90 and ITL p50 against request rate, a line per policy (in the CSV's order)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for i, policy in enumerate(policies):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        rates = [r["rate"] for r in mine]
        color = PALETTE[i % len(PALETTE)]
        label = SERVING_LABELS.get(policy, policy)
        left.plot(rates, [r["ttft_p50_s"] for r in mine], "o-", color=color, label=f"{label} p50")
        left.plot(rates, [r["ttft_p90_s"] for r in mine], "s--", color=color, alpha=0.7, label=f"{label} p90")
        right.plot(rates, [r["itl_p50_s"] for r in mine], "o-", color=color, label=label)
    for ax, target, name in ((left, ttft_target_s, "TTFT"), (right, itl_target_s, "ITL")):
        if target:
            ax.axhline(target, color="grey", lw=1, ls=":")
            ax.annotate(f"goodput target: {name} ≤ {target:g} s", (0.98, target), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["rate"] for r in rows}), [f"{x:g}" for x in sorted({r["rate"] for r in rows})])
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("time to first token (s)")
    left.set_title("TTFT: p50 (solid), p90 (dashed)")
    right.set_ylabel("inter-token latency p50 (s)")
    right.set_title("time per output token after the first (p50)")
    left.legend(fontsize=7, ncol=2)
    right.legend(fontsize=8)
    fig.suptitle("Latency under load through the real server (guidellm, streamed, 2 CPU cores)")
    return fig


def serving_latency_figure(results_dir=None):
    """``figures/13_serving_latency.png`` from the committed ``serving.csv``."""
    return draw_serving_latency(read_results("serving", results_dir), *_targets(results_dir))
