"""Where one decode step's time goes: a batch of decoding sequences, timed part by part and op by op.

The engine is filled with ``--batch`` requests, all prefilled, and then steps in pure decode
rounds. Each timed step is cut into the engine's own phases (schedule, input preparation, the
model's forward, the LM head, sampling, postprocessing), and the forward pass into its matmuls
(every projection of every layer), attention (the backend's store and read of the paged cache)
and the rest (norms, rotary, activations, residual adds, Python between them). On a CPU every
torch op is synchronous, so wall-clock timers around a call measure that call.

Then a few more steps run under ``torch.profiler``, with labels around the same parts, and
``tinyserve.lab.perf.op_table`` groups every op of the trace into a kind (matmul, attention,
norm, rotary, activation, residual, layout, the Python between ops, ...) with its count and
time per step, beside the kind's floor: its FLOPs at the rate measured in the same run for each
of the step's matmul shapes (``F.linear``, or oneDNN's packed linear where it is faster, over
the model's own weights of that shape, so they stream from memory as in a step), its bytes
(weights, K/V) at the memory bandwidth measured as ``roofline.py`` measures it.

``--modes eager compiled`` takes both for ``LLM(enforce_eager=True)`` and for the compiled
decode step (``enforce_eager=False``: ``tinyserve/graphs/compiled.py``); the default is eager
alone. The part timers wrap
Python functions (``F.linear``, the backend, the model's forward), and a compiled graph calls
none of them: in the compiled mode the timers see the phases around the graph, the graph as a
whole and attention (the opaque op calls the backend), and the split of the graph's time into
matmuls and the fused kernels between them comes from the profiler's table only. The compiled
step's first call at each batch size compiles (about 30 s for SmolLM2, seconds when inductor's
disk cache has it); it is paid in the warm-up, before anything is timed.

    python benchmarks/profile_step.py                  # SmolLM2-135M, batch 16 and 32, fp32 and bf16
    python benchmarks/profile_step.py --batches 1 --dtypes float32 --steps 10
    python benchmarks/profile_step.py --batches 16 --dtypes bfloat16 --modes eager compiled

Each dtype runs tinyserve and transformers in it; transformers' decode forward (one new token per
row, its KV cache, the same batch and context) is timed beside tinyserve's step, the two taking
turns step by step. It writes ``profile_step.csv`` (per dtype, batch and mode: median ms and share
of each part) and ``profile_step_ops.csv`` (per dtype, batch and mode: each op kind's ops and ms
per step under the profiler, its floor, FLOPs and bytes) to ``--out``.

The answer to "is a step's fixed cost small?" is the share that is neither a matmul nor
attention (``other``): issue 17's target is at most a third of a batch-32 decode step.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import RESULTS_DIR, machine, patched, table  # noqa: E402
from torch.profiler import ProfilerActivity, record_function  # noqa: E402

from tinyserve import SamplingParams  # noqa: E402
from tinyserve.lab import perf  # noqa: E402
from tinyserve.lab.perf import op_table  # noqa: E402


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


def build_llm(model: str, batch: int, dtype: torch.dtype | str = "auto", enforce_eager: bool | None = None):
    from tinyserve import LLM

    return LLM(model=model, device="cpu", dtype=dtype, max_num_seqs=batch, swap_space=0.0,
               enforce_eager=enforce_eager)


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


def compiled_graphs(llm):
    """The engine's compiled decode graphs, or None where its steps run eagerly."""
    return getattr(llm.engine.executor, "decode_graphs", None)


