"""Chapter 06's views of the CacheEngine: what its tensors hold, round by round.

The CacheEngine stores floats, and a pool of floats says nothing to a reader. So the drawings
here fill the cache with *marked* K/V: the key of sequence ``s<i>``'s token at position ``p`` is
``100 * (i + 1) + p`` plus a small fraction that differs for every layer, head and channel, and
its value is minus its key. Reading one number back tells whose token a slot holds and which,
and because every element is distinct a bit-for-bit comparison after a swap means something.

- ``MarkingWorker`` plays the Worker's part without a model: it carries out the scheduler's
  cache orders on a real CacheEngine, then writes a marked K/V for every scheduled token.
- ``seed_cache_rounds`` drives the real Scheduler over the s0/s1/s2 preset with it and keeps a
  ``PoolFrame`` (plain numbers) after each round; ``draw_pools`` draws one frame.
- ``copy_on_write_story`` shows the ``copy`` order on a request sampled twice, and
  ``fig_memory_budget`` where a GPU's memory goes under the CUDA sizing rule.
- The split-x key layout of vLLM's CUDA kernel, as index arithmetic next to tinyserve's plain
  layout, and ``draw_split_x`` to show which bytes one load step touches in each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch

from tinyserve import presets
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus
from tinyserve.viz.blocks import owner_colors
from tinyserve.viz.figures import figure

# -- marked K/V ---------------------------------------------------------------------------------


def owner_index(label: str) -> int:
    """``"s2"`` -> 2; any other label gets a number from its characters (stable, below 90)."""
    if label[:1] == "s" and label[1:].isdigit():
        return int(label[1:])
    return 10 + sum(map(ord, label)) % 80


def marks_for(owner: int, positions: torch.Tensor, num_layers: int, num_kv_heads: int,
              head_dim: int) -> torch.Tensor:
    """Marked keys ``[num_layers, len(positions), num_kv_heads, head_dim]`` (values are their negatives).

    The integer part is ``100 * (owner + 1) + position``; the fraction (below 0.5) numbers the
    (layer, head, channel), so no two elements of a block are equal.
    """
    n = num_layers * num_kv_heads * head_dim
    frac = torch.arange(n, dtype=torch.float64).view(num_layers, 1, num_kv_heads, head_dim) / (2 * n)
    base = (100 * (owner + 1) + positions.to(torch.float64)).view(1, -1, 1, 1)
    return base + frac


def write_marked(engine: CacheEngine, owner: int, block_table: list[int], start: int, end: int) -> None:
    """Write the marked K/V of positions ``start .. end-1`` into their slots in every layer."""
    if end <= start:
        return
    positions = torch.arange(start, end)
    keys = marks_for(owner, positions, engine.num_layers, engine.num_kv_heads, engine.head_dim)
    bs = engine.block_size
    blocks = torch.tensor([block_table[p // bs] for p in range(start, end)])
    offsets = positions % bs
    for layer, (k_cache, v_cache) in enumerate(engine.gpu_cache):
        k_cache[blocks, offsets] = keys[layer].to(k_cache.dtype)
        v_cache[blocks, offsets] = (-keys[layer]).to(v_cache.dtype)


def read_marks(k_cache: torch.Tensor) -> list[list[tuple[int, int] | None]]:
    """``(owner, position)`` of the marked token in every slot of one layer's key pool, block by
    block (None for a slot that was never written: the pools start as zeros)."""
    first = k_cache[:, :, 0, 0].double().floor().long().tolist()
    return [[None if v <= 0 else (v // 100 - 1, v % 100) for v in block] for block in first]


# -- a worker without a model -------------------------------------------------------------------


class MarkingWorker:
    """The Worker's cache duties on a real CacheEngine, with marked K/V where a model would
    write real keys and values."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def execute(self, metas: list[SequenceGroupMetadata], out: SchedulerOutputs) -> None:
        self.apply_cache_orders(out)
        self.write(metas)

    def apply_cache_orders(self, out: SchedulerOutputs) -> None:
        # The real Worker's order: a block swapped out may be handed to another sequence in this
        # very round, so its bytes must be saved before anything writes there.
        self.engine.swap_out(out.blocks_to_swap_out)
        self.engine.swap_in(out.blocks_to_swap_in)
        self.engine.copy(out.blocks_to_copy)

    def write(self, metas: list[SequenceGroupMetadata]) -> None:
        """Where the model would store each scheduled token's K/V, store its marks."""
        for meta in metas:
            for seq_id, seq in meta.seq_data.items():
                start = seq.num_computed_tokens
                write_marked(self.engine, owner_index(meta.request_id), meta.block_tables[seq_id],
                             start, start + meta.token_chunk_size)


