"""Drawings for chapter 12: cached prefixes shared across requests, and chunked-prefill rounds.

Both read ``RoundRecord``s (the runs and their reading are in ``tinyserve.lab.beyond_runs``), so
a simulator run (what ``make figures`` draws, no model needed) and the engine's ``history`` (what
the chapter draws from the real model) look the same.

- ``draw_prefix_sharing``: every request's block table in one round, a shared physical block
  drawn in the same colour in every row that holds it, beside the prompt tokens each request
  computed and the ones it found cached.
- ``draw_chunked_timeline``: a grid of rounds by request, the tokens each request computed in
  each round, a dot where it produced a token, and each round's total against the budget.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tinyserve.lab.beyond_runs import (
    chunked_run,
    long_prompt_requests,
    prefill_tokens,
    prefix_sharing_run,
    producers,
    system_prompt_requests,
)
from tinyserve.sim import RoundRecord
from tinyserve.viz.style import MIN_FONT, PALETTE, REQUEST_PALETTE, UNSHARED, pick, pyplot

LONG_COLOR = PALETTE[1]


# -- drawings -----------------------------------------------------------------------------------

def draw_prefix_sharing(record: RoundRecord, prompt_lens: dict[str, int], computed: dict[str, int],
                        block_size: int, title: str = "", labels: dict[str, str] | None = None):
    """Block tables of one round (shared physical blocks coloured alike) and the prefill saved."""
    plt = pyplot()
    rids = [rid for rid in prompt_lens if rid in record.block_tables]
    uses = Counter(b for rid in rids for b in set(record.block_tables[rid]))
    shared = sorted(b for b, n in uses.items() if n > 1)
    color = {b: pick(PALETTE, i) for i, b in enumerate(shared)}
    width = max(len(record.block_tables[rid]) for rid in rids)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 0.7 * len(rids) + 2.0), gridspec_kw={"width_ratios": [3, 2]})
    for row, rid in enumerate(rids):
        y = len(rids) - 1 - row
        for i, b in enumerate(record.block_tables[rid]):
            ax.add_patch(plt.Rectangle((i, y + 0.1), 0.92, 0.8, facecolor=color.get(b, UNSHARED), edgecolor="#333"))
            ax.text(i + 0.46, y + 0.5, str(b), ha="center", va="center", fontsize=10,
                    color="white" if b in color else "#333", gid=f"block:{rid}:{i}:{b}")
        ax.text(-0.2, y + 0.5, (labels or {}).get(rid, rid), ha="right", va="center", fontsize=10)
    ax.set_xlim(-2.5, width + 0.2)
    ax.set_ylim(-0.2, len(rids))
    ax.set_xticks([i + 0.46 for i in range(width)], [f"{i}" for i in range(width)], fontsize=10)
    ax.set_xlabel(f"logical block (of {block_size} tokens); the number is the physical block")
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{len(shared)} physical blocks shared (coloured), the rest private (grey)", fontsize=10)

    ys = range(len(rids))
    cached = [prompt_lens[rid] - computed[rid] for rid in rids]
    comp = [computed[rid] for rid in rids]
    bx.barh(list(ys)[::-1], comp, color="#e15759", label="computed")
    bx.barh(list(ys)[::-1], cached, left=comp, color="#bab0ac", hatch="//", label="found in the cache")
    for y, c, k in zip(list(ys)[::-1], comp, cached):
        bx.text(c + k + 0.5, y, f"{c} of {c + k}", va="center", fontsize=10)
    bx.set_yticks(list(ys)[::-1], [(labels or {}).get(rid, rid) for rid in rids])
    bx.set_xlabel("prompt tokens")
    bx.set_xlim(0, max(prompt_lens[rid] for rid in rids) * 1.3)
    saved = sum(cached)
    bx.set_title(f"prefill: {sum(comp)} tokens computed, {saved} saved "
                 f"({saved / max(1, sum(prompt_lens[r] for r in rids)):.0%})", fontsize=10)
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=MIN_FONT)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_chunked_timeline(records: Sequence[RoundRecord], output_lens: dict[str, int], ax=None,
                          budget: int | None = None, long_id: str = "long", title: str = ""):
    """A grid of rounds (columns) by request (rows): the number of tokens each request computed in
    each round, a dot where it produced a token, and each round's total against the budget.

    Numbers rather than stacked bars: a 160-token prompt and a 1-token decode share one round, and
    bars to scale would make the decodes vanish."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    rids = list(output_lens)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * (len(rids) + 1) + 1.6))
    colors = {rid: LONG_COLOR if rid == long_id else pick(REQUEST_PALETTE, i) for i, rid in enumerate(rids)}
    made = producers(records, output_lens)
    rows = len(rids)
    for rec, who in zip(records, made):
        x = rec.round
        for row, rid in enumerate(rids):
            n = rec.chunk_sizes.get(rid, 0)
            if not n:
                continue
            ax.add_patch(plt.Rectangle((x - 0.45, row - 0.4), 0.9, 0.8, facecolor=colors[rid], edgecolor="#333",
                                       linewidth=0.5))
            ax.text(x - 0.1 if rid in who else x, row, str(n), ha="center", va="center", fontsize=MIN_FONT)
            if rid in who:
                ax.plot(x + 0.27, row, "o", color="#222", markersize=4)
        total = sum(rec.chunk_sizes.values())
        over = budget is not None and total > budget
        ax.text(x, rows, str(total), ha="center", va="center", fontsize=MIN_FONT,
                color="#c42525" if over else "#333", fontweight="bold")
    ax.axhline(rows - 0.5, color="#999", linewidth=0.8)
    ax.set_xlim(records[0].round - 0.6, records[-1].round + 0.6)
    ax.set_ylim(rows + 0.5, -0.5)
    ax.set_yticks(range(rows + 1), [*rids, "total" if budget is None else f"total (≤{budget})"])
    ax.set_xticks([rec.round for rec in records])
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("round")
    key = [Line2D([], [], marker="o", color="#222", linestyle="", markersize=4, label="produced a token"),
           plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#333", linewidth=0.5,
                         label="number: tokens it computed")]
    ax.legend(handles=key, fontsize=MIN_FONT, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "tokens each request computed per round; a dot where it produced a token", fontsize=11)
    return ax


# -- make figures' figures (simulator runs: no model needed) ------------------------------------

def fig_prefix_sharing():
    requests = system_prompt_requests()
    records = prefix_sharing_run(True)
    lens = {r.request_id: r.prompt_len for r in requests}
    record = max(records, key=lambda r: len(r.block_tables))
    computed = prefill_tokens(records, {r.request_id: r.output_len for r in requests})
    return draw_prefix_sharing(record, lens, computed, 8,
                               title="Four requests with a 28-token system prompt (blocks of 8), prefix caching on")


def fig_chunked_prefill():
    plt = pyplot()
    lens = {r.request_id: r.output_len for r in long_prompt_requests()}
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6.0))
    whole, chunked = chunked_run(False), chunked_run(True)
    draw_chunked_timeline(whole, lens, ax=a,
                          title="without chunking: the 160-token prompt takes a round to itself; the decodes stall")
    draw_chunked_timeline(chunked, lens, ax=b, budget=32,
                          title="chunked prefill, 32 tokens a round: decodes first, the prompt gets the rest")
    for ax in (a, b):  # one round axis for both
        ax.set_xlim(0.4, max(len(whole), len(chunked)) + 0.6)
    fig.tight_layout()
    return fig
