"""Where one decode step's time goes: a batch of decoding sequences, timed part by part.

The engine is filled with ``--batch`` requests, all prefilled, and then steps in pure decode
rounds. Each timed step is cut into the engine's own phases (schedule, input preparation, the
model's forward, the LM head, sampling, postprocessing), and the forward pass into its matmuls
(every projection of every layer), attention (the backend's store and read of the paged cache)
and the rest (norms, rotary, activations, residual adds, Python between them). On a CPU every
torch op is synchronous, so wall-clock timers around a call measure that call.

    python benchmarks/profile_step.py                  # SmolLM2-135M, batch 16 and 32, fp32 and bf16
    python benchmarks/profile_step.py --batches 1 --dtypes float32 --steps 10

Each dtype runs tinyserve and transformers in it; transformers' decode forward (one new token per
row, its KV cache, the same batch and context) is timed beside tinyserve's step, the two taking
turns step by step. It writes
``profile_step.csv`` (per dtype and batch: median ms and share of each part) to ``--out``.

The answer to "is a step's fixed cost small?" is the share that is neither a matmul nor
attention (``other``): issue 17's target is at most a third of a batch-32 decode step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from common import RESULTS_DIR, machine, patched  # noqa: E402

from tinyserve import SamplingParams  # noqa: E402
from tinyserve.lab import perf  # noqa: E402


class Timers:
    """Accumulated seconds per label, reset each step."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    @contextmanager
    def wrap(self, obj, attr: str, label: str):
        """Time every call of ``obj.attr`` under ``label`` while the block runs."""
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[label] += time.perf_counter() - t

        with patched(obj, attr, timed):
            yield


def build_llm(model: str, batch: int, dtype: torch.dtype | str = "auto"):
    from tinyserve import LLM

    return LLM(model=model, device="cpu", dtype=dtype, max_num_seqs=batch, swap_space=0.0)


