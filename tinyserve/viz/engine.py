"""Drawings of the engine, and two small tools for looking inside one while it runs.

Drawings:

- ``draw_architecture``: LLMEngine on top of the two halves, Scheduler | Worker, with the parts
  each one owns and what crosses between them every step (chapters 00 and 09); with
  ``chapters=True`` each part carries the numbers of the chapters that build it.
- ``draw_packed_inputs``: the tensors ``prepare_inputs`` builds for one round, token by token.
- ``draw_sampling``: one real row of logits under greedy, temperature, top-k and top-p.
- ``draw_token_timeline``: the rounds of an engine run, with the text each request produced.
- ``draw_step_times``: each step's time split into schedule / model / sample / process.

Tools (the engine itself has no hooks for the book; these stand beside it):

- ``TracingWorker``: a Worker that keeps, for every call, the cache orders it was given, the
  packed inputs it ran and the logits it returned.
- ``peek``: the engine's next round, scheduled on a deep copy of its scheduler, so looking at a
  round does not consume it.
- ``rename_requests``: the same records under other request ids.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tinyserve.model_runner import ModelInput, prepare_inputs
from tinyserve.sampler import Sampler
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SamplingParams, SequenceGroupMetadata
from tinyserve.sim import RoundRecord
from tinyserve.viz.figures import figure
from tinyserve.viz.rounds import draw_timeline, request_order
from tinyserve.worker import Worker

SEQ_COLORS = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#d9d9d9"]
TIME_PARTS = (("schedule", "#4e79a7"), ("model", "#f28e2b"), ("sample", "#59a14f"), ("process", "#b07aa1"))


def _plt():
    import matplotlib.pyplot as plt

    return plt


# -- looking inside a running engine ------------------------------------------------------------

@dataclass
class WorkerCall:
    """One ``execute_model`` call: the cache orders, then what the model saw and returned."""

    blocks_to_swap_in: dict[int, int]
    blocks_to_swap_out: dict[int, int]
    blocks_to_copy: dict[int, list[int]]
    inputs: ModelInput | None = None
    logits: torch.Tensor | None = None  # float32 on the CPU, one row per sampled sequence


class TracingWorker(Worker):
    """A Worker that writes down every call. The engine calls the worker only for rounds that
    have work (``SchedulerOutputs.is_empty()`` is False), so ``calls[i]`` is the i-th such round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[WorkerCall] = []

    def execute_model(self, groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy):
        call = WorkerCall(dict(blocks_to_swap_in), dict(blocks_to_swap_out),
                          {src: list(dsts) for src, dsts in blocks_to_copy.items()})
        self.calls.append(call)
        logits = super().execute_model(groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy)
        if logits is not None:
            call.logits = logits.detach().float().cpu().clone()
        return logits

    def run(self, inputs: ModelInput) -> torch.Tensor:
        self.calls[-1].inputs = inputs
        return super().run(inputs)


def peek(engine) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs, ModelInput | None]:
    """The round ``engine.step()`` would run next: scheduled on a deep copy of the engine's
    scheduler (``schedule()`` allocates blocks and moves queues, so it cannot be undone) and
    packed by ``prepare_inputs``. The engine is left exactly as it was."""
    scheduler = copy.deepcopy(engine.scheduler)
    metas, out = scheduler.schedule()
    inputs = prepare_inputs(metas, engine.cache_config.block_size) if metas else None
    return metas, out, inputs


def sequence_names(metas: Sequence[SequenceGroupMetadata]) -> list[str]:
    """A name per packed sequence, in packing order: the request id, suffixed ``.i`` for the
    i-th sequence of a group that has several."""
    names = []
    for meta in metas:
        several = len(meta.seq_data) > 1
        names += [f"{meta.request_id}.{i}" if several else meta.request_id for i in range(len(meta.seq_data))]
    return names


