"""Chapter 09's drawings of the engine at work, over what ``tinyserve.lab.tracing`` records.

- ``draw_packed_inputs``: the tensors ``prepare_inputs`` builds for one round, token by token.
- ``draw_sampling``: one real row of logits under greedy, temperature, top-k and top-p.
- ``draw_token_timeline``: the rounds of an engine run, with the text each request produced
  (chapter 00 draws it too).
- ``draw_engine_step_times``: each step's time split into schedule / model / sample / process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyserve.lab.records import request_order, request_states
from tinyserve.lab.tracing import DEFAULT_SAMPLING_SETTINGS, sampling_probs, seed_run, sequence_names
from tinyserve.model_runner import ModelInput
from tinyserve.sequence import SequenceGroupMetadata
from tinyserve.sim import RoundRecord
from tinyserve.viz.rounds import draw_timeline
from tinyserve.viz.style import MIN_FONT, REQUEST_PALETTE, TIME_PART_COLORS, pick, pyplot, text_size

TIME_PARTS = ("schedule", "model", "sample", "process")  # the engine's own timers, in step order


# -- one round's packed inputs ------------------------------------------------------------------

def _printable(text: str) -> str:
    """Text a font can draw: a newline as ⏎, other control characters escaped (\\x0f)."""
    return "".join("⏎" if c == "\n" else c if c.isprintable() else repr(c)[1:-1] for c in text)


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return ""
    return _printable(tokenizer.decode([token_id]).replace(" ", "␣"))[:8]


def draw_packed_inputs(metas: Sequence[SequenceGroupMetadata], inputs: ModelInput, block_size: int,
                       tokenizer=None, ax=None, title: str | None = None):
    """Every row of the packed batch as a column: its token, input id, position and slot (block ·
    offset). Sequences are coloured and separated at ``query_start_loc``; ▲ marks the rows whose
    logits are sampled. On the right, each sequence's block table and context length."""
    plt = pyplot()
    md = inputs.attn_metadata
    names = sequence_names(metas)
    ids, positions = inputs.input_ids.tolist(), inputs.positions.tolist()
    slots, starts = md.slot_mapping.tolist(), md.query_start_loc.tolist()
    n = len(ids)
    owner = [i for i in range(len(names)) for _ in range(starts[i], starts[i + 1])]
    rows = [("token", [_token_text(tokenizer, t) for t in ids]), ("input_ids", [str(t) for t in ids]),
            ("positions", [str(p) for p in positions]),
            ("slot_mapping", [f"{s}\n({s // block_size}·{s % block_size})" for s in slots])]
    if tokenizer is None:
        rows = rows[1:]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.78 * n + 5.5), 0.62 * len(rows) + 1.9))
    h = 0.9
    size = text_size(ax.figure)  # many rows make a wide figure, shown scaled down: its text grows with it
    for r, (label, values) in enumerate(rows):
        y = r * h
        ax.text(-0.15, y + h / 2, label, ha="right", va="center", fontsize=size, family="monospace")
        for col, value in enumerate(values):
            rect = plt.Rectangle((col + 0.04, y + 0.04), 0.92, h - 0.08, facecolor=pick(REQUEST_PALETTE, owner[col]),
                                 edgecolor="#555", linewidth=0.6)
            rect.set_gid(f"cell:{label}:{col}")
            ax.add_patch(rect)
            ax.text(col + 0.5, y + h / 2, value, ha="center", va="center",
                    fontsize=size if "\n" not in value else size - 0.5)
    bottom = len(rows) * h
    for i, name in enumerate(names):
        lo, hi = starts[i], starts[i + 1]
        ax.text((lo + hi) / 2, -0.12, name, ha="center", va="bottom", fontsize=size + 0.5, fontweight="bold")
    for i, s in enumerate(starts):
        line = ax.plot([s, s], [-0.05, bottom + 0.05], color="#222", linewidth=2.0 if 0 < s < n else 1.0)[0]
        line.set_gid(f"boundary:{i}")
        ax.text(s, bottom + 0.3, str(s), ha="center", va="center", fontsize=size, color="#222")
    ax.text(-0.15, bottom + 0.3, "query_start_loc", ha="right", va="center", fontsize=size, family="monospace")
    for row in inputs.sample_indices.tolist():
        mark = ax.text(row + 0.5, bottom + 0.75, "▲ sample", ha="center", va="center", fontsize=size - 0.5,
                       color="#e15759")
        mark.set_gid(f"sample:{row}")
    tables = md.block_tables.tolist()
    lines = ["sequence  block table   context_len"]
    for i, name in enumerate(names):
        used = -(-md.context_lens_list[i] // block_size)
        lines.append(f"{name:<9} {str(tables[i][:used]):<13} {md.context_lens_list[i]}")
    for j, line in enumerate(lines):
        ax.text(n + 0.5, 0.1 + 0.45 * j, line, ha="left", va="top", fontsize=size, family="monospace",
                fontweight="bold" if j == 0 else "normal")
    ax.set_xlim(-2.6, n + 5.2)
    ax.set_ylim(max(bottom + 1.1, 0.45 * len(lines) + 0.3), -0.6)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=size + 1)
    return ax.figure