def profile(llm, steps: int) -> list[dict]:
    """Time ``steps`` decode steps part by part; one dict of seconds per step. Under a compiled
    step the graph is timed whole (``graph_other``: all but attention, its matmuls included)."""
    from tinyserve.models import llama

    engine = llm.engine
    executor = engine.executor
    if not hasattr(executor, "model"):
        raise ValueError("profile_step.py times a single-process engine (tensor_parallel_size=1)")
    model = executor.model
    graphs = compiled_graphs(llm)
    timers = Timers()
    rows = []
    backend = model.backend
    with ExitStack() as stack:
        for obj, attr, label in [(engine.scheduler, "schedule", "schedule"),
                                 (executor, "prepare_inputs", "prepare_inputs"),
                                 (model, "compute_logits", "lm_head"), (engine, "sampler", "sample"),
                                 # Called from Python in both modes: the opaque op runs the backend.
                                 (backend, "store_kv", "attention"), (backend, "forward", "attention")]:
            stack.enter_context(timers.wrap(obj, attr, label))
        if graphs is None:
            stack.enter_context(timers.wrap(model, "forward", "forward"))
            # torch.nn.functional.linear itself, for the duration of the block: every projection
            # of every layer (and the LM head, taken back out below) goes through it.
            stack.enter_context(timers.wrap(llama.F, "linear", "matmul"))
        else:  # inside the graph no Python runs: it is timed whole
            stack.enter_context(timers.wrap(graphs, "run", "forward"))
        for _ in range(steps):
            timers.acc.clear()
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            acc = dict(timers.acc)
            forward = acc.pop("forward", 0.0)
            if graphs is None:
                # compute_logits calls F.linear too: the LM head is its own line, not a layer matmul.
                acc["matmul"] = acc.get("matmul", 0.0) - acc.get("lm_head", 0.0)
                acc["forward_other"] = forward - acc["matmul"] - acc.get("attention", 0.0)
            else:
                acc["graph_other"] = forward - acc.get("attention", 0.0)
            acc["postprocess"] = total - sum(acc.values())
            acc["total"] = total
            rows.append(acc)
    return rows


ORDER = ["schedule", "prepare_inputs", "matmul", "attention", "forward_other", "lm_head", "sample", "postprocess"]
ORDER_COMPILED = ["schedule", "prepare_inputs", "attention", "graph_other", "lm_head", "sample", "postprocess"]


def summarize(rows: list[dict], order: list[str] = ORDER) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in order + ["total"]}


def report(med: dict[str, float], batch: int, order: list[str] = ORDER) -> str:
    lines = [f"batch-{batch} decode step, median over steps: {1000 * med['total']:.1f} ms"]
    for k in order:
        lines.append(f"  {k:15s} {1000 * med[k]:7.2f} ms  {100 * med[k] / med['total']:5.1f}%")
    if "matmul" in med:
        core = med["matmul"] + med["attention"] + med["lm_head"]
        lines.append(f"  not a matmul or attention: {100 * (1 - core / med['total']):.1f}% of the step")
    return "\n".join(lines)


