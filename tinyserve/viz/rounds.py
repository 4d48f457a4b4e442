"""Drawings of scheduling rounds: who ran in each round, who waited, and where the blocks lie.

Everything here reads ``RoundRecord``s, the form in which ``sim.simulate`` and the engine's
``history`` both report rounds, so the same pictures serve chapter 04 (a timeline of batches),
chapter 05 (one round's queues and block tables) and chapter 09 (the real engine).

It also holds the baseline the book compares against: ``static_batching`` plays request-level
batching (a batch runs until its longest member is done) and reports it as RoundRecords too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request, RoundRecord, simulate
from tinyserve.viz.figures import figure

# What a request is doing in a round, and how the timeline paints it.
STATES = {
    "prefill": ("#f28e2b", "prefill (computes its prompt, samples a token)"),
    "decode": ("#4e79a7", "decode (one new token)"),
    "idle": ("#cdd7e3", "idle: holds its place and blocks, computes nothing"),
    "waiting": ("#ececec", "waiting"),
    "preempted": ("#e15759", "preempted this round"),
    "swapped": ("#b07aa1", "swapped out to the CPU"),
    "ignored": ("#555555", "ignored (can never run)"),
}
FINISH_MARK = "✓"
SWAP_IN_MARK = "↑"
_PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
            "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]


def _plt():
    import matplotlib.pyplot as plt

    return plt


# -- reading records --------------------------------------------------------------------------

def request_order(records: Sequence[RoundRecord]) -> list[str]:
    """Request ids in the order they first appear (batch first, then the queues)."""
    seen: dict[str, None] = {}
    for r in records:
        for rid in [*r.batch, *r.running, *r.waiting, *r.swapped, *r.preempted, *r.ignored, *r.finished]:
            seen.setdefault(rid, None)
    return list(seen)


def request_colors(records: Sequence[RoundRecord]) -> dict[str, str]:
    """One fixed colour per request, so a request looks the same in every round's drawing."""
    return {rid: _PALETTE[i % len(_PALETTE)] for i, rid in enumerate(request_order(records))}


def member_kind(record: RoundRecord, request_id: str, previous: RoundRecord | None) -> str:
    """Whether a batch member prefilled or decoded in this round.

    A pure round says so in its phase. In a mixed round, a member prefills if it brought more
    than one new token, or if it was not running before and did not come back from swap."""
    if record.phase in ("prefill", "decode"):
        return record.phase
    if record.chunk_sizes.get(request_id, 1) > 1:
        return "prefill"
    was_running = previous is not None and request_id in previous.running
    return "decode" if was_running or request_id in record.swapped_in else "prefill"


def request_states(records: Sequence[RoundRecord]) -> list[dict[str, str]]:
    """For each round, the state (a key of STATES) of every request present in it."""
    out = []
    previous = None
    for r in records:
        states: dict[str, str] = {}
        for rid in r.waiting:
            states[rid] = "waiting"
        for rid in r.swapped:
            states[rid] = "swapped"
        for rid in r.running:
            states[rid] = "idle"
        for rid in r.batch:
            states[rid] = member_kind(r, rid, previous)
        for rid in r.preempted:
            states[rid] = "preempted"
        for rid in r.ignored:
            states[rid] = "ignored"
        out.append(states)
        previous = r
    return out


def finish_rounds(records: Sequence[RoundRecord]) -> dict[str, int]:
    """The round in which each request produced its last token."""
    return {rid: r.round for r in records for rid in r.finished}


# -- the timeline -------------------------------------------------------------------------------