@dataclass
class PoolFrame:
    """Both pools after one round, as plain numbers (no references to live tensors)."""

    round: int
    block_size: int
    gpu: list[list[tuple[int, int] | None]]  # read_marks of layer 0's key pool
    cpu: list[list[tuple[int, int] | None]]
    gpu_tables: dict[str, list[int]]
    cpu_tables: dict[str, list[int]]
    lens: dict[str, int]  # tokens of each request whose K/V is in the cache
    swapped_out: dict[int, int] = field(default_factory=dict)
    swapped_in: dict[int, int] = field(default_factory=dict)
    copied: dict[int, list[int]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # mark owner -> label (default "s<i>")

    def name(self, owner: int) -> str:
        return self.names.get(owner, f"s{owner}")

    def live(self, device: str, block: int, offset: int) -> str | None:
        """The request whose K/V this slot holds *now* according to the block tables (None: the
        slot is free or past its owner's last token, whatever stale bytes it still holds)."""
        tables = self.gpu_tables if device == "GPU" else self.cpu_tables
        for rid, table in tables.items():
            for i, b in enumerate(table):
                if b == block and i * self.block_size + offset < self.lens[rid]:
                    return rid
        return None


def frame_of(round_no: int, sched: Scheduler, engine: CacheEngine, out: SchedulerOutputs | None = None) -> PoolFrame:
    """Snapshot the live Scheduler and CacheEngine into a PoolFrame."""
    bm = sched.block_manager
    gpu_tables, cpu_tables, lens = {}, {}, {}
    for queue in (sched.running, sched.swapped):
        for group in queue:
            for seq in group.get_seqs():
                if seq.seq_id not in bm.block_tables:
                    continue
                label = group.request_id if group.num_seqs() == 1 else f"{group.request_id}.{seq.seq_id}"
                device = bm.get_block_device(seq)
                (gpu_tables if device is None or device.name == "GPU" else cpu_tables)[label] = bm.get_block_table(seq)
                lens[label] = seq.num_computed_tokens
    out = out or SchedulerOutputs()
    return PoolFrame(round_no, engine.block_size, read_marks(engine.gpu_cache[0][0]),
                     read_marks(engine.cpu_cache[0][0]), gpu_tables, cpu_tables, lens,
                     dict(out.blocks_to_swap_out), dict(out.blocks_to_swap_in),
                     {k: list(v) for k, v in out.blocks_to_copy.items()})


def finish_round(sched: Scheduler, metas: list[SequenceGroupMetadata]) -> None:
    """What the engine does after the model: every scheduled sequence has its chunk computed
    and gains a (made-up) token; those that reached max_tokens finish and free their blocks."""
    for meta in metas:
        for seq in meta.seq_data.values():
            seq.num_computed_tokens += meta.token_chunk_size
            seq.append_token_id(0)
            if seq.get_output_len() >= meta.sampling_params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                sched.free_seq(seq)
    sched.free_finished_seq_groups()


def seed_scheduler(preset: presets.Preset | None = None) -> Scheduler:
    """A real Scheduler holding the seed preset's three requests (token ids are placeholders)."""
    preset = preset or presets.seed_rounds("swap")
    sched = Scheduler(preset.scheduler_config, preset.cache_config)
    for i, r in enumerate(preset.requests):
        seq = Sequence(i, None, list(range(100, 100 + r.prompt_len)), preset.cache_config.block_size)
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len)
        sched.add_seq_group(SequenceGroup(r.request_id, [seq], params, arrival_time=float(i)))
    return sched