def fill(llm, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Add ``batch`` requests and step until all of them are decoding."""
    engine = llm.engine
    for i, ids in enumerate(perf.make_prompts(llm.tokenizer, [prompt_len] * batch)):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           prompt_token_ids=ids)
    # Prefill rounds until every request has its first token.
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)


def profile(llm, steps: int) -> list[dict]:
    """Time ``steps`` decode steps part by part; one dict of seconds per step."""
    from tinyserve.models import llama

    engine = llm.engine
    executor = engine.executor
    if not hasattr(executor, "model"):
        raise ValueError("profile_step.py times a single-process engine (tensor_parallel_size=1)")
    model = executor.model
    timers = Timers()
    rows = []
    backend = model.backend
    with (timers.wrap(engine.scheduler, "schedule", "schedule"),
          timers.wrap(executor, "prepare_inputs", "prepare_inputs"),
          timers.wrap(model, "forward", "forward"),
          timers.wrap(model, "compute_logits", "lm_head"),
          timers.wrap(engine, "sampler", "sample"),
          timers.wrap(backend, "store_kv", "attention"),
          timers.wrap(backend, "forward", "attention"),
          # torch.nn.functional.linear itself, for the duration of the block: every projection
          # of every layer (and the LM head, taken back out below) goes through it.
          timers.wrap(llama.F, "linear", "matmul")):
        for _ in range(steps):
            timers.acc.clear()
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            acc = dict(timers.acc)
            # compute_logits calls F.linear too: the LM head is its own line, not a layer matmul.
            acc["matmul"] = acc.get("matmul", 0.0) - acc.get("lm_head", 0.0)
            forward = acc.pop("forward", 0.0)
            acc["forward_other"] = forward - acc["matmul"] - acc.get("attention", 0.0)
            acc["postprocess"] = total - sum(acc.values())
            acc["total"] = total
            rows.append(acc)
    return rows


ORDER = ["schedule", "prepare_inputs", "matmul", "attention", "forward_other", "lm_head", "sample", "postprocess"]


def summarize(rows: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ORDER + ["total"]}


def report(med: dict[str, float], batch: int) -> str:
    lines = [f"batch-{batch} decode step, median over steps: {1000 * med['total']:.1f} ms"]
    for k in ORDER:
        lines.append(f"  {k:15s} {1000 * med[k]:7.2f} ms  {100 * med[k] / med['total']:5.1f}%")
    core = med["matmul"] + med["attention"] + med["lm_head"]
    lines.append(f"  not a matmul or attention: {100 * (1 - core / med['total']):.1f}% of the step")
    return "\n".join(lines)


def fusion_side_by_side(model, batch: int, repeats: int = 5) -> dict[str, float]:
    """Seconds of one step's q/k/v and gate/up projections over all layers, as the model runs
    them (one fused matmul each) and split as in the checkpoint (three and two matmuls), on the
    same weights and input, interleaved; medians of ``repeats``."""
    import torch.nn.functional as F

    x = torch.randn(batch, model.hidden_size, dtype=model.embed_tokens.dtype)
    fused = [(layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight) for layer in model.layers]
    q_rows = model.num_heads * model.head_dim
    kv_rows = model.num_kv_heads * model.head_dim
    split = [([w[:q_rows].clone(), w[q_rows:q_rows + kv_rows].clone(), w[q_rows + kv_rows:].clone()],
              [c.clone() for c in g.chunk(2)]) for w, g in fused]

    def run_fused() -> None:
        for w, g in fused:
            F.linear(x, w), F.linear(x, g)

    def run_split() -> None:
        for ws, gs in split:
            for w in ws + gs:
                F.linear(x, w)

    times: dict[str, list[float]] = {"fused": [], "split": []}
    with torch.inference_mode():
        run_fused(), run_split()
        for _ in range(repeats):
            for name, fn in (("fused", run_fused), ("split", run_split)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformers_decoder(hf, prompts: list[list[int]]):
    """A function that runs one more of transformers' decode forwards (one new token per row,
    its KV cache) over ``prompts`` and returns its seconds: called in turn with tinyserve's
    steps, so that both see the same spells of a shared machine."""
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor(prompts), use_cache=True)  # equal lengths: no padding
    state = {"cache": out.cache, "next": out.logits[:, -1:].argmax(-1)}

    @torch.inference_mode()
    def step() -> float:
        t = time.perf_counter()
        out = hf(input_ids=state["next"], cache=state["cache"], use_cache=True)
        state["next"] = out.logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - t
        state["cache"] = out.cache
        return seconds

    step()  # the first call pays for lazy set-up
    return step


def take_turns(ours, theirs, steps: int) -> tuple[list, list]:
    """What ``ours()`` and ``theirs()`` return over ``steps`` calls each, called in turn (theirs
    is None where transformers is left out: then only ours)."""
    mine, their_results = [], []
    for _ in range(steps):
        mine.append(ours())
        if theirs is not None:
            their_results.append(theirs())
    return mine, their_results


def profile_dtype(args, name: str) -> list[dict]:
    """The rows of one dtype: each batch's parts, the fused-projection comparison, and
    transformers' decode forward at the same batch, context and dtype, step for step in turn."""
    llm = build_llm(args.model, max(args.batches), dtype=DTYPES[name])
    hf = None if args.no_transformers else perf.load_hf_model(args.model, device="cpu", dtype=DTYPES[name])
    rows = []
    for batch in args.batches:
        fill(llm, batch, args.prompt_len, max_tokens=args.steps + 8)
        profile(llm, 2)  # warm-up
        # The same context as tinyserve's steps (the prompt and its first token, then decoding).
        theirs = None if hf is None else transformers_decoder(
            hf, perf.make_prompts(llm.tokenizer, [args.prompt_len + 1] * batch))
        ours, their_times = take_turns(lambda: profile(llm, 1)[0], theirs, args.steps)
        med = summarize(ours)
        llm.engine.abort_request([f"r{i}" for i in range(batch)])
        print(f"{name}: " + report(med, batch))
        f = fusion_side_by_side(llm.engine.executor.model, batch)
        print(f"q/k/v + gate/up projections of all layers at batch {batch}: fused {1000 * f['fused']:.1f} ms, "
              f"split into 5 matmuls {1000 * f['split']:.1f} ms ({f['split'] / f['fused']:.2f}x)")
        rows += [dict(dtype=name, batch=batch, part=k, ms=round(1000 * med[k], 3),
                      share=round(med[k] / med["total"], 4)) for k in ORDER + ["total"]]
        rows += [dict(dtype=name, batch=batch, part=f"qkv_gate_up_{k}", ms=round(1000 * v, 3), share="")
                 for k, v in f.items()]
        if their_times:
            ms = 1000 * statistics.median(their_times)
            print(f"{name}: transformers' decode forward at batch {batch}: {ms:.1f} ms "
                  f"(tinyserve's whole step {1000 * med['total']:.1f} ms)")
            rows.append(dict(dtype=name, batch=batch, part="transformers_forward", ms=round(ms, 3), share=""))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1:
        raise ValueError("--batches and --steps must be at least 1")
    print(f"machine: {machine()}")
    rows = [row for name in args.dtypes for row in profile_dtype(args, name)]
    print(f"wrote {perf.write_results('profile_step', rows, args.out)}")
    return rows


if __name__ == "__main__":
    main()
