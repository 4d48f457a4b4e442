"""Throughput over a grid of workload shapes: where does tinyserve's advantage hold?

``throughput.py`` measures two headline workloads. This sweep varies the shape of the work:

- prompt lengths: short (4..16 tokens) or long (16..256);
- output lengths: drawn from 8..64, from 8..128, or uniform 64;
- at most 16 or 32 sequences running (every system gets the same cap);
- tinyserve's "vllm" policy, its "orca" policy and chunked prefill, against transformers
  ``generate`` (static left-padded batches) and ``generate_batch`` (continuous batching).

Each cell has 1.5 times more requests than may run at once, so continuous batching has work
to refill with. The systems run interleaved, system by system within a cell, and the repeats
are the outer loop (every cell once, then every cell again), so a slow spell of the shared
machine hits all systems alike and an interrupted run still covers every cell. A cell reports
the median tokens/s of its repeats and their spread (min..max), and tinyserve's ratios to both
transformers baselines. The tables are rewritten after every cell.

    python benchmarks/sweep.py            # "bench": the 16-running half, 1 run each (~17 min, 2 quiet cores)
    python benchmarks/sweep.py --full     # all 12 cells, median of 3 (135 min on 2 quiet cores)
    python benchmarks/sweep.py --quick    # 2 tiny cells (a smoke test)
    python benchmarks/sweep.py --dtype bfloat16   # every system in bf16 (default: dtype="auto")
    python benchmarks/sweep.py --full --running 32 --keep   # measure one half, keep the other's rows
    python benchmarks/sweep.py --dtype float32 --name throughput_sweep_float32_native_bf16  # other files
    python benchmarks/sweep.py --dtype bfloat16 --compiled --name throughput_sweep_bfloat16_compiled

Every system runs in the same dtype: tinyserve's ``dtype="auto"`` unless ``--dtype`` names one
(bfloat16 on a CPU with native bf16, float32 elsewhere), and transformers in whatever tinyserve
resolved it to. It writes ``throughput_sweep.csv`` and ``throughput_sweep.md`` to ``--out``
(default ``benchmarks/results``) for float32, ``throughput_sweep_bfloat16.*`` for bfloat16, or
``<--name>.*``. ``--keep`` keeps the rows of cells this run does not measure from the files it
rewrites, only if they were measured on a machine with the same description; the run's facts
then name both runs.
``make figures`` draws chapter 11's heat maps of ratios from the CSVs (``tinyserve.viz.sweep``),
and ``tinyserve.lab.perf.sweep`` reads the targets off them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common import RESULTS_DIR, dtype_suffix, machine  # noqa: E402

from tinyserve.config import dtype_name  # noqa: E402
from tinyserve.lab import perf  # noqa: E402
from tinyserve.lab.perf.sweep import BASELINES, COMPILED, OURS  # noqa: E402

PROMPTS = {"short": (4, 16), "long": (16, 256)}
OUTPUTS = {"8-64": (8, 64), "8-128": (8, 128), "uniform-64": (64, 64)}


@dataclass(frozen=True)
class Cell:
    prompts: str
    outputs: str
    max_running: int
    num_requests: int

    def workload(self, tokenizer, seed: int = 0) -> perf.Workload:
        lo, hi = OUTPUTS[self.outputs]
        p_lo, p_hi = PROMPTS[self.prompts]
        w = perf.mixed_workload(tokenizer, self.num_requests, lo, hi, p_lo, p_hi, seed=seed)
        return perf.Workload(f"{self.prompts}/{self.outputs}/{self.max_running}", w.prompts, w.output_lens)


def grid(preset: str, running: tuple[int, ...] | None = None) -> tuple[list[Cell], int]:
    """The cells of a preset (only those at ``running``, where given) and how many runs each gets."""
    if preset == "quick":
        return [Cell("short", "8-64", 4, 6), Cell("long", "uniform-64", 4, 4)], 1
    running = running or ((16, 32) if preset == "full" else (16,))
    # More requests than may run at once, so continuous batching has work to refill with.
    cells = [Cell(p, o, b, b * 3 // 2) for b in running for p in PROMPTS for o in OUTPUTS]
    return cells, 3 if preset == "full" else 1


def build_systems(model: str, max_running: int, quick: bool, dtype: str = "auto", compiled: bool = False) -> list:
    """tinyserve under its three schedules and both transformers baselines, on the same weights
    and in the same dtype; with ``compiled``, also the default schedule with compiled decode
    steps (``enforce_eager=False``, every size compiled before anything is timed)."""
    from tinyserve import LLM

    kw = dict(model=model, device="cpu", dtype=dtype, max_num_seqs=max_running, swap_space=0.0)
    vllm = LLM(**kw)
    systems = [perf.TinyserveSystem(vllm), perf.TinyserveSystem(LLM(**kw, policy="orca"), name="tinyserve-orca"),
               perf.TinyserveSystem(LLM(**kw, enable_chunked_prefill=True,
                                        # small enough that the quick run's prompts are really cut
                                        max_num_batched_tokens=32 if quick else None),
                                    name="tinyserve-chunked")]
    if compiled:
        graphs = LLM(**kw, enforce_eager=False)
        graphs.engine.executor.warm_up_graphs()
        systems.append(perf.TinyserveSystem(graphs, name=COMPILED))
    executor = vllm.engine.executor
    hf = perf.load_hf_model(model, device=executor.device, dtype=executor.dtype)
    pad = vllm.tokenizer.pad_token_id if vllm.tokenizer.pad_token_id is not None else 0
    systems.append(perf.StaticGenerateSystem(hf, max_running, pad))
    systems.append(perf.GenerateBatchSystem(hf, max_running, num_blocks=vllm.engine.cache_config.num_gpu_blocks,
                                            pad_token_id=pad))
    return systems


def cell_rows(cell: Cell, w: perf.Workload, runs: dict[str, list[perf.RunResult]], dtype: str) -> list[dict]:
    """One row per system: median tokens/s, spread, and (for tinyserve) ratios to the baselines."""
    med = {name: perf.median_rate(res) for name, res in runs.items()}
    ref = runs["tinyserve"][0]
    rows = []
    for name, res in runs.items():
        rates = [r.tokens_per_s for r in res]
        row = dict(dtype=dtype, prompts=cell.prompts, outputs=cell.outputs, max_running=cell.max_running,
                   num_requests=cell.num_requests, prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens,
                   system=name, runs=len(res), tokens_per_s=round(med[name], 2), min_tokens_per_s=round(min(rates), 2),
                   max_tokens_per_s=round(max(rates), 2),
                   same_outputs_as_tinyserve=round(perf.agreement(ref, res[0]), 3),
                   # The work behind the rate (the same in every run; blank where unknown).
                   forwards=_blank(res[0].forwards), prefill_forwards=_blank(res[0].prefill_forwards),
                   decode_rows=_blank(res[0].decode_rows))
        for base in BASELINES:
            row[f"x_{base}"] = round(med[name] / med[base], 3) if name in (*OURS, COMPILED) else ""
        rows.append(row)
    return rows


def _blank(value: int | None) -> int | str:
    return "" if value is None else value


def markdown(rows: list[dict]) -> str:
    """A table with one line per cell: tokens/s of every system (median, min..max) and the ratios."""
    head = ["prompts", "outputs", "running"] + list(OURS + BASELINES) + [f"{o} ÷ {b}" for o in OURS for b in BASELINES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = dict.fromkeys((r["prompts"], r["outputs"], r["max_running"]) for r in rows)
    for key in cells:
        by = {r["system"]: r for r in rows if (r["prompts"], r["outputs"], r["max_running"]) == key}
        out = list(map(str, key))
        for s in OURS + BASELINES:
            r = by[s]
            spread = f" ({r['min_tokens_per_s']:.0f}–{r['max_tokens_per_s']:.0f})" if r["runs"] > 1 else ""
            out.append(f"{r['tokens_per_s']:.1f}{spread}")
        out += [f"{by[o][f'x_{b}']:.2f}×" for o in OURS for b in BASELINES]
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="two tiny cells (a smoke test)")
    size.add_argument("--full", action="store_true", help="all 12 cells, median of 3 runs each")
    ap.add_argument("--repeats", type=int, default=None, help="runs per cell (default: 1, or 3 with --full)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--running", type=int, nargs="+", choices=[16, 32], default=None,
                    help="measure only the cells with this many running")
    ap.add_argument("--keep", action="store_true", help="keep the other cells' rows from the files rewritten")
    ap.add_argument("--name", default=None, help="stem of the files written (default: from the dtype)")
    ap.add_argument("--compiled", action="store_true",
                    help="add tinyserve with compiled decode steps (enforce_eager=False) to every cell")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    preset = "quick" if args.quick else "full" if args.full else "bench"
    cells, repeats = grid(preset, tuple(args.running) if args.running else None)
    repeats = args.repeats if args.repeats is not None else repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if args.keep and args.name is None and args.dtype == "auto":
        raise ValueError("--keep needs the files named: give --dtype float32/bfloat16 or --name")

    started = time.perf_counter()
    print(f"machine: {machine()}\nsweep {preset}: {len(cells)} cells x {repeats} runs, model {args.model}")
    runs: dict[Cell, dict[str, list[perf.RunResult]]] = {}
    workloads: dict[Cell, perf.Workload] = {}
    rows: list[dict] = []
    kept: list[dict] | None = None
    for r in range(repeats):
        for max_running in dict.fromkeys(c.max_running for c in cells):
            systems = build_systems(args.model, max_running, args.quick, args.dtype, args.compiled)
            tok = systems[0].llm.tokenizer
            dtype = dtype_name(systems[0].llm.engine.executor.dtype)
            if r == 0 and max_running == cells[0].max_running:
                print(f"every system runs in {dtype}")
            perf.compare(systems, perf.uniform_workload(tok, 2, 2, 4, 8, seed=1))  # warm-up, untimed
            for i, cell in enumerate(cells):
                if cell.max_running != max_running:
                    continue
                w = workloads.setdefault(cell, cell.workload(tok, seed=i))
                print(f"run {r + 1}/{repeats} {w.name}: {w.num_requests} requests, {w.prompt_tokens} prompt "
                      f"tokens, {w.output_tokens} to generate")
                for name, res in perf.compare(systems, w, log=print).items():
                    runs.setdefault(cell, {}).setdefault(name, []).extend(res)
                name = args.name or "throughput_sweep" + dtype_suffix(dtype)
                if kept is None:  # read once, before this run first rewrites the files
                    kept = _kept_rows(args, name, cells, dtype)
                rows = [row for c in cells if c in runs for row in cell_rows(c, workloads[c], runs[c], dtype)]
                _write(_in_grid_order(kept + rows), name, args, preset, repeats,
                       round(time.perf_counter() - started, 1))
            del systems
            gc.collect()
    rows = _in_grid_order(kept + rows)
    print(markdown(rows))
    print(f"wrote {args.out / (name + '.csv')} ({time.perf_counter() - started:.1f} s)")
    return rows


def _in_grid_order(rows: list[dict]) -> list[dict]:
    """Kept and new rows as the grid lists them: each half's cells together, 16 running first."""
    return sorted(rows, key=lambda r: r["max_running"])  # stable: each part is already in grid order


