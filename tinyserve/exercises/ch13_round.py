"""The runs behind chapter 13's main exercise, the v1 round (a Scheduler subclass with
``_schedule_v1``, ``_run_running_v1`` and ``_admit_waiting_v1``, ``V1_ROUND_METHODS``).

``v1_round_workloads`` are the simulator's: s0/s1/s2, the A–E workload, thresholds, prefix
sharing, the hooks and random workloads on tiny caches, graded with chapter 05's round runs.
``engine_workloads`` and ``_engine_failures`` run the round inside the engine on the tiny random
Llama (``LLMEngine(scheduler=)``), greedily, beside the package's: the tokens must be the same.
The checker, ``check_v1_round``, is in ``tinyserve.exercises.ch13``.
"""

from __future__ import annotations

import dataclasses
import random

from tinyserve import presets
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.exercises.ch05_hooks import _most_tokens
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SequenceGroup
from tinyserve.sim import Request, RoundRecord
from tinyserve.workspace.so_far import round_difference, token_difference

# -- exercise 2, the main one: the v1 round ---------------------------------------------------------------

V1_ROUND_METHODS = ("_schedule_v1", "_run_running_v1", "_admit_waiting_v1")
# The other rounds and the entry point they share: a v1_round leaves them alone, so that it joins
# the reader's orca_round and scheduler_round (subclasses of their own) by inheritance.
NOT_THE_V1_ROUND = ("schedule", "_schedule_round", "_schedule_mixed", "_schedule_vllm", "_admit_waiting",
                    "_decode_running", "_swap_in_swapped")

V1Workload = tuple[str, list[Request], SchedulerConfig, CacheConfig, dict]  # (label, ..., Scheduler hooks)


def _v1(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(policy="v1", **kwargs)


def _cache(block_size: int, gpu: int, prefix: bool = False) -> CacheConfig:
    return CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=0, watermark=0.0,
                       enable_prefix_caching=prefix)


def _at_most_three(group: SequenceGroup, budget, block_manager) -> bool:
    """An admission rule for the hook run: no more than three sequences at a time."""
    return budget.num_curr_seqs < 3


def _prefix_requests(rng: random.Random, block_size: int, num: int, limit: int) -> list[Request]:
    """Requests that share a system prompt of whole blocks, some of them whole duplicates of an
    earlier one (a prompt of whole blocks cached entirely: its last block is computed again)."""
    system = [7000 + i for i in range(block_size * rng.randint(1, 2))]
    requests: list[Request] = []
    for j in range(num):
        if requests and rng.random() < 0.35:
            twin = rng.choice(requests)
            ids = list(twin.prompt_token_ids)
        else:
            room = max(0, limit - len(system))
            tail = [8000 + 100 * j + i for i in range(rng.randint(0, min(room, 2 * block_size)))]
            ids = system + tail
        requests.append(Request(f"r{j}", len(ids), rng.randint(1, 8), rng.randint(1, 6), prompt_token_ids=ids))
    return requests


