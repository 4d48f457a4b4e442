"""Which changes make a decode step cheaper? Each candidate, switched on and off in one run.

Issue 25 lists levers that might make tinyserve's decode step cheaper than transformers' at the
same batch. A lever here is a context manager that patches the engine while it is active, so
every candidate runs on the same engine, the same requests and the same weights, interleaved
with the unpatched engine (base, lever 1, lever 2, ..., then lever 1, lever 2, ..., base, and so
on, each round starting one further along): a slow spell of the shared machine hits them all
alike. ``unchanged`` patches nothing: its ratio to the base is the harness's own noise, which on
a shared 2-core machine is larger than most single levers. So each lever's part of the step is
also timed on its own (``parts``: the same tensors, many repeats), which shows what it saves.

Two levers paid and are in the package; they appear here as the old way, to measure against:

- ``store_per_layer``: the slots a batch's new K/V go to, filtered for padding in every layer (a
  mask, a ``nonzero`` and two masked copies, 30 times a step) as ``reference.store_kv`` does; the
  ``torch-batched`` backend now filters them once per step.
- ``logprobs_gathered``: the sampled tokens' log-probabilities from a ``logsumexp`` over a gathered
  copy of the logits' rows (the whole ``[batch, vocab]`` every step); ``logprobs.token_logprobs``
  now takes it over the logits as they lie.

Five did not pay, and stay here, measured:

- ``rms_norm_op``: ``torch.nn.functional.rms_norm``, one op, instead of RMSNorm spelled out.
- ``attention_fp32``: in bfloat16, the decode attention (SDPA) computed in float32 on converted
  copies (the CPU's bf16 SDPA ran about half as fast as its float32 one on small decode shapes).
- ``attention_matmul``: the attention's SDPA spelled out as two matmuls with a float32 softmax
  between them (faster than SDPA on short bf16 decode contexts in a microbenchmark).
- ``compile_mlp``: ``torch.compile`` (inductor, dynamic shapes) of every layer's MLP and norms, so
  SiLU·up and RMSNorm become fused loops; its compile time is reported apart.
- ``compile_layers``: ``torch.compile`` of the whole decoder layer but its paged attention, which
  stays eager (the graph breaks around it, as vLLM's later compiled models split their graphs at
  attention): norms, rotary, residual adds and SiLU·up fused around the matmuls.

    python benchmarks/levers.py                      # batch 16 and 32, float32 and bfloat16 (~8 min)
    python benchmarks/levers.py --batches 32 --dtypes bfloat16 --levers unchanged store_per_layer

It writes ``levers.csv`` (dtype, batch, step or part, median ms of the lever and of the package as
it is, and the lever's time over the package's) to ``--out``: a ratio above 1 means the lever
made the step (or its part) slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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
from profile_step import DTYPES, build_llm, fill  # noqa: E402

from tinyserve import logprobs  # noqa: E402
from tinyserve.attention import batched, reference  # noqa: E402
from tinyserve.config import dtype_name  # noqa: E402
from tinyserve.lab import perf  # noqa: E402
from tinyserve.models import llama  # noqa: E402


@contextmanager
def store_per_layer(llm) -> Iterator[None]:
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    with patched(batched.BatchedTorchBackend, "store_kv", store_kv):
        yield


def gathered_token_logprobs(logits, rows, tokens):
    """``logprobs.token_logprobs`` as it was: the logsumexp of a gathered copy of the rows."""
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits[index, torch.tensor(tokens, dtype=torch.long, device=logits.device)]
    return (picked - logits.index_select(0, index).logsumexp(dim=-1)).tolist()


@contextmanager
def logprobs_gathered(llm) -> Iterator[None]:
    with patched(logprobs, "token_logprobs", gathered_token_logprobs):
        yield


@contextmanager
def rms_norm_op(llm) -> Iterator[None]:
    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight

    with patched(llama.RMSNorm, "forward", forward):
        yield


class _FunctionalWith:
    """``torch.nn.functional`` as the batched backend sees it, with its SDPA replaced."""

    def __init__(self, sdpa) -> None:
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str):
        return getattr(F, name)


def sdpa_in_float32(q, k, v, attn_mask=None, scale=None):
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask, scale=scale)
    return out.to(q.dtype)


def sdpa_by_matmuls(q, k, v, attn_mask=None, scale=None):
    """Two matmuls in the inputs' dtype and a float32 softmax between them."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(~attn_mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)


@contextmanager
def attention_fp32(llm) -> Iterator[None]:
    with patched(batched, "F", _FunctionalWith(sdpa_in_float32)):
        yield


