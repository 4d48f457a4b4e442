"""Side-by-side runs of the real engine, for the exercises whose answer is an engine component.

The reader's component goes in through a documented constructor argument (``Worker(...,
cache_engine=...)``, ``attention_backend=<object>``, ``LLMEngine(..., sampler=...)``), the
package's own runs on the same requests, and ``compare`` prints both runs' tokens with a verdict.
The checkers run the tiny random Llama of ``models.tiny`` (built once per process, so a check
takes a second); the chapters may pass the model they already loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.models.loader import LoadedModel
from tinyserve.models.tiny import tiny_model
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker

PROMPTS = {"s0": "Hello, my name is", "s1": "The future of AI is", "s2": "The life is"}


def tiny(device: str = "cpu") -> LoadedModel:
    """The tiny random Llama, built once per process and device."""
    return _tiny(str(device))


@functools.cache
def _tiny(device: str) -> LoadedModel:
    return tiny_model(device=device)


@dataclass
class Run:
    """What one engine run produced: each request's tokens, and how often blocks moved."""

    label: str
    tokens: dict[str, list[int]]
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    error: str | None = None  # the run raised: the reader's component crashed inside the engine
    texts: dict[str, str] = field(default_factory=dict)


def run_engine(label: str, *, loaded: LoadedModel | None = None, prompts: dict[str, str] | None = None,
               params: SamplingParams | dict[str, SamplingParams] | None = None, block_size: int = 4,
               num_gpu_blocks: int = 256, num_cpu_blocks: int = 16, max_model_len: int = 64,
               preemption_mode: str | None = None, attention_backend="torch", cache_engine=None,
               sampler=None) -> Run:
    """Run ``prompts`` to the end on a fresh engine over ``loaded`` (default: the tiny model).

    ``cache_engine``, ``attention_backend`` and ``sampler`` go to the Worker and the engine as they
    are. An exception inside the run is caught and reported in ``Run.error``: the reader's
    component may crash, and the comparison should say so rather than stop the notebook."""
    loaded = loaded if loaded is not None else tiny()
    prompts = prompts if prompts is not None else PROMPTS
    if not isinstance(params, dict):
        params = {rid: params or SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for rid in prompts}
    model_config = ModelConfig(model=str(loaded.path or "in-memory"))
    try:
        worker = Worker(model_config, attention_backend=attention_backend, loaded=loaded, cache_engine=cache_engine)
        engine = LLMEngine(model_config,
                           CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                       num_cpu_blocks=num_cpu_blocks, watermark=0.0),
                           SchedulerConfig(max_num_batched_tokens=max(max_model_len, 64), max_num_seqs=8,
                                           max_model_len=max_model_len, preemption_mode=preemption_mode),
                           executor=worker, sampler=sampler, record_history=True)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params[rid])
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    except Exception as e:  # the reader's component: report, do not stop the chapter
        return Run(label, {}, error=f"{type(e).__name__}: {e}")
    history = engine.history
    return Run(label, {rid: list(done[rid].outputs[0].token_ids) for rid in prompts},
               preemptions=sum(len(r.preempted) for r in history),
               swap_outs=sum(len(r.swapped_out) for r in history), swap_ins=sum(len(r.swapped_in) for r in history),
               texts={rid: done[rid].outputs[0].text for rid in prompts})


def same_tokens(a: Run, b: Run) -> bool:
    return a.error is None and b.error is None and a.tokens == b.tokens


def compare(*runs: Run, show_moves: bool = False, show_text: bool = False) -> bool:
    """Print every run's tokens (or their text), request by request, then a verdict: True when
    all runs produced the same tokens."""
    width = max(len(r.label) for r in runs)
    for r in runs:
        if r.error:
            print(f"{r.label:<{width}}  raised {r.error}")
    ids = list(next((r.tokens for r in runs if not r.error), {}))
    for rid in ids:
        for r in runs:
            if not r.error:
                shown = repr(r.texts[rid]) if show_text else r.tokens[rid]
                print(f"{rid} {r.label:<{width}}  {shown}")
    if show_moves:
        for r in runs:
            if not r.error:
                print(f"{r.label:<{width}}  {r.preemptions} preemptions, {r.swap_outs} swap-outs, "
                      f"{r.swap_ins} swap-ins")
    ok = all(same_tokens(runs[0], r) for r in runs[1:])
    print("✓ the same tokens in every run" if ok else "✗ the runs differ")
    return ok

