"""Chapter 12's workloads and what their rounds say: a shared system prompt, a long prompt
among decoders, and the tokens each request computed or produced.

Both run through ``sim.simulate`` (no model needed) and read ``RoundRecord``s, so the engine's
``history`` can be read the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request, RoundRecord, simulate


def system_prompt_requests(system_len: int = 28, user_lens: Sequence[int] = (6, 9, 12, 7), output_len: int = 8,
                           ) -> list[Request]:
    """Requests that all start with the same system prompt and arrive one per round."""
    system = list(range(500, 500 + system_len))
    requests = []
    for i, n in enumerate(user_lens):
        ids = system + [1000 + 100 * i + j for j in range(n)]
        requests.append(Request(f"u{i}", len(ids), output_len, arrival_round=1 + i, prompt_token_ids=ids))
    return requests


def prefix_sharing_run(enable_prefix_caching: bool = True, block_size: int = 8,
                       requests: list[Request] | None = None) -> list[RoundRecord]:
    requests = requests or system_prompt_requests()
    sc = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0,
                     enable_prefix_caching=enable_prefix_caching)
    return simulate(requests, sc, cc)


def long_prompt_requests(long_len: int = 160, num_decoders: int = 3, decode_len: int = 12, long_arrival: int = 3,
                         ) -> list[Request]:
    """A few short requests that are decoding when a long prompt arrives."""
    short = [Request(f"d{i}", 6 + i, decode_len, arrival_round=1) for i in range(num_decoders)]
    return short + [Request("long", long_len, 4, arrival_round=long_arrival)]


def chunked_run(enable_chunked_prefill: bool, budget: int = 32,
                requests: list[Request] | None = None) -> list[RoundRecord]:
    requests = requests or long_prompt_requests()
    sc = SchedulerConfig(max_num_batched_tokens=budget if enable_chunked_prefill else None, max_num_seqs=8,
                         max_model_len=512, enable_chunked_prefill=enable_chunked_prefill)
    cc = CacheConfig(block_size=16, num_gpu_blocks=128, num_cpu_blocks=0, watermark=0.0)
    return simulate(requests, sc, cc)


# -- reading records ----------------------------------------------------------------------------
# Both helpers assume no request was preempted: then a request produces one token in each of
# the last ``output_len`` rounds it takes part in (the end of its prefill, then every decode),
# and every other token it brought was a prompt token it computed.

def _appearances(records: Sequence[RoundRecord], rid: str) -> list[RoundRecord]:
    return [rec for rec in records if rid in rec.chunk_sizes]


def prefill_tokens(records: Sequence[RoundRecord], output_lens: dict[str, int]) -> dict[str, int]:
    """Prompt tokens each request actually computed (what prefix caching did not save)."""
    return {rid: sum(rec.chunk_sizes[rid] for rec in _appearances(records, rid)) - (n - 1)
            for rid, n in output_lens.items()}


def producers(records: Sequence[RoundRecord], output_lens: dict[str, int]) -> list[set[str]]:
    """For each round, the requests that produced a token in it."""
    if any(rec.tokens for rec in records):  # the engine records the tokens themselves
        return [set(rec.tokens) for rec in records]
    made: list[set[str]] = [set() for _ in records]
    index = {rec.round: i for i, rec in enumerate(records)}
    for rid, n in output_lens.items():
        for rec in _appearances(records, rid)[-n:]:
            made[index[rec.round]].add(rid)
    return made
