"""Drawings for chapter 12: cached prefixes shared across requests, and chunked-prefill rounds.

Both read ``RoundRecord``s, so a simulator run (what ``make figures`` draws, no model needed)
and the engine's ``history`` (what the chapter draws from the real model) look the same.

- ``draw_prefix_sharing``: every request's block table in one round, a shared physical block
  drawn in the same colour in every row that holds it, beside the prompt tokens each request
  computed and the ones it found cached.
- ``draw_chunked_timeline``: tokens per round, stacked by request, against the round's token
  budget, with a dot under every request that produced a token in that round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request, RoundRecord, simulate
from tinyserve.viz.figures import figure

_SHARED = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"]
_PRIVATE = "#e6e6e6"
_REQUEST = ["#8dd3c7", "#bebada", "#80b1d3", "#b3de69", "#fccde5", "#ccebc5", "#ffed6f", "#d9d9d9"]
LONG_COLOR = "#f28e2b"


def _plt():
    import matplotlib.pyplot as plt

    return plt


# -- workloads ----------------------------------------------------------------------------------

def system_prompt_requests(system_len: int = 28, user_lens: Sequence[int] = (6, 9, 12, 7), output_len: int = 8,
                           ) -> list[Request]:
    """Requests that all start with the same system prompt and arrive one per round."""
    system = list(range(500, 500 + system_len))
    requests = []
    for i, n in enumerate(user_lens):
        ids = system + [1000 + 100 * i + j for j in range(n)]
        requests.append(Request(f"u{i}", len(ids), output_len, arrival_round=1 + i, prompt_token_ids=ids))
    return requests


def prefix_sharing_run(enable_prefix_caching: bool = True, block_size: int = 8,
                       requests: list[Request] | None = None) -> list[RoundRecord]:
    requests = requests or system_prompt_requests()
    sc = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0,
                     enable_prefix_caching=enable_prefix_caching)
    return simulate(requests, sc, cc)


def long_prompt_requests(long_len: int = 160, num_decoders: int = 3, decode_len: int = 12, long_arrival: int = 3,
                         ) -> list[Request]:
    """A few short requests that are decoding when a long prompt arrives."""
    short = [Request(f"d{i}", 6 + i, decode_len, arrival_round=1) for i in range(num_decoders)]
    return short + [Request("long", long_len, 4, arrival_round=long_arrival)]


def chunked_run(enable_chunked_prefill: bool, budget: int = 32,
                requests: list[Request] | None = None) -> list[RoundRecord]:
    requests = requests or long_prompt_requests()
    sc = SchedulerConfig(max_num_batched_tokens=budget if enable_chunked_prefill else None, max_num_seqs=8,
                         max_model_len=512, enable_chunked_prefill=enable_chunked_prefill)
    cc = CacheConfig(block_size=16, num_gpu_blocks=128, num_cpu_blocks=0, watermark=0.0)
    return simulate(requests, sc, cc)


# -- reading records ----------------------------------------------------------------------------
# Both helpers assume no request was preempted: then a request produces one token in each of
# the last ``output_len`` rounds it takes part in (the end of its prefill, then every decode),
# and every other token it brought was a prompt token it computed.

def _appearances(records: Sequence[RoundRecord], rid: str) -> list[RoundRecord]:
    return [rec for rec in records if rid in rec.chunk_sizes]


def prefill_tokens(records: Sequence[RoundRecord], output_lens: dict[str, int]) -> dict[str, int]:
    """Prompt tokens each request actually computed (what prefix caching did not save)."""
    return {rid: sum(rec.chunk_sizes[rid] for rec in _appearances(records, rid)) - (n - 1)
            for rid, n in output_lens.items()}


def producers(records: Sequence[RoundRecord], output_lens: dict[str, int]) -> list[set[str]]:
    """For each round, the requests that produced a token in it."""
    if any(rec.tokens for rec in records):  # the engine records the tokens themselves
        return [set(rec.tokens) for rec in records]
    made: list[set[str]] = [set() for _ in records]
    index = {rec.round: i for i, rec in enumerate(records)}
    for rid, n in output_lens.items():
        for rec in _appearances(records, rid)[-n:]:
            made[index[rec.round]].add(rid)
    return made


# -- drawings -----------------------------------------------------------------------------------

def draw_prefix_sharing(record: RoundRecord, prompt_lens: dict[str, int], computed: dict[str, int],
                        block_size: int, title: str = "", labels: dict[str, str] | None = None):
    """Block tables of one round (shared physical blocks coloured alike) and the prefill saved."""
    plt = _plt()
    rids = [rid for rid in prompt_lens if rid in record.block_tables]
    uses = Counter(b for rid in rids for b in set(record.block_tables[rid]))
    shared = sorted(b for b, n in uses.items() if n > 1)
    color = {b: _SHARED[i % len(_SHARED)] for i, b in enumerate(shared)}
    width = max(len(record.block_tables[rid]) for rid in rids)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.7 * len(rids) + 1.6), gridspec_kw={"width_ratios": [3, 2]})
    for row, rid in enumerate(rids):
        y = len(rids) - 1 - row
        for i, b in enumerate(record.block_tables[rid]):
            ax.add_patch(plt.Rectangle((i, y + 0.1), 0.92, 0.8, facecolor=color.get(b, _PRIVATE), edgecolor="#333"))
            ax.text(i + 0.46, y + 0.5, str(b), ha="center", va="center", fontsize=9,
                    color="white" if b in color else "#333", gid=f"block:{rid}:{i}:{b}")
        ax.text(-0.2, y + 0.5, (labels or {}).get(rid, rid), ha="right", va="center", fontsize=10)
    ax.set_xlim(-2.5, width + 0.2)
    ax.set_ylim(-0.2, len(rids))
    ax.set_xticks([i + 0.46 for i in range(width)], [f"{i}" for i in range(width)], fontsize=8)
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
        bx.text(c + k + 0.5, y, f"{c} of {c + k}", va="center", fontsize=9)
    bx.set_yticks(list(ys)[::-1], [(labels or {}).get(rid, rid) for rid in rids])
    bx.set_xlabel("prompt tokens")
    bx.set_xlim(0, max(prompt_lens[rid] for rid in rids) * 1.3)
    saved = sum(cached)
    bx.set_title(f"prefill: {sum(comp)} tokens computed, {saved} saved "
                 f"({saved / max(1, sum(prompt_lens[r] for r in rids)):.0%})", fontsize=10)
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_chunked_timeline(records: Sequence[RoundRecord], output_lens: dict[str, int], ax=None,
                          budget: int | None = None, long_id: str = "long", title: str = ""):
    """Tokens per round stacked by request; a dot under each request that produced a token."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    rids = list(output_lens)
    colors = {rid: LONG_COLOR if rid == long_id else _REQUEST[i % len(_REQUEST)] for i, rid in enumerate(rids)}
    made = producers(records, output_lens)
    top = 1
    for rec in records:
        bottom = 0
        for rid in rids:  # a fixed stacking order, so colours line up round to round
            n = rec.chunk_sizes.get(rid, 0)
            if n:
                ax.bar(rec.round, n, bottom=bottom, color=colors[rid], edgecolor="#333", linewidth=0.4, width=0.8)
                bottom += n
        top = max(top, bottom)
    for row, rid in enumerate(rids):
        xs = [rec.round for rec, who in zip(records, made) if rid in who]
        ax.scatter(xs, [-(row + 1) * top * 0.06] * len(xs), s=9, color=colors[rid], edgecolor="#333", linewidth=0.3,
                   zorder=3)
    if budget is not None:
        ax.axhline(budget, color="#333", linestyle="--", linewidth=1)
        ax.text(0.4, budget, f" budget {budget}", va="bottom", ha="left", fontsize=8)
    ax.set_xlim(0.3, records[-1].round + 0.7)
    ax.set_ylim(-(len(rids) + 1) * top * 0.06, top * 1.08)
    ax.set_xlabel("round")
    ax.set_ylabel("tokens in the round")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[rid]) for rid in rids]
    ax.legend(handles, rids, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "tokens per round (bars) and who produced a token (dots)", fontsize=10)
    return ax


