"""The KV memory that block sharing saves: beam search and parallel sampling, with and without sharing.

The beams of a beam search (and the samples of parallel sampling) are the sequences of one group;
they share the prompt's blocks and the blocks of their common prefixes through fork and
copy-on-write (``BlockSpaceManager.fork`` / ``append_slot``). This benchmark runs a workload of
12 real English prompts (``benchmarks/data/beam_memory_prompts.json``, 18 to 184 tokens on
SmolLM2's tokenizer), all at once, through the engine on SmolLM2-135M, and at every engine step
counts from the block manager, for each request:

- **with sharing**: the distinct physical GPU blocks in its running sequences' block tables;
- **without sharing**: each sequence its own copy, the sum over its running sequences of
  ``ceil(len / block_size)``, the blocks a sequence of ``len`` tokens needs.

The count is taken right after the scheduler has made room for the step's tokens (``append_slot``,
so after the step's copy-on-write copies), while the model writes into those blocks: both sides
then hold every token of every running sequence. Finished sequences hold nothing on either side.
Each count is checked against the allocator (the GPU blocks in use equal the with-sharing total).

The memory saved is the PagedAttention paper's (Kwon et al. 2023, section 6.3, Fig. 15): "the
number of blocks we saved by sharing divided by the number of total blocks without sharing",
here summed over the steps, each step one unit of time: ``1 - sum(with) / sum(without)``
(``avg_saved``); the plain mean over steps of each step's ``1 - with / without`` is
``mean_step_saved``. At the peak: ``1 - max(with) / max(without)``, the memory a cache must have for
the workload with sharing against without (``peak_saved``).

Beam search: ``use_beam_search=True, best_of=W, n=1, temperature=0, length_penalty=1,
early_stopping=False`` for W = 2, 4, 6, 8 (n only picks how many beams are returned; the search
keeps W either way). Parallel sampling: ``n=N`` (= best_of) for N = 2, 4, 6, 8, temperature 0.8,
seeded per request. ``max_tokens`` 64; block sizes 16 (vLLM's default) and 8. float32 by default,
so that greedy beam choices are reproducible. The cache is sized so that nothing is preempted
(checked).

    python benchmarks/beam_memory.py            # SmolLM2-135M, minutes on two cores
    python benchmarks/beam_memory.py --quick    # the tiny random model, 3 prompts (seconds)

It writes ``beam_memory.csv`` (one row per mode, width and block size) and ``beam_memory.md`` (the
table beside the paper's figures, for the README and chapter 14) to ``--out`` (default
``benchmarks/results``; ``--quick`` writes only where ``--out`` says).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the Makefile does, before torch starts

from common import RESULTS_DIR, machine, patched, table  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.block import Device  # noqa: E402
from tinyserve.sequence import SequenceStatus  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "beam_memory_prompts.json"
WIDTHS = (2, 4, 6, 8)
BLOCK_SIZES = (16, 8)
MAX_TOKENS = 64
TEMPERATURE = 0.8
SEED = 0
# Kwon et al. 2023, section 6.3 and Fig. 15: OPT-13B, widths / n of 2, 4 and 6 (vLLM's default block size is 16).
PAPER = {
    "beam": "37.6%–55.2% (Alpaca), 44.3%–66.3% (ShareGPT)",
    "parallel": "6.1%–9.8% (Alpaca), 16.2%–30.5% (ShareGPT)",
}


def load_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    return json.loads(path.read_text())


def beam_params(width: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=1, temperature=0.0, max_tokens=max_tokens,
                          length_penalty=1.0, early_stopping=False)


def parallel_params(n: int, seed: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(n=n, temperature=TEMPERATURE, seed=seed, max_tokens=max_tokens)


@dataclass
class StepCount:
    """One step's blocks: per request ``(with sharing, without sharing, running sequences)``."""

    step: int
    requests: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def with_sharing(self) -> int:
        return sum(w for w, _, _ in self.requests.values())

    @property
    def without_sharing(self) -> int:
        return sum(wo for _, wo, _ in self.requests.values())