def _kept_rows(args, name: str, cells: list[Cell], dtype: str) -> list[dict]:
    """With ``--keep``: the rows of the cells this run does not measure, from the files it rewrites.

    They are kept only if they ran on a machine described as this one is and in the same dtype, so
    one file never mixes machines."""
    if not args.keep or not (args.out / f"{name}.csv").exists():
        return []
    earlier = json.loads((args.out / f"{name}_machine.json").read_text())
    if earlier["machine"] != machine() or earlier["dtype"] != dtype:
        raise ValueError(f"--keep: {name} was measured on {earlier['machine']!r} in {earlier['dtype']}, "
                         f"this run is on {machine()!r} in {dtype}; measure every cell instead")
    measured = {(c.prompts, c.outputs, c.max_running) for c in cells}
    rows = [r for r in perf.read_results(name, args.out)
            if (r["prompts"], r["outputs"], r["max_running"]) not in measured]
    args.earlier = {k: v for k, v in earlier.items() if k != "earlier"}
    return rows


def _write(rows: list[dict], name: str, args, preset: str, repeats: int, seconds: float) -> None:
    """The CSV, the markdown table and the run's facts, as far as the sweep has got."""
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = rows[0]["dtype"]
    perf.write_results(name, rows, args.out)
    done = min(r["runs"] for r in rows)
    earlier = getattr(args, "earlier", None)
    measured = "/".join(map(str, args.running or ()))
    kept = (f" (only cells at running {measured} in this run, the rest kept from one of {earlier['seconds']} s)"
            if earlier else "")
    note = (f"Measured on {machine()}, model {args.model}, {dtype} on the CPU for every system, greedy with "
            f"ignore_eos; tokens/s, median of {done} run(s) (min–max); {seconds} s in all{kept}.")
    (args.out / f"{name}.md").write_text(markdown(rows) + "\n\n" + note + "\n")
    facts = dict(machine=machine(), model=args.model, dtype=dtype, preset=preset, repeats=repeats, runs_done=done,
                 cells=len({(r["prompts"], r["outputs"], r["max_running"]) for r in rows}), seconds=seconds)
    if earlier:
        facts["earlier"] = earlier
    (args.out / f"{name}_machine.json").write_text(json.dumps(facts, indent=1) + "\n")


if __name__ == "__main__":
    main()