@contextmanager
def attention_matmul(llm) -> Iterator[None]:
    with patched(batched, "F", _FunctionalWith(sdpa_by_matmuls)):
        yield


# Seconds spent compiling, per (lever, dtype): torch.compile is lazy, so it is the first step's
# extra time. Compiled functions are kept per dtype, so later rounds reuse them.
COMPILE_SECONDS: dict[tuple[str, str], float] = {}
_COMPILED: dict[tuple[str, str], tuple] = {}


@contextmanager
def _compiled(llm, name: str, make: Callable[[], tuple], patches: Callable[[tuple], list]) -> Iterator[None]:
    """Enter ``patches(compiled)`` (``(object, attribute, value)`` triples), compiling on first use
    and timing the first step, which pays for the compile."""
    dtype = dtype_name(llm.engine.executor.dtype)
    first = (name, dtype) not in _COMPILED
    if first:
        _COMPILED[name, dtype] = make()
    with ExitStack() as stack:
        for obj, attr, value in patches(_COMPILED[name, dtype]):
            stack.enter_context(patched(obj, attr, value))
        if first:
            t = time.perf_counter()
            llm.engine.step()
            COMPILE_SECONDS[name, dtype] = time.perf_counter() - t
        yield


def compile_mlp(llm):
    return _compiled(llm, "compile_mlp",
                     lambda: (torch.compile(llama.LlamaMLP.forward, dynamic=True),
                              torch.compile(llama.RMSNorm.forward, dynamic=True)),
                     lambda c: [(llama.LlamaMLP, "forward", c[0]), (llama.RMSNorm, "forward", c[1])])


def compile_layers(llm):
    """Each whole decoder layer compiled, except the paged attention: the backend's ``store_kv``
    and ``forward`` plan the batch in Python from its metadata, so they are left to run eagerly
    (``torch.compiler.disable``) and the layer's graph breaks around them, into the part before
    (norm, q/k/v projection, rotary) and the part after (output projection, residuals, norm, MLP)."""
    cls = type(llm.engine.executor.model.backend)
    return _compiled(llm, "compile_layers",
                     lambda: (torch.compile(llama.LlamaDecoderLayer.forward, dynamic=True),
                              torch.compiler.disable(cls.store_kv), torch.compiler.disable(cls.forward)),
                     lambda c: [(llama.LlamaDecoderLayer, "forward", c[0]), (cls, "store_kv", c[1]),
                                (cls, "forward", c[2])])


@contextmanager
def unchanged(llm) -> Iterator[None]:
    """A control: patches nothing, so its ratio to the base is the harness's own noise."""
    yield


LEVERS: dict[str, Callable] = {"unchanged": unchanged, "store_per_layer": store_per_layer,
                               "logprobs_gathered": logprobs_gathered, "rms_norm_op": rms_norm_op,
                               "attention_fp32": attention_fp32, "attention_matmul": attention_matmul,
                               "compile_mlp": compile_mlp, "compile_layers": compile_layers}


