"""Measurements that need no model: KV cache utilization over a workload, and the cost of one
``schedule()`` call with many sequences running (``benchmarks/memory.py``,
``benchmarks/scheduler_overhead.py``, chapter 11)."""

from __future__ import annotations

import time

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup
from tinyserve.sim import Request, simulate


def kv_utilization(prompt_lens: list[int], output_lens: list[int], block_size: int = 16,
                   max_num_seqs: int = 32, max_model_len: int = 2048,
                   max_num_batched_tokens: int = 2048) -> dict[str, float]:
    """Share of allocated KV slots that hold a token, averaged over every round of a workload.

    The real scheduler runs the workload (``sim.simulate``) with room for every request it
    admits. In each round a running request holds the tokens it has computed (the sum of its
    chunks) in ``len(block_table) * block_size`` slots. The same rounds are then charged as if
    every running request had reserved a contiguous region of ``max_model_len`` slots, or of
    ``prompt + max_tokens`` slots (its worst case, known up front), as systems before paging did.
    """
    reqs = [Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
    blocks_per_req = -(-(max(prompt_lens) + max(output_lens)) // block_size)
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=max_num_seqs * blocks_per_req + 1, num_cpu_blocks=0)
    sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
    want = {r.request_id: r.prompt_len + r.output_len for r in reqs}
    computed: dict[str, int] = {}
    held = paged = to_max = to_need = 0
    for rec in simulate(reqs, sched, cache):
        if rec.preempted:
            raise RuntimeError("the utilization measurement assumes a cache with room for every request")
        for rid, chunk in rec.chunk_sizes.items():
            computed[rid] = computed.get(rid, 0) + chunk
        for rid, table in rec.block_tables.items():
            held += computed[rid]
            paged += len(table) * block_size
            to_max += max_model_len
            to_need += want[rid]
    return {"paged": held / paged, "reserve_max_model_len": held / to_max, "reserve_prompt_plus_max_tokens":
            held / to_need}


def time_schedule(num_seqs: int = 256, num_blocks: int = 10_000, block_size: int = 16, prompt_len: int = 100,
                  rounds: int = 200, policy: str = "vllm") -> list[float]:
    """Seconds per ``schedule()`` call while ``num_seqs`` sequences decode together.

    Every sequence is admitted and prefilled first (untimed); then each timed round schedules all
    of them for one decode step, and each gets a token, as the engine would do after sampling.
    """
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0)
    config = SchedulerConfig(max_num_batched_tokens=max(num_seqs * prompt_len, 2048), max_num_seqs=num_seqs,
                             max_model_len=2048, policy=policy)
    scheduler = Scheduler(config, cache)
    for i in range(num_seqs):
        seq = Sequence(i, None, [1000 + i] * prompt_len, block_size)
        scheduler.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(max_tokens=10**6), 0.0))
    times = []
    for r in range(rounds + 1):
        t = time.perf_counter()
        metas, out = scheduler.schedule()
        dt = time.perf_counter() - t
        if r > 0:  # round 0 is the prefill
            times.append(dt)
        scheduler.postprocess(out, lambda group, seq: 7)
    if len(out.scheduled_seq_groups) != num_seqs:
        raise RuntimeError(f"only {len(out.scheduled_seq_groups)} of {num_seqs} sequences were scheduled")
    return times
