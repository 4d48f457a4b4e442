"""Memory is flat over thousands of steps when history is off, as in the server.

A steady stream of requests runs through the engine on the tiny model. ``tracemalloc`` counts
every Python allocation still alive, so a list that grows by a record a step (the old
``engine.history`` and ``times.history``) shows up at once; the same run with
``record_history=True`` shows that it would.
"""

from __future__ import annotations

import itertools
import tracemalloc

import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.sequence import SamplingParams
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:"]


def make_engine(loaded, record_history: bool) -> LLMEngine:
    config = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    # A small pool, so that preemption (swap) is part of the steady state too.
    return LLMEngine(config, CacheConfig(block_size=8, num_gpu_blocks=8, num_cpu_blocks=16, watermark=0.0),
                     SchedulerConfig(max_num_seqs=4, max_model_len=64, preemption_mode="swap"),
                     executor=Worker(config, loaded=loaded), record_history=record_history)


def run_steps(engine: LLMEngine, ids, num_steps: int) -> None:
    """Keep about four requests in flight (greedy, sampled with n=2, seeded, stop strings)."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=1, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=15, stop=["zz", "q"], ignore_eos=True)]
    for _ in range(num_steps):
        while engine.get_num_unfinished_requests() < 4:
            i = next(ids)
            engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], params[i % len(params)])
        engine.step()


def growth(engine: LLMEngine, warmup: int, steps: int) -> int:
    """Bytes of Python memory still allocated after ``steps`` steps that were not after warm-up."""
    ids = itertools.count()
    tracemalloc.start()
    try:
        run_steps(engine, ids, warmup)
        before = tracemalloc.get_traced_memory()[0]
        run_steps(engine, ids, steps)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(120)
def test_memory_is_flat_over_thousands_of_steps_without_history(tiny_loaded):
    engine = make_engine(tiny_loaded, record_history=False)
    grown = growth(engine, warmup=300, steps=2000)
    assert engine.num_generation_tokens_total > 2000 and engine.num_preemptions_total > 0
    assert grown < 64 * 1024, f"{grown} bytes more after 2000 steps"


def test_the_same_run_with_history_grows_with_every_step(tiny_loaded):
    # The control: the measurement above does see a record a step.
    engine = make_engine(tiny_loaded, record_history=True)
    grown = growth(engine, warmup=100, steps=300)
    assert len(engine.history) == 400 and len(engine.times.history) == 400
    assert grown > 300 * 500, f"only {grown} bytes for 300 recorded steps"
