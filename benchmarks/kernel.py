"""GPU benchmark: the Triton paged decode kernel against batched PyTorch and the memory floor.

Decoding one token reads every cached K/V row of every sequence once, and does little arithmetic
per byte, so its floor is the time to stream those bytes from GPU memory. For each shape this
script times the Triton kernel and ``batched.paged_decode_attention`` (the ``torch-batched``
backend's decode, what the engine runs without Triton; "ref" below) with CUDA events (the
median over repetitions after warm-up), and reports the kernel's achieved bandwidth

    K/V bytes = sum over sequences of context_len * num_kv_heads * head_dim * 2 (K and V) * itemsize

divided by the time, as a share of the bandwidth a large device-to-device copy reaches on the same
GPU (the practical ceiling, a little under the datasheet number).

    python benchmarks/kernel.py                 # the full grid (tens of minutes)
    python benchmarks/kernel.py --quick         # a reduced grid, about 1-2 minutes on an H200
    python benchmarks/kernel.py --interpret-smoke   # a tiny run through Triton's interpreter (CPU)

It prints a table and writes a CSV (``--out``, default ``benchmarks/results/kernel.csv``). With
``--quick`` it also sweeps the kernel's two tuning knobs (tokens per tile, warps) on two shapes
and writes them next to the CSV (``*_tune.csv``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))

from tinyserve.attention import batched  # noqa: E402
from tinyserve.attention import triton_paged as tp  # noqa: E402
from tinyserve.attention.triton_env import triton  # noqa: E402

BLOCK_SIZE = 16
NUM_HEADS = 32  # query heads of a Llama-3-8B-sized layer; GQA g gives NUM_HEADS // g KV heads
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Grid:
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    groups: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]


FULL = Grid(("bf16", "fp16"), (64, 128), (1, 4, 8), (1, 4, 16, 64, 256), (128, 512, 2048, 8192, 32768))
# Quick: head_dim 128 in both dtypes, head_dim 64 in bf16 only; short, middle and long contexts.
QUICK = [Grid(("bf16", "fp16"), (128,), (1, 4, 8), (1, 16, 256), (128, 2048, 32768)),
         Grid(("bf16",), (64,), (1, 4, 8), (1, 16, 256), (128, 2048, 32768))]
SMOKE = Grid(("bf16", "fp16"), (64,), (8,), (2,), (40, 300))


class Timer:
    """Median time of ``fn`` in microseconds.

    On CUDA each repetition is bracketed by events and preceded by a write of a buffer larger
    than the L2 cache: in a real model the K/V of the other layers evicts this layer's K/V
    between two decode steps, so a warm L2 would overstate the bandwidth. That write also keeps
    the GPU busy while Python launches the kernel, so launch latency stays out of the numbers.
    """

    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.flush = torch.empty(max(2 * l2, 256 << 20), dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (each byte counts once read, once
    written): the ceiling a memory-bound kernel can hope to approach."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = Timer(device, warmup=3, reps=10)(partial(dst.copy_, src))
    return 2 * nbytes / (us * 1e-6)


def make_case(batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, seed: int = 0):
    """A decode batch whose sequences all hold ``context`` tokens, over shuffled physical blocks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device).normal_(generator=gen)
    v_cache = torch.empty(shape, dtype=dtype, device=device).normal_(generator=gen)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.empty(batch, NUM_HEADS, head_dim, dtype=dtype, device=device).normal_(generator=gen)
    return q, k_cache, v_cache, tables, lens


def kv_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return batch * context * num_kv_heads * head_dim * 2 * itemsize


