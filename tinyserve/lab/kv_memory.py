"""Chapter 01's measurements (no drawing): how big the KV cache is, and how much of it reservation wastes.

Two things live here. ``kv_bytes_per_token`` is the arithmetic of the cache's size. And a small
memory simulator runs one random workload (requests arrive, grow one token per step, finish)
through three ways of handing out KV memory from one fixed arena:

- ``"max_len"``: contiguous, every request reserves ``max_model_len`` slots up front;
- ``"max_tokens"``: contiguous, every request reserves ``prompt + max_tokens`` slots (first fit);
- ``"paged"``: blocks of ``block_size`` slots from the package's real ``BlockAllocator``,
  taken one at a time as a sequence grows.

At every step it counts each slot of the arena as used (holds a token's K/V), reserved but
unused (internal fragmentation), free but stranded in holes too small for the waiting request
(external fragmentation), or free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from tinyserve.block import BlockAllocator, Device, PhysicalTokenBlock

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True)
class KVShape:
    """The three numbers of a model that decide the size of its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


# Public configs. SmolLM2 is the book's default model (grouped-query attention: 9 query heads
# share 3 KV heads); Llama-2-7B has one KV head per query head; Llama-3-8B shows what GQA saves.
MODELS = {
    "SmolLM2-135M": KVShape(num_layers=30, num_kv_heads=3, head_dim=64),
    "Llama-2-7B": KVShape(num_layers=32, num_kv_heads=32, head_dim=128),
    "Llama-3-8B": KVShape(num_layers=32, num_kv_heads=8, head_dim=128),
}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of cache one token occupies: a key and a value vector (the 2), per KV head, per layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_table(dtypes: tuple[str, ...] = ("float16", "float32"), context: int = 2048) -> list[dict]:
    """One row per model and dtype: bytes per token and the cache of one ``context``-token sequence."""
    rows = []
    for name, s in MODELS.items():
        for dtype in dtypes:
            per_token = kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, DTYPE_BYTES[dtype])
            rows.append({"model": name, "dtype": dtype, "bytes_per_token": per_token,
                         "KiB_per_token": per_token / 1024, "MiB_per_seq": per_token * context / 2**20})
    return rows


# -- the memory simulator -----------------------------------------------------------------

SCHEMES = ("max_len", "max_tokens", "paged")
SCHEME_LABELS = {
    "max_len": "contiguous,\nreserve max_model_len",
    "max_tokens": "contiguous,\nreserve prompt+max_tokens",
    "paged": "paged,\nblocks on demand",
}


@dataclass
class WorkloadRequest:
    """A request of the random workload. It stops after ``output_len`` tokens, which the server
    cannot know in advance: it only knows the cap ``max_tokens``."""

    rid: int
    prompt_len: int
    max_tokens: int
    output_len: int
    arrival: int


def fragmentation_workload(num_requests: int = 150, max_model_len: int = 512, seed: int = 0,
                    arrival_rate: float = 0.5) -> list[WorkloadRequest]:
    """Prompts of 8..128 tokens, caps of 32..max_model_len-prompt, outputs stopping anywhere
    up to the cap; arrivals are a Poisson process of ``arrival_rate`` requests per step."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(num_requests):
        prompt = rng.randint(8, 128)
        cap = rng.randint(32, max_model_len - prompt)
        reqs.append(WorkloadRequest(i, prompt, cap, rng.randint(1, cap), int(t)))
        t += rng.expovariate(arrival_rate)
    return reqs


@dataclass
class FragmentationResult:
    """What one scheme did with the arena, step by step (arrays are slot counts per step)."""

    scheme: str
    arena_slots: int
    used: np.ndarray
    internal: np.ndarray
    external: np.ndarray
    free: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    steps: int
    preemptions: int = 0
    per_seq_internal_max: int = 0  # the largest reserved-but-unused count of any one sequence
    extra: dict = field(default_factory=dict)

    def shares(self, only_when_waiting: bool = False) -> dict[str, float]:
        """Mean share of the arena in each state over the run, or only over the steps when some
        request was kept waiting (when memory that holds no token is really lost)."""
        mask = self.waiting > 0 if only_when_waiting else np.ones(len(self.used), dtype=bool)
        total = self.arena_slots * max(int(mask.sum()), 1)
        return {k: float(getattr(self, k)[mask].sum()) / total for k in ("used", "internal", "external", "free")}

    def waste_of_reserved(self) -> float:
        """Of all the slots held by requests, the share that held no token."""
        held = self.used.sum() + self.internal.sum()
        return float(self.internal.sum() / held) if held else 0.0


class FirstFitArena:
    """A contiguous allocator: each reservation is one run of slots, placed in the first hole
    that fits. Freed runs leave holes, which is where external fragmentation comes from."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.runs: dict[int, tuple[int, int]] = {}  # owner -> (start, length)

    def holes(self) -> list[int]:
        """Lengths of the free runs, in address order."""
        out, pos = [], 0
        for start, length in sorted(self.runs.values()):
            if start > pos:
                out.append(start - pos)
            pos = start + length
        if pos < self.size:
            out.append(self.size - pos)
        return out

    def reserve(self, owner: int, length: int) -> bool:
        """Place ``length`` slots in the first hole that fits; False (and nothing changes) if none does."""
        pos = 0
        for start, run in sorted(self.runs.values()):
            if start - pos >= length:
                break
            pos = start + run
        else:
            if self.size - pos < length:
                return False
        self.runs[owner] = (pos, length)
        return True

    def release(self, owner: int) -> None:
        del self.runs[owner]