def seed_engine(preset: presets.Preset | None = None, num_layers: int = 2, num_kv_heads: int = 2,
                head_dim: int = 4) -> CacheEngine:
    """A small CacheEngine with the seed preset's pools (4 GPU and 4 CPU blocks of 5 tokens)."""
    preset = preset or presets.seed_rounds("swap")
    return CacheEngine(preset.cache_config, num_layers, num_kv_heads, head_dim, torch.float32, "cpu")


def seed_cache_rounds(num_rounds: int = 12) -> list[PoolFrame]:
    """Run the seed story's first ``num_rounds`` rounds on a real Scheduler and CacheEngine."""
    sched, engine = seed_scheduler(), seed_engine()
    worker = MarkingWorker(engine)
    frames = []
    for n in range(1, num_rounds + 1):
        if not sched.has_unfinished_seqs():
            break
        metas, out = sched.schedule()
        worker.execute(metas, out)
        finish_round(sched, metas)
        frames.append(frame_of(n, sched, engine, out))
    return frames


# -- drawing the pools ----------------------------------------------------------------------------


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _pool_row(ax, marks, device: str, frame: PoolFrame, y: float, colors: dict[str, str], gap: float) -> None:
    from matplotlib.patches import Rectangle

    bs = frame.block_size
    for b, block in enumerate(marks):
        x0 = b * (bs + gap)
        for off, mark in enumerate(block):
            live = frame.live(device, b, off)
            if mark is None:
                face, alpha, text = "white", 1.0, ""
            else:
                face = colors.get(frame.name(mark[0]), "#bbbbbb")
                # Stale bytes (a freed block, a reused block's old tail) are drawn faded: they are
                # still in memory, but no block table points a reader at them.
                alpha = 1.0 if live is not None else 0.25
                text = str(mark[1])
            rect = Rectangle((x0 + off, y), 0.92, 0.85, facecolor=face, alpha=alpha, edgecolor="#555",
                             linewidth=0.6)
            rect.set_gid(f"slot:{device}:{b}:{off}")
            ax.add_patch(rect)
            if text:
                t = ax.text(x0 + off + 0.46, y + 0.42, text, ha="center", va="center", fontsize=7,
                            color="black" if alpha == 1.0 else "#777")
                t.set_gid(f"pos:{device}:{b}:{off}")
        owners = [rid for rid, table in (frame.gpu_tables if device == "GPU" else frame.cpu_tables).items()
                  if b in table]
        ax.text(x0 + bs / 2, y - 0.28, f"{device} {b}" + (f" ({','.join(owners)})" if owners else ""),
                ha="center", va="top", fontsize=7, color="#333")