def draw_sampling(logits_row: torch.Tensor, tokenizer=None, settings=DEFAULT_SAMPLING_SETTINGS, top: int = 10,
                  title: str | None = None):
    """One panel per setting: the probability of the ``top`` likeliest tokens (by the raw
    logits) under that setting. A token the setting cuts off is a dashed outline at its
    temperature-1 probability."""
    plt = pyplot()
    order = logits_row.float().argsort(descending=True)[:top].tolist()
    base = torch.softmax(logits_row.float(), dim=-1)
    labels = [repr(tokenizer.decode([t])) if tokenizer is not None else str(t) for t in order]
    cols = min(3, len(settings))  # at most three panels a row: five side by side are too small to read
    rows = -(-len(settings) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.5 * rows + 0.4), sharey=True, squeeze=False)
    axes = list(grid.flat)
    for extra in axes[len(settings):]:
        fig.delaxes(extra)
    axes = axes[:len(settings)]
    for ax, (name, params) in zip(axes, settings):
        probs = sampling_probs(logits_row, params)
        kept = int((probs > 0).sum())
        for x, t in enumerate(order):
            p = float(probs[t])
            if p > 0:
                bar = ax.bar(x, p, color="#4e79a7", width=0.8)[0]
                bar.set_gid(f"bar:{t}")
            else:
                cut = ax.bar(x, float(base[t]), facecolor="none", edgecolor="#999", linestyle="--", width=0.8)[0]
                cut.set_gid(f"cut:{t}")
        ax.set_title(f"{name}\n{kept} token{'s' if kept != 1 else ''} can be drawn", fontsize=MIN_FONT)
        ax.set_xticks(range(len(order)), labels, rotation=70, fontsize=9)
        ax.set_ylim(0, 1.05)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for ax in axes[::cols]:
        ax.set_ylabel("probability")
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


# -- rounds with tokens, and step times ------------------------------------------------------------

def draw_token_timeline(records: Sequence[RoundRecord], ax=None, title: str | None = None, width: int = 9,
                        per_band: int = 10):
    """The round timeline (``rounds.draw_timeline``) with, in each cell where a request produced
    a token, the text of that token.

    Drawn on its own (no ``ax``), a run longer than ``per_band`` rounds wraps into bands of rounds
    stacked one above the other, so that a token's text stays legible when the figure is shown
    at a notebook's width."""
    import math

    plt = pyplot()
    ids = request_order(records)
    if ax is not None:
        bands = [(ax, 0, len(records))]
        fig = ax.figure
    else:
        count = max(1, math.ceil(len(records) / per_band))
        span = math.ceil(len(records) / count)
        fig, axes = plt.subplots(count, 1, figsize=(0.95 * span + 1.4, count * (0.62 * len(ids) + 1.25) + 1.9),
                                 squeeze=False)
        bands = [(a, i * span, min(len(records), (i + 1) * span)) for i, a in enumerate(axes[:, 0])]
    states = request_states(records)
    for i, (band, lo, hi) in enumerate(bands):
        draw_timeline(records, ax=band, title=title if i == 0 else None,
                      legend=(True if ax is not None else "below") if i == len(bands) - 1 else False)
        size = text_size(fig)
        if (lo, hi) != (0, len(records)):
            band.set_xlim(lo, hi)
            for t in band.texts:  # the batch sizes of other bands' rounds, and the row label
                x = t.get_position()[0]
                if t.get_text() == "batch":
                    t.set_x(lo - 0.15)
                elif not lo <= x < hi:
                    t.set_visible(False)
        for col in range(lo, hi):
            r = records[col]
            for key, text in r.tokens.items():
                rid = key if key in ids else key.rsplit(".", 1)[0]
                if rid not in ids:
                    continue
                shown = _printable(text)
                shown = shown if len(shown) <= width else shown[: width - 1] + "…"
                dark = states[col].get(rid) in ("decode", "ignored", "swapped")
                t = band.text(col + 0.5, ids.index(rid) + 0.8, shown, ha="center", va="center", fontsize=size,
                              color="white" if dark else "#111")
                t.set_gid(f"token:{r.round}:{key}")
    if ax is None:
        fig.tight_layout()
    return fig


