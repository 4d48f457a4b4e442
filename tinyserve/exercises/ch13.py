"""Checkers for chapter 13: from v0.4 to v1, the round of ``SchedulerConfig(policy="v1")``.

``check_v1_chunk`` compares the reader's rule for the tokens a prefill brings in one step with the
package's ``Scheduler._v1_chunk`` on the same numbers. ``check_first_token_rounds`` compares the
reader's prediction of the round in which each request's first token comes out, under the vLLM
policy and under v1, with the simulator's, when memory never binds.

``check_v1_round`` grades the chapter's main exercise, the v1 round itself (a Scheduler subclass
with ``_schedule_v1``, ``_run_running_v1`` and ``_admit_waiting_v1``): the simulator runs it beside
the package's Scheduler on s0/s1/s2, the A–E workload, thresholds, prefix sharing, the hooks and
random workloads on tiny caches, and the first round and fact that differ are named, with the
method that alone makes the difference where one does; then the engine runs it on the tiny random
Llama (``LLMEngine(scheduler=)``), greedily, beside the package's, and the tokens must be the same.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

from tinyserve import presets
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.exercises.ch03 import answer_name
from tinyserve.exercises.ch04 import AMPLE_CACHE, _copies
from tinyserve.exercises.ch05 import _culprits, _most_tokens, round_failures
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.scheduler import Scheduler
from tinyserve.scheduler_outputs import SchedulingBudget
from tinyserve.sequence import Sequence, SequenceGroup
from tinyserve.sim import Request, RoundRecord, simulate
from tinyserve.workspace.so_far import round_difference, token_difference

# -- exercise 1: the chunk a prefill brings -----------------------------------------------------------


def _package_chunk(prompt_len: int, num_computed: int, budget_left: int, threshold: int, chunked: bool) -> int:
    """The package's ``_v1_chunk`` on a fresh prompt (never preempted) of ``prompt_len`` tokens."""
    sc = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=4096, policy="v1",
                         enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    sched = Scheduler(sc, CacheConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0))
    seq = Sequence(0, None, list(range(1000, 1000 + prompt_len)), 4)
    return sched._v1_chunk(seq, num_computed, SchedulingBudget(budget_left, 8))


@checker(chapter=13, answer="v1_chunk")
def check_v1_chunk(fn: Callable[[int, int, int, int, bool], int], num_cases: int = 80, seed: int = 0) -> bool:
    """``fn(prompt_len, num_computed, budget_left, threshold, chunked)`` returns how many prompt
    tokens a prefill brings in one v1 step: the ``prompt_len - num_computed`` it still lacks, cut
    to ``long_prefill_token_threshold`` (``threshold``, 0 for none) and, when prompts may be
    chunked (``chunked``), to the ``budget_left`` of the step. (A prompt that may not be chunked
    and brings more than the budget left is the caller's business: it waits.)"""
    rng = random.Random(seed)
    cases = [(24, 0, 10, 0, True), (24, 0, 10, 0, False), (24, 16, 10, 6, True), (5, 0, 10, 8, True),
             (30, 8, 40, 16, False)]
    while len(cases) < num_cases:
        prompt = rng.randint(1, 40)
        cases.append((prompt, rng.randint(0, prompt - 1), rng.randint(1, 32), rng.choice([0, 0, *range(1, 17)]),
                       rng.random() < 0.6))
    return run_cases(answer_name(fn, "v1_chunk"), lambda *args: fn(*args), [(c, _package_chunk(*c)) for c in cases],
                     describe=lambda a: "prompt_len={}, num_computed={}, budget_left={}, threshold={}, chunked={}"
                     .format(*a))


# -- exercise 3: first tokens under each policy --------------------------------------------------------

def _budget_config(token_budget: int, policy: str) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=8, max_model_len=4096, policy=policy)


def first_token_round_of(records: list[RoundRecord], requests: list[Request]) -> dict[str, int]:
    """{request id: the round whose piece completed its prompt} (when nothing is preempted)."""
    need = {r.request_id: r.prompt_len for r in requests}
    done: dict[str, int] = {}
    for rec in records:
        for rid, n in rec.chunk_sizes.items():
            if rid not in done:
                need[rid] -= n
                if need[rid] <= 0:
                    done[rid] = rec.round
    return done