def draw_pools(frame: PoolFrame, ax=None, colors: dict[str, str] | None = None, title: str | None = None):
    """Both pools of one frame: every slot colored by the request whose marked K/V it holds and
    numbered with the token's position; faded when no block table points at it any more."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.6))
    colors = colors or owner_colors([frame.name(o) for o in sorted({m[0] for pool in (frame.gpu, frame.cpu)
                                                                   for block in pool for m in block if m})])
    gap = 0.6
    _pool_row(ax, frame.gpu, "GPU", frame, 1.9, colors, gap)
    _pool_row(ax, frame.cpu, "CPU", frame, 0.0, colors, gap)
    width = max(len(frame.gpu), len(frame.cpu)) * (frame.block_size + gap)
    ax.set_xlim(-0.3, width)
    ax.set_ylim(-0.75, 3.0)
    ax.set_aspect("equal")
    ax.axis("off")
    if title is None:
        moves = []
        if frame.swapped_out:
            moves.append("swap_out " + ", ".join(f"GPU {g}→CPU {c}" for g, c in frame.swapped_out.items()))
        if frame.swapped_in:
            moves.append("swap_in " + ", ".join(f"CPU {c}→GPU {g}" for c, g in frame.swapped_in.items()))
        if frame.copied:
            moves.append("copy " + ", ".join(f"{s}→{d}" for s, ds in frame.copied.items() for d in ds))
        title = f"after round {frame.round}" + (": " + "; ".join(moves) if moves else "")
    ax.set_title(title, loc="left", fontsize=9)
    return ax.figure


SWAP_FIGURE_ROUNDS = (2, 3, 8, 12)


@figure("06_swap_pools")
def fig_swap_pools(frames: list[PoolFrame] | None = None, rounds: tuple[int, ...] = SWAP_FIGURE_ROUNDS):
    """The seed story's pools after the rounds that move blocks: s2 leaves in round 3, s1 in
    round 8, s2 comes back in round 12 into a different GPU block."""
    frames = frames or seed_cache_rounds(max(rounds))
    by_round = {f.round: f for f in frames}
    plt = _plt()
    fig, axes = plt.subplots(len(rounds), 1, figsize=(9.5, 2.25 * len(rounds)))
    colors = owner_colors(["s0", "s1", "s2"])
    for ax, r in zip(axes, rounds):
        draw_pools(by_round[r], ax=ax, colors=colors)
    fig.suptitle("Marked K/V in the CacheEngine's pools (numbers: token positions; faded: stale bytes)",
                 fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


# -- copy-on-write -------------------------------------------------------------------------------


@dataclass
class CopyOnWriteStory:
    before: PoolFrame  # after the prefill: both samples share the prompt's blocks
    after: PoolFrame  # after the copy and each sample's first token
    copies: dict[int, list[int]]  # the worker's blocks_to_copy
    appended: dict[str, tuple[int, int] | None]  # what append_slot returned for each sample
    engine: CacheEngine


def copy_on_write_story(block_size: int = 4, prompt_len: int = 6) -> CopyOnWriteStory:
    """A request sampled twice (n=2) on a real BlockSpaceManager and CacheEngine: the prompt is
    prefilled once into blocks both samples share; then each sample appends its first token.
    The first finds its last block shared and gets a copy (``append_slot`` returns ``(src, dst)``);
    the second is then the block's only owner and writes in place."""
    bm = BlockSpaceManager(block_size, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    engine = CacheEngine(CacheConfig(block_size=block_size, num_gpu_blocks=4, num_cpu_blocks=0), 2, 2, 4,
                         torch.float32, "cpu")
    parent = Sequence(0, None, list(range(prompt_len)), block_size)
    group = SequenceGroup("r", [parent], SamplingParams(n=2, temperature=1.0), arrival_time=0.0)
    bm.allocate(group)
    write_marked(engine, 0, bm.get_block_table(parent), 0, prompt_len)  # the prefill writes the prompt once
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    samples = {"r.0": parent, "r.1": child}
    names = {0: "prompt", 1: "r.0", 2: "r.1"}

    def frame(n: int, length: int) -> PoolFrame:
        tables = {label: bm.get_block_table(seq) for label, seq in samples.items()}
        return PoolFrame(n, block_size, read_marks(engine.gpu_cache[0][0]), [], tables, {},
                         dict.fromkeys(tables, length), names=names)

    before = frame(1, prompt_len)
    copies: dict[int, list[int]] = {}
    appended = {}
    for label, seq in samples.items():
        seq.append_token_id(1000 + seq.seq_id)  # the sample's first token
        appended[label] = bm.append_slot(seq)
        if appended[label] is not None:
            src, dst = appended[label]
            copies.setdefault(src, []).append(dst)
    engine.copy(copies)  # the worker copies first, then the model writes each sample's token
    for owner, seq in enumerate(samples.values(), start=1):
        write_marked(engine, owner, bm.get_block_table(seq), prompt_len, prompt_len + 1)
    after = frame(2, prompt_len + 1)
    after.copied = copies
    return CopyOnWriteStory(before, after, copies, appended, engine)


@figure("06_copy_on_write")
def fig_copy_on_write(story: CopyOnWriteStory | None = None):
    story = story or copy_on_write_story()
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.6))
    colors = owner_colors(["prompt", "r.0", "r.1"])
    shared = sorted(set(story.before.gpu_tables["r.0"]))
    draw_pools(story.before, ax=axes[0], colors=colors,
               title=f"after the prefill: both samples share blocks {', '.join(map(str, shared))}")
    draw_pools(story.after, ax=axes[1], colors=colors,
               title=f"after copy {story.copies} and each sample's first token")
    for ax in axes:
        ax.set_ylim(1.5, 3.0)  # there is no CPU pool in this story
    fig.tight_layout()
    return fig