def rename_requests(records: Sequence[RoundRecord], names: dict[str, str]) -> list[RoundRecord]:
    """Copies of ``records`` with request ids replaced through ``names`` (``LLM.generate`` calls
    its requests gen-0, gen-1, ...; the book calls them s0, s1, ...). Sample suffixes (".1")
    are kept; ids not in ``names`` stay as they are."""
    def one(key: str) -> str:
        if key in names:
            return names[key]
        base, _, index = key.rpartition(".")
        return f"{names[base]}.{index}" if base in names else key

    def ids(values: list[str]) -> list[str]:
        return [one(v) for v in values]

    def keyed(d: dict) -> dict:
        return {one(k): v for k, v in d.items()}

    return [replace(r, batch=ids(r.batch), preempted=ids(r.preempted), swapped_out=ids(r.swapped_out),
                    swapped_in=ids(r.swapped_in), finished=ids(r.finished), ignored=ids(r.ignored),
                    waiting=ids(r.waiting), running=ids(r.running), swapped=ids(r.swapped),
                    block_tables=keyed(r.block_tables), cpu_block_tables=keyed(r.cpu_block_tables),
                    chunk_sizes=keyed(r.chunk_sizes), tokens=keyed(r.tokens))
            for r in records]


# -- the architecture ---------------------------------------------------------------------------

# Which chapters build which part (the book's map, drawn as badges on the architecture).
CHAPTER_BADGES = {
    "LLMEngine": ["09", "11", "12"],
    "queues": ["04", "05"],
    "BlockSpaceManager": ["02", "03"],
    "model": ["07"],
    "attention": ["08"],
    "CacheEngine": ["01", "06"],
    "Worker": ["09", "10"],
}


def _box(ax, x, y, w, h, label, gid, face="#ffffff", edge="#333333", size=9, weight="bold", va="top", lw=1.2,
         pad=0.12):
    from matplotlib.patches import FancyBboxPatch

    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", facecolor=face,
                           edgecolor=edge, linewidth=lw)
    patch.set_gid(gid)
    ax.add_patch(patch)
    if label:
        ty = y + h - pad if va == "top" else y + h / 2
        ax.text(x + pad, ty, label, ha="left", va=va, fontsize=size, fontweight=weight)
    return patch


def _arrow(ax, start, end, label, gid, label_xy, color="#333333", ha="center", rad=0.0):
    from matplotlib.patches import FancyArrowPatch

    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.6, color=color,
                            connectionstyle=f"arc3,rad={rad}")
    arrow.set_gid(gid)
    ax.add_patch(arrow)
    ax.text(*label_xy, label, ha=ha, va="center", fontsize=7.5, color=color, linespacing=1.25)


def _badge(ax, x, y, numbers: list[str]) -> None:
    for i, n in enumerate(numbers):
        circle = _plt().Circle((x + i * 0.48, y), 0.21, facecolor="#e15759", edgecolor="white", linewidth=1.0,
                               zorder=5)
        circle.set_gid(f"badge:{n}")
        ax.add_patch(circle)
        ax.text(x + i * 0.48, y, n, ha="center", va="center", fontsize=6.5, color="white", fontweight="bold",
                zorder=6)


def _cells(ax, x, y, n, fill: set[int], color: str, gid: str, size=0.34) -> None:
    for i in range(n):
        rect = _plt().Rectangle((x + i * (size + 0.06), y), size, size, facecolor=color if i in fill else "white",
                                edgecolor="#666", linewidth=0.6)
        rect.set_gid(gid)
        ax.add_patch(rect)


