"""Checkers for chapter 00 (overview): predict the engine's rounds before reading its code.

The expected answers come from the real Scheduler, driven round by round by ``sim.simulate``
with a cache so large that nobody is preempted and all requests arriving before round 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.sim import Request, RoundRecord, simulate

MAX_REQUESTS = 6  # and every budget is at least this, so max_num_seqs never decides a round


def _prompt_workloads(num_cases: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt_lens, output_lens, token_budget); every prompt fits the budget on its own."""
    rng = random.Random(seed)
    cases = [([5, 5, 3], [8, 8, 8], 10)]  # the seed prompts under the seed preset's budget
    while len(cases) < num_cases:
        n = rng.randint(1, MAX_REQUESTS)
        prompts = [rng.randint(1, 12) for _ in range(n)]
        outputs = [rng.randint(1, 10) for _ in range(n)]
        cases.append((prompts, outputs, rng.randint(max(*prompts, MAX_REQUESTS), 30)))
    return cases


def _rounds(prompt_lens: list[int], output_lens: list[int], token_budget: int, block_size: int = 4,
            num_gpu_blocks: int = 4096) -> list[RoundRecord]:
    requests = [Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
    return simulate(requests,
                    SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=MAX_REQUESTS, max_model_len=64),
                    CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, watermark=0.0))


def _same_list(got, expected) -> bool:
    return list(got) == expected


@checker(chapter=0, answer="round_phases")
def check_round_phases(fn: Callable[[list[int], list[int], int], list[str]], num_cases: int = 40,
                       seed: int = 0) -> bool:
    """``fn(prompt_lens, output_lens, token_budget)`` returns the phase, "prefill" or "decode", of
    every round under the vllm policy until all requests have finished. All requests arrive
    before round 1; a prefill produces a request's first output token; memory never runs out."""
    cases = [(case, [r.phase for r in _rounds(*case)]) for case in _prompt_workloads(num_cases, seed)]
    return run_cases("round_phases", fn, cases, same=_same_list)


@checker(chapter=0, answer="tokens_per_round")
def check_tokens_per_round(fn: Callable[[list[int], list[int], int], list[int]], num_cases: int = 40,
                           seed: int = 1) -> bool:
    """``fn(prompt_lens, output_lens, token_budget)`` returns how many tokens the model processes
    in every round (``num_batched_tokens``), under the same rules as ``check_round_phases``."""
    cases = [(case, [r.num_batched_tokens for r in _rounds(*case)]) for case in _prompt_workloads(num_cases, seed)]
    return run_cases("tokens_per_round", fn, cases, same=_same_list)


@checker(chapter=0, answer="free_blocks")
def check_free_blocks(fn: Callable[[list[int], list[int], int, int, int], list[int]], num_cases: int = 40,
                      seed: int = 2) -> bool:
    """``fn(prompt_lens, output_lens, token_budget, block_size, num_gpu_blocks)`` returns the
    number of free GPU blocks after every round. A request holds blocks for every token whose
    K/V has been computed; it gives them all back in the round it finishes. The cache is large
    enough that nobody is preempted."""
    rng = random.Random(seed)
    cases = []
    for prompts, outputs, budget in _prompt_workloads(num_cases, seed):
        block_size = rng.choice([1, 2, 4, 5, 8])
        need = sum(-(-(p + o) // block_size) for p, o in zip(prompts, outputs))
        args = (prompts, outputs, budget, block_size, need + rng.randint(0, 4))
        cases.append((args, [r.free_gpu_blocks for r in _rounds(*args)]))
    return run_cases("free_blocks", fn, cases, same=_same_list)