# -- sizing a device -----------------------------------------------------------------------------

GiB = 2**30


def budget_parts(total: int, used: int, activation: int, cache_bytes: int, utilization: float) -> dict[str, int]:
    """The device split four ways (what is left over, less than one block, is not drawn)."""
    return {"weights + context": used, "activations": activation, "KV cache": cache_bytes,
            "headroom (1 − utilization)": total - int(total * utilization)}


@figure("06_memory_budget")
def fig_memory_budget(total: int = 80 * GiB, used: int = int(13.5e9) + GiB // 2, activation: int = 2 * GiB,
                      shape: tuple[int, int, int] = (32, 32, 128), dtype: torch.dtype = torch.float16,
                      utilization: float = 0.9, block_size: int = 16):
    """Where a device's memory goes once the CUDA sizing rule has run (by default: Llama-2-7B in
    float16 on an 80 GiB card), computed by ``profile_num_gpu_blocks`` on a pretend device."""
    with pretend_gpu(total, total - used):
        blocks = CacheEngine.profile_num_gpu_blocks(block_size, *shape, dtype, utilization, activation)
    cache_bytes = blocks * CacheEngine.get_cache_block_size(block_size, *shape, dtype)
    parts = budget_parts(total, used, activation, cache_bytes, utilization)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 1.7))
    left = 0
    for (name, size), color in zip(parts.items(), ["#9c755f", "#edc948", "#4e79a7", "#dddddd"]):
        bar = ax.barh(0, size / GiB, left=left / GiB, color=color, edgecolor="white",
                      label=f"{name}: {size / GiB:.1f} GiB")
        bar.patches[0].set_gid(f"part:{name}")
        left += size
    ax.set_xlim(0, total / GiB)
    ax.set_yticks([])
    ax.set_xlabel(f"GiB of a {total / GiB:g} GiB device")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.5), frameon=False)
    ax.set_title(f"Where the device's memory goes: {blocks:,} blocks of {block_size} tokens "
                 f"(utilization {utilization:g})", loc="left", fontsize=10)
    return fig


# -- pretending to be a GPU (for the sizing rule) -----------------------------------------------


