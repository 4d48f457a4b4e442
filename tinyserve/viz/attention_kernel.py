"""Chapter 08's views of the Triton decode kernel: its program grid, one program's walk, its speed.

Four things live here, each built on the real kernel module (``attention/triton_paged.py``):

- ``plan_decode``: the launch the decode kernel gets for a batch (grid, tile, partitions), worked
  out with the kernel module's own ``choose_num_splits`` and tile rule, and what every program of
  the grid does: which query heads, which tokens, which physical blocks. ``draw_program_grid``
  draws it.
- ``online_softmax`` and ``walk_program``: the kernel's inner loop in plain PyTorch, tile by
  tile with a running max and a running sum, so its intermediate state can be printed and
  plotted (``draw_program_walk``); ``combine_partitions`` is the second kernel's merge.
- ``kv_bytes_per_step`` and ``floor_us``: the bytes a decode step must read and the time that
  takes at a given memory bandwidth, the floor ``benchmarks/kernel.py`` measures against.
- ``load_kernel_results`` / ``draw_kernel_bandwidth``: the benchmark's CSV, when a GPU run left
  one in ``benchmarks/results/kernel.csv``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinyserve.attention import triton_paged as tp
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.viz.figures import figure

H200_SMS = 132  # streaming multiprocessors of an H100/H200 SXM: what choose_num_splits sizes for
H200_BANDWIDTH = 4.8e12  # bytes/s, the H200's datasheet HBM3e bandwidth
KERNEL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernel.csv"


def _plt():
    import matplotlib.pyplot as plt

    return plt


# -- the launch: grid, partitions, and what each program does ----------------------------------


def partition_layout(max_context_len: int, num_splits: int, tile_tokens: int) -> tuple[int, int]:
    """``(tokens per partition, number of partitions)`` for a context cut into ``num_splits``.

    A partition is a whole number of tiles, so rounding up can leave fewer partitions than asked
    for. The same arithmetic as ``triton_paged.paged_decode_attention``; with one partition the
    kernel is told a huge partition instead, which covers any context.
    """
    max_context_len = max(1, max_context_len)
    per_split = math.ceil(max_context_len / max(1, num_splits))
    partition = tile_tokens * math.ceil(per_split / tile_tokens)
    return partition, math.ceil(max_context_len / partition)


@dataclass
class ProgramWork:
    """What one program of the decode grid does."""

    seq: int
    kv_head: int
    part: int
    q_heads: list[int]        # the query heads it attends for (its rows of the query tile)
    start: int                # tokens [start, end) of the sequence's context
    end: int
    num_tiles: int
    blocks: list[int] = field(default_factory=list)  # physical blocks it reads, in order

    @property
    def empty(self) -> bool:
        """A partition past the end of a short sequence: the program writes weight 0 and stops."""
        return self.end <= self.start


@dataclass
class DecodePlan:
    """The launch of ``_paged_decode_kernel`` for one batch."""

    context_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    group: int           # query heads per KV head
    group_pad: int       # rows of the query tile (tl.dot needs at least 16)
    tile_tokens: int     # tokens per loop iteration (TILE_N)
    num_splits: int      # partitions asked for (1 = the single-pass kernel)
    num_parts: int       # partitions launched
    partition_size: int  # the kernel's partition_size argument (2**30 in the single pass)
    programs: list[ProgramWork]

    @property
    def grid(self) -> tuple[int, int, int]:
        return (len(self.context_lens), self.num_kv_heads, self.num_parts)

    @property
    def split(self) -> bool:
        return self.num_parts > 1

    def program(self, seq: int, kv_head: int, part: int = 0) -> ProgramWork:
        return next(p for p in self.programs if (p.seq, p.kv_head, p.part) == (seq, kv_head, part))


def plan_decode(context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                block_tables: list[list[int]] | None = None, *, num_sms: int = 0, num_splits: int | None = None,
                max_context_len: int | None = None, tile_tokens: int | None = None) -> DecodePlan:
    """The grid and partitions ``paged_decode_attention`` launches for this batch.

    ``num_sms`` is the GPU's number of streaming multiprocessors (0, as on the CPU, never splits);
    ``max_context_len`` defaults to the longest context, which is what the backend passes.
    """
    group = num_heads // num_kv_heads
    head_dim_pad = tp._pow2(head_dim, 16)
    tile = tile_tokens or tp._tile_tokens(head_dim_pad)
    max_ctx = max(1, max_context_len if max_context_len is not None else max(context_lens))
    if num_splits is None:
        num_splits = tp.choose_num_splits(len(context_lens), num_kv_heads, max_ctx, num_sms)
    partition, num_parts = partition_layout(max_ctx, num_splits, tile)
    if num_parts == 1:
        partition = 2**30  # as the kernel is told: one pass, whatever the context
    programs = []
    for s, ctx in enumerate(context_lens):
        table = block_tables[s] if block_tables is not None else None
        for h in range(num_kv_heads):
            for p in range(num_parts):
                start = p * partition
                end = min(ctx, start + partition)
                blocks = []
                if table is not None and end > start:
                    blocks = [table[b] for b in range(start // block_size, math.ceil(end / block_size))]
                programs.append(ProgramWork(s, h, p, list(range(h * group, (h + 1) * group)), start, end,
                                            max(0, math.ceil((end - start) / tile)), blocks))
    return DecodePlan(list(context_lens), num_heads, num_kv_heads, head_dim, block_size, group,
                      tp._pow2(group, 16), tile, num_splits, num_parts, partition, programs)


def example_batch(context_lens: tuple[int, ...] = (700, 300, 45), block_size: int = 16,
                  prompt_lens: tuple[int, ...] = (40, 24, 12)) -> tuple[list[list[int]], BlockSpaceManager]:
    """Block tables of a batch grown the way a server grows one, with the real BlockSpaceManager.

    Each sequence's prompt is allocated, then all of them decode one token at a time, round
    robin, until each holds its context; so their blocks interleave in the pool.
    """
    num_blocks = sum(math.ceil(c / block_size) for c in context_lens) + 4
    bm = BlockSpaceManager(block_size, num_blocks, 0, watermark=0.0)
    seqs = []
    for i, (p, ctx) in enumerate(zip(prompt_lens, context_lens)):
        seq = Sequence(i, None, list(range(min(p, ctx))), block_size)
        bm.allocate(SequenceGroup(f"s{i}", [seq], SamplingParams(max_tokens=ctx), 0.0))
        seq.status = SequenceStatus.RUNNING
        seqs.append((seq, ctx))
    while any(seq.get_len() < ctx for seq, ctx in seqs):
        for seq, ctx in seqs:
            if seq.get_len() < ctx:
                seq.append_token_id(0)
                bm.append_slot(seq)
    return [bm.get_block_table(seq) for seq, _ in seqs], bm


def random_cache(block_tables: list[list[int]], context_lens: list[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V caches with random values in every slot a sequence owns and NaN everywhere else, so
    a kernel that reads a slot outside a context gives NaN instead of a plausible number."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    for table, ctx in zip(block_tables, context_lens):
        pos = torch.arange(ctx)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return k.view(cache_shape).to(dtype).to(device), v.view(cache_shape).to(dtype).to(device)


# -- the inner loop in plain PyTorch: online softmax -------------------------------------------


@dataclass
class SoftmaxState:
    """The running state of an online softmax over the tiles seen so far, per query row."""

    m: torch.Tensor    # [R] running max of the scores
    l: torch.Tensor    # [R] running sum of exp(score - m)  # noqa: E741 (the l of the math)
    acc: torch.Tensor  # [R, D] running sum of exp(score - m) * value

    @classmethod
    def empty(cls, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> SoftmaxState:
        return cls(torch.full((rows,), float("-inf"), dtype=dtype), torch.zeros(rows, dtype=dtype),
                   torch.zeros(rows, dim, dtype=dtype))

    def output(self) -> torch.Tensor:
        return self.acc / self.l[:, None]

    def lse(self) -> torch.Tensor:
        """log(sum of exp(score)) over everything seen: all a later merge needs to know."""
        return self.m + torch.log(self.l)


def online_softmax_step(state: SoftmaxState, scores: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """Fold one tile, ``scores [R, N]`` and ``values [N, D]``, into the running state."""
    m_new = torch.maximum(state.m, scores.max(dim=-1).values)
    alpha = torch.exp(state.m - m_new)  # rescales the old sums to the new max; exp(-inf) = 0 at first
    p = torch.exp(scores - m_new[:, None])
    return SoftmaxState(m_new, state.l * alpha + p.sum(dim=-1), state.acc * alpha[:, None] + p @ values)


def online_softmax(scores: torch.Tensor, values: torch.Tensor, tile: int) -> tuple[torch.Tensor, list[SoftmaxState]]:
    """``softmax(scores) @ values`` computed ``tile`` columns at a time, never holding a whole row.

    ``scores [R, N]`` (or ``[N]``), ``values [N, D]``. Returns the output and the state after
    each tile.
    """
    rows = scores.reshape(-1, scores.shape[-1])
    state = SoftmaxState.empty(rows.shape[0], values.shape[-1], rows.dtype)
    states = []
    for t in range(0, rows.shape[1], tile):
        state = online_softmax_step(state, rows[:, t:t + tile], values[t:t + tile])
        states.append(state)
    out = state.output()
    return (out[0] if scores.dim() == 1 else out), states


def combine_partitions(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partitions' normalized outputs ``outs [P, ..., D]`` by their ``lses [P, ...]``
    (natural log; -inf marks an empty partition), as ``_combine_partitions_kernel`` does in base 2.

    Partition p holds ``o_p = sum_i e^{s_i} v_i / e^{lse_p}``, so the softmax over all tokens
    weighs it by ``e^{lse_p} / sum_q e^{lse_q}``; subtracting the largest lse keeps that finite.
    """
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # every partition empty
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    out = (outs * weights[..., None]).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    return out, top + torch.log(total)