def reference_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Rough peak memory of the reference: it gathers K and V into dense copies and builds a
    boolean mask and float32 scores of [batch, heads, context]."""
    width = math.ceil(context / BLOCK_SIZE) * BLOCK_SIZE
    return kv_bytes(batch, width, num_kv_heads, head_dim, dtype) + batch * NUM_HEADS * width * (1 + 4 + 4)


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


class CsvLog:
    """Rows are written as they come, so a run stopped by a timeout still leaves its results."""

    def __init__(self, path: Path, extra: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.extra, self.file, self.writer = path, extra, path.open("w", newline=""), None

    def write(self, row: dict) -> None:
        row = {**row, **self.extra}
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row))
            self.writer.writeheader()
        self.writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        print(f"wrote {self.path}")


def run_grid(grids: list[Grid], device: torch.device, timer: Timer, copy_bw: float,
             cache_budget: int, ref_budget: int, log: CsvLog) -> list[dict]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    rows = []
    header = (f"{'dtype':>5} {'hd':>4} {'gqa':>3} {'kvh':>3} {'batch':>5} {'context':>7} {'splits':>6} "
              f"{'KV MiB':>8} {'triton us':>10} {'GB/s':>7} {'% copy':>6} {'ref us':>10} {'speedup':>7}")
    print(header)
    print("-" * len(header))
    for grid in grids:
        for name, head_dim, group, batch, context in itertools.product(
                grid.dtypes, grid.head_dims, grid.groups, grid.batches, grid.contexts):
            dtype = DTYPES[name]
            num_kv_heads = NUM_HEADS // group
            nbytes = kv_bytes(batch, context, num_kv_heads, head_dim, dtype)
            row = dict(dtype=name, head_dim=head_dim, num_heads=NUM_HEADS, num_kv_heads=num_kv_heads,
                       gqa=group, batch=batch, context=context, block_size=BLOCK_SIZE,
                       num_splits=tp.choose_num_splits(batch, num_kv_heads, context, sms),
                       kv_bytes=nbytes, triton_us=None, triton_gbps=None, pct_of_copy=None,
                       ref_us=None, ref_gbps=None, speedup=None, note="")
            if nbytes > cache_budget:
                row["note"] = "skipped: cache larger than --cache-gib"
                rows.append(row)
                log.write(row)
                continue
            q, k_cache, v_cache, tables, lens = make_case(batch, context, num_kv_heads, head_dim, dtype, device)
            args = (q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
            us = timer(partial(tp.paged_decode_attention, *args, max_context_len=context))
            row.update(triton_us=us, triton_gbps=nbytes / us / 1e3, pct_of_copy=100 * nbytes / (us * 1e-6) / copy_bw)
            if reference_bytes(batch, context, num_kv_heads, head_dim, dtype) > ref_budget:
                row["note"] = "reference n/a: would need more than --ref-gib"
            else:
                try:
                    ref_us = timer(partial(batched.paged_decode_attention, *args))
                    row.update(ref_us=ref_us, ref_gbps=nbytes / ref_us / 1e3, speedup=ref_us / us)
                except torch.cuda.OutOfMemoryError:
                    row["note"] = "reference n/a: out of memory"
            del q, k_cache, v_cache, tables, lens, args  # free this shape before the next one
            rows.append(row)
            log.write(row)
            print(f"{name:>5} {head_dim:>4} {group:>3} {num_kv_heads:>3} {batch:>5} {context:>7} "
                  f"{row['num_splits']:>6} {nbytes / 2**20:>8.1f} {fmt(row['triton_us'], '10.1f')} "
                  f"{fmt(row['triton_gbps'], '7.0f')} {fmt(row['pct_of_copy'], '6.1f')} "
                  f"{fmt(row['ref_us'], '>10.1f')} {fmt(row['speedup'], '>7.2f')}  {row['note']}", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_tuning(device: torch.device, timer: Timer, copy_bw: float, log: CsvLog) -> list[dict]:
    """Time every (tokens per tile, warps) pair on a split-context shape and a full-batch one."""
    shapes = [(16, 4096), (256, 2048)]  # (batch, context), bf16, head_dim 128, GQA 4
    rows = []
    print(f"\n{'batch':>5} {'context':>7} {'tile':>4} {'warps':>5} {'us':>9} {'% copy':>6}")
    for batch, context in shapes:
        num_kv_heads, head_dim, dtype = NUM_HEADS // 4, 128, torch.bfloat16
        q, k_cache, v_cache, tables, lens = make_case(batch, context, num_kv_heads, head_dim, dtype, device)
        nbytes = kv_bytes(batch, context, num_kv_heads, head_dim, dtype)
        for tile, warps in itertools.product((16, 32, 64), (2, 4, 8)):
            us = timer(partial(tp.paged_decode_attention, q, k_cache, v_cache, tables, lens, 0.1,
                               max_context_len=context, tile_tokens=tile, num_warps=warps))
            pct = 100 * nbytes / (us * 1e-6) / copy_bw
            rows.append(dict(batch=batch, context=context, dtype="bf16", head_dim=head_dim, gqa=4,
                             tile_tokens=tile, num_warps=warps, triton_us=us, pct_of_copy=pct))
            log.write(rows[-1])
            print(f"{batch:>5} {context:>7} {tile:>4} {warps:>5} {us:>9.1f} {pct:>6.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced grid (~1-2 min on an H200) + tuning sweep")
    mode.add_argument("--interpret-smoke", action="store_true",
                      help="tiny grid through Triton's interpreter on the CPU: checks the script, not speed")
    parser.add_argument("--no-tune", action="store_true", help="skip the tuning sweep of --quick")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kernel.csv")
    parser.add_argument("--cache-gib", type=float, default=24.0, help="skip shapes whose K/V exceed this")
    parser.add_argument("--ref-gib", type=float, default=16.0, help="skip the reference above this estimate")
    args = parser.parse_args(argv)

    if args.interpret_smoke:
        if not tp.INTERPRET:
            sys.exit("--interpret-smoke needs the interpreter (no CUDA, or TRITON_INTERPRET=1)")
        device, grids, timer = torch.device("cpu"), [SMOKE], Timer(torch.device("cpu"), warmup=1, reps=2)
    elif not torch.cuda.is_available() or tp.INTERPRET:
        sys.exit("benchmarks/kernel.py times compiled kernels and needs a CUDA GPU "
                 "(use --interpret-smoke to check the script on a CPU)")
    else:
        device = torch.device("cuda")
        grids = QUICK if args.quick else [FULL]
        timer = Timer(device, warmup=3, reps=10 if args.quick else 30)
        print(torch.cuda.get_device_name(device), f"torch {torch.__version__}",
              f"triton {triton.__version__}")

    copy_bw = copy_bandwidth(device)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (bytes read + bytes written per second)\n")
    extra = dict(copy_gbps=copy_bw / 1e9)
    log = CsvLog(args.out, extra)
    run_grid(grids, device, timer, copy_bw, int(args.cache_gib * 2**30), int(args.ref_gib * 2**30), log)
    log.close()
    if args.quick and not args.no_tune:
        log = CsvLog(args.out.with_name(args.out.stem + "_tune.csv"), extra)
        run_tuning(device, timer, copy_bw, log)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