@contextmanager
def labelled(obj, attr: str, label: str):
    """Every call of ``obj.attr`` inside ``record_function(label)`` while the block runs: a
    labelled span in the profiler's trace."""
    original = getattr(obj, attr)

    def run(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    with patched(obj, attr, run):
        yield


def profile_ops(llm, steps: int) -> dict[str, dict[str, float]]:
    """``op_table.op_kinds`` of ``steps`` decode steps run under ``torch.profiler``, with the
    labels it reads around the engine's phases, attention and (in an eager step) the model's
    modules. A compiled graph is left as it is: labels inside it would break it."""
    from tinyserve.models import llama

    engine, executor = llm.engine, llm.engine.executor
    model, graphs = executor.model, compiled_graphs(llm)
    spans = [(engine.scheduler, "schedule", "ts.schedule"), (executor, "prepare_inputs", "ts.prepare_inputs"),
             (model, "compute_logits", "ts.lm_head"), (engine, "sampler", "ts.sample"),
             (model.backend, "store_kv", "ts.attention"), (model.backend, "forward", "ts.attention")]
    if graphs is None:
        spans += [(model, "forward", op_table.FORWARD), (llama.RMSNorm, "forward", "ts.norm"),
                  (llama, "apply_rotary", "ts.rotary"), (llama.RotaryEmbedding, "forward", "ts.rotary"),
                  (llama.LlamaMLP, "forward", "ts.mlp"), (llama.LlamaAttention, "forward", "ts.attn"),
                  (llama.LlamaDecoderLayer, "forward", "ts.layer")]
    else:
        spans.append((graphs, "run", op_table.FORWARD))
    with ExitStack() as stack:
        for obj, attr, label in spans:
            stack.enter_context(labelled(obj, attr, label))
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function(op_table.STEP):
                    engine.step()
    return op_table.op_kinds(prof.events())


def matmul_rates(model, batch: int, repeats: int = 3) -> dict[tuple[int, int, int], float]:
    """FLOP/s of each (M, K, N) matmul of a decode step at ``batch``: the best of ``repeats``
    passes of ``F.linear`` over all the model's weights of that shape (so they stream from
    memory, as in a step, rather than sit in cache), or of oneDNN's linear on the same weights
    packed (``models/packed_linear.py``) where the CPU packs them and that is faster."""
    from tinyserve.models.packed_linear import packing_supported

    weights = [m.weight for m in model.layers.modules() if isinstance(m, op_table.Linear)] + [model.head_weight]
    rates = {}
    with torch.inference_mode():
        for kind in op_table.matmul_shapes(model, batch).values():
            for m, k, n in kind:
                ws = [w for w in weights if tuple(w.shape) == (n, k)]
                x = torch.randn(m, k, dtype=ws[0].dtype)
                best = _best_pass(lambda x=x, ws=ws: [F.linear(x, w) for w in ws], repeats)
                if packing_supported(ws[0]):
                    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
                    best = min(best, _best_pass(lambda x=x, packed=packed: [
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed], repeats))
                    del packed
                rates[m, k, n] = 2 * m * k * n * len(ws) / best
    return rates


def _best_pass(call, repeats: int) -> float:
    """The fewest seconds of ``repeats`` calls of ``call``, after one to warm up (oneDNN's
    buffers, the thread pool)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def context_len(llm) -> int:
    """The mean length of the running sequences: each one's context at the next decode step."""
    lens = [s.get_len() for g in llm.engine.scheduler.running for s in g.get_seqs()]
    return round(statistics.mean(lens))


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


def profile_dtype(args, name: str, bandwidth: float) -> tuple[list[dict], list[dict]]:
    """The rows of one dtype, each mode in turn (``profile_mode``), with transformers loaded once;
    then each op table beside its floors. Each mode measures the matmul rates again after its
    steps and a shape's floor takes the fastest: the floor is the best this machine was seen to
    do, the same in every mode (on a shared machine one measurement may fall in a busy spell)."""
    hf = None if args.no_transformers else perf.load_hf_model(args.model, device="cpu", dtype=DTYPES[name])
    rows, tables, rates = [], [], {}
    for mode in args.modes:
        parts, mode_tables = profile_mode(args, name, mode, hf, rates)
        rows += parts
        tables += mode_tables
        gc.collect()  # the mode's engine and its cache go before the next one's
    op_rows = []
    for mode, batch, model, context, kinds in tables:
        kind_floors = op_table.floors(model, batch, context, DTYPES[name].itemsize, rates[batch], bandwidth)
        for r in op_table.table_rows(kinds, kind_floors, compiled=mode == "compiled"):
            op_rows.append(dict(dtype=name, batch=batch, mode=mode, **r))
    return rows, op_rows


def profile_mode(args, name: str, mode: str, hf, rates: dict) -> tuple[list[dict], list[tuple]]:
    """One dtype and mode: each batch's parts, the fused-projection comparison (eager) and
    transformers' decode forward at the same batch, context and dtype, step for step in turn;
    and each batch's op table, as ``(mode, batch, model, context, kinds)``. ``rates`` (per
    batch, per matmul shape) keeps the fastest rate measured."""
    dtype = DTYPES[name]
    llm = build_llm(args.model, max(args.batches), dtype=dtype, enforce_eager=mode == "eager")
    graphs = compiled_graphs(llm)
    order = ORDER if graphs is None else ORDER_COMPILED
    rows, tables = [], []
    for batch in args.batches:
        fill(llm, batch, args.prompt_len, max_tokens=args.steps + args.profile_steps + 8)
        if graphs is not None:
            print(f"{name} batch {batch}: compiling the decode step (once per padded size; inductor's disk "
                  f"cache makes a later run's quick) ...", flush=True)
        t = time.perf_counter()
        profile(llm, 2)  # warm-up; a compiled step's first call at this size compiles
        if graphs is not None:
            print(f"{name} batch {batch}: warm-up with compiling {time.perf_counter() - t:.1f} s "
                  f"(compile seconds per size: {graphs.compile_seconds})")
        # The same context as tinyserve's steps (the prompt and its first token, then decoding).
        theirs = None if hf is None else transformers_decoder(
            hf, perf.make_prompts(llm.tokenizer, [args.prompt_len + 1] * batch))
        ours, their_times = take_turns(lambda: profile(llm, 1)[0], theirs, args.steps)
        med = summarize(ours, order)
        context = context_len(llm) + args.profile_steps // 2  # the middle of the profiled steps
        kinds = profile_ops(llm, args.profile_steps)
        llm.engine.abort_request([f"r{i}" for i in range(batch)])
        print(f"{name} {mode}: " + report(med, batch, order))
        model = llm.engine.executor.model
        measured = matmul_rates(model, batch)
        rates[batch] = {s: max(r, rates.get(batch, {}).get(s, 0.0)) for s, r in measured.items()}
        tables.append((mode, batch, model, context, kinds))
        print(f"{name} {mode}: under the profiler the step took {kinds['total']['us'] / 1000:.1f} ms "
              f"(median of {args.profile_steps})")
        rows += [dict(dtype=name, batch=batch, mode=mode, part=k, ms=round(1000 * med[k], 3),
                      share=round(med[k] / med["total"], 4)) for k in order + ["total"]]
        if graphs is None:
            f = fusion_side_by_side(model, batch)
            print(f"q/k/v + gate/up projections of all layers at batch {batch}: fused {1000 * f['fused']:.1f} "
                  f"ms, split into 5 matmuls {1000 * f['split']:.1f} ms ({f['split'] / f['fused']:.2f}x)")
            rows += [dict(dtype=name, batch=batch, mode=mode, part=f"qkv_gate_up_{k}", ms=round(1000 * v, 3),
                          share="") for k, v in f.items()]
        if their_times:
            ms = 1000 * statistics.median(their_times)
            print(f"{name}: transformers' decode forward at batch {batch}: {ms:.1f} ms "
                  f"(tinyserve's whole step {1000 * med['total']:.1f} ms, {mode})")
            rows.append(dict(dtype=name, batch=batch, mode=mode, part="transformers_forward", ms=round(ms, 3),
                             share=""))
    return rows, tables


OP_COLUMNS = ["dtype", "batch", "mode", "kind", "ops_per_step", "ms_per_step", "floor_ms", "flops", "bytes"]


def main(argv: list[str] | None = None) -> list[dict]:
    from roofline import copy_bandwidth  # here, not at the top: roofline imports this module

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"],
                    help="eager: LLM(enforce_eager=True); compiled: enforce_eager=False, the compiled decode step")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=3, help="steps run under torch.profiler for the op table")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="compile with inductor's kernel profiling, so the table counts the fused kernels one by "
                         "one (a different compiled step: it compiles again, and each kernel is one more span)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1 or args.profile_steps < 1:
        raise ValueError("--batches, --steps and --profile-steps must be at least 1")
    if args.kernel_profile:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
    print(f"machine: {machine()}")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    rows, op_rows = [], []
    for name in args.dtypes:
        parts, ops = profile_dtype(args, name, bandwidth)
        rows += parts
        op_rows += ops
    print()
    print("op kinds per decode step (under torch.profiler), beside each kind's floor:")
    print(table(op_rows, OP_COLUMNS))
    print(f"wrote {perf.write_results('profile_step', rows, args.out)}")
    print(f"wrote {perf.write_results('profile_step_ops', op_rows, args.out)}")
    return rows


if __name__ == "__main__":
    main()