def draw_timeline(records: Sequence[RoundRecord], ax=None, title: str | None = None, legend: bool = True):
    """A requests x rounds grid: what every request did in every round, with the batch size on top.

    ✓ marks the round in which a request produced its last token, ↑ a swap back in."""
    plt = _plt()
    ids = request_order(records)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.42 * len(records) + 2.0, 0.42 * len(ids) + 1.6))
    states = request_states(records)
    for col, (r, st) in enumerate(zip(records, states)):
        for row, rid in enumerate(ids):
            state = st.get(rid)
            if state is None:
                continue
            color, _ = STATES[state]
            ax.add_patch(_plt().Rectangle((col + 0.05, row + 0.05), 0.9, 0.9, facecolor=color,
                                          edgecolor="#333" if rid in r.finished else "none", linewidth=1.2))
            mark = FINISH_MARK if rid in r.finished else SWAP_IN_MARK if rid in r.swapped_in else ""
            if mark:
                ax.text(col + 0.5, row + 0.52, mark, ha="center", va="center", fontsize=9,
                        color="white" if state in ("decode", "ignored") else "black")
        ax.text(col + 0.5, -0.25, str(r.batch_size), ha="center", va="bottom", fontsize=8, color="#333")
    ax.set_xlim(0, len(records))
    ax.set_ylim(len(ids), -0.9)
    ax.set_xticks([i + 0.5 for i in range(len(records))], [str(r.round) for r in records], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(ids))], ids)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("round")
    ax.text(-0.15, -0.25, "batch", ha="right", va="bottom", fontsize=8, color="#333")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    if legend:
        used = {s for st in states for s in st.values()}
        handles = [plt.Rectangle((0, 0), 1, 1, facecolor=STATES[s][0]) for s in STATES if s in used]
        labels = [STATES[s][1] for s in STATES if s in used]
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
                  title=f"{FINISH_MARK} last token   {SWAP_IN_MARK} swapped in", title_fontsize=7)
    return ax.figure


# -- one round: queues and block tables ---------------------------------------------------------

