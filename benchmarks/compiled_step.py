"""A decode step eager and compiled, against transformers and the machine's floor, batch by batch.

Two engines on the same weights take turns with transformers' eager decode forward (one new
token per row, its KV cache, the same batch, context and dtype): tinyserve with
``enforce_eager=True`` (every op dispatched from Python) and ``enforce_eager=False`` (decode
steps padded to a capture size and run through a ``torch.compile``'d graph, linears on
oneDNN-packed weights; see ``tinyserve/graphs``). Each row gives the whole engine step's median
in both modes, transformers' forward, and the step's floor on this machine,
``max(FLOPs / peak matmul rate, bytes / bandwidth)`` (``roofline.py``), both measured in the
same run. A batch that is not a capture size runs on the next one up: its row shows what the
padding costs.

    python benchmarks/compiled_step.py                        # SmolLM2-135M, default dtype
    python benchmarks/compiled_step.py --batches 1 16 --steps 5
    python benchmarks/compiled_step.py --compile-times        # first compile, then from the cache
    python benchmarks/compiled_step.py --workload             # the sweep's short-prompt mixed cell

``--compile-times`` runs a batch-16 engine twice in fresh processes sharing a fresh inductor
cache folder: the first compiles, the second loads what the first left on disk. ``--workload``
runs the short-prompt mixed shape of ``sweep.py`` (32 requests, outputs 8-64, 16 running)
through both engines and transformers' static ``generate``. Results go to ``compiled_step.csv``,
``compiled_step_compile.csv`` and ``compiled_step_workload.csv`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from common import RESULTS_DIR, machine, table  # noqa: E402
from profile_step import fill, transformers_decoder  # noqa: E402
from roofline import copy_bandwidth, decode_step_cost, peak_matmul_flops  # noqa: E402

from tinyserve import LLM  # noqa: E402
from tinyserve.config import resolve_dtype  # noqa: E402
from tinyserve.graphs.sizes import capture_sizes, padded_size  # noqa: E402
from tinyserve.lab import perf  # noqa: E402

COLUMNS = ["dtype", "batch", "graph_size", "eager_ms", "compiled_ms", "transformers_ms", "floor_ms",
           "compiled_vs_eager", "compiled_vs_transformers", "roofline_share"]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build(model: str, dtype: torch.dtype, max_num_seqs: int, enforce_eager: bool) -> LLM:
    return LLM(model=model, device="cpu", dtype=dtype, max_num_seqs=max_num_seqs, swap_space=0.0,
               enforce_eager=enforce_eager)


def measure_batch(engines: dict[str, LLM], hf, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median seconds of a decode step of each engine and of transformers' forward, in turn."""
    for llm in engines.values():
        fill(llm, batch, prompt_len, max_tokens=steps + 4)
        llm.engine.step()  # the compiled engine's first step at a new size compiles it
    some = next(iter(engines.values()))
    theirs = transformers_decoder(hf, perf.make_prompts(some.tokenizer, [prompt_len + 1] * batch))
    times: dict[str, list[float]] = {name: [] for name in [*engines, "transformers"]}
    for _ in range(steps):
        for name, llm in engines.items():
            times[name].append(timed(llm.engine.step))
        times["transformers"].append(theirs())
    for llm in engines.values():
        llm.engine.abort_request([f"r{i}" for i in range(batch)])
    return {name: statistics.median(v) for name, v in times.items()}