def draw_architecture(ax=None, chapters: bool = False, title: str | None = None):
    """The engine as boxes and arrows: LLMEngine (requests in, outputs out, the sampler) on top;
    below it the Scheduler (three queues, the BlockSpaceManager's block tables) and the Worker
    (the model, the CacheEngine's GPU blocks and CPU swap space); arrows for one step."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(13.0, 7.4))
    wx = 9.6  # left edge of the Worker
    # LLMEngine
    _box(ax, 0.3, 7.2, 16.3, 2.5, "LLMEngine", "box:LLMEngine", face="#f4f4f4", size=11)
    ax.text(0.45, 9.05, "creates the Scheduler and the Worker(s); step() = schedule → execute → sample → update",
            fontsize=8, va="center", color="#333")
    _box(ax, 2.2, 7.45, 3.4, 1.15, "requests", "box:requests", face="#ffffff", size=8.5)
    ax.text(2.34, 7.75, "SequenceGroup per prompt\nadd_request · abort_request", fontsize=7, va="center")
    _box(ax, 6.6, 7.45, 3.2, 1.15, "Sampler", "box:Sampler", face="#e8f3e6", size=8.5)
    ax.text(6.74, 7.75, "greedy · temperature\ntop-k · top-p · seeds", fontsize=7, va="center")
    _box(ax, 11.0, 7.45, 3.6, 1.15, "outputs", "box:outputs", face="#ffffff", size=8.5)
    ax.text(11.14, 7.75, "detokenize, stop checks\nRequestOutput · history", fontsize=7, va="center")
    _arrow(ax, (-0.9, 8.0), (2.2, 8.0), "prompts", "arrow:prompts", (0.35, 8.25))
    _arrow(ax, (14.6, 8.0), (17.9, 8.0), "text", "arrow:text", (17.1, 8.25))

    # Scheduler
    _box(ax, 0.3, 0.3, 7.0, 5.6, "Scheduler", "box:Scheduler", face="#eef3fa", size=11)
    ax.text(0.45, 5.2, "which requests run this round (vllm: all prefill or all decode)", fontsize=7.5)
    for i, (name, fill) in enumerate((("waiting", {0, 1}), ("running", {0, 1, 2}), ("swapped", {0}))):
        x = 0.6 + i * 2.2
        _box(ax, x, 3.75, 2.0, 1.1, name, f"box:{name}", face="#ffffff", size=8, pad=0.1)
        _cells(ax, x + 0.15, 3.9, 4, fill, "#80b1d3", f"queue:{name}")
    _box(ax, 0.6, 0.6, 6.4, 2.8, "BlockSpaceManager", "box:BlockSpaceManager", face="#ffffff", size=9)
    ax.text(0.8, 2.55, "block tables: s0→[0,3]  s1→[1,2]  s2→cpu[0]", fontsize=7.5, family="monospace")
    ax.text(0.8, 2.0, "GPU allocator: free list, ref counts", fontsize=7.5)
    ax.text(0.8, 1.55, "CPU allocator: swap space", fontsize=7.5)
    ax.text(0.8, 1.0, "can_allocate · append_slot (copy-on-write)\nfork · swap_out · swap_in · free", fontsize=7,
            color="#444", va="center")

    # Worker, with shadows for the tensor-parallel copies
    for k in (2, 1):
        _box(ax, wx + 0.14 * k, 0.3 - 0.14 * k, 7.0, 5.6, "", f"box:Worker-shadow{k}", face="#f7efe6",
             edge="#bbbbbb", lw=0.8)
    _box(ax, wx, 0.3, 7.0, 5.6, "Worker", "box:Worker", face="#fbf1e4", size=11)
    ax.text(wx + 0.15, 5.2, "runs the model; one per GPU (× tensor_parallel_size)", fontsize=7.5)
    _box(ax, wx + 0.3, 3.75, 6.4, 1.1, "model runner + Llama model", "box:model", face="#ffffff", size=8, pad=0.1)
    ax.text(wx + 0.4, 4.05, "prepare_inputs (packed, no padding) → 30 layers,\npaged attention reads K/V by "
            "block table → logits", fontsize=6.8, va="center")
    _box(ax, wx + 0.3, 0.6, 6.4, 2.8, "CacheEngine", "box:CacheEngine", face="#ffffff", size=9)
    ax.text(wx + 0.5, 2.55, "GPU KV blocks [num_blocks, block_size, kv_heads, head_dim]", fontsize=6.8)
    _cells(ax, wx + 0.5, 2.0, 12, {0, 1, 2, 3}, "#fdb462", "cache:gpu")
    ax.text(wx + 0.5, 1.55, "CPU swap space", fontsize=6.8)
    _cells(ax, wx + 0.5, 1.0, 6, {0}, "#bebada", "cache:cpu")
    ax.text(wx + 3.0, 1.15, "swap_out · swap_in · copy", fontsize=7, color="#444")

    # One step's traffic
    _arrow(ax, (3.9, 7.2), (3.9, 5.95), "schedule()", "arrow:schedule", (3.1, 6.55))
    _arrow(ax, (7.35, 3.0), (wx - 0.05, 3.0), "groups' metadata\n+ swap in / out\nand copy orders",
           "arrow:orders", (8.45, 3.85))
    _arrow(ax, (wx + 3.2, 5.95), (8.7, 7.4), "logits of the\nsampled rows", "arrow:logits", (11.6, 6.55), rad=0.15)
    _arrow(ax, (6.9, 7.4), (5.4, 5.95), "new tokens,\nfinished → free", "arrow:tokens", (7.2, 6.55))

    if chapters:
        _badge(ax, 2.75, 9.45, CHAPTER_BADGES["LLMEngine"])
        _badge(ax, 2.7, 5.55, CHAPTER_BADGES["queues"])
        _badge(ax, 4.25, 3.05, CHAPTER_BADGES["BlockSpaceManager"])
        _badge(ax, wx + 4.2, 4.6, CHAPTER_BADGES["model"])
        _badge(ax, wx + 5.75, 4.6, CHAPTER_BADGES["attention"])
        _badge(ax, wx + 2.55, 3.05, CHAPTER_BADGES["CacheEngine"])
        _badge(ax, wx + 1.95, 5.55, CHAPTER_BADGES["Worker"])
    ax.set_xlim(-1.0, 18.0)
    ax.set_ylim(-0.2, 9.9)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax.figure


@figure("00_architecture")
def fig_architecture():
    return draw_architecture(title="The engine: the Scheduler decides, the Worker computes")


@figure("00_chapter_map")
def fig_chapter_map():
    return draw_architecture(chapters=True, title="Where each chapter builds its part (red badges: chapter numbers)")


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
    plt = _plt()
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
    for r, (label, values) in enumerate(rows):
        y = r * h
        ax.text(-0.15, y + h / 2, label, ha="right", va="center", fontsize=8, family="monospace")
        for col, value in enumerate(values):
            rect = plt.Rectangle((col + 0.04, y + 0.04), 0.92, h - 0.08, facecolor=SEQ_COLORS[owner[col] % 8],
                                 edgecolor="#555", linewidth=0.6)
            rect.set_gid(f"cell:{label}:{col}")
            ax.add_patch(rect)
            ax.text(col + 0.5, y + h / 2, value, ha="center", va="center", fontsize=7 if "\n" not in value else 6)
    bottom = len(rows) * h
    for i, name in enumerate(names):
        lo, hi = starts[i], starts[i + 1]
        ax.text((lo + hi) / 2, -0.12, name, ha="center", va="bottom", fontsize=8.5, fontweight="bold")
    for i, s in enumerate(starts):
        line = ax.plot([s, s], [-0.05, bottom + 0.05], color="#222", linewidth=2.0 if 0 < s < n else 1.0)[0]
        line.set_gid(f"boundary:{i}")
        ax.text(s, bottom + 0.3, str(s), ha="center", va="center", fontsize=7.5, color="#222")
    ax.text(-0.15, bottom + 0.3, "query_start_loc", ha="right", va="center", fontsize=8, family="monospace")
    for row in inputs.sample_indices.tolist():
        mark = ax.text(row + 0.5, bottom + 0.75, "▲ sample", ha="center", va="center", fontsize=6.5,
                       color="#e15759")
        mark.set_gid(f"sample:{row}")
    tables = md.block_tables.tolist()
    lines = ["sequence  block table   context_len"]
    for i, name in enumerate(names):
        used = -(-md.context_lens_list[i] // block_size)
        lines.append(f"{name:<9} {str(tables[i][:used]):<13} {md.context_lens_list[i]}")
    for j, line in enumerate(lines):
        ax.text(n + 0.5, 0.1 + 0.45 * j, line, ha="left", va="top", fontsize=7.5, family="monospace",
                fontweight="bold" if j == 0 else "normal")
    ax.set_xlim(-2.6, n + 5.2)
    ax.set_ylim(max(bottom + 1.1, 0.45 * len(lines) + 0.3), -0.6)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax.figure


# -- sampling -------------------------------------------------------------------------------------

DEFAULT_SAMPLING_SETTINGS = (
    ("greedy (temperature 0)", SamplingParams(temperature=0.0)),
    ("temperature 0.6", SamplingParams(temperature=0.6)),
    ("temperature 1.0", SamplingParams(temperature=1.0)),
    ("temperature 1.0, top-k 4", SamplingParams(temperature=1.0, top_k=4)),
    ("temperature 1.0, top-p 0.6", SamplingParams(temperature=1.0, top_p=0.6)),
)


def sampling_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for one row (one-hot on the argmax when greedy)."""
    row = logits_row.float().reshape(1, -1)
    if params.greedy:
        return torch.nn.functional.one_hot(row.argmax(dim=-1), row.shape[-1]).float()[0]
    return Sampler._probs(row, [params])[0]


