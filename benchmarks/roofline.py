"""How close a decode step comes to the machine's limit (the roofline).

A decode step at batch B does about ``2 * B * P`` FLOPs over the P parameters of its matmuls
(plus attention over every sequence's context), and must read every weight once plus every
sequence's cached K/V. The machine can do at most ``peak_flops`` and stream at most
``bandwidth`` bytes a second, so no step can beat

    floor(B) = max(flops(B) / peak_flops, bytes(B) / bandwidth)

This script measures both limits on this machine, in each dtype (a large matmul in float32
and in bfloat16; a large tensor copy, counted as bytes read + bytes written), counts the
FLOPs and bytes of a SmolLM2 decode step at batch 1, 16, 32 and 64, times tinyserve's whole
engine step (and transformers' decode forward with its KV cache, at the same dtype) at those
batches, and reports ``floor / measured``: the fraction of the roofline each step achieves, both
of the roofline of the dtype it ran in and of the machine's best one (its fastest dtype's peak,
with that dtype's bytes). A CPU without native bf16 (no ``avx512_bf16`` or AMX) emulates it, and
its bf16 peak falls far below its float32 one; there the best roofline is float32's. At batch 1
a step is bound by memory (the weights are read for one token); by batch 32 on a CPU it is bound
by compute.

Not counted: activations (kilobytes next to megabytes of weights), norms, rotary, softmax and
other elementwise work; they cost time but are not part of the floor.

    python benchmarks/roofline.py                   # ~6 minutes on 2 cores, both dtypes
    python benchmarks/roofline.py --batches 1 4 --steps 3 --model <dir>

Results go to ``roofline.csv`` in ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import RESULTS_DIR, machine, table  # noqa: E402
from profile_step import DTYPES, build_llm, fill, take_turns, transformers_decoder  # noqa: E402

from tinyserve.lab import perf  # noqa: E402


def peak_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s in ``dtype`` of the best of ``repeats`` ``[n, n] x [n, n]^T`` products, taken as
    ``F.linear``: the layout of every projection in the model. (Without native bf16, a square
    bf16 ``torch.mm`` falls back to a path some 20x slower still, which no step of the model takes.)"""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    F.linear(a, b)  # warm-up: thread pool, packing buffers
    best = min(_timed(lambda: F.linear(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of the best of ``repeats`` copies of a ``mib`` MiB tensor (read + written)."""
    src = torch.empty(mib * 2**18)  # 4-byte floats
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_step_cost(config, batch: int, context: int, bytes_per_value: int = 4) -> tuple[float, float]:
    """FLOPs and bytes of one decode step: ``batch`` sequences, each ``context`` tokens long
    (counting the new one). Matmul weights and the LM head are read once for the whole batch;
    each sequence reads its own K/V."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter  # qkv, o, gate/up, down
    matmul_params = layers * per_layer + config.vocab_size * h  # + the LM head
    attention_flops = layers * batch * 4 * heads * d * context  # q.k over the context, then p.v
    flops = 2 * batch * matmul_params + attention_flops
    kv_bytes = layers * batch * 2 * kv_heads * d * context * bytes_per_value
    return flops, matmul_params * bytes_per_value + kv_bytes


def time_steps(llm, hf, batch: int, prompt_len: int, steps: int) -> tuple[float, float | None]:
    """Median seconds of one tinyserve engine step with ``batch`` sequences decoding, and of
    transformers' decode forward at the same batch and context (None without ``hf``), the two
    taking turns step by step."""
    fill(llm, batch, prompt_len, max_tokens=steps + 4)
    llm.engine.step()  # warm-up
    theirs = None if hf is None else transformers_decoder(hf, perf.make_prompts(llm.tokenizer,
                                                                                [prompt_len + 1] * batch))
    ours, their_times = take_turns(lambda: _timed(llm.engine.step), theirs, steps)
    llm.engine.abort_request([f"r{i}" for i in range(batch)])
    return statistics.median(ours), statistics.median(their_times) if their_times else None


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1 or args.prompt_len < 1:
        raise ValueError("--batches, --steps and --prompt-len must be at least 1")
    print(f"machine: {machine()}")
    bandwidth = copy_bandwidth()
    peaks = {name: peak_matmul_flops(DTYPES[name]) for name in args.dtypes}
    best = max(peaks, key=peaks.get)  # the machine's fastest dtype: its roofline is the machine's
    for name, peak in peaks.items():
        print(f"{name} matmul: {peak / 1e9:.1f} GFLOP/s; ridge point {peak / bandwidth:.1f} FLOP/byte")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s; the machine's best dtype: {best}")
    rows = []
    for name in args.dtypes:
        rows += measure(args, name, peaks, best, bandwidth)
    print()
    print(table(rows, [c for c in rows[0] if c not in ("peak_gflops", "bandwidth_gbs", "best_dtype")]))
    path = perf.write_results("roofline", rows, args.out)
    print(f"wrote {path}")
    return rows



def measure(args, name: str, peaks: dict[str, float], best: str, bandwidth: float) -> list[dict]:
    """The rows of one dtype: each batch's floor in that dtype and in the best one, and the
    measured steps of tinyserve and transformers."""
    dtype = DTYPES[name]
    llm = build_llm(args.model, max(args.batches), dtype=dtype)
    config = llm.engine.executor.loaded.hf_config
    hf = None if args.no_transformers else perf.load_hf_model(args.model, device="cpu", dtype=dtype)
    rows = []
    for b in args.batches:
        context = args.prompt_len + args.steps // 2 + 2  # the middle of the timed steps
        flops, nbytes = decode_step_cost(config, b, context, dtype.itemsize)
        floor = max(flops / peaks[name], nbytes / bandwidth)
        best_flops, best_bytes = decode_step_cost(config, b, context, DTYPES[best].itemsize)
        best_floor = max(best_flops / peaks[best], best_bytes / bandwidth)
        ours, theirs = time_steps(llm, hf, b, args.prompt_len, args.steps)
        row = dict(dtype=name, batch=b, context=context, gflops=round(flops / 1e9, 3),
                   mbytes=round(nbytes / 1e6, 1), intensity=round(flops / nbytes, 2),
                   bound="compute" if flops / peaks[name] > nbytes / bandwidth else "memory",
                   floor_ms=round(1000 * floor, 2), best_floor_ms=round(1000 * best_floor, 2),
                   tinyserve_ms=round(1000 * ours, 2), tinyserve_fraction=round(floor / ours, 3),
                   tinyserve_fraction_of_best=round(best_floor / ours, 3))
        if theirs is not None:
            row.update(transformers_ms=round(1000 * theirs, 2), transformers_fraction=round(floor / theirs, 3))
        row.update(peak_gflops=round(peaks[name] / 1e9, 1), bandwidth_gbs=round(bandwidth / 1e9, 1), best_dtype=best)
        rows.append(row)
        print(f"{name} batch {b}: floor {row['floor_ms']} ms ({row['bound']}-bound), tinyserve {row['tinyserve_ms']} "
              f"ms = {100 * row['tinyserve_fraction']:.0f}% of the {name} roofline, "
              f"{100 * row['tinyserve_fraction_of_best']:.0f}% of the machine's ({best})")
    return rows


def readme_table(rows: list[dict]) -> str:
    """The table of ``roofline.csv`` in ``docs/performance.md``: per dtype, its peak, then each batch's step as
    "tinyserve / transformers ms (tinyserve's fraction of that dtype's roofline)"."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    first = {d: next(r for r in rows if r["dtype"] == d) for d in dtypes}
    lines = ["| | " + " | ".join(dtypes) + " |", "|---" * (len(dtypes) + 1) + "|",
             "| matmul peak (2048², `F.linear`) | " + " | ".join(f"{first[d]['peak_gflops']:.1f} GFLOP/s"
                                                             for d in dtypes) + " |"]
    for b in dict.fromkeys(r["batch"] for r in rows):
        cells = []
        for d in dtypes:
            r = next(r for r in rows if r["dtype"] == d and r["batch"] == b)
            theirs = f" / {r['transformers_ms']:.1f}" if r.get("transformers_ms") not in (None, "") else ""
            cells.append(f"{r['tinyserve_ms']:.1f}{theirs} ms ({r['tinyserve_fraction']:.0%})")
        lines.append(f"| batch {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