def run_sweep(args) -> list[dict]:
    dtype = resolve_dtype(args.dtype, "cpu")
    name = str(dtype).removeprefix("torch.")
    top = max(args.batches)
    engines = {"eager": build(args.model, dtype, top, True), "compiled": build(args.model, dtype, top, False)}
    hf = perf.load_hf_model(args.model, device="cpu", dtype=dtype)
    config = engines["eager"].engine.executor.loaded.hf_config
    peak, bandwidth = peak_matmul_flops(dtype), copy_bandwidth()
    print(f"machine: {machine()}\n{name}: peak matmul {peak / 1e9:.0f} GFLOP/s, "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for batch in args.batches:
        med = measure_batch(engines, hf, batch, args.prompt_len, args.steps)
        # The context at the middle of the timed steps.
        flops, nbytes = decode_step_cost(config, batch, args.prompt_len + 2 + args.steps // 2, dtype.itemsize)
        floor = max(flops / peak, nbytes / bandwidth)
        rows.append(dict(dtype=name, batch=batch, graph_size=padded_size(batch, capture_sizes(top)),
                         eager_ms=round(1000 * med["eager"], 2), compiled_ms=round(1000 * med["compiled"], 2),
                         transformers_ms=round(1000 * med["transformers"], 2), floor_ms=round(1000 * floor, 2),
                         compiled_vs_eager=round(med["compiled"] / med["eager"], 3),
                         compiled_vs_transformers=round(med["compiled"] / med["transformers"], 3),
                         roofline_share=round(floor / med["compiled"], 3)))
        print(table(rows[-1:], COLUMNS), flush=True)
    graphs = engines["compiled"].engine.executor.decode_graphs
    print("compile seconds by size (this process):",
          {size: round(s, 1) for size, s in sorted(graphs.compile_seconds.items())})
    return rows


def one_compile(model: str, dtype: str) -> None:
    """(child process) Build a compiled engine, run one batch-16 decode step, print its seconds."""
    llm = build(model, resolve_dtype(dtype, "cpu"), 16, False)
    fill(llm, 16, 32, max_tokens=8)
    start = time.perf_counter()
    llm.engine.step()
    print(json.dumps({"step_s": time.perf_counter() - start,
                      "compile_s": llm.engine.executor.decode_graphs.compile_seconds[16]}))


def compile_times(args) -> list[dict]:
    """Batch 16's first compile in a fresh cache folder, then again in a new process (cached)."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for run in ("first", "cached"):
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype],
                                 env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(dict(run=run, batch=16, compile_s=round(result["compile_s"], 2)))
            print(f"{run}: batch 16 compiled in {result['compile_s']:.1f} s", flush=True)
    return rows


def workload(args) -> list[dict]:
    """The short-prompt mixed shape of ``sweep.py`` (32 requests, prompts 4-16 and outputs 8-64
    tokens, 16 running): tinyserve eager and compiled against transformers' static ``generate``,
    interleaved ``--repeats`` times; tokens/s medians and the ratios."""
    dtype = resolve_dtype(args.dtype, "cpu")
    engines = {name: build(args.model, dtype, 16, name == "eager") for name in ("eager", "compiled")}
    engines["compiled"].engine.executor.warm_up_graphs()  # compiling is not part of the timed runs
    hf = perf.load_hf_model(args.model, device="cpu", dtype=dtype)
    tok = engines["eager"].tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    systems = [perf.TinyserveSystem(engines["eager"], name="tinyserve-eager"),
               perf.TinyserveSystem(engines["compiled"], name="tinyserve-compiled"),
               perf.StaticGenerateSystem(hf, 16, pad)]
    perf.compare(systems, perf.uniform_workload(tok, 2, 2, 4, 8, seed=1))  # warm-up, untimed
    w = perf.mixed_workload(tok, 32, 8, 64, 4, 16, seed=0)
    runs = perf.compare(systems, w, repeats=args.repeats, log=print)
    rates = {name: perf.median_rate(r) for name, r in runs.items()}
    base = rates[systems[-1].name]
    rows = [dict(dtype=str(dtype).removeprefix("torch."), system=name, tokens_per_s=round(rate, 1),
                 vs_generate=round(rate / base, 3), runs=len(runs[name])) for name, rate in rates.items()]
    print(table(rows, list(rows[0])))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--compile-times", action="store_true")
    ap.add_argument("--workload", action="store_true", help="the short-prompt mixed workload instead")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of --workload")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.child:
        one_compile(args.model, args.dtype)
        return []
    if args.compile_times:
        rows = compile_times(args)
        print(f"wrote {perf.write_results('compiled_step_compile', rows, args.out)}")
        return rows
    if args.workload:
        rows = workload(args)
        print(f"wrote {perf.write_results('compiled_step_workload', rows, args.out)}")
        return rows
    rows = run_sweep(args)
    print(f"wrote {perf.write_results('compiled_step', rows, args.out)}")
    return rows


if __name__ == "__main__":
    main()