def measure(llm, levers: list[str], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per engine step of the base and of each lever, interleaved over ``rounds``."""
    times: dict[str, list[float]] = {name: [] for name in ["base", *levers]}
    names = list(times)
    for r in range(rounds):
        # Each round starts one further along, so no variant always runs first (or last).
        for name in names[r % len(names):] + names[:r % len(names)]:
            with ExitStack() as stack:
                if name != "base":
                    stack.enter_context(LEVERS[name](llm))
                llm.engine.step()  # the first step after a switch pays for it
                for _ in range(steps):
                    t = time.perf_counter()
                    llm.engine.step()
                    times[name].append(time.perf_counter() - t)
    return times


def capture_step(llm) -> dict:
    """The inputs of the model's forward in one decode step: ids, positions, caches, metadata."""
    model = llm.engine.executor.model
    seen: dict = {}

    def grab(input_ids, positions, kv_caches, meta):
        seen.update(ids=input_ids, positions=positions, kv_caches=kv_caches, meta=meta)
        return forward(input_ids, positions, kv_caches, meta)

    forward = model.forward
    with patched(model, "forward", grab):
        llm.engine.step()
    return seen


def time_parts(llm, batch: int, levers: list[str], rounds: int, repeats: int = 20) -> list[tuple[str, float, float]]:
    """``(lever, ms of the package's way, ms of the lever's way)`` for the part of one decode
    step each lever changes, summed over the layers, on one step's real inputs (the next step's:
    after ``measure``, so the contexts are as long as the run made them): the same call, plain
    and under the lever's patch (each looks its function up when called); medians of ``rounds``
    interleaved runs of ``repeats`` each."""
    model = llm.engine.executor.model
    step = capture_step(llm)
    meta, kv_caches, dtype = step["meta"], step["kv_caches"], llm.engine.executor.dtype
    backend = model.backend
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, model.num_heads, model.head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, model.num_kv_heads, model.head_dim, generator=gen).to(dtype)
    x = torch.randn(batch, model.hidden_size, generator=gen).to(dtype)
    logits = torch.randn(batch, model.vocab_size, generator=gen)
    norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    scale = model.head_dim ** -0.5

    def store():
        return [backend.store_kv(k, k, kc, vc, meta.slot_mapping) for kc, vc in kv_caches]

    def sampled_logprobs():
        return logprobs.token_logprobs(logits, list(range(batch)), [0] * batch)

    def normalize():
        return [n(x) for n in norms]

    def attend():
        return [backend.forward(q, kc, vc, meta, scale) for kc, vc in kv_caches]

    parts = {"store_per_layer": store, "logprobs_gathered": sampled_logprobs, "rms_norm_op": normalize,
             "attention_fp32": attend, "attention_matmul": attend}
    chosen = [name for name in parts if name in levers]
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in chosen}
    with torch.inference_mode():
        for _ in range(rounds):
            for name in chosen:
                times[name][0].append(_median_call(parts[name], repeats))
                with LEVERS[name](llm):
                    times[name][1].append(_median_call(parts[name], repeats))
    return [(name, statistics.median(a), statistics.median(b)) for name, (a, b) in times.items()]


def _median_call(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    print(f"machine: {machine()}")
    rows = []
    for dtype in args.dtypes:
        llm = build_llm(args.model, max(args.batches), dtype=DTYPES[dtype])
        levers = [lv for lv in args.levers if lv != "attention_fp32" or dtype != "float32"]
        for batch in args.batches:
            per_round = (1 + len(levers)) * (args.steps + 1)
            fill(llm, batch, args.prompt_len, max_tokens=args.rounds * per_round + 16)
            llm.engine.step()
            times = measure(llm, levers, args.rounds, args.steps)
            base = statistics.median(times["base"])
            for name, ts in times.items():
                med = statistics.median(ts)
                rows.append(dict(dtype=dtype, batch=batch, timed="step", lever=name, ms=round(1000 * med, 2),
                                 base_ms=round(1000 * base, 2), lever_over_base=round(med / base, 3),
                                 compile_s=round(COMPILE_SECONDS[name, dtype], 1)
                                 if (name, dtype) in COMPILE_SECONDS else ""))
                print(f"{dtype} batch {batch} step {name:>18}: {1000 * med:7.1f} ms against the base's "
                      f"{1000 * base:.1f}")
            for name, ours, theirs in time_parts(llm, batch, levers, args.rounds):
                rows.append(dict(dtype=dtype, batch=batch, timed="part", lever=name, ms=round(1000 * theirs, 3),
                                 base_ms=round(1000 * ours, 3), lever_over_base=round(theirs / ours, 3), compile_s=""))
                print(f"{dtype} batch {batch} part {name:>18}: {1000 * theirs:7.3f} ms against the package's "
                      f"{1000 * ours:.3f} ms")
            llm.engine.abort_request([f"r{i}" for i in range(batch)])
    print(table(rows, list(rows[0])))
    print(f"wrote {perf.write_results('levers', rows, args.out)}")
    return rows


def readme_table(rows: list[dict]) -> str:
    """The table of ``levers.csv`` in ``docs/performance.md``: per lever, the part it changes (its ms against the
    package's) and the whole step (its time over the base's), in each dtype and batch."""
    shapes = list(dict.fromkeys((r["dtype"], r["batch"]) for r in rows))
    lines = ["| lever | " + " | ".join(f"{d} b{b}" for d, b in shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    for lever in dict.fromkeys(r["lever"] for r in rows if r["lever"] != "base"):
        for timed in ("part", "step"):
            found = {(r["dtype"], r["batch"]): r for r in rows if r["lever"] == lever and r["timed"] == timed}
            if not found:
                continue
            cells = []
            for shape in shapes:
                r = found.get(shape)
                if r is None:
                    cells.append("")
                elif timed == "part":
                    cells.append(f"{r['ms']:.2f} ms against {r['base_ms']:.2f}")
                else:
                    cells.append(f"{r['lever_over_base']:.2f}×")
            lines.append(f"| `{lever}`, {'its part' if timed == 'part' else 'the step'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
