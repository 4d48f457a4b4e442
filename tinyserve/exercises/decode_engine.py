"""A decode launcher inside the real engine: s0/s1/s2 on the Triton backend, with the package's
decode kernel or with another one in its place (``TritonBackend(decode=)``).

Chapter 8 runs the reader's kernel this way. Everything else is the package's: the scheduler
with its preemption, the cache engine, the Triton store kernel, the SDPA prefill and the sampler;
only the ``decode-kernel`` route changes hands. The model is the tiny random Llama by default
(2 layers, 4 query heads on 2 KV heads), small enough for Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyserve import presets
from tinyserve.attention.triton_backend import TritonBackend
from tinyserve.attention.triton_paged import INTERPRET
from tinyserve.sampling_params import SamplingParams


@dataclass
class DecodeRun:
    """One engine run: each request's greedy tokens, the backend's route counts (attention calls
    per route), how many decode calls went to the given launcher, and an error if the run raised."""

    label: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    route_counts: dict[str, int] = field(default_factory=dict)
    decode_calls: int = 0
    error: str | None = None


def run_seed_rounds(label: str, decode: Callable[..., torch.Tensor] | None = None, *, model=None,
                    preemption_mode: str = "swap") -> DecodeRun:
    """s0/s1/s2 (``presets.seed_rounds``: blocks of 5 tokens, 4 GPU blocks, a preemption) through
    the engine on ``TritonBackend(decode=decode)`` over ``model`` (default the tiny Llama, on
    CUDA when the kernels compile, else on the CPU).
    An exception in the run is caught and reported in ``error``."""
    from tinyserve.exercises.engine_runs import tiny
    from tinyserve.workspace.assemble import build_engine

    calls = [0]

    def counted(*args):
        calls[0] += 1
        return decode(*args)

    backend = TritonBackend(decode=counted if decode is not None else None)
    preset = presets.seed_rounds(preemption_mode)
    run = DecodeRun(label)
    try:
        # The Triton kernels run where they were built: compiled on CUDA, interpreted on the CPU.
        device = "cpu" if INTERPRET else "cuda"
        engine, _ = build_engine(model if model is not None else tiny(device), preset=preset, chapter=0,
                                 attention_backend=backend)
        params = SamplingParams(temperature=0.0, max_tokens=preset.max_tokens, ignore_eos=True)
        for rid, prompt in preset.prompts.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    run.tokens[out.request_id] = list(out.outputs[0].token_ids)
    except Exception as e:  # the reader's kernel may raise: report it, do not stop the chapter
        run.error = f"{type(e).__name__}: {e}"
    run.route_counts = dict(backend.route_counts)
    run.decode_calls = calls[0]
    return run


def compare_runs(package: DecodeRun, yours: DecodeRun) -> bool:
    """Print both runs' tokens request by request and a verdict; True when they are the same."""
    width = max(len(package.label), len(yours.label))
    for run in (package, yours):
        if run.error:
            print(f"{run.label:<{width}}  raised {run.error}")
    for rid in package.tokens:
        for run in (package, yours):
            if not run.error:
                print(f"{rid} {run.label:<{width}}  {run.tokens.get(rid)}")
    print(f"attention calls by route ({yours.label}): {yours.route_counts}; "
          f"{yours.decode_calls} of them went to the given decode launcher")
    ok = package.error is None and yours.error is None and package.tokens == yours.tokens
    print("✓ the same greedy tokens" if ok else "✗ the runs differ")
    return ok