def draw_sampling(logits_row: torch.Tensor, tokenizer=None, settings=DEFAULT_SAMPLING_SETTINGS, top: int = 10,
                  title: str | None = None):
    """One panel per setting: the probability of the ``top`` likeliest tokens (by the raw
    logits) under that setting. A token the setting cuts off is a dashed outline at its
    temperature-1 probability."""
    plt = _plt()
    order = logits_row.float().argsort(descending=True)[:top].tolist()
    base = torch.softmax(logits_row.float(), dim=-1)
    labels = [repr(tokenizer.decode([t])) if tokenizer is not None else str(t) for t in order]
    fig, axes = plt.subplots(1, len(settings), figsize=(3.0 * len(settings), 3.2), sharey=True)
    axes = [axes] if len(settings) == 1 else list(axes)
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
        ax.set_title(f"{name}\n{kept} token{'s' if kept != 1 else ''} can be drawn", fontsize=8.5)
        ax.set_xticks(range(len(order)), labels, rotation=70, fontsize=7)
        ax.set_ylim(0, 1.05)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("probability")
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    return fig


# -- rounds with tokens, and step times ------------------------------------------------------------

def draw_token_timeline(records: Sequence[RoundRecord], ax=None, title: str | None = None, width: int = 9):
    """The round timeline (``rounds.draw_timeline``) with, in each cell where a request produced
    a token, the text of that token."""
    plt = _plt()
    ids = request_order(records)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.62 * len(records) + 3.2, 0.55 * len(ids) + 1.8))
    draw_timeline(records, ax=ax, title=title)
    for col, r in enumerate(records):
        for key, text in r.tokens.items():
            rid = key if key in ids else key.rsplit(".", 1)[0]
            if rid not in ids:
                continue
            shown = _printable(text)
            shown = shown if len(shown) <= width else shown[: width - 1] + "…"
            t = ax.text(col + 0.5, ids.index(rid) + 0.8, shown, ha="center", va="center", fontsize=5.5,
                        color="#111", rotation=0)
            t.set_gid(f"token:{r.round}:{key}")
    return ax.figure


