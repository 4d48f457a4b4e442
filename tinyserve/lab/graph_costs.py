"""What a compiled decode step saves, and what its padding costs: the numbers of section 11.14.

Three kinds of numbers, none of them drawn here (``tinyserve/viz/graphs.py`` draws them):

- **Measured live.** ``op_times`` times one small op at several sizes and ``fit_op_cost`` splits
  its time into a fixed cost per call (the dispatch from Python to the kernel) and a cost per
  element (the work); ``count_step_ops`` counts the tensor ops one eager decode step dispatches.
  Together they say how much of a step is overhead that a graph removes. ``packing_gain`` times
  one bf16 projection on a plain weight and on the weight packed once for oneDNN.
- **Read from the benchmark.** ``step_rows`` reads ``benchmarks/results/compiled_step.csv``
  (``benchmarks/compiled_step.py``: a decode step eager and compiled, transformers' forward and
  the machine's floor, batch by batch), ``compile_times`` its ``compiled_step_compile.csv`` (the
  first compile and the one loaded from inductor's cache).
- **Derived.** ``padding_table`` says which capture size each batch runs on
  (``tinyserve.graphs.sizes``) and ``padding_costs`` what the padded rows cost, from the rows of
  a batch and of the size it is padded to.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tinyserve.graphs.sizes import capture_sizes, padded_size
from tinyserve.lab.perf.results import read_results
from tinyserve.models.packed_linear import pack, packed_linear, packing_supported

STEP_RESULTS = "compiled_step"
COMPILE_RESULTS = "compiled_step_compile"
# Sizes of one elementwise op in a decode step: a hidden state row of SmolLM2 (576 values) up to
# 32 of them (18,432 values). All stay under torch's grain size for splitting an elementwise op
# across threads (32,768 elements) and in cache, so the fit sees one thread's work on cached data.
OP_SIZES = (1, 576, 4 * 576, 8 * 576, 16 * 576, 32 * 576)


# -- read from the benchmark -------------------------------------------------------------------


def step_rows(results_dir: str | Path | None = None, dtype: str | None = None) -> list[dict]:
    """The rows of ``compiled_step.csv`` (of ``dtype`` only, when given), by batch."""
    rows = [r for r in read_results(STEP_RESULTS, results_dir) if dtype is None or r["dtype"] == dtype]
    return sorted(rows, key=lambda r: r["batch"])


def compile_times(results_dir: str | Path | None = None) -> dict[str, float]:
    """Seconds to compile batch 16's graph: ``{"first": s, "cached": s}`` (the second run loads
    what the first left in inductor's on-disk cache)."""
    return {r["run"]: float(r["compile_s"]) for r in read_results(COMPILE_RESULTS, results_dir)}


# -- derived -----------------------------------------------------------------------------------


def padding_table(max_num_seqs: int = 32) -> list[dict]:
    """For every batch of 1 to ``max_num_seqs`` sequences: the capture size it runs on, its
    padding rows and their share of the rows the graph computes."""
    sizes = capture_sizes(max_num_seqs)
    out = []
    for batch in range(1, max_num_seqs + 1):
        size = padded_size(batch, sizes)
        out.append(dict(batch=batch, graph_size=size, padded_rows=size - batch, padded_share=(size - batch) / size))
    return out


def padding_costs(rows: list[dict]) -> list[dict]:
    """Each padded batch of ``rows`` (``compiled_step.csv``) beside the batch its graph was
    recorded for: what its step costs against a full graph's, and per generated token."""
    full = {r["batch"]: r for r in rows if r["batch"] == r["graph_size"]}
    out = []
    for r in rows:
        at = full.get(r["graph_size"])
        if r["batch"] == r["graph_size"] or at is None:
            continue
        out.append(dict(batch=r["batch"], graph_size=r["graph_size"], compiled_ms=r["compiled_ms"],
                        full_ms=at["compiled_ms"], step_ratio=r["compiled_ms"] / at["compiled_ms"],
                        padded_share=(r["graph_size"] - r["batch"]) / r["graph_size"],
                        ms_per_token=r["compiled_ms"] / r["batch"], full_ms_per_token=at["compiled_ms"] / at["batch"]))
    return out