def count_blocks(scheduler, step: int) -> StepCount:
    """The blocks each running request holds now, with sharing (distinct physical blocks over its
    running sequences' tables) and without (``ceil(len / block_size)`` per running sequence)."""
    bm = scheduler.block_manager
    count = StepCount(step)
    for group in scheduler.running:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        blocks = {b.block_number for s in seqs for b in bm.block_tables[s.seq_id]}
        if any(b.device != Device.GPU for s in seqs for b in bm.block_tables[s.seq_id]):
            raise RuntimeError(f"request {group.request_id!r} holds CPU blocks while running")
        without = sum(math.ceil(s.get_len() / bm.block_size) for s in seqs)
        count.requests[group.request_id] = (len(blocks), without, len(seqs))
    # Nothing else holds blocks (no prefix cache, nothing swapped): the allocator must agree.
    used = bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()
    if used != count.with_sharing:
        raise RuntimeError(f"step {step}: the allocator has {used} blocks in use, the tables {count.with_sharing}")
    return count


@dataclass
class Run:
    steps: list[StepCount]
    output_lens: list[int]  # tokens of every returned output
    seconds: float


def measure(llm: LLM, prompts: list[str], params: list[SamplingParams],
            on_step: Callable[[object, StepCount], None] | None = None) -> Run:
    """Run every prompt at once (prompt i with ``params[i]``) and count the blocks at every step,
    right after the scheduler has given the step's tokens their slots. ``on_step(scheduler,
    count)`` is called with each count (the tests check it against their own)."""
    engine = llm.engine
    scheduler = engine.scheduler
    if engine.cache_config.enable_prefix_caching:
        raise ValueError("measure counts blocks without a prefix cache: build the LLM with enable_prefix_caching=False")
    steps: list[StepCount] = []
    schedule = scheduler.schedule

    def counted_schedule():
        result = schedule()
        steps.append(count_blocks(scheduler, len(steps)))
        if on_step is not None:
            on_step(scheduler, steps[-1])
        return result

    preemptions = engine.num_preemptions_total
    outputs = {}
    t0 = time.perf_counter()
    with patched(scheduler, "schedule", counted_schedule):
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"bm-{i}", prompt, p)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    seconds = time.perf_counter() - t0
    if engine.num_preemptions_total != preemptions:
        raise RuntimeError("a request was preempted: the cache is too small for the measurement")
    failed = [o.error for o in outputs.values() if o.error]
    if failed or len(outputs) != len(prompts) or not all(o.finished for o in outputs.values()):
        raise RuntimeError(f"not every request finished cleanly: {failed}")
    return Run(steps, [len(c.token_ids) for o in outputs.values() for c in o.outputs], seconds)


def summarize(steps: list[StepCount]) -> dict:
    """The memory saved over the run (block-steps) and at the peak."""
    with_ = [s.with_sharing for s in steps]
    without = [s.without_sharing for s in steps]
    return dict(steps=len(steps), block_steps_with=sum(with_), block_steps_without=sum(without),
                avg_saved=1 - sum(with_) / sum(without),
                mean_step_saved=sum(1 - w / wo for w, wo in zip(with_, without)) / len(steps),
                peak_with=max(with_), peak_without=max(without),
                peak_saved=1 - max(with_) / max(without))


def cache_blocks(llm_tokenizer, prompts: list[str], block_size: int, width: int, max_tokens: int) -> int:
    """Enough GPU blocks for every request's ``width`` sequences at full length, unshared."""
    return sum(width * math.ceil((len(llm_tokenizer.encode(p)) + max_tokens) / block_size) for p in prompts)