def draw_step_times(step_times: Sequence[tuple[float, float, float, float]],
                    records: Sequence[RoundRecord] | None = None, ax=None, title: str | None = None):
    """Stacked bars, one per step, of ``LLMEngine.times.history``: scheduling, the model (cache
    orders + forward pass), sampling, and processing the outputs, in milliseconds. With the
    records, each bar is labelled with its round's phase and batch size."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.42 * len(step_times) + 2.5), 3.4))
    bottoms = [0.0] * len(step_times)
    for k, (name, color) in enumerate(TIME_PARTS):
        heights = [1e3 * t[k] for t in step_times]
        bars = ax.bar(range(1, len(step_times) + 1), heights, bottom=bottoms, color=color, label=name, width=0.75)
        for b in bars:
            b.set_gid(f"time:{name}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if records is not None:
        for i, r in enumerate(records[: len(step_times)]):
            ax.text(i + 1, bottoms[i], f"{r.phase[0].upper()}{r.batch_size}", ha="center", va="bottom", fontsize=6.5)
    ax.set_xlabel("step (round)")
    ax.set_ylabel("milliseconds")
    ax.set_xticks(range(1, len(step_times) + 1))
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax.figure


# -- the registered chapter 09 figures: one real run of s0/s1/s2 ----------------------------------

@dataclass
class SeedRun:
    """The s0/s1/s2 walkthrough on the real engine, with the rounds the book looks at."""

    engine: object  # LLMEngine, finished
    prefill: tuple[list[SequenceGroupMetadata], ModelInput]  # round 1, as peeked before it ran
    decode: tuple[list[SequenceGroupMetadata], ModelInput]  # round 3, as peeked before it ran


_SEED_RUNS: dict[tuple[int, str], SeedRun] = {}


@functools.lru_cache(maxsize=1)
def _default_loaded():
    from tinyserve.models.loader import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


def seed_engine(loaded, preemption_mode: str = "swap", max_tokens: int = 8,
                prompt_token_ids: dict[str, list[int]] | None = None):
    """An LLMEngine on ``presets.seed_rounds`` with s0, s1, s2 added (greedy), built around a
    fresh TracingWorker over ``loaded`` (a LoadedModel, shared so the weights load once).
    ``prompt_token_ids`` replaces the tokenized prompts (a model with another tokenizer needs
    it to get the story's 5, 5 and 3 tokens)."""
    from tinyserve import presets
    from tinyserve.config import ModelConfig
    from tinyserve.engine import LLMEngine

    preset = presets.seed_rounds(preemption_mode, max_tokens=max_tokens)
    weight = next(loaded.model.parameters())
    model_config = ModelConfig(model=str(loaded.path), device=weight.device.type,
                               dtype=str(weight.dtype).removeprefix("torch."))
    engine = LLMEngine(model_config, preset.cache_config, preset.scheduler_config,
                       executor=TracingWorker(model_config, loaded=loaded), record_history=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for rid, prompt in preset.prompts.items():
        engine.add_request(rid, prompt, params, (prompt_token_ids or {}).get(rid))
    return engine


def seed_run(loaded=None, prompt_token_ids: dict[str, list[int]] | None = None) -> SeedRun:
    """Run (once per model, then cached) s0/s1/s2 to the end, peeking at rounds 1 and 3."""
    loaded = loaded or _default_loaded()
    key = (id(loaded), repr(prompt_token_ids))
    if key not in _SEED_RUNS:
        engine = seed_engine(loaded, prompt_token_ids=prompt_token_ids)
        metas1, _, prefill = peek(engine)
        engine.step()
        engine.step()
        metas3, _, decode = peek(engine)
        while engine.has_unfinished_requests():
            engine.step()
        _SEED_RUNS[key] = SeedRun(engine, (metas1, prefill), (metas3, decode))
    return _SEED_RUNS[key]


def fig_packed_inputs(prefill=None, decode=None, block_size: int = 5, tokenizer=None):
    """Rounds 1 (prefill of s0, s1) and 3 (decode of s0, s1) of the walkthrough, packed."""
    if prefill is None or decode is None:
        run = seed_run()
        prefill, decode, tokenizer = run.prefill, run.decode, run.engine.tokenizer
    plt = _plt()
    n = max(len(prefill[1].input_ids), len(decode[1].input_ids))
    fig, axes = plt.subplots(2, 1, figsize=(0.78 * n + 5.5, 6.6), gridspec_kw={"height_ratios": [1, 1]})
    draw_packed_inputs(*prefill, block_size, tokenizer, ax=axes[0],
                       title="round 1, prefill: every prompt token is a row of the batch")
    draw_packed_inputs(*decode, block_size, tokenizer, ax=axes[1],
                       title="round 3, decode: one row per sequence, at the end of its context")
    axes[1].set_xlim(axes[0].get_xlim())
    fig.tight_layout()
    return fig


figure("09_packed_inputs")(fig_packed_inputs)


@figure("09_sampling")
def fig_sampling(logits_row: torch.Tensor | None = None, tokenizer=None):
    """s0's first next-token distribution ("Hello, my name is" → ?) under five settings."""
    if logits_row is None:
        run = seed_run()
        logits_row, tokenizer = run.engine.executor.calls[0].logits[0], run.engine.tokenizer
    return draw_sampling(logits_row, tokenizer, title="After 'Hello, my name is': what each setting lets the "
                                                      "sampler draw")


@figure("09_seed_rounds")
def fig_seed_rounds(records: Sequence[RoundRecord] | None = None):
    records = records if records is not None else seed_run().engine.history
    return draw_token_timeline(records, title="s0, s1, s2 on the real engine (swap preemption): what each round "
                                              "produced")


@figure("09_step_times")
def fig_step_times(engine=None):
    engine = engine if engine is not None else seed_run().engine
    return draw_step_times(engine.times.history, engine.history,
                           title="Where each step's time went (P/D = prefill/decode, then batch size)")