def _owners(tables: dict[str, list[int]]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for key, blocks in tables.items():
        for b in blocks:
            owners.setdefault(b, []).append(key)
    return owners


def _draw_pool(ax, x0: float, y0: float, tables: dict[str, list[int]], num_blocks: int, cols: int,
               colors: dict[str, str], label: str) -> float:
    """Draw a pool of blocks as a grid from (x0, y0) downwards; returns the y below it."""
    plt = _plt()
    owners = _owners(tables)
    ax.text(x0, y0, label, ha="left", va="bottom", fontsize=8, fontweight="bold")
    for b in range(num_blocks):
        x, y = x0 + b % cols, y0 + 0.15 + b // cols
        who = owners.get(b, [])
        # Block-table keys are request ids, or "id.i" for the i-th sample of a group.
        rid = (who[0] if who[0] in colors else who[0].rsplit(".", 1)[0]) if who else None
        ax.add_patch(plt.Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=colors.get(rid, "#bbb") if rid
                                   else "white", edgecolor="#666", linewidth=0.8))
        if who:
            text = rid if len(who) == 1 else f"{rid}×{len(who)}"
            ax.text(x + 0.5, y + 0.45, text, ha="center", va="center", fontsize=7)
        ax.text(x + 0.93, y + 0.92, str(b), ha="right", va="bottom", fontsize=5, color="#777")
    return y0 + 0.15 + max(1, -(-num_blocks // cols)) + 0.7


def _draw_queue(ax, x0: float, y0: float, width: float, name: str, ids: list[str], record: RoundRecord,
                colors: dict[str, str]) -> None:
    plt = _plt()
    ax.add_patch(plt.Rectangle((x0, y0), width, 1.5, facecolor="#fafafa", edgecolor="#999", linewidth=0.8))
    ax.text(x0 + 0.1, y0 - 0.05, f"{name} ({len(ids)})", ha="left", va="bottom", fontsize=8, fontweight="bold")
    chip = min(1.6, (width - 0.2) / max(1, len(ids)))
    for i, rid in enumerate(ids):
        in_batch = rid in record.batch
        preempted = rid in record.preempted
        ax.add_patch(plt.Rectangle((x0 + 0.1 + i * chip, y0 + 0.3), chip - 0.1, 0.9,
                                   facecolor=colors.get(rid, "#ddd"),
                                   edgecolor="#e15759" if preempted else "black",
                                   linewidth=2.2 if in_batch or preempted else 0.6,
                                   linestyle="--" if preempted else "-"))
        ax.text(x0 + 0.05 + (i + 0.5) * chip, y0 + 0.75, rid, ha="center", va="center", fontsize=7)


def _fmt(ids: list[str]) -> str:
    return ", ".join(ids) if ids else "-"


def round_caption(record: RoundRecord) -> str:
    """One line on what happened in the round (used under the drawing and by the stepper)."""
    parts = [f"batch [{_fmt(record.batch)}] ({record.num_batched_tokens} tokens)"]
    if record.preempted:
        parts.append(f"preempted {_fmt(record.preempted)}")
    if record.swapped_out:
        parts.append(f"swapped out {_fmt(record.swapped_out)}")
    if record.swapped_in:
        parts.append(f"swapped in {_fmt(record.swapped_in)}")
    if record.finished:
        parts.append(f"finished {_fmt(record.finished)}")
    if record.ignored:
        parts.append(f"ignored {_fmt(record.ignored)}")
    return " · ".join(parts)


def draw_round(record: RoundRecord, ax=None, title: str | None = None, colors: dict[str, str] | None = None):
    """One round as a drawing: the three queues (batch members outlined bold, preempted ones
    dashed red), then the GPU pool and the CPU swap pool with each block's owner, and the block
    tables as text."""
    plt = _plt()
    colors = colors if colors is not None else request_colors([record])
    cols = max(4, min(16, max(record.num_gpu_blocks, record.num_cpu_blocks, 1)))
    width = max(cols, 9) + 7.5
    if ax is None:
        rows = -(-record.num_gpu_blocks // cols) + (-(-record.num_cpu_blocks // cols) if record.num_cpu_blocks else 0)
        _, ax = plt.subplots(figsize=(0.5 * width, 0.5 * (rows + 6)))
    qw = (width - 0.6) / 3
    for i, (name, ids) in enumerate((("waiting", record.waiting), ("running", record.running),
                                     ("swapped", record.swapped))):
        _draw_queue(ax, i * (qw + 0.3), 0.5, qw, name, ids, record, colors)
    caption = round_caption(record)
    if record.tokens:
        caption += " · produced " + ", ".join(f"{k}→{v!r}" for k, v in record.tokens.items())
    ax.text(0, 2.45, caption, ha="left", va="center", fontsize=7.5, wrap=True)
    y = 3.2
    y_gpu = y
    y = _draw_pool(ax, 0, y, record.block_tables, record.num_gpu_blocks, cols, colors,
                   f"GPU blocks: {record.free_gpu_blocks} of {record.num_gpu_blocks} free")
    if record.num_cpu_blocks:
        y = _draw_pool(ax, 0, y, record.cpu_block_tables, record.num_cpu_blocks, cols, colors,
                       f"CPU swap blocks: {record.free_cpu_blocks} of {record.num_cpu_blocks} free")
    lines = ["block tables"] + [f"{k}: GPU {v}" for k, v in record.block_tables.items()] + \
            [f"{k}: CPU {v}" for k, v in record.cpu_block_tables.items()]
    if len(lines) == 1:
        lines.append("(none)")
    tx = cols + 0.6
    for i, line in enumerate(lines[:14]):
        ax.text(tx, y_gpu + 0.1 + 0.62 * i, line, ha="left", va="top", fontsize=7.5,
                fontweight="bold" if i == 0 else "normal", family="monospace")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(max(y, y_gpu + 0.62 * min(len(lines), 14) + 0.3), -0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"round {record.round} · {record.phase}", loc="left", fontsize=10)
    return ax.figure


def draw_rounds(records: Sequence[RoundRecord], rounds: Sequence[int], title: str | None = None):
    """Several rounds' drawings stacked, one panel per round (numbered from 1)."""
    plt = _plt()
    by_round = {r.round: r for r in records}
    colors = request_colors(records)
    first = by_round[rounds[0]]
    cols = max(4, min(16, max(first.num_gpu_blocks, first.num_cpu_blocks, 1)))
    rows = -(-first.num_gpu_blocks // cols) + (-(-first.num_cpu_blocks // cols) if first.num_cpu_blocks else 0)
    fig, axes = plt.subplots(len(rounds), 1, figsize=(0.5 * (max(cols, 9) + 7.5), 0.5 * (rows + 5.4) * len(rounds)))
    axes = [axes] if len(rounds) == 1 else list(axes)
    for ax, n in zip(axes, rounds):
        draw_round(by_round[n], ax=ax, colors=colors)
    if title:
        fig.suptitle(title, x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


# -- the baseline: request-level (static) batching ---------------------------------------------

def static_batching(requests: Sequence[Request], max_batch_size: int) -> list[RoundRecord]:
    """Request-level batching, as RoundRecords: a batch of up to ``max_batch_size`` arrived
    requests (first come, first served) is prefilled together and then decoded until its
    longest member is done; only then does the next batch start.

    ``running`` lists every member of the batch in each of its rounds: one that has finished
    keeps its slot until the batch ends, in ``running`` but not in ``batch`` (an idle slot).
    Memory is not modelled (block fields are empty)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    pending = sorted(requests, key=lambda r: r.arrival_round)
    waiting: list[Request] = []
    current: list[Request] = []
    produced: dict[str, int] = {}
    records: list[RoundRecord] = []
    round_no = 0
    while pending or waiting or current:
        round_no += 1
        while pending and pending[0].arrival_round <= round_no:
            waiting.append(pending.pop(0))
        phase = "decode"
        if not current and waiting:
            current, waiting = waiting[:max_batch_size], waiting[max_batch_size:]
            phase = "prefill"
        batch = [r for r in current if produced.get(r.request_id, 0) < r.output_len]
        finished = []
        for r in batch:
            produced[r.request_id] = produced.get(r.request_id, 0) + 1
            if produced[r.request_id] == r.output_len:
                finished.append(r.request_id)
        # A finished member still holds its slot until the whole batch is done.
        running = [r.request_id for r in current]
        if all(produced.get(r.request_id, 0) >= r.output_len for r in current):
            current = []
        records.append(RoundRecord(
            round=round_no, phase=phase if batch else "idle", batch=[r.request_id for r in batch], preempted=[],
            swapped_out=[], swapped_in=[], finished=finished, ignored=[], waiting=[r.request_id for r in waiting],
            running=running, swapped=[], free_gpu_blocks=0, block_tables={},
            num_batched_tokens=sum(r.prompt_len if phase == "prefill" else 1 for r in batch),
            chunk_sizes={r.request_id: r.prompt_len if phase == "prefill" else 1 for r in batch}))
    return records


def idle_slots(records: Sequence[RoundRecord]) -> int:
    """Slot-rounds held by a running request that computed nothing (static padding, or a decode
    paused by a prefill-only round)."""
    return sum(len(set(r.running) - set(r.batch)) for r in records)


# -- the watermark and the block budget ---------------------------------------------------------

def random_workload(num_requests: int = 24, seed: int = 0, max_arrival: int = 12) -> list[Request]:
    """A fixed random workload: prompts of 4–24 tokens, outputs of 4–40, arrivals over 12 rounds."""
    rng = random.Random(seed)
    return [Request(f"r{i}", rng.randint(4, 24), rng.randint(4, 40), rng.randint(1, max_arrival))
            for i in range(num_requests)]


def recomputed_tokens(records: Sequence[RoundRecord], requests: Sequence[Request]) -> int:
    """Tokens prefilled beyond each prompt's first prefill: the work recompute-preemption redoes."""
    states = request_states(records)
    prefilled = sum(r.chunk_sizes.get(rid, 0) for r, st in zip(records, states)
                    for rid, s in st.items() if s == "prefill")
    return prefilled - sum(q.prompt_len for q in requests)


def preemption_sweep(requests: Sequence[Request], gpu_blocks: Sequence[int], watermarks: Sequence[float],
                     block_size: int = 4, preemption_mode: str = "recompute",
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 64) -> dict[float, list[dict]]:
    """Run the same workload over a grid of GPU block budgets and watermarks (vLLM policy).

    Returns, per watermark, one row per budget: preemptions, rounds to finish everything,
    recomputed tokens and ignored requests."""
    results: dict[float, list[dict]] = {}
    for wm in watermarks:
        rows = []
        for g in gpu_blocks:
            recs = simulate(list(requests),
                            SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                            max_model_len=256, preemption_mode=preemption_mode),
                            CacheConfig(block_size=block_size, num_gpu_blocks=g, num_cpu_blocks=4 * g, watermark=wm))
            rows.append({"num_gpu_blocks": g, "preemptions": sum(len(r.preempted) for r in recs),
                         "rounds": len(recs), "recomputed_tokens": recomputed_tokens(recs, requests),
                         "ignored": sum(len(r.ignored) for r in recs)})
        results[wm] = rows
    return results


def draw_preemption_sweep(results: dict[float, list[dict]], title: str | None = None):
    """Preemptions, recomputed tokens and rounds to finish against the GPU block budget, one
    line per watermark."""
    plt = _plt()
    metrics = (("preemptions", "preemptions"), ("recomputed_tokens", "tokens prefilled again"),
               ("rounds", "rounds to finish the workload"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.6))
    for wm, rows in results.items():
        xs = [row["num_gpu_blocks"] for row in rows]
        for ax, (key, _) in zip(axes, metrics):
            ax.plot(xs, [row[key] for row in rows], marker="o", ms=3, label=f"watermark {wm:g}")
    for ax, (_, label) in zip(axes, metrics):
        ax.set_ylabel(label)
    for ax in axes:
        ax.set_xlabel("GPU blocks")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


# -- the registered figures ---------------------------------------------------------------------

def _run(preset) -> list[RoundRecord]:
    return simulate(preset.requests, preset.scheduler_config, preset.cache_config)


@figure("04_static_vs_iteration")
def fig_static_vs_iteration():
    from tinyserve import presets

    p = presets.orca_example("orca")
    plt = _plt()
    static, orca = static_batching(p.requests, max_batch_size=5), _run(p)
    fig, axes = plt.subplots(2, 1, figsize=(13, 5.6), gridspec_kw={"height_ratios": [1, 1]})
    draw_timeline(static, ax=axes[0], title=f"request-level batching: {len(static)} rounds, "
                                            f"{idle_slots(static)} idle slot-rounds")
    draw_timeline(orca, ax=axes[1], title=f"iteration-level batching (Orca): {len(orca)} rounds, "
                                          f"{idle_slots(orca)} idle slot-rounds")
    axes[1].set_xlim(0, len(static))
    fig.tight_layout()
    return fig


@figure("04_orca_vs_vllm_timeline")
def fig_orca_vs_vllm():
    from tinyserve import presets

    plt = _plt()
    orca, vllm = _run(presets.orca_example("orca")), _run(presets.orca_example("vllm"))
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6))
    draw_timeline(orca, ax=axes[0], title="A–E under the orca policy (prefill and decode mixed)")
    draw_timeline(vllm, ax=axes[1], title="A–E under the vllm policy (a round is all prefill or all decode)")
    axes[0].set_xlim(0, len(vllm))
    fig.tight_layout()
    return fig


@figure("05_seed_rounds_blocks")
def fig_seed_rounds_blocks():
    from tinyserve import presets

    return draw_rounds(_run(presets.seed_rounds("swap")), [1, 2, 3],
                       title="s0, s1, s2: rounds 1-3 with their block tables (swap preemption)")


@figure("05_recompute_vs_swap")
def fig_recompute_vs_swap():
    from tinyserve import presets

    plt = _plt()
    swap, recompute = _run(presets.seed_rounds("swap")), _run(presets.seed_rounds("recompute"))
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2))
    draw_timeline(swap, ax=axes[0], title=f"preemption by swap: {len(swap)} rounds")
    draw_timeline(recompute, ax=axes[1], title=f"preemption by recompute: {len(recompute)} rounds")
    axes[0].set_xlim(0, max(len(swap), len(recompute)))
    axes[1].set_xlim(0, max(len(swap), len(recompute)))
    fig.tight_layout()
    return fig


SWEEP_BLOCKS = tuple(range(16, 81, 4))
SWEEP_WATERMARKS = (0.0, 0.05, 0.1, 0.2)


@figure("05_watermark_sweep")
def fig_watermark_sweep():
    results = preemption_sweep(random_workload(), SWEEP_BLOCKS, SWEEP_WATERMARKS)
    return draw_preemption_sweep(results, title="24 random requests, recompute preemption, block size 4")
