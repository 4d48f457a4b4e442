"""Where tinyserve's step time goes: scheduling, input preparation, the model, sampling, the rest.

The engine times four phases itself; ``prepare_inputs`` is inside its "model" phase, so it is
timed on its own (``timing``) and subtracted. ``time_decode_step`` times one decode step of the
real model at a large batch without running the prompts through it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from tinyserve.config import SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup


@contextlib.contextmanager
def timing(module, name: str, sink: list[float]) -> Iterator[None]:
    """Temporarily wrap ``module.name`` so every call's duration is appended to ``sink``."""
    original = getattr(module, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


STEP_PARTS = ("schedule", "prepare", "model", "sample", "process")


def split_steps(times: list[tuple], records: list, prepare: list[float]) -> list[dict]:
    rows = []
    timed = iter(prepare)
    for (sched, model, sample, process), rec in zip(times, records):
        prep = next(timed, 0.0) if rec.batch else 0.0
        # A decoding member brings one new token (a prompt chunk of exactly one token would count
        # too; the benchmarks' prompts are longer than that).
        decoding = len(rec.batch) if rec.phase == "decode" else sum(n == 1 for n in rec.chunk_sizes.values())
        rows.append(dict(step=len(rows) + 1, phase=rec.phase, batch_size=len(rec.batch),
                         decode_rows=decoding, num_tokens=rec.num_batched_tokens, schedule=sched,
                         prepare=prep, model=model - prep, sample=sample, process=process))
    return rows


def time_decode_step(llm, num_seqs: int = 256, prompt_len: int = 64, rounds: int = 3) -> list[dict]:
    """One decode step of the real model at batch ``num_seqs``, split as ``step_breakdown`` does.

    The prompts are not run through the model (at batch 256 that would take minutes on a CPU):
    a scheduler of its own admits them and marks them computed, so the cache holds zeros where
    their K/V would be. A decode step costs the same either way; only the tokens differ.
    """
    from tinyserve.sampler import SampleRequest

    engine = llm.engine
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=num_seqs * prompt_len, max_num_seqs=num_seqs,
                                          max_model_len=engine.scheduler_config.max_model_len),
                          engine.cache_config)
    for i in range(num_seqs):
        seq = Sequence(i, None, [1000 + i] * prompt_len, engine.cache_config.block_size)
        scheduler.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(temperature=0.0, max_tokens=10**6), 0.0))
    greedy = SampleRequest(SamplingParams(temperature=0.0))
    rows = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        metas, out = scheduler.schedule()
        t1 = time.perf_counter()
        prepare: list[float] = []
        if r > 0:  # round 0 is the prefill: skipped, see above
            with timing(engine.executor, "prepare_inputs", prepare):  # the Worker packs with it
                logits = engine.executor.execute_model(metas, {}, {}, {})
        t2 = time.perf_counter()
        tokens = engine.sampler(logits, [greedy] * len(metas)) if r > 0 else [[7]] * len(metas)
        t3 = time.perf_counter()
        sampled = {meta.request_id: tok[0] for meta, tok in zip(metas, tokens)}
        scheduler.postprocess(out, lambda group, seq, sampled=sampled: sampled[group.request_id])
        if r > 0:
            if len(metas) != num_seqs or out.phase != "decode":
                raise RuntimeError(f"expected a decode round of {num_seqs}, got {out.phase} of {len(metas)}")
            rows.append(dict(schedule=t1 - t0, prepare=prepare[0], model=t2 - t1 - prepare[0], sample=t3 - t2))
    return rows


def step_shares(rows: list[dict]) -> dict[str, float]:
    total = sum(r[p] for r in rows for p in STEP_PARTS)
    return {p: sum(r[p] for r in rows) / total for p in STEP_PARTS}