# -- registered figures (simulator runs: no model needed) ---------------------------------------

@figure("12_prefix_sharing")
def fig_prefix_sharing():
    requests = system_prompt_requests()
    records = prefix_sharing_run(True)
    lens = {r.request_id: r.prompt_len for r in requests}
    record = max(records, key=lambda r: len(r.block_tables))
    computed = prefill_tokens(records, {r.request_id: r.output_len for r in requests})
    return draw_prefix_sharing(record, lens, computed, 8,
                               title="Four requests with a 28-token system prompt (blocks of 8), prefix caching on")


@figure("12_chunked_prefill")
def fig_chunked_prefill():
    plt = _plt()
    lens = {r.request_id: r.output_len for r in long_prompt_requests()}
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6.4))
    whole, chunked = chunked_run(False), chunked_run(True)
    draw_chunked_timeline(whole, lens, ax=a,
                          title="without chunking: the 160-token prompt takes a round to itself; the decodes stall")
    draw_chunked_timeline(chunked, lens, ax=b, budget=32,
                          title="chunked prefill, 32 tokens a round: decodes first, the prompt gets the rest")
    for ax in (a, b):  # one round axis for both
        ax.set_xlim(0.3, max(len(whole), len(chunked)) + 0.7)
    fig.tight_layout()
    return fig