# -- measured live -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCost:
    """``time(n) = fixed_s + per_element_s * n`` for one op on ``n`` elements."""

    fixed_s: float
    per_element_s: float

    def seconds(self, numel: int) -> float:
        return self.fixed_s + self.per_element_s * numel

    def fixed_share(self, numel: int) -> float:
        """The share of one call on ``numel`` elements that is its fixed cost."""
        return self.fixed_s / self.seconds(numel)

    def break_even(self) -> float:
        """The size at which the work costs as much as the call itself."""
        return self.fixed_s / self.per_element_s if self.per_element_s > 0 else float("inf")


def op_times(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add, sizes=OP_SIZES,
             calls: int = 300, rounds: int = 5, dtype: torch.dtype = torch.float32) -> list[tuple[int, float]]:
    """Seconds per call of ``op(a, b)`` on two tensors of each size: the best of ``rounds``
    rounds of ``calls`` back-to-back calls (the least disturbed by a shared machine)."""
    out = []
    for n in sizes:
        a, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
        op(a, b)  # the first call allocates; not what a step pays
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                op(a, b)
            best = min(best, (time.perf_counter() - start) / calls)
        out.append((n, best))
    return out


def fit_op_cost(points: list[tuple[int, float]]) -> OpCost:
    """The least-squares line through ``(numel, seconds)`` points; a negative fixed or
    per-element cost (noise at two points) is clipped to zero."""
    if len({n for n, _ in points}) < 2:
        raise ValueError("fitting a fixed and a per-element cost needs at least two sizes")
    k = len(points)
    mx, my = sum(n for n, _ in points) / k, sum(t for _, t in points) / k
    slope = sum((n - mx) * (t - my) for n, t in points) / sum((n - mx) ** 2 for n, _ in points)
    slope = max(slope, 0.0)
    return OpCost(fixed_s=max(my - slope * mx, 0.0), per_element_s=slope)


def time_call(fn: Callable[[], object], calls: int = 300, rounds: int = 5) -> float:
    """Best seconds per call of ``fn()`` over ``rounds`` rounds of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def packing_gain(rows: int = 16, in_features: int = 576, out_features: int = 3072) -> dict | None:
    """One bf16 projection of ``rows`` rows (by default SmolLM2's gate/up at batch 16) through
    ``F.linear`` and through the weight packed once for oneDNN (``models/packed_linear.py``): best
    seconds per call of each, and whether the two agree exactly. None where the CPU's oneDNN has
    no bf16 kernels (nothing is packed there)."""
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features**0.5
    if not packing_supported(weight):
        return None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    handle = pack(weight)
    with torch.inference_mode():
        plain = time_call(lambda: F.linear(x, weight), calls=50)
        packed = time_call(lambda: packed_linear(x, handle), calls=50)
        same = torch.equal(F.linear(x, weight), packed_linear(x, handle))
    return dict(plain_s=plain, packed_s=packed, same=same)


class _OpCounter(TorchDispatchMode):
    """Counts every ATen op that reaches the dispatcher while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_ops() -> Iterator[Counter]:
    """``with counting_ops() as ops:``: ``ops`` counts the ATen ops run in the block, by name."""
    counter = _OpCounter()
    with counter:
        yield counter.ops


def count_step_ops(llm, batch: int = 16, prompt_len: int = 32) -> Counter:
    """The ATen ops of the model's forward in one eager decode step of ``batch`` sequences of
    ``llm``'s engine (scheduling and sampling left out: they are the engine's, not the graph's)."""
    from tinyserve.sampling_params import SamplingParams

    engine, worker = llm.engine, llm.engine.executor
    if batch > engine.scheduler_config.max_num_seqs:
        raise ValueError(f"batch {batch} is more than the engine runs at once ({engine.scheduler_config.max_num_seqs})")
    ids = [f"ops{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           prompt_token_ids=[(7 + i) % engine.vocab_size] * prompt_len)
    try:
        while engine.scheduler.waiting:  # the prefills, until every request decodes
            engine.step()
        plain_run, counted = worker.run, Counter()

        def run(inputs):
            meta = inputs.attn_metadata
            if not meta.is_decode or meta.num_seqs != batch:
                raise RuntimeError(f"expected a decode step of {batch} sequences, got {meta.num_seqs}")
            with counting_ops() as ops:
                out = plain_run(inputs)
            counted.update(ops)
            return out

        worker.run = run
        try:
            engine.step()
        finally:
            del worker.run  # the instance attribute goes; the class's method is back
    finally:
        engine.abort_request(ids)
    return counted