def draw_engine_step_times(step_times: Sequence[tuple[float, float, float, float]],
                    records: Sequence[RoundRecord] | None = None, ax=None, title: str | None = None):
    """Stacked bars, one per step, of ``LLMEngine.times.history``: scheduling, the model (cache
    orders + forward pass), sampling, and processing the outputs, in milliseconds. With the
    records, each bar is labelled with its round's phase and batch size."""
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.42 * len(step_times) + 2.5), 3.4))
    bottoms = [0.0] * len(step_times)
    for k, name in enumerate(TIME_PARTS):
        color = TIME_PART_COLORS[name]
        heights = [1e3 * t[k] for t in step_times]
        bars = ax.bar(range(1, len(step_times) + 1), heights, bottom=bottoms, color=color, label=name, width=0.75)
        for b in bars:
            b.set_gid(f"time:{name}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if records is not None:
        for i, r in enumerate(records[: len(step_times)]):
            ax.text(i + 1, bottoms[i], f"{r.phase[0].upper()}{r.batch_size}", ha="center", va="bottom",
                    fontsize=text_size(ax.figure, 9))
    ax.set_xlabel("step (round)")
    ax.set_ylabel("milliseconds")
    ax.set_xticks(range(1, len(step_times) + 1))
    ax.tick_params(axis="x", labelsize=text_size(ax.figure, 9))
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax.figure


# -- make figures' chapter 09 figures: one real run of s0/s1/s2 -----------------------------------

def fig_packed_inputs(prefill=None, decode=None, block_size: int = 5, tokenizer=None):
    """Rounds 1 (prefill of s0, s1) and 3 (decode of s0, s1) of the walkthrough, packed."""
    if prefill is None or decode is None:
        run = seed_run()
        prefill, decode, tokenizer = run.prefill, run.decode, run.engine.tokenizer
    plt = pyplot()
    n = max(len(prefill[1].input_ids), len(decode[1].input_ids))
    fig, axes = plt.subplots(2, 1, figsize=(0.78 * n + 5.5, 6.6), gridspec_kw={"height_ratios": [1, 1]})
    draw_packed_inputs(*prefill, block_size, tokenizer, ax=axes[0],
                       title="round 1, prefill: every prompt token is a row of the batch")
    draw_packed_inputs(*decode, block_size, tokenizer, ax=axes[1],
                       title="round 3, decode: one row per sequence, at the end of its context")
    axes[1].set_xlim(axes[0].get_xlim())
    fig.tight_layout()
    return fig


def fig_sampling(logits_row: torch.Tensor | None = None, tokenizer=None):
    """s0's first next-token distribution ("Hello, my name is" → ?) under five settings."""
    if logits_row is None:
        run = seed_run()
        logits_row, tokenizer = run.engine.executor.calls[0].logits[0], run.engine.tokenizer
    return draw_sampling(logits_row, tokenizer, title="After 'Hello, my name is': what each setting lets the "
                                                      "sampler draw")


def fig_seed_rounds(records: Sequence[RoundRecord] | None = None):
    records = records if records is not None else seed_run().engine.history
    return draw_token_timeline(records, title="s0, s1, s2 on the real engine (swap preemption): what each round "
                                              "produced")


def fig_step_times(engine=None):
    engine = engine if engine is not None else seed_run().engine
    return draw_engine_step_times(engine.times.history, engine.history,
                           title="Where each step's time went (P/D = prefill/decode, then batch size)")
