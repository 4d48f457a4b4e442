"""What if the cache were smaller, the watermark higher, the token budget tighter, or preempted
requests were swapped instead of recomputed? ``explore`` runs a workload through the real
scheduler (``sim.simulate``) under one setting and counts what that setting cost.

The counts come straight from the round records, independently of how the scheduler decided:

- ``recomputed_tokens``: tokens the model processed for the requests that finished, beyond
  what they need. Without preemption a request costs its prompt once plus one token per later
  output token (``prompt_len + output_len - 1``); recompute-preemption prefills a request's
  tokens again, and everything above that sum is work done twice.
- ``wasted_tokens``: tokens processed for requests that were refused later: work thrown away.
  A request preempted by recompute comes back as a prompt of all its tokens so far; once that
  needs more blocks than the whole cache has, the scheduler finishes it as ignored, unfinished,
  after it ran for rounds (``ran_then_ignored``). Only a prompt too long from the start is
  ignored without ever running.
- ``swapped_out_blocks`` / ``swapped_in_blocks``: blocks copied GPU -> CPU and back, read from
  the CPU block tables of the rounds around each swap.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request, RoundRecord, simulate

PREEMPTION_MODES = ("recompute", "swap", None)  # None: vLLM's rule (recompute single sequences)


@dataclass(frozen=True)
class WhatIfSettings:
    """One point in the what-if space. The CPU swap space is ``cpu_factor`` times the GPU's."""

    num_gpu_blocks: int = 20
    watermark: float = 0.0
    max_num_batched_tokens: int = 48
    preemption_mode: str | None = "recompute"
    block_size: int = 4
    max_num_seqs: int = 8
    max_model_len: int = 48
    cpu_factor: int = 2

    def configs(self) -> tuple[SchedulerConfig, CacheConfig]:
        """The scheduler and cache configs (each checks its fields and names a bad one)."""
        sched = SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                                max_model_len=self.max_model_len, preemption_mode=self.preemption_mode)
        cache = CacheConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                            num_cpu_blocks=self.cpu_factor * self.num_gpu_blocks, watermark=self.watermark)
        return sched, cache

    def but(self, **changes) -> WhatIfSettings:
        return replace(self, **changes)


@dataclass
class WhatIfOutcome:
    settings: WhatIfSettings
    records: list[RoundRecord]
    rounds: int
    preemptions: int
    recomputed_tokens: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    ignored: list[str] = field(default_factory=list)
    wasted_tokens: int = 0
    ran_then_ignored: list[str] = field(default_factory=list)  # the ignored that had run first

    def summary(self) -> str:
        text = (f"{self.rounds} rounds, {self.preemptions} preemptions, {self.recomputed_tokens} tokens computed "
                f"again, {self.swapped_out_blocks}/{self.swapped_in_blocks} blocks swapped out/in")
        if self.ignored:
            text += f", dropped {', '.join(self.ignored)} unfinished ({self.wasted_tokens} tokens spent on them)"
        return text


def whatif_workload() -> list[Request]:
    """Eight requests that overlap: prompts of 5 to 20 tokens, 10 to 28 tokens out, arriving in
    rounds 1 to 7. With 4-token blocks they need about 40 GPU blocks to run without preemption."""
    shapes = [(12, 24, 1), (20, 14, 1), (8, 28, 2), (16, 18, 3), (5, 22, 4), (10, 16, 5), (18, 10, 6), (6, 20, 7)]
    return [Request(f"r{i}", p, o, a) for i, (p, o, a) in enumerate(shapes)]


_LONGEST: dict[str, int] = {}


def longest_run(requests: list[Request], settings: Iterable[WhatIfSettings]) -> int:
    """The most rounds ``requests`` take under any of ``settings`` (those the configs refuse are
    skipped). Each question is answered once per process: the what-if explorer asks it for the
    edge of its sliders' ranges, to fix its x-axis before the reader moves anything."""
    settings = list(settings)
    key = repr((requests, settings))
    if key not in _LONGEST:
        most = 0
        for s in settings:
            try:
                sched, cache = s.configs()
            except ValueError:
                continue
            most = max(most, len(simulate(list(requests), sched, cache)))
        _LONGEST[key] = most
    return _LONGEST[key]


def _group_blocks(record: RoundRecord, rid: str) -> int:
    """Distinct CPU blocks a request holds after this round (its samples are keyed "rid.i")."""
    return len({b for key, table in record.cpu_block_tables.items()
                if key == rid or key.startswith(f"{rid}.") for b in table})


def explore(requests: list[Request], settings: WhatIfSettings) -> WhatIfOutcome:
    """Simulate ``requests`` under ``settings`` and count preemptions, recomputation and swaps.

    A bad setting raises ValueError naming the field (from the configs)."""
    sched, cache = settings.configs()
    records = simulate(list(requests), sched, cache)
    ignored = [rid for r in records for rid in r.ignored]
    processed = {q.request_id: 0 for q in requests}
    for r in records:
        for rid, chunk in r.chunk_sizes.items():
            processed[rid] += chunk
    again = sum(processed[q.request_id] - (q.prompt_len + q.output_len - 1)
                for q in requests if q.request_id not in ignored)
    out_blocks = sum(_group_blocks(r, rid) for r in records for rid in r.swapped_out)
    # A request swapped in this round held its CPU blocks at the end of the previous round.
    in_blocks = sum(_group_blocks(prev, rid) for prev, r in zip(records, records[1:]) for rid in r.swapped_in)
    return WhatIfOutcome(settings, records, len(records), sum(len(r.preempted) for r in records), again,
                         out_blocks, in_blocks, ignored, sum(processed[rid] for rid in ignored),
                         [rid for rid in ignored if processed[rid] > 0])