def _first_token_workloads(num_cases: int, seed: int) -> list[tuple[list[Request], int]]:
    rng = random.Random(seed)
    # A long prompt arrives while two requests decode: vLLM stops them for it, v1 lets them go on.
    cases = [([Request("A", 4, 8), Request("B", 4, 8), Request("C", 14, 2, 3)], 16),
             ([Request(rid, 6, 3) for rid in "ABCD"], 10)]
    while len(cases) < num_cases:
        budget = rng.randint(8, 24)
        cases.append(([Request(chr(ord("A") + i), rng.randint(1, budget), rng.randint(1, 8), rng.randint(1, 5))
                       for i in range(rng.randint(1, 7))], budget))
    return cases


@checker(chapter=13, answer="first_token_rounds")
def check_first_token_rounds(fn: Callable[[list[Request], int, str], dict[str, int]], num_cases: int = 30,
                             seed: int = 1) -> bool:
    """``fn(requests, token_budget, policy)`` returns {request id: the round in which its first
    token comes out} under policy "vllm" or "v1" (chunked prefill on, no threshold), with a
    cache so large that nobody is preempted, ``max_num_batched_tokens=token_budget`` and room for
    every request at once. Every prompt fits the budget; a request arrives before its
    ``arrival_round`` is scheduled, and the round of its prefill's last piece makes its first token."""
    cases = []
    for reqs, budget in _first_token_workloads(num_cases // 2, seed):
        for policy in ("vllm", "v1"):
            records = simulate(reqs, _budget_config(budget, policy), AMPLE_CACHE)
            cases.append(((reqs, budget, policy), first_token_round_of(records, reqs)))
    return run_cases(answer_name(fn, "first_token_rounds"),
                     lambda reqs, budget, policy: dict(fn(_copies(reqs), budget, policy)), cases,
                     describe=_describe_requests)


def _describe_requests(args: tuple) -> str:
    requests, budget, policy = args
    text = ", ".join(f"{r.request_id}(prompt={r.prompt_len}, out={r.output_len}, arrives={r.arrival_round})"
                     for r in requests)
    return f"[{text}], {budget}, {policy!r}"


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


@checker(chapter=13, answer="V1Round")
def check_v1_round(cls: type, loaded=None) -> bool:
    """``cls``: a subclass of tinyserve.scheduler.Scheduler whose ``_schedule_v1``,
    ``_run_running_v1`` and ``_admit_waiting_v1`` make the v1 policy's round: running requests
    first, oldest first, each with its next token or prompt piece while the budget lasts, blocks
    for this step's tokens only, the newest preempted (``self.choose_victim``) when they do not
    fit, and waiting requests admitted with the budget left only in a step that preempted
    nobody, prefix hits counted in whole blocks of all tokens but the last. Run through the
    simulator beside the package's Scheduler on every workload of ``v1_round_workloads``, it must
    decide every step alike: batch, pieces, preemptions, refusals, queues and block tables. A
    failure names the workload, the first round and fact that differ and, where one method
    alone (with the package's other two) makes the difference, that method. Then the engine runs
    it (``LLMEngine(scheduler=cls)``) on ``loaded`` (default: the tiny random Llama) greedily
    beside the package's scheduler, on ``engine_workloads``: the same tokens and steps."""
    name = answer_name(cls, "V1Round")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        print(f"✗ {name} must be a class that subclasses tinyserve.scheduler.Scheduler, got {cls!r}")
        return False
    if cls._schedule_v1 is Scheduler._schedule_v1:
        print(f"✗ {name} does not override _schedule_v1, the v1 policy's round: the package's would run")
        return False
    theirs = [m for m in NOT_THE_V1_ROUND if getattr(cls, m) is not getattr(Scheduler, m)]
    if theirs:
        print(f"✗ {name} overrides {', '.join(theirs)}: that belongs to the other rounds (chapters 04 and 05); "
              "the v1 round is _schedule_v1 and its two phases, _run_running_v1 and _admit_waiting_v1")
        return False
    workloads = v1_round_workloads()
    failures = round_failures(cls, workloads, functools.partial(_culprits, methods=V1_ROUND_METHODS))
    num_cases = len(workloads) + len(engine_workloads())
    if failures:  # the engine would only show the same difference, more slowly
        return verdict(name, failures, len(workloads))
    if loaded is None:
        from tinyserve.exercises.engine_runs import tiny

        loaded = tiny()
    return verdict(name, _engine_failures(cls, loaded), num_cases)