def run_all(model: str, prompts: list[str], widths: tuple[int, ...], block_sizes: tuple[int, ...], dtype: str,
            max_tokens: int, log: Callable[[str], None] = print) -> list[dict]:
    rows = []
    for block_size in block_sizes:
        llm = None
        for mode in ("beam", "parallel"):
            for width in widths:
                if llm is None:
                    from tinyserve.lab.perf import load_tokenizer

                    blocks = cache_blocks(load_tokenizer(model), prompts, block_size, max(widths), max_tokens)
                    llm = LLM(model=model, device="cpu", dtype=dtype, block_size=block_size,
                              num_gpu_blocks=blocks + 16, swap_space=0.0, max_num_seqs=len(prompts) * max(widths),
                              enable_prefix_caching=False, seed=SEED)
                params = ([beam_params(width, max_tokens)] * len(prompts) if mode == "beam"
                          else [parallel_params(width, SEED + i, max_tokens) for i in range(len(prompts))])
                run = measure(llm, prompts, params)
                row = dict(mode=mode, width=width, block_size=block_size, **summarize(run.steps),
                           mean_output_len=sum(run.output_lens) / len(run.output_lens), seconds=run.seconds)
                log(f"{mode:8s} width {width} block size {block_size:2d}: {row['steps']} steps, "
                    f"saved {row['avg_saved']:.1%} on average, {row['peak_saved']:.1%} at the peak "
                    f"({run.seconds:.0f} s)")
                rows.append(row)
    return rows


COLUMNS = ["mode", "width", "block_size", "steps", "avg_saved", "mean_step_saved", "peak_saved", "block_steps_with",
           "block_steps_without", "peak_with", "peak_without", "mean_output_len"]
FORMATS = {"avg_saved": ".1%", "mean_step_saved": ".1%", "peak_saved": ".1%", "mean_output_len": ".1f"}


def headline(rows: list[dict], mode: str, block_size: int = 16) -> tuple[float, float]:
    """The lowest and highest average saved over the widths, at ``block_size``."""
    saved = [r["avg_saved"] for r in rows if r["mode"] == mode and r["block_size"] == block_size]
    return min(saved), max(saved)


def markdown(rows: list[dict], meta: dict) -> str:
    md_rows = [dict(r, mode="beam search" if r["mode"] == "beam" else "parallel sampling") for r in rows]
    header = ("| mode | width / n | block size | steps | saved, average | saved, mean of steps | saved, at the peak "
              "| blocks at the peak (with / without) |")
    lines = [header, "|" + "---|" * 8]
    lines += [f"| {r['mode']} | {r['width']} | {r['block_size']} | {r['steps']} | {r['avg_saved']:.1%} | "
              f"{r['mean_step_saved']:.1%} | {r['peak_saved']:.1%} | {r['peak_with']} / {r['peak_without']} |"
              for r in md_rows]
    bs = 16 if any(r["block_size"] == 16 for r in rows) else rows[0]["block_size"]
    beam, par = headline(rows, "beam", bs), headline(rows, "parallel", bs)
    widths = sorted({r["width"] for r in rows})
    return "\n".join([
        "# Memory saved by block sharing: beam search and parallel sampling",
        "",
        f"Measured by `benchmarks/beam_memory.py` on {meta['model']} ({meta['dtype']}): {meta['prompts']} English "
        f"prompts of {meta['prompt_tokens']} tokens, all at once, `max_tokens` {meta['max_tokens']}. Beam search: "
        f"`use_beam_search=True, best_of=W, n=1, temperature=0, early_stopping=False`; parallel sampling: `n=N`, "
        f"temperature {TEMPERATURE}, seeded. At every engine step, once the scheduler has given the step's tokens "
        "their slots, each request's blocks are counted with sharing (distinct physical blocks in its running "
        "sequences' tables) and without (each sequence its own copy, `ceil(len / block_size)`). Saved on average: "
        "`1 - sum(with) / sum(without)` over the steps, the paper's \"blocks saved by sharing divided by the total "
        "blocks without sharing\"; the mean of steps is each step's `1 - with / without` averaged; at the peak: "
        "`1 - max(with) / max(without)`.",
        "",
        *lines,
        "",
        f"At block size {bs}, beam search with widths {widths[0]}–{widths[-1]} saves {beam[0]:.1%}–{beam[1]:.1%} of "
        f"the KV blocks on average, parallel sampling with n {widths[0]}–{widths[-1]} saves {par[0]:.1%}–{par[1]:.1%}. "
        f"Neither can save more than 1 - 1/W, every sequence on one copy: {1 - 1 / widths[0]:.1%} at width "
        f"{widths[0]}, {1 - 1 / widths[-1]:.1%} at width {widths[-1]}.",
        "",
        "The PagedAttention paper (Kwon et al. 2023, section 6.3, Fig. 15) reports, for widths and n of 2, 4 and 6 "
        f"on OPT-13B (served with vLLM, whose default block size is 16): beam search {PAPER['beam']}; "
        f"parallel sampling {PAPER['parallel']}. Its "
        "traces are different (Alpaca's and ShareGPT's prompts and output lengths, requests arriving over time, "
        "outputs as long as the dataset's), and so is its model, so only the order of magnitude and the ordering "
        "compare: beam search shares far more than parallel sampling, because beams keep sharing the blocks of "
        "their common prefix while parallel samples share only the prompt's full blocks. What parallel sampling "
        "saves is bounded by the prompt's share of each sequence: below (n - 1) / n of the prompt's full blocks "
        f"over all blocks; here the prompts are long against at most {meta['max_tokens']} output tokens, so it saves "
        "far more than on the paper's traces, whose outputs are long against their prompts.",
        "",
        f"Machine: {meta['machine']}.",
        "",
    ])


