"""Chapter 06's CacheEngine filled with *marked* K/V, so its tensors say what they hold.

A pool of floats says nothing to a reader. So here the key of sequence ``s<i>``'s token at
position ``p`` is ``100 * (i + 1) + p`` plus a small fraction that differs for every layer, head
and channel, and its value is minus its key. Reading one number back tells whose token a slot
holds and which, and because every element is distinct a bit-for-bit comparison after a swap
means something.

- ``MarkingWorker`` plays the Worker's part without a model: it carries out the scheduler's
  cache orders on a real CacheEngine, then writes a marked K/V for every scheduled token.
- ``seed_cache_rounds`` drives the real Scheduler over the s0/s1/s2 preset with it and keeps a
  ``PoolFrame`` (plain numbers) after each round; ``tinyserve.viz.cache.draw_pools`` draws one.
- ``copy_on_write_story`` shows the ``copy`` order on a request sampled twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinyserve import presets
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceGroupMetadata

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


def finish_round(sched: Scheduler, out: SchedulerOutputs) -> list[str]:
    """What the engine does after the model, with a made-up token (0) for every sequence that
    reached its end: the scheduler's own ``postprocess``. Returns the requests that finished."""
    return sched.postprocess(out, lambda group, seq: 0)


def seed_scheduler(preset: presets.Preset | None = None) -> Scheduler:
    """A real Scheduler holding the seed preset's three requests (token ids are placeholders)."""
    preset = preset or presets.seed_rounds("swap")
    sched = Scheduler(preset.scheduler_config, preset.cache_config)
    for i, r in enumerate(preset.requests):
        seq = Sequence(i, None, list(range(100, 100 + r.prompt_len)), preset.cache_config.block_size)
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len)
        sched.add_seq_group(SequenceGroup(r.request_id, [seq], params, arrival_time=float(i)))
    return sched


def seed_cache_engine(preset: presets.Preset | None = None, num_layers: int = 2, num_kv_heads: int = 2,
                head_dim: int = 4) -> CacheEngine:
    """A small CacheEngine with the seed preset's pools (4 GPU and 4 CPU blocks of 5 tokens)."""
    preset = preset or presets.seed_rounds("swap")
    return CacheEngine(preset.cache_config, num_layers, num_kv_heads, head_dim, torch.float32, "cpu")


def seed_cache_rounds(num_rounds: int = 12) -> list[PoolFrame]:
    """Run the seed story's first ``num_rounds`` rounds on a real Scheduler and CacheEngine."""
    sched, engine = seed_scheduler(), seed_cache_engine()
    worker = MarkingWorker(engine)
    frames = []
    for n in range(1, num_rounds + 1):
        if not sched.has_unfinished_seqs():
            break
        metas, out = sched.schedule()
        worker.execute(metas, out)
        finish_round(sched, out)
        frames.append(frame_of(n, sched, engine, out))
    return frames


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
