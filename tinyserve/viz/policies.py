"""Drawings for chapter 13: one workload under v0.4's "vllm", "orca" and "v1", and a rate sweep.

The runs and the measurements come from ``tinyserve.lab.policy_runs``; these functions only draw.

- ``draw_policy_timelines``: one timeline per policy (``rounds.draw_timeline``), on a shared
  round axis, titled with its rounds and preemptions.
- ``draw_rate_sweep``: time to first token (in rounds, mean and p90) and tokens computed per
  round against the request rate, one line per policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tinyserve.lab.policy_runs import RATES, rate_sweep, sweep_configs, three_policies
from tinyserve.sim import RoundRecord
from tinyserve.viz.rounds import draw_timeline, draw_timelines
from tinyserve.viz.style import MIN_FONT, PALETTE, pyplot

POLICY_LABELS = {"vllm": "vLLM v0.4 (prefill or decode)", "orca": "Orca (mixed rounds)",
                 "v1": "vLLM V1 (one token budget)"}
POLICY_COLORS = {"vllm": PALETTE[0], "orca": PALETTE[1], "v1": PALETTE[2]}


def draw_policy_timelines(runs: Mapping[str, Sequence[RoundRecord]], axes=None, title: str | None = None):
    """The runs' timelines stacked, one per policy, all drawn over the longest run's rounds, with one
    key under the last."""
    def name(policy, run):
        preemptions = sum(len(r.preempted) for r in run)
        return (f"{POLICY_LABELS.get(policy, policy)}: {len(run)} rounds, "
                f"{preemptions} preemption{'s' if preemptions != 1 else ''}")

    if axes is None:
        return draw_timelines([(name(policy, run), run) for policy, run in runs.items()], title=title)
    n = max(len(run) for run in runs.values())
    for i, (ax, (policy, run)) in enumerate(zip(axes, runs.items())):
        draw_timeline(run, ax=ax, title=name(policy, run), legend="below" if i == len(runs) - 1 else False)
        ax.set_xlim(0, n)
    fig = axes[0].figure
    if title:
        fig.suptitle(title, x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


def draw_rate_sweep(rows: Sequence[dict], title: str | None = None):
    """TTFT in rounds (mean solid, p90 dashed) and tokens per round against the request rate."""
    plt = pyplot()
    fig, (ttft, tokens) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = sorted((row for row in rows if row["policy"] == policy), key=lambda row: row["rate"])
        rates = [row["rate"] for row in mine]
        color, label = POLICY_COLORS.get(policy), POLICY_LABELS.get(policy, policy)
        ttft.plot(rates, [row["ttft_mean"] for row in mine], marker="o", ms=3, color=color, label=f"{label}, mean")
        ttft.plot(rates, [row["ttft_p90"] for row in mine], ls="--", color=color, alpha=0.7, label=f"{label}, p90")
        tokens.plot(rates, [row["tokens_per_round"] for row in mine], marker="o", ms=3, color=color, label=label)
    ttft.set_title("rounds from arrival to first token\n(mean solid, p90 dashed)", fontsize=11)
    tokens.set_title("tokens computed per round", fontsize=11)
    for ax in (ttft, tokens):
        ax.set_xlabel("request rate (requests per round)")
        ax.grid(alpha=0.3)
    # one key under both panels (a line per policy; its p90 is the dashed line of its colour)
    fig.legend(*tokens.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=MIN_FONT,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# -- the figures of make figures (listed in figures.py) -----------------------------------------

def fig_policy_rounds():
    return draw_policy_timelines(three_policies("seed"), title="s0, s1, s2 under the three policies")


def fig_rate_sweep():
    rows = rate_sweep(RATES)
    sc, cc = sweep_configs("v1")
    return draw_rate_sweep(rows, title=f"{rows[0]['num_requests']} random requests, Poisson arrivals; "
                                       f"{cc.num_gpu_blocks} blocks of {cc.block_size} tokens, "
                                       f"{sc.max_num_batched_tokens} tokens per round")
