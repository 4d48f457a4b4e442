"""The book's two worked examples, as ready-made configs and scripted requests.

- ``seed_rounds``: the source story's three prompts s0, s1, s2 (5, 5 and 3 tokens with the
  default model's tokenizer), under budgets chosen so the rounds unfold as the story tells:
  round 1 prefills s0 and s1 (the token budget fits two prompts), round 2 prefills s2 alone,
  round 3 decodes s0 and s1 while s2 is preempted for lack of free blocks.
- ``orca_example``: the A–E workload of the Orca discussion.

Both take ``policy="v1"`` too (chapter 13; V1 preempts by recompute only) and
``enable_prefix_caching`` (off by default, so a reader's block manager of chapter 03, which has
no prefix cache, runs every preset; chapter 13 turns it on for v1, as V1 does by default: see
``tinyserve.lab.policy_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request

SEED_PROMPTS = {"s0": "Hello, my name is", "s1": "The future of AI is", "s2": "The life is"}
SEED_PROMPT_LENS = {"s0": 5, "s1": 5, "s2": 3}


@dataclass
class Preset:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: list[Request]
    prompts: dict[str, str | None]
    max_tokens: int


def seed_rounds(preemption_mode: str | None = "auto", policy: str = "vllm", max_tokens: int = 8,
                compat: str = "tinyserve", enable_prefix_caching: bool = False) -> Preset:
    """The s0/s1/s2 walkthrough.

    Why these numbers: a budget of 10 tokens per round fits s0 and s1 (5 + 5) but not s2 as
    well (13). A block holds 5 tokens, so each 5-token prompt fills exactly one block and its
    first decode needs a second one. With 4 GPU blocks, after three prefills one block is free:
    s0 takes it in round 3, s1 then needs one too, and the newest running request, s2, is
    preempted to make room. ``max_model_len=20`` is what the 4 blocks of 5 tokens can hold.

    The story's rounds need ``preemption_mode="swap"``. ``compat="vllm-0.4"`` runs the same
    workload under vLLM v0.4.0's rules; v0.4 itself would refuse this configuration (a budget
    below ``max_model_len``, a block size of 5: see the ``tinyserve.scheduler`` docstring).
    ``preemption_mode="auto"`` is "swap" under the vllm and orca policies and recompute under
    v1, the only mode V1 has (an explicit "swap" with ``policy="v1"`` is refused by
    SchedulerConfig). Under v1 the rounds differ: running requests decode first and take the
    last free blocks in round 2, so s2 waits for blocks instead of being preempted, and s1 is
    the one preempted when s0 and s1 both need a third block (round 7). With
    ``enable_prefix_caching`` s1 finds its prompt block still cached when it comes back.
    """
    if preemption_mode == "auto":
        preemption_mode = None if policy == "v1" else "swap"
    return Preset(
        scheduler_config=SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4, max_model_len=20,
                                         policy=policy, preemption_mode=preemption_mode, compat=compat),
        cache_config=CacheConfig(block_size=5, num_gpu_blocks=4, num_cpu_blocks=4, watermark=0.0,
                                 enable_prefix_caching=enable_prefix_caching),
        requests=[Request(rid, SEED_PROMPT_LENS[rid], max_tokens) for rid in SEED_PROMPTS],
        prompts=dict(SEED_PROMPTS),
        max_tokens=max_tokens,
    )


def orca_example(policy: str = "orca", enable_prefix_caching: bool = False) -> Preset:
    """A, B and C need 10, 15 and 5 tokens and arrive in round 1; D (8) in round 2; E (12) in
    round 3. Prompts are 4 tokens each; the cache is large enough that nobody is preempted.
    No two prompts share a block, so ``enable_prefix_caching`` changes no round here."""
    needs = {"A": (10, 1), "B": (15, 1), "C": (5, 1), "D": (8, 2), "E": (12, 3)}
    return Preset(
        scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, policy=policy),
        cache_config=CacheConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0,
                                 enable_prefix_caching=enable_prefix_caching),
        requests=[Request(rid, 4, out, arrival) for rid, (out, arrival) in needs.items()],
        prompts={rid: None for rid in needs},
        max_tokens=max(out for out, _ in needs.values()),
    )
