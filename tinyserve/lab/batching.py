"""Workloads run under other rules than tinyserve's: the baselines the chapters compare against.

``static_batching`` plays request-level batching (a batch runs until its longest member is done)
and reports it as RoundRecords, so it can be drawn and measured like the real scheduler's rounds.
``preemption_sweep`` runs one random workload (``random_requests``) over a grid of GPU block
budgets and watermarks to show what preemption costs (chapter 05).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.lab.records import recomputed_tokens
from tinyserve.sim import Request, RoundRecord, simulate


def static_batching(requests: Sequence[Request], max_batch_size: int) -> list[RoundRecord]:
    """Request-level batching, as RoundRecords: a batch of up to ``max_batch_size`` arrived
    requests (first come, first served) is prefilled together and then decoded until its
    longest member is done; only then does the next batch start.

    ``running`` lists every member of the batch in each of its rounds: one that has finished
    keeps its slot until the batch ends, in ``running`` but not in ``batch`` (an idle slot).
    Memory is not modelled (block fields are empty)."""
    # >>> fold: validation
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    # <<<
    pending = sorted(requests, key=lambda r: r.arrival_round)
    waiting: list[Request] = []
    current: list[Request] = []
    produced: dict[str, int] = {}
    records: list[RoundRecord] = []
    round_no = 0
    while pending or waiting or current:
        round_no += 1
        while pending and pending[0].arrival_round <= round_no:
            waiting.append(pending.pop(0))
        phase = "decode"
        if not current and waiting:
            current, waiting = waiting[:max_batch_size], waiting[max_batch_size:]
            phase = "prefill"
        batch = [r for r in current if produced.get(r.request_id, 0) < r.output_len]
        finished = []
        for r in batch:
            produced[r.request_id] = produced.get(r.request_id, 0) + 1
            if produced[r.request_id] == r.output_len:
                finished.append(r.request_id)
        # A finished member still holds its slot until the whole batch is done.
        running = [r.request_id for r in current]
        if all(produced.get(r.request_id, 0) >= r.output_len for r in current):
            current = []
        records.append(RoundRecord(
            round=round_no, phase=phase if batch else "idle", batch=[r.request_id for r in batch], preempted=[],
            swapped_out=[], swapped_in=[], finished=finished, ignored=[], waiting=[r.request_id for r in waiting],
            running=running, swapped=[], free_gpu_blocks=0, block_tables={},
            num_batched_tokens=sum(r.prompt_len if phase == "prefill" else 1 for r in batch),
            chunk_sizes={r.request_id: r.prompt_len if phase == "prefill" else 1 for r in batch}))
    return records


def random_requests(num_requests: int = 24, seed: int = 0, max_arrival: int = 12) -> list[Request]:
    """A fixed random workload: prompts of 4–24 tokens, outputs of 4–40, arrivals over 12 rounds."""
    rng = random.Random(seed)
    return [Request(f"r{i}", rng.randint(4, 24), rng.randint(4, 40), rng.randint(1, max_arrival))
            for i in range(num_requests)]


def preemption_sweep(requests: Sequence[Request], gpu_blocks: Sequence[int], watermarks: Sequence[float],
                     block_size: int = 4, preemption_mode: str = "recompute",
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 64) -> dict[float, list[dict]]:
    """Run the same workload over a grid of GPU block budgets and watermarks (vLLM policy).

    Returns, per watermark, one row per budget: preemptions, rounds to finish everything,
    recomputed tokens and ignored requests."""
    results: dict[float, list[dict]] = {}
    for wm in watermarks:
        rows = []
        for g in gpu_blocks:
            recs = simulate(list(requests),
                            SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                            max_model_len=256, preemption_mode=preemption_mode),
                            CacheConfig(block_size=block_size, num_gpu_blocks=g, num_cpu_blocks=4 * g, watermark=wm))
            rows.append({"num_gpu_blocks": g, "preemptions": sum(len(r.preempted) for r in recs),
                         "rounds": len(recs), "recomputed_tokens": recomputed_tokens(recs, requests),
                         "ignored": sum(len(r.ignored) for r in recs)})
        results[wm] = rows
    return results
