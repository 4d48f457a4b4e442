"""Chapter 13's runs: one workload under v0.4's "vllm", "orca" and "v1", and a sweep of request rates.

``three_policies("seed")`` (s0/s1/s2) and ``three_policies("orca_example")`` (A–E) run a preset
of ``tinyserve.presets`` under each policy through ``sim.simulate``. ``rate_sweep`` draws a
random workload whose requests arrive as a Poisson process of a given rate (requests per round)
and runs it under each policy with one fixed cache and token budget, measuring in rounds: how
many the workload takes, the tokens computed per round, the time to first token and the time per
output token. Everything is the real Scheduler with no model, so a whole sweep takes a second or two.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sim import Request, RoundRecord, simulate

POLICIES = ("vllm", "orca", "v1")
# Requests per round: from a light load, served at once, to more than the cache keeps running.
RATES = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0)
PRESET_NAMES = ("seed", "orca_example")


def policy_preset(preset_name: str, policy: str) -> presets.Preset:
    """The preset ``preset_name`` ("seed" or "orca_example") under ``policy``. The seed rounds
    preempt by swap under vllm and orca (the story's rounds) and by recompute under v1, the only
    mode it has; under v1 prefix caching is on, as V1 has it by default (in the seed rounds the
    request preempted by recompute finds its prompt block still cached; in A–E it changes nothing)."""
    v1 = policy == "v1"
    if preset_name == "seed":
        return presets.seed_rounds(policy=policy, enable_prefix_caching=v1)
    if preset_name == "orca_example":
        return presets.orca_example(policy, enable_prefix_caching=v1)
    raise ValueError(f"preset_name must be one of {PRESET_NAMES}, got {preset_name!r}")


def three_policies(preset_name: str, policies: Sequence[str] = POLICIES) -> dict[str, list[RoundRecord]]:
    """{policy: the preset's RoundRecords under it}, for "vllm", "orca" and "v1"."""
    runs = {}
    for policy in policies:
        p = policy_preset(preset_name, policy)
        runs[policy] = simulate(p.requests, p.scheduler_config, p.cache_config)
    return runs


def budget(preset_name: str) -> int:
    """The preset's token budget of one round (the same under every policy)."""
    return policy_preset(preset_name, "vllm").scheduler_config.max_num_batched_tokens


# -- the rate sweep -----------------------------------------------------------------------------

def poisson_requests(rate: float, num_requests: int = 40, seed: int = 0, prompt_lens: tuple[int, int] = (4, 40),
                     output_lens: tuple[int, int] = (2, 24)) -> list[Request]:
    """``num_requests`` requests arriving as a Poisson process of ``rate`` requests per round.

    Request i arrives before round ``1 + floor(t_i)``, where ``t_i`` sums i exponential gaps of
    mean ``1 / rate``; prompt and output lengths are uniform in the given (inclusive) ranges.
    The same seed gives the same lengths and the same gaps (scaled by the rate) at every rate,
    so rates differ only in how close together the requests come."""
    # >>> fold: validation
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (requests per round), got {rate!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    # <<<
    lengths, gaps = random.Random(seed), random.Random(seed + 1)
    t, requests = 0.0, []
    for i in range(num_requests):
        if i:
            t += gaps.expovariate(1.0)
        requests.append(Request(f"r{i}", lengths.randint(*prompt_lens), lengths.randint(*output_lens),
                                arrival_round=1 + math.floor(t / rate)))
    return requests


def sweep_configs(policy: str, max_num_batched_tokens: int = 64, max_num_seqs: int = 16, block_size: int = 4,
                  num_gpu_blocks: int = 96, max_model_len: int = 128) -> tuple[SchedulerConfig, CacheConfig]:
    """The one cache and budget of the sweep, under ``policy``: vLLM's preemption rule
    (recompute, every request has one sequence), chunked prefill under v1 only (its default),
    and prefix caching under v1 only (V1's default: a recomputed request may find its own blocks)."""
    sc = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, policy=policy)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, watermark=0.0,
                     enable_prefix_caching=policy == "v1")
    return sc, cc


class TokenLog(Scheduler):
    """A Scheduler that notes, per request, the round of every token it produced
    (``token_rounds``): the round count is its number of ``schedule`` calls, one per round of
    ``sim.simulate``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.round = 0
        self.token_rounds: dict[str, list[int]] = {}

    def schedule(self):
        self.round += 1
        return super().schedule()

    def postprocess(self, out, next_token, eos_token_id=None):
        def noted(group, seq):
            self.token_rounds.setdefault(group.request_id, []).append(self.round)
            return next_token(group, seq)

        return super().postprocess(out, noted, eos_token_id)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (linear between order statistics, as numpy's default)."""
    xs = sorted(values)
    k = 0.9 * (len(xs) - 1)
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run_metrics(records: Sequence[RoundRecord], requests: Sequence[Request],
                token_rounds: dict[str, list[int]]) -> dict:
    """What one run measured, in rounds.

    - ``rounds``: rounds until the last request finished.
    - ``tokens_per_round``: tokens computed (prompt and decode) per round, over all rounds;
      ``tokens_per_busy_round`` over the rounds that computed something.
    - ``ttft_mean``, ``ttft_p90``: rounds from arrival to first token, counting the round that
      produced it (1: prefilled in the round it arrived); time to first token in rounds.
    - ``tpot_mean``: rounds per output token after the first, ``(last - first) / (n - 1)``, over
      requests with two or more output tokens; time per output token in rounds.
    - ``preemptions``: how many times a request was preempted.
    """
    busy = [r for r in records if r.batch]
    total = sum(r.num_batched_tokens for r in records)
    ttft = [token_rounds[q.request_id][0] - q.arrival_round + 1 for q in requests]
    tpot = [(token_rounds[q.request_id][-1] - token_rounds[q.request_id][0]) / (q.output_len - 1)
            for q in requests if q.output_len > 1]
    return {
        "rounds": len(records),
        "tokens_per_round": total / len(records),
        "tokens_per_busy_round": total / len(busy) if busy else 0.0,
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p90": p90(ttft),
        "tpot_mean": statistics.fmean(tpot) if tpot else 0.0,
        "preemptions": sum(len(r.preempted) for r in records),
    }


def run_policy(requests: Sequence[Request], policy: str, **config) -> tuple[list[RoundRecord], dict]:
    """One workload under one policy: its RoundRecords and ``run_metrics``. ``config`` goes to
    ``sweep_configs``."""
    sc, cc = sweep_configs(policy, **config)
    log = TokenLog(sc, cc)
    records = simulate(list(requests), sc, cc, scheduler=log)
    # >>> fold: safety net: every request of the sweep must run (none is too long for the cache)
    missing = [q.request_id for q in requests if len(log.token_rounds.get(q.request_id, ())) != q.output_len]
    if missing:
        raise RuntimeError(f"{policy}: requests {missing} did not produce all their tokens; "
                           "the sweep's lengths must fit its cache and budget")
    # <<<
    return records, run_metrics(records, requests, log.token_rounds)


def rate_sweep(rates: Sequence[float], policies: Sequence[str] = POLICIES, num_requests: int = 40, seed: int = 0,
               prompt_lens: tuple[int, int] = (4, 40), output_lens: tuple[int, int] = (2, 24),
               **config) -> list[dict]:
    """Each policy at each request rate (requests per round) on the same seeded workload.

    Returns one row per (rate, policy): ``{"rate", "policy", "num_requests"}`` and the numbers of
    ``run_metrics``. ``config`` (``max_num_batched_tokens=64``, ``max_num_seqs=16``,
    ``block_size=4``, ``num_gpu_blocks=96``, ``max_model_len=128``) sets the fixed cache and
    budget (``sweep_configs``)."""
    rows = []
    for rate in rates:
        requests = poisson_requests(rate, num_requests, seed, prompt_lens, output_lens)
        for policy in policies:
            _, metrics = run_policy(requests, policy, **config)
            rows.append({"rate": rate, "policy": policy, "num_requests": num_requests, **metrics})
    return rows