@contextlib.contextmanager
def pretend_gpu(total_bytes: int, free_bytes: int) -> Iterator[None]:
    """Make ``torch.cuda`` report a device with this much memory, so the CUDA sizing rule
    (``CacheEngine.profile_num_gpu_blocks``) can be run on a machine without one."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "mem_get_info", return_value=(int(free_bytes), int(total_bytes))):
        yield


# -- the split-x key layout of vLLM's CUDA kernel ---------------------------------------------------


def split_x(dtype: torch.dtype) -> int:
    """Elements in 16 bytes: 4 for float32, 8 for float16/bfloat16, 16 for 8-bit types."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def to_split_x(k_cache: torch.Tensor, x: int) -> torch.Tensor:
    """tinyserve's ``[num_blocks, block_size, num_kv_heads, head_dim]`` keys rearranged into
    vLLM's ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]`` (a contiguous copy)."""
    nb, bs, heads, head_dim = k_cache.shape
    if head_dim % x:
        raise ValueError(f"head_dim {head_dim} is not a multiple of x={x}")
    return k_cache.view(nb, bs, heads, head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()


def from_split_x(k_split: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_split_x``."""
    nb, heads, chunks, bs, x = k_split.shape
    return k_split.permute(0, 3, 1, 2, 4).reshape(nb, bs, heads, chunks * x)


def plain_offset(block: int, token: int, head: int, d: int, block_size: int, num_heads: int,
                 head_dim: int) -> int:
    """Element offset of key channel ``d`` of (block, token, head) in tinyserve's layout."""
    return ((block * block_size + token) * num_heads + head) * head_dim + d


def split_x_offset(block: int, token: int, head: int, d: int, block_size: int, num_heads: int,
                   head_dim: int, x: int) -> int:
    """The same element's offset in the split-x layout: channels are cut into ``x``-wide pieces,
    and piece ``d // x`` of every token of the block lies side by side."""
    chunk, inner = divmod(d, x)
    return (((block * num_heads + head) * (head_dim // x) + chunk) * block_size + token) * x + inner


def draw_split_x(block_size: int = 4, num_heads: int = 2, head_dim: int = 8, x: int = 4, head: int = 0,
                 chunk: int = 0):
    """One block's keys as memory, in both layouts: each cell is one element, colored by token.
    Outlined: what one load step reads when thread ``t`` fetches the ``chunk``-th x-wide piece of
    token ``t``'s key for ``head`` (scattered in the plain layout, one contiguous run in split-x)."""
    plt = _plt()
    from matplotlib.patches import Rectangle

    n = block_size * num_heads * head_dim
    token_colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7"]
    layouts = {
        "tinyserve [block, token, head, d]": lambda t, h, d: plain_offset(0, t, h, d, block_size, num_heads,
                                                                        head_dim),
        f"vLLM split-x [block, head, d/x, token, x], x={x}": lambda t, h, d: split_x_offset(
            0, t, h, d, block_size, num_heads, head_dim, x),
    }
    cols = min(n, 32)
    rows_per = -(-n // cols)
    fig, axes = plt.subplots(2, 1, figsize=(0.36 * cols + 1.2, 0.45 * rows_per * 2 + 1.6))
    for ax, (name, offset) in zip(axes, layouts.items()):
        read = []
        for t in range(block_size):
            for h in range(num_heads):
                for d in range(head_dim):
                    off = offset(t, h, d)
                    r, c = divmod(off, cols)
                    hot = h == head and d // x == chunk
                    rect = Rectangle((c, -r), 0.94, 0.9, facecolor=token_colors[t % len(token_colors)],
                                     alpha=1.0 if h == head else 0.35, edgecolor="black" if hot else "white",
                                     linewidth=2.0 if hot else 0.5, zorder=3 if hot else 1)
                    rect.set_gid(f"elem:{off}:{'hot' if hot else 'cold'}")
                    ax.add_patch(rect)
                    ax.text(c + 0.47, -r + 0.45, f"{d}", ha="center", va="center", fontsize=6, color="white")
                    if hot:
                        read.append(off)
        for r in range(rows_per):
            ax.text(-0.3, -r + 0.45, f"+{r * cols}", ha="right", va="center", fontsize=7, color="#555")
        read.sort()
        runs = 1 + sum(1 for a, b in zip(read, read[1:]) if b != a + 1)
        where = "one contiguous run" if runs == 1 else f"{runs} separate runs"
        ax.set_xlim(-1.6, cols + 0.2)
        ax.set_ylim(-rows_per + 0.85, 1.0)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{name}: the outlined {len(read)} elements lie in {where}", loc="left", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, facecolor=token_colors[t]) for t in range(block_size)]
    fig.legend(handles, [f"token {t}" for t in range(block_size)], loc="lower center", ncol=block_size,
               fontsize=8, frameon=False)
    fig.suptitle(f"One block's keys in memory, element by element, {cols} to a row (numbers: channel d; "
                 f"faded: heads other than {head})", fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


@figure("06_split_x_layout")
def fig_split_x_layout():
    return draw_split_x()


def block_bytes_rows(shapes: dict[str, tuple[int, int, int]], dtypes: tuple[torch.dtype, ...],
                     block_size: int = 16) -> list[dict]:
    """Bytes of one block (K and V, every layer) for each model shape and dtype."""
    rows = []
    for name, (layers, kv_heads, head_dim) in shapes.items():
        for dtype in dtypes:
            per_block = CacheEngine.get_cache_block_size(block_size, layers, kv_heads, head_dim, dtype)
            rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "block_bytes": per_block,
                         "per_token": per_block // block_size})
    return rows