def write(rows: list[dict], meta: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "beam_memory.csv", out / "beam_memory.md"
    fields = COLUMNS + ["seconds", "model", "dtype", "prompts", "max_tokens"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in
                        dict(r, model=meta["model"], dtype=meta["dtype"], prompts=meta["prompts"],
                             max_tokens=meta["max_tokens"]).items() if k in fields})
    md_path.write_text(markdown(rows, meta))
    return csv_path, md_path


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny random model, 3 prompts, widths 2 and 4")
    ap.add_argument("--model", default=None, help="default smollm2-135m (--quick: the tiny model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=None, help=f"default {MAX_TOKENS} (--quick: 16)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results (--quick: nothing written)")
    args = ap.parse_args(argv)
    prompts = load_prompts()
    widths, max_tokens = WIDTHS, args.max_tokens or MAX_TOKENS
    model = args.model or "smollm2-135m"
    if args.quick:
        prompts, widths, max_tokens = prompts[:3], (2, 4), args.max_tokens or 16
        if args.model is None:
            from tinyserve.models.tiny import make_tiny_model_dir

            model = str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="tinyserve-tiny-"))))
    from tinyserve.lab.perf import load_tokenizer

    lens = [len(load_tokenizer(model).encode(p)) for p in prompts]
    meta = dict(model=args.model or ("the tiny random Llama" if args.quick else "SmolLM2-135M"), dtype=args.dtype,
                prompts=len(prompts), prompt_tokens=f"{min(lens)}–{max(lens)} (mean {sum(lens) / len(lens):.0f})",
                max_tokens=max_tokens,
                machine=machine())
    rows = run_all(model, prompts, widths, BLOCK_SIZES, args.dtype, max_tokens)
    print(table(rows, COLUMNS, FORMATS))
    bs = BLOCK_SIZES[0]
    (b0, b1), (p0, p1) = headline(rows, "beam", bs), headline(rows, "parallel", bs)
    print(f"block size {bs}: beam search saves {b0:.1%}–{b1:.1%} on average, parallel sampling {p0:.1%}–{p1:.1%} "
          f"(paper, OPT-13B: beam {PAPER['beam']}; parallel {PAPER['parallel']})")
    out = args.out if args.out is not None else (None if args.quick else RESULTS_DIR)
    if out is not None:
        print("wrote", *write(rows, meta, out))
    return rows


if __name__ == "__main__":
    main()