@dataclass
class TileStep:
    """One iteration of a program's loop."""

    start: int             # tokens [start, end)
    end: int
    blocks: list[int]      # physical blocks the tile's tokens live in
    m: torch.Tensor        # running max per query row after this tile
    l: torch.Tensor        # running sum per query row after this tile  # noqa: E741


@dataclass
class ProgramWalk:
    out: torch.Tensor      # [group, D], softmax over the program's tokens applied to V
    lse: torch.Tensor      # [group], natural log
    steps: list[TileStep]


def walk_program(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int],
                 kv_head: int, scale: float, start: int, end: int, tile: int) -> ProgramWalk:
    """Do in PyTorch what one decode program does: attend the query heads of ``kv_head``
    (``q [num_heads, D]`` is one sequence's query) to tokens ``[start, end)``, read tile by tile
    through the block table. The kernel works in base 2 (exp2); this walk in base e, in float32.
    """
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[0] // num_kv_heads
    qg = q[kv_head * group:(kv_head + 1) * group].float().cpu()
    table = torch.tensor(block_table)
    state = SoftmaxState.empty(group, q.shape[-1])
    steps = []
    for t0 in range(start, end, tile):
        tokens = torch.arange(t0, min(t0 + tile, end))
        blocks, rows = table[tokens // block_size], tokens % block_size
        k = k_cache[blocks.to(k_cache.device), rows.to(k_cache.device), kv_head].float().cpu()
        v = v_cache[blocks.to(v_cache.device), rows.to(v_cache.device), kv_head].float().cpu()
        state = online_softmax_step(state, (qg @ k.T) * scale, v)
        steps.append(TileStep(int(tokens[0]), int(tokens[-1]) + 1, list(dict.fromkeys(blocks.tolist())),
                              state.m.clone(), state.l.clone()))
    return ProgramWalk(state.output(), state.lse(), steps)


# -- bytes and the bandwidth floor -------------------------------------------------------------


def kv_bytes_per_step(context_lens: list[int], num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K/V bytes one layer's decode step reads: every cached token's K and V row, once per KV
    head (the query heads of a group share the read)."""
    return sum(context_lens) * num_kv_heads * head_dim * 2 * dtype_bytes


def floor_us(nbytes: int, bandwidth: float = H200_BANDWIDTH) -> float:
    """Microseconds to stream ``nbytes`` from memory at ``bandwidth`` bytes/s: no decode kernel
    can be faster, since it must read them all."""
    return nbytes / bandwidth * 1e6


# Layers of the book's models, as the benchmark's shapes: (query heads, KV heads, head_dim).
FLOOR_SHAPES = {
    "SmolLM2-135M layer (9 q / 3 kv heads, d=64)": (9, 3, 64),
    "Llama-3-8B layer (32 q / 8 kv heads, d=128)": (32, 8, 128),
}
FLOOR_CONTEXTS = (128, 512, 2048, 8192, 32768)


def floor_table(batches: tuple[int, ...] = (1, 16, 256), contexts: tuple[int, ...] = FLOOR_CONTEXTS,
                dtype_bytes: int = 2, bandwidth: float = H200_BANDWIDTH) -> list[dict]:
    """One row per layer shape, batch and context: the K/V bytes of one decode step and the floor."""
    rows = []
    for name, (_, kv_heads, head_dim) in FLOOR_SHAPES.items():
        for batch in batches:
            for ctx in contexts:
                nbytes = kv_bytes_per_step([ctx] * batch, kv_heads, head_dim, dtype_bytes)
                rows.append(dict(shape=name, batch=batch, context=ctx, kv_MiB=nbytes / 2**20,
                                 floor_us=floor_us(nbytes, bandwidth)))
    return rows


# -- drawings -----------------------------------------------------------------------------------

PART_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2"]


def draw_program_grid(plan: DecodePlan, block_tables: list[list[int]], title: str | None = None):
    """Top: every program of the grid, one box per (sequence, KV head, partition). Bottom: each
    sequence's context as its logical blocks, coloured by partition, with the physical block
    number each logical block maps to, and the tile boundaries of the kernel's loop."""
    plt = _plt()
    num_seqs = len(plan.context_lens)
    widest = max(math.ceil(c / plan.block_size) for c in plan.context_lens)
    cols = plan.num_kv_heads * plan.num_parts
    width = max(9.0, 0.26 * widest + 2.0, 2.2 * cols)
    fig, (ax_g, ax_b) = plt.subplots(2, 1, figsize=(width, 1.2 + 1.9 * num_seqs),
                                     gridspec_kw={"height_ratios": [1.1, 1.0]})
    for ax in (ax_g, ax_b):
        ax.set_axis_off()
    box_w = min(2.6, (width - 0.5) / cols)
    for prog in plan.programs:
        x = (prog.kv_head * plan.num_parts + prog.part) * box_w
        y = prog.seq * 1.2
        color = "#eeeeee" if prog.empty else PART_COLORS[prog.part % len(PART_COLORS)]
        ax_g.add_patch(plt.Rectangle((x, y), box_w - 0.12, 1.08, facecolor=color, alpha=1 if prog.empty else 0.35,
                                     edgecolor="#333", lw=0.8, gid=f"program:{prog.seq},{prog.kv_head},{prog.part}"))
        heads = f"q heads {prog.q_heads[0]}-{prog.q_heads[-1]}" if plan.group > 1 else f"q head {prog.q_heads[0]}"
        tiles = f"{prog.num_tiles} tile" + ("s" if prog.num_tiles != 1 else "")
        body = "empty: weight 0" if prog.empty else f"tokens {prog.start}-{prog.end - 1}, {tiles}"
        label = f"program ({prog.seq}, {prog.kv_head}, {prog.part})\n{heads}\n{body}"
        ax_g.text(x + (box_w - 0.12) / 2, y + 0.54, label, ha="center", va="center", fontsize=7.5,
                  gid=f"program_text:{prog.seq},{prog.kv_head},{prog.part}")
    for h in range(plan.num_kv_heads):
        ax_g.text((h * plan.num_parts + plan.num_parts / 2) * box_w - 0.06, -0.2, f"KV head {h}", ha="center",
                  fontsize=9, weight="bold")
    ax_g.set_xlim(-0.05, box_w * cols)
    ax_g.set_ylim(1.2 * num_seqs, -0.5)
    ax_g.set_title(f"the grid: {plan.grid} = (sequences, KV heads, partitions) programs; each holds a "
                   f"{plan.group_pad}-row query tile with {plan.group} real rows", fontsize=10)

    for s, (ctx, table) in enumerate(zip(plan.context_lens, block_tables)):
        y = s * 1.1
        ax_b.text(-0.3, y + 0.35, f"seq {s}\n{ctx} tok", ha="right", va="center", fontsize=8)
        for b in range(math.ceil(ctx / plan.block_size)):
            part = (b * plan.block_size) // plan.partition_size  # the partition of its first token
            filled = min(plan.block_size, ctx - b * plan.block_size) / plan.block_size
            ax_b.add_patch(plt.Rectangle((b, y), 0.95, 0.7, facecolor="white", edgecolor="#666", lw=0.5))
            ax_b.add_patch(plt.Rectangle((b, y), 0.95 * filled, 0.7, alpha=0.55, lw=0,
                                         facecolor=PART_COLORS[part % len(PART_COLORS)], gid=f"block:{s},{b}"))
            ax_b.text(b + 0.47, y + 0.37, str(table[b]), ha="center", va="center", fontsize=6)
        for t in range(plan.tile_tokens, ctx, plan.tile_tokens):  # tile boundaries of the loop
            xb = t / plan.block_size - 0.025
            edge = t % plan.partition_size == 0
            ax_b.plot([xb, xb], [y - 0.15, y + 0.85], color="#c00" if edge else "#222", lw=2.0 if edge else 0.9,
                      ls="-" if edge else "--")
    ax_b.set_xlim(-2.2, max(widest + 0.2, (width - 2.0) / 0.26))
    ax_b.set_ylim(1.1 * num_seqs, -0.3)
    ax_b.set_title(f"each sequence's logical blocks of {plan.block_size} tokens (number: physical block); dashed: "
                   f"tiles of {plan.tile_tokens} tokens" + ("; red: partition boundary" if plan.split else ""),
                   fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def draw_program_walk(walk: ProgramWalk, block_tables: list[list[int]], num_blocks: int, seq: int,
                      row: int = 0, per_row: int = 16):
    """Left: the physical block pool; the blocks one program reads are numbered by the tile that
    reads them, other sequences' blocks are grey. Right: that program's running max and running
    sum (for query row ``row``) after each tile; the sum drops when a new max rescales it."""
    plt = _plt()
    fig, (ax_p, ax_s) = plt.subplots(1, 2, figsize=(13, 3.6), gridspec_kw={"width_ratios": [1.1, 1]})
    tile_of = {}
    for i, step in enumerate(walk.steps):
        for b in step.blocks:
            tile_of.setdefault(b, i)
    others = {b for s, t in enumerate(block_tables) if s != seq for b in t}
    cmap = plt.get_cmap("viridis")
    n = max(1, len(walk.steps) - 1)
    for b in range(num_blocks):
        x, y = b % per_row, b // per_row
        if b in tile_of:
            color, label = cmap(tile_of[b] / n), f"{b}\nt{tile_of[b]}"
        else:
            color, label = ("#d0d0d0" if b in others else "white"), str(b)
        ax_p.add_patch(plt.Rectangle((x, y), 0.94, 0.9, facecolor=color, edgecolor="#777", lw=0.5, gid=f"pool:{b}"))
        ax_p.text(x + 0.47, y + 0.46, label, ha="center", va="center", fontsize=6,
                  color="white" if b in tile_of and tile_of[b] / n < 0.6 else "black")
    ax_p.set_xlim(0, per_row)
    ax_p.set_ylim(math.ceil(num_blocks / per_row), 0)
    ax_p.set_axis_off()
    ax_p.set_title(f"the block pool: blocks read by one program of seq {seq} (tN = tile N); grey: other sequences",
                   fontsize=9)

    x = range(len(walk.steps))
    ax_s.plot(x, [float(s.m[row]) for s in walk.steps], "o-", label="running max m")
    ax_s.set_xlabel("after tile")
    ax_s.set_ylabel("m (score units)")
    ax2 = ax_s.twinx()
    ax2.plot(x, [float(s.l[row]) for s in walk.steps], "s--", color="#f58518", label="running sum l")
    ax2.set_ylabel("l = sum exp(score - m)")
    lines = ax_s.get_lines() + ax2.get_lines()
    ax_s.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    ax_s.set_title(f"online softmax state of query row {row}", fontsize=10)
    fig.tight_layout()
    return fig


def draw_bandwidth_floor(rows: list[dict] | None = None, bandwidth: float = H200_BANDWIDTH, ax=None):
    """The floor time of one layer's decode step against context length: K/V bytes / bandwidth."""
    plt = _plt()
    rows = rows or floor_table(bandwidth=bandwidth)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    styles = dict(zip(FLOOR_SHAPES, ("--", "-")))
    for shape in FLOOR_SHAPES:
        for i, batch in enumerate(sorted({r["batch"] for r in rows})):
            pts = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
            ax.plot([r["context"] for r in pts], [r["floor_us"] for r in pts], styles[shape], marker="o", ms=3,
                    color=PART_COLORS[i], label=f"{shape.split(' (')[0]}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("floor per decode step and layer (µs)")
    ax.set_title(f"the bandwidth floor at {bandwidth / 1e12:.1f} TB/s (bf16 K/V, read once): arithmetic, "
                 "not a measurement", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, ncol=2)
    return ax.figure


def load_kernel_results(path: str | Path = KERNEL_RESULTS) -> list[dict] | None:
    """The rows of the benchmark's CSV with numbers parsed, or None when no GPU run left one."""
    path = Path(path)
    if not path.exists():
        return None
    rows = []
    with path.open() as f:
        for raw in csv.DictReader(f):
            row = {}
            for key, value in raw.items():
                try:
                    row[key] = int(value)
                except ValueError:
                    try:
                        row[key] = float(value)
                    except ValueError:
                        row[key] = value if value != "" else None
            rows.append(row)
    return rows


def draw_kernel_bandwidth(rows: list[dict]):
    """Measured share of the device copy bandwidth against context length, one panel per batch
    size and one line per (dtype, head_dim, GQA); the reference dashed; 100% = the floor."""
    plt = _plt()
    timed = [r for r in rows if r.get("pct_of_copy") is not None]
    batches = sorted({r["batch"] for r in timed})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.0), sharey=True, squeeze=False)
    configs = sorted({(r["dtype"], r["head_dim"], r["gqa"]) for r in timed})
    copy_gbps = timed[0]["copy_gbps"] if timed else 0.0
    for ax, batch in zip(axes[0], batches):
        for i, cfg in enumerate(configs):
            pts = sorted((r for r in timed if r["batch"] == batch and (r["dtype"], r["head_dim"], r["gqa"]) == cfg),
                         key=lambda r: r["context"])
            if not pts:
                continue
            color = plt.get_cmap("tab10")(i % 10)
            ax.plot([r["context"] for r in pts], [r["pct_of_copy"] for r in pts], "o-", ms=3, color=color,
                    label=f"{cfg[0]} d={cfg[1]} gqa {cfg[2]}")
            ref = [r for r in pts if r.get("ref_gbps") is not None]
            if ref:
                ax.plot([r["context"] for r in ref], [100 * r["ref_gbps"] / r["copy_gbps"] for r in ref], ":",
                        color=color, lw=1)
        ax.axhline(100, color="black", lw=1.2)
        ax.text(min(r["context"] for r in timed), 101, "bandwidth floor (device copy)",
                fontsize=8, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of copy bandwidth (solid: triton, dotted: reference)")
    fig.suptitle(f"measured: the decode kernel against a copy at {copy_gbps:.0f} GB/s", fontsize=11)
    fig.tight_layout()
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


# -- registered figures (make figures) ----------------------------------------------------------

EXAMPLE = dict(context_lens=(700, 300, 45), num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)


@figure("08_program_grid")
def fig_program_grid():
    ex = EXAMPLE
    tables, _ = example_batch(ex["context_lens"], ex["block_size"])
    plan = plan_decode(list(ex["context_lens"]), ex["num_heads"], ex["num_kv_heads"], ex["head_dim"],
                       ex["block_size"], tables, num_sms=H200_SMS)
    return draw_program_grid(plan, tables, title=f"the decode grid on a GPU with {H200_SMS} SMs")


@dataclass
class Example:
    """The chapter's batch, ready for the kernel: block tables from the real BlockSpaceManager,
    NaN-poisoned caches, random queries."""

    context_lens: list[int]
    tables: list[list[int]]
    num_blocks: int
    q: torch.Tensor             # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    lens: torch.Tensor          # [num_seqs] int32
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def example_inputs(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Example:
    ex = EXAMPLE
    lens = list(ex["context_lens"])
    tables, bm = example_batch(ex["context_lens"], ex["block_size"])
    num_blocks = bm.gpu_allocator.num_blocks
    k_cache, v_cache = random_cache(tables, lens, num_blocks, ex["block_size"], ex["num_kv_heads"], ex["head_dim"],
                                    dtype, device, seed)
    q = torch.randn(len(lens), ex["num_heads"], ex["head_dim"], generator=torch.Generator().manual_seed(seed + 1))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return Example(lens, tables, num_blocks, q.to(dtype).to(device), k_cache, v_cache, block_tables,
                   torch.tensor(lens, dtype=torch.int32, device=device), ex["num_heads"], ex["num_kv_heads"],
                   ex["head_dim"], ex["block_size"])


def example_walk(seq: int = 0, kv_head: int = 1, example: Example | None = None) -> tuple[ProgramWalk, Example]:
    """The figure's walk: one program of the example batch, single pass, over its whole context."""
    e = example or example_inputs()
    tile = tp._tile_tokens(tp._pow2(e.head_dim, 16))
    walk = walk_program(e.q[seq], e.k_cache, e.v_cache, e.tables[seq], kv_head, e.scale, 0, e.context_lens[seq], tile)
    return walk, e


@figure("08_program_walk")
def fig_program_walk():
    walk, e = example_walk()
    return draw_program_walk(walk, e.tables, e.num_blocks, seq=0)


@figure("08_bandwidth_floor")
def fig_bandwidth_floor():
    return draw_bandwidth_floor()


if KERNEL_RESULTS.exists():  # measured results only where a GPU run left them
    figure("08_kernel_bandwidth")(lambda: draw_kernel_bandwidth(load_kernel_results()))