def _run_contiguous(reqs: list[WorkloadRequest], arena_slots: int, max_model_len: int,
                    scheme: str) -> FragmentationResult:
    arena = FirstFitArena(arena_slots)
    pending = sorted(reqs, key=lambda r: (r.arrival, r.rid))
    waiting: list[WorkloadRequest] = []
    running: dict[int, list] = {}  # rid -> [request, tokens held, reserved]
    rows: list[tuple[int, ...]] = []
    worst, step = 0, 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.pop(0))
        # FCFS admission: stop at the first request that does not fit (no overtaking).
        while waiting:
            r = waiting[0]
            need = max_model_len if scheme == "max_len" else r.prompt_len + r.max_tokens
            if not arena.reserve(r.rid, need):
                break
            running[r.rid] = [r, r.prompt_len, need]
            waiting.pop(0)
        for entry in running.values():
            entry[1] += 1  # the slot of the token this step produces
        used = sum(e[1] for e in running.values())
        reserved = sum(e[2] for e in running.values())
        worst = max([worst] + [e[2] - e[1] for e in running.values()])
        free = arena_slots - reserved
        stranded = 0
        if waiting:
            head = waiting[0]
            need = max_model_len if scheme == "max_len" else head.prompt_len + head.max_tokens
            stranded = sum(h for h in arena.holes() if h < need)
        rows.append((used, reserved - used, stranded, free - stranded, len(running), len(waiting)))
        for rid, (r, held, _) in list(running.items()):
            if held - r.prompt_len >= r.output_len:
                arena.release(rid)
                del running[rid]
        step += 1
    return _result(scheme, arena_slots, rows, 0, worst)


def _run_paged(reqs: list[WorkloadRequest], num_blocks: int, block_size: int) -> FragmentationResult:
    alloc = BlockAllocator(Device.GPU, block_size, num_blocks)
    pending = sorted(reqs, key=lambda r: (r.arrival, r.rid))
    waiting: list[WorkloadRequest] = []
    # rid -> [request, tokens held, blocks]; dict order is admission order (newest last).
    running: dict[int, list] = {}
    rows: list[tuple[int, ...]] = []
    worst, step, preemptions = 0, 0, 0

    def release(rid: int) -> None:
        for b in running.pop(rid)[2]:
            alloc.free(b)

    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.pop(0))
        while waiting:
            r = waiting[0]
            need = -(-r.prompt_len // block_size)
            # Keep one free block per running sequence, so admitting does not force an
            # immediate preemption when they grow (the role of vLLM's watermark).
            if alloc.get_num_free_blocks() - need < len(running) + 1:
                break
            blocks: list[PhysicalTokenBlock] = [alloc.allocate() for _ in range(need)]
            running[r.rid] = [r, r.prompt_len, blocks]
            waiting.pop(0)
        for rid in list(running):
            if rid not in running:
                continue  # preempted earlier in this step
            entry = running[rid]
            if entry[1] == len(entry[2]) * block_size:
                while alloc.get_num_free_blocks() == 0:
                    # Out of memory: preempt the newest request (recompute: it starts over).
                    victim = next(reversed(running))
                    waiting.insert(0, running[victim][0])
                    release(victim)
                    preemptions += 1
                    if victim == rid:
                        break
                if rid not in running:
                    continue
                entry[2].append(alloc.allocate())
            entry[1] += 1
        used = sum(e[1] for e in running.values())
        held = sum(len(e[2]) for e in running.values()) * block_size
        worst = max([worst] + [len(e[2]) * block_size - e[1] for e in running.values()])
        # Any free block fits any request's next block: paging has no external fragmentation.
        rows.append((used, held - used, 0, num_blocks * block_size - held, len(running), len(waiting)))
        for rid, (r, n, _) in list(running.items()):
            if n - r.prompt_len >= r.output_len:
                release(rid)
        step += 1
    return _result("paged", num_blocks * block_size, rows, preemptions, worst,
                   extra={"block_size": block_size, "leaked_blocks": num_blocks - alloc.get_num_free_blocks()})


def _result(scheme: str, arena_slots: int, rows: list, preemptions: int, worst: int,
            extra: dict | None = None) -> FragmentationResult:
    a = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return FragmentationResult(scheme, arena_slots, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5],
                               steps=len(a), preemptions=preemptions, per_seq_internal_max=worst,
                               extra=extra or {})


def measure_fragmentation(reqs: list[WorkloadRequest] | None = None, arena_slots: int = 4096,
                          max_model_len: int = 512, block_size: int = 16) -> dict[str, FragmentationResult]:
    """Run the same workload through all three schemes over an arena of ``arena_slots`` slots."""
    if arena_slots % block_size:
        raise ValueError(f"arena_slots ({arena_slots}) must be a multiple of block_size ({block_size})")
    reqs = reqs if reqs is not None else fragmentation_workload(max_model_len=max_model_len)
    too_long = [r.rid for r in reqs if r.prompt_len + r.max_tokens > max_model_len]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} exceed max_model_len={max_model_len}")
    return {
        "max_len": _run_contiguous(reqs, arena_slots, max_model_len, "max_len"),
        "max_tokens": _run_contiguous(reqs, arena_slots, max_model_len, "max_tokens"),
        "paged": _run_paged(reqs, arena_slots // block_size, block_size),
    }