def v1_round_workloads(num_random: int = 24, seed: int = 13) -> list[V1Workload]:
    """The runs ``check_v1_round`` compares, all under ``policy="v1"``: s0/s1/s2 (chunked prefill
    on and off), A–E (roomy, then on a cache that makes it preempt), long prompts under a
    threshold, prompts that share a prefix and whole duplicates (prefix caching), the two hooks,
    and random workloads on tiny caches (prompts that can never run, arrivals over time, chunking
    on and off, thresholds, prefix caching)."""
    runs: list[V1Workload] = []
    seed_preset = presets.seed_rounds(None, policy="v1")
    runs.append(("s0/s1/s2, policy='v1'", seed_preset.requests, seed_preset.scheduler_config,
                 seed_preset.cache_config, {}))
    runs.append(("s0/s1/s2, policy='v1', enable_chunked_prefill=False", seed_preset.requests,
                 dataclasses.replace(seed_preset.scheduler_config, enable_chunked_prefill=False),
                 seed_preset.cache_config, {}))
    ae = presets.orca_example("v1")
    runs.append(("A-E, policy='v1'", ae.requests, ae.scheduler_config, ae.cache_config, {}))
    runs.append(("A-E on 7 GPU blocks of 4, budget 12", ae.requests,
                 _v1(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=28), _cache(4, 7), {}))
    # Without chunking, a prompt longer than what the decodes leave is skipped, not waited for.
    crowded = [Request("A", 4, 8), Request("B", 4, 8), Request("C", 11, 2, 2), Request("D", 3, 4, 2)]
    runs.append(("a prompt that does not fit what the decodes leave, enable_chunked_prefill=False", crowded,
                 _v1(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=24, enable_chunked_prefill=False),
                 _cache(4, 16), {}))
    long = [Request("L0", 30, 4), Request("L1", 22, 6), Request("s", 3, 8, 2), Request("L2", 17, 3, 3)]
    for chunked in (True, False):
        runs.append((f"long prompts, long_prefill_token_threshold=6, enable_chunked_prefill={chunked}", long,
                     _v1(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=48, enable_chunked_prefill=chunked,
                         long_prefill_token_threshold=6), _cache(4, 24), {}))
    runs.append(("long prompts on 10 GPU blocks of 4, threshold 8", long,
                 _v1(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=40, long_prefill_token_threshold=8),
                 _cache(4, 10), {}))
    system = list(range(5000, 5008))
    shared = [Request("p0", 8, 3, 1, system), Request("p1", 8, 4, 2, system),
              Request("p2", 11, 3, 2, system + [9001, 9002, 9003]), Request("p3", 8, 2, 4, system),
              Request("p4", 10, 5, 4, system + [9101, 9102])]
    runs.append(("a shared system prompt and whole duplicates, enable_prefix_caching=True", shared,
                 _v1(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32), _cache(4, 16, prefix=True), {}))
    runs.append(("the same, on 7 GPU blocks of 4, budget 8", shared,
                 _v1(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=24), _cache(4, 7, prefix=True), {}))
    # Older requests bring longer prompts, so the request with the most tokens is rarely the newest.
    hooked = [Request(f"r{j}", 8 - j, 10, 1 + j // 3) for j in range(7)]
    sc = _v1(max_num_batched_tokens=12, max_num_seqs=6, max_model_len=16)
    runs.append(("7 requests on 8 GPU blocks of 2, choose_victim=the most tokens", hooked, sc, _cache(2, 8),
                 {"choose_victim": _most_tokens}))
    runs.append(("7 requests on 32 GPU blocks of 2, can_admit=at most three sequences running", hooked, sc,
                 _cache(2, 32), {"can_admit": _at_most_three}))
    rng = random.Random(seed)
    for i in range(num_random):
        budget, block_size, gpu = rng.randint(6, 16), rng.choice([2, 4]), rng.randint(4, 10)
        chunked = i % 3 != 2
        threshold = rng.choice([0, 0, rng.randint(2, budget)])
        prefix = i % 4 == 1
        limit = gpu * block_size if chunked or threshold else min(budget, gpu * block_size)
        if prefix:
            requests = _prefix_requests(rng, block_size, rng.randint(3, 7), max(1, limit - 1))
        else:
            requests = []
            for j in range(rng.randint(3, 8)):
                never = rng.random() < 0.15
                prompt = rng.randint(limit + 1, limit + 6) if never else rng.randint(1, max(1, limit - 2))
                requests.append(Request(f"r{j}", prompt, rng.randint(1, 10), rng.randint(1, 4)))
        runs.append((f"random workload {i} ({len(requests)} requests, {gpu} GPU blocks of {block_size}, "
                     f"budget {budget}, chunked={chunked}, threshold={threshold}, prefix caching={prefix})", requests,
                     _v1(max_num_batched_tokens=budget, max_num_seqs=rng.randint(2, 5), max_model_len=gpu * block_size,
                         enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold),
                     _cache(block_size, gpu, prefix), {}))
    return runs


# -- the same round inside the engine ---------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and kindly. "
ENGINE_PROMPTS = {
    "s0/s1/s2": {"s0": "Hello, my name is", "s1": "The future of AI is", "s2": "The life is"},
    # q0 and q1 arrive together, so neither finds the other cached; q2, the system prompt alone,
    # finds its whole blocks cached once theirs are computed.
    "a shared system prompt": {"q0": SYSTEM + "What is the capital of France?",
                               "q1": SYSTEM + "What is the capital of France?", "q2": SYSTEM},
}


def engine_workloads() -> list[tuple[str, dict[str, str], SchedulerConfig, CacheConfig, int]]:
    """(label, prompts, scheduler config, cache config, max_tokens) for the engine runs: s0/s1/s2 on a
    cache that makes v1 preempt, and prompts sharing a system prompt, with prefix caching and a
    threshold that cuts their prefills."""
    return [
        ("s0/s1/s2, policy='v1', 8 GPU blocks of 4, budget 8", ENGINE_PROMPTS["s0/s1/s2"],
         _v1(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=32), _cache(4, 8), 8),
        ("a shared system prompt, prefix caching, threshold 8, 24 GPU blocks of 4",
         ENGINE_PROMPTS["a shared system prompt"],
         _v1(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=96, long_prefill_token_threshold=8),
         _cache(4, 24, prefix=True), 4),
    ]


def _engine_run(cls: type, loaded, prompts: dict[str, str], sc: SchedulerConfig, cc: CacheConfig,
                max_tokens: int) -> tuple[dict[str, list[int]], list[RoundRecord], str | None]:
    """Greedy tokens and rounds of ``prompts`` through an LLMEngine whose scheduler is ``cls``."""
    from tinyserve.engine import LLMEngine
    from tinyserve.sampling_params import SamplingParams
    from tinyserve.worker import Worker

    done: dict[str, list[int]] = {}
    engine = None
    try:
        model_config = ModelConfig(model=str(loaded.path or "in-memory"))
        worker = Worker(model_config, attention_backend="torch", loaded=loaded)
        engine = LLMEngine(model_config, dataclasses.replace(cc), dataclasses.replace(sc), executor=worker,
                           scheduler=cls, record_history=True)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps > 500:
                raise RuntimeError("the engine ran 500 steps without finishing (a round that schedules nobody?)")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    except Exception as e:  # the reader's round, inside the engine
        return done, engine.history if engine is not None else [], f"{type(e).__name__}: {e}"
    return done, engine.history, None


_PACKAGE_RUNS: dict[tuple[str, int], tuple] = {}  # the package's engine runs, once per workload and model


def _engine_failures(cls: type, loaded) -> list[str]:
    failures = []
    for label, prompts, sc, cc, max_tokens in engine_workloads():
        key = (label, id(loaded))
        if key not in _PACKAGE_RUNS:
            _PACKAGE_RUNS[key] = (loaded, _engine_run(Scheduler, loaded, prompts, sc, cc, max_tokens))
        want, want_rounds, _ = _PACKAGE_RUNS[key][1]
        got, rounds, error = _engine_run(cls, loaded, prompts, sc, cc, max_tokens)
        problem = (f"raised {error} (after {len(rounds)} steps)" if error else
                   token_difference(got, want) or round_difference(rounds, want_rounds))
        if problem:
            failures.append(f"the engine, {label}: {problem}")
    return failures


