"""Drawings of scheduling rounds: who ran in each round, who waited, and where the blocks lie.

Everything here reads ``RoundRecord``s, the form in which ``sim.simulate`` and the engine's
``history`` both report rounds, so the same pictures serve chapter 04 (a timeline of batches),
chapter 05 (one round's queues and block tables) and chapter 09 (the real engine).

What the drawings read off the records comes from ``tinyserve.lab.records``; the baseline the
book compares against (``static_batching``) and the preemption sweep from ``tinyserve.lab.batching``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.lab.batching import preemption_sweep, random_requests, static_batching
from tinyserve.lab.records import idle_slots, recomputed_tokens, request_order, request_states
from tinyserve.sim import Request, RoundRecord, simulate

# One round's queues and pools live in round_view; chapters and the stepper name them here.
from tinyserve.viz.round_view import draw_round, draw_round_panels, draw_rounds, request_colors  # noqa: F401
from tinyserve.viz.style import FINISH_MARK, MIN_FONT, STATES, SWAP_IN_MARK, pyplot, text_size

# -- the timeline -------------------------------------------------------------------------------

def draw_timeline(records: Sequence[RoundRecord], ax=None, title: str | None = None, legend: bool | str = True):
    """A requests x rounds grid: what every request did in every round, with the batch size on top.

    ✓ marks the round in which a request produced its last token, ↑ a swap back in. The key
    (``legend``) goes "below" the grid, or "right" of it; ``True`` puts it below a figure drawn
    here (beside it, a long timeline grows too wide to read at a column's width) and right of
    an ``ax`` the caller laid out."""
    plt = pyplot()
    ids = request_order(records)
    if legend is True:
        legend = "below" if ax is None else "right"
    if ax is None:
        _, ax = plt.subplots(figsize=(0.42 * len(records) + 2.0, 0.42 * len(ids) + (2.6 if legend else 1.6)))
    states = request_states(records)
    size = text_size(ax.figure)
    for col, (r, st) in enumerate(zip(records, states)):
        for row, rid in enumerate(ids):
            state = st.get(rid)
            if state is None:
                continue
            color, _ = STATES[state]
            ax.add_patch(pyplot().Rectangle((col + 0.05, row + 0.05), 0.9, 0.9, facecolor=color,
                                          edgecolor="#333" if rid in r.finished else "none", linewidth=1.2))
            mark = FINISH_MARK if rid in r.finished else SWAP_IN_MARK if rid in r.swapped_in else ""
            if mark:
                ax.text(col + 0.5, row + 0.52, mark, ha="center", va="center", fontsize=max(11, size),
                        color="white" if state in ("decode", "ignored") else "black")
        ax.text(col + 0.5, -0.25, str(r.batch_size), ha="center", va="bottom", fontsize=size, color="#333")
    ax.set_xlim(0, len(records))
    ax.set_ylim(len(ids), -0.9)
    ax.set_xticks([i + 0.5 for i in range(len(records))], [str(r.round) for r in records], fontsize=size)
    ax.set_yticks([i + 0.5 for i in range(len(ids))], ids, fontsize=size)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("round", fontsize=size)
    ax.text(-0.15, -0.25, "batch", ha="right", va="bottom", fontsize=size, color="#333")
    if title:
        ax.set_title(title, loc="left", fontsize=max(11, size))
    if legend:
        timeline_key(ax, {s for st in states for s in st.values()}, where=legend)
    return ax.figure


def timeline_key(ax, used: set[str], where: str = "below") -> None:
    """The key of ``draw_timeline`` (the states in ``used``): under the round numbers of ``ax``,
    or at its right (``where="right"``)."""
    from matplotlib.transforms import offset_copy

    plt = pyplot()
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=STATES[s][0]) for s in STATES if s in used]
    labels = [STATES[s][1] for s in STATES if s in used]
    size = text_size(ax.figure)
    marks = f"{FINISH_MARK} last token   {SWAP_IN_MARK} swapped in"
    if where == "right":
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=size, frameon=False,
                  title=marks, title_fontsize=size)
        return
    below = offset_copy(ax.transAxes, ax.figure, y=-40, units="points")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(0, 0), bbox_transform=below, ncol=2,
              fontsize=size, frameon=False, alignment="left", title=marks, title_fontsize=size)


def draw_timelines(runs: Sequence[tuple[str, Sequence[RoundRecord]]], title: str | None = None,
                   rounds: int | None = None):
    """Several ``(title, records)`` timelines stacked over the same rounds, with one key under the
    last (the union of the states they show)."""
    plt = pyplot()
    n = rounds or max(len(records) for _, records in runs)
    heights = [len(request_order(records)) + 0.9 for _, records in runs]  # the rows and the batch sizes
    # and, in inches, each panel's title and round numbers, the key under the last, the suptitle
    extra = 0.95 * len(runs) + 1.5 + (0.4 if title else 0)
    fig, axes = plt.subplots(len(runs), 1, figsize=(0.42 * n + 2.2, 0.42 * sum(heights) + extra),
                             gridspec_kw={"height_ratios": heights})
    axes = [axes] if len(runs) == 1 else list(axes)
    used: set[str] = set()
    for ax, (name, records) in zip(axes, runs):
        draw_timeline(records, ax=ax, title=name, legend=False)
        ax.set_xlim(0, n)
        used |= {s for st in request_states(records) for s in st.values()}
    timeline_key(axes[-1], used)
    if title:
        fig.suptitle(title, x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


def draw_preemption_runs(runs: dict[str, Sequence[RoundRecord]], requests: Sequence[Request],
                         title: str | None = None):
    """Timelines of one workload (``requests``) run under several settings, stacked like
    ``draw_timelines``, each titled with what preemption cost it: preemptions, tokens prefilled
    again, rounds."""
    return draw_timelines([(f"{name}: preemptions {sum(len(r.preempted) for r in records)}, "
                            f"{recomputed_tokens(records, requests)} tokens prefilled again, {len(records)} rounds",
                            records) for name, records in runs.items()], title=title)


# -- chapter 05: what preemption costs ------------------------------------------------------------

def draw_preemption_sweep(results: dict[float, list[dict]], title: str | None = None):
    """Preemptions, recomputed tokens and rounds to finish against the GPU block budget, one
    line per watermark."""
    plt = pyplot()
    metrics = (("preemptions", "preemptions"), ("recomputed_tokens", "tokens prefilled again"),
               ("rounds", "rounds to finish the workload"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.9), layout="constrained")
    for wm, rows in results.items():
        xs = [row["num_gpu_blocks"] for row in rows]
        for ax, (key, _) in zip(axes, metrics):
            ax.plot(xs, [row[key] for row in rows], marker="o", ms=3, label=f"watermark {wm:g}")
    for ax, (_, label) in zip(axes, metrics):
        ax.set_title(label, fontsize=11)
    for ax in axes:
        ax.set_xlabel("GPU blocks")
        ax.grid(alpha=0.3)
    # one key under the panels: inside one, it would sit on its lines
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=len(results),
               fontsize=MIN_FONT, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# -- the figures of make figures (listed in figures.py) -----------------------------------------

def _run(preset) -> list[RoundRecord]:
    return simulate(preset.requests, preset.scheduler_config, preset.cache_config)


def fig_static_vs_iteration():
    from tinyserve import presets

    p = presets.orca_example("orca")
    static, orca = static_batching(p.requests, max_batch_size=5), _run(p)
    return draw_timelines([(f"request-level batching: {len(static)} rounds, {idle_slots(static)} idle slot-rounds",
                            static),
                           (f"iteration-level batching (Orca): {len(orca)} rounds, {idle_slots(orca)} idle "
                            "slot-rounds", orca)])


def fig_orca_vs_vllm():
    from tinyserve import presets

    orca, vllm = _run(presets.orca_example("orca")), _run(presets.orca_example("vllm"))
    return draw_timelines([("A–E under the orca policy (prefill and decode mixed)", orca),
                           ("A–E under the vllm policy (a round is all prefill or all decode)", vllm)])


def fig_seed_rounds_blocks():
    from tinyserve import presets

    return draw_rounds(_run(presets.seed_rounds("swap")), [1, 2, 3],
                       title="s0, s1, s2: rounds 1-3 with their block tables (swap preemption)")


def fig_recompute_vs_swap():
    from tinyserve import presets

    swap, recompute = _run(presets.seed_rounds("swap")), _run(presets.seed_rounds("recompute"))
    return draw_timelines([(f"preemption by swap: {len(swap)} rounds", swap),
                           (f"preemption by recompute: {len(recompute)} rounds", recompute)])


SWEEP_BLOCKS = tuple(range(16, 81, 4))
SWEEP_WATERMARKS = (0.0, 0.05, 0.1, 0.2)


def fig_watermark_sweep():
    results = preemption_sweep(random_requests(), SWEEP_BLOCKS, SWEEP_WATERMARKS)
    return draw_preemption_sweep(results, title="24 random requests, recompute preemption, block size 4")
