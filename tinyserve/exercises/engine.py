"""Checkers for the overview (chapter 00) and the worker and the engine (chapter 09).

Each checker calls the reader's function on fixed and random cases and compares its answers
with what the package's own code does in the same situation.

Chapter 00, predicting the engine's rounds (compared with the real Scheduler, run by
``sim.simulate`` with a cache so large that nobody is preempted):
``check_round_phases``, ``check_tokens_per_round``, ``check_free_blocks``.

Chapter 09: ``check_packed_inputs`` (against ``model_runner.prepare_inputs``),
``check_top_k_top_p`` (against ``sampler.apply_top_k_top_p``) and ``check_worker_order`` (a
round's cache orders and the model's writes on toy caches, against the real CacheEngine driven
by ``Worker.execute_model``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.verdict import verdict
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampler import apply_top_k_top_p
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroupMetadata
from tinyserve.sim import Request, simulate
from tinyserve.worker import Worker


def _run_cases(name: str, cases: list, expected: Callable, given: Callable, describe: Callable) -> bool:
    failures = []
    for case in cases:
        want = expected(*case)
        try:
            got = given(*case)
        except Exception as e:  # a crash is a failed case, reported like any other
            failures.append(f"{describe(*case)}: raised {type(e).__name__}: {e}")
            continue
        if got != want:
            failures.append(f"{describe(*case)}: expected {want!r}, got {got!r}")
    return verdict(name, failures, len(cases))


# -- chapter 00: predict the rounds -------------------------------------------------------------

MAX_REQUESTS = 6  # and every budget is at least this, so max_num_seqs never decides a round


def _workload_cases(num_cases: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt_lens, output_lens, token_budget); every prompt fits the budget on its own."""
    rng = random.Random(seed)
    cases = [([5, 5, 3], [8, 8, 8], 10)]  # the seed prompts under the seed preset's budget
    while len(cases) < num_cases:
        n = rng.randint(1, MAX_REQUESTS)
        prompts = [rng.randint(1, 12) for _ in range(n)]
        outputs = [rng.randint(1, 10) for _ in range(n)]
        cases.append((prompts, outputs, rng.randint(max(*prompts, MAX_REQUESTS), 30)))
    return cases


def _simulate(prompt_lens: list[int], output_lens: list[int], token_budget: int, block_size: int = 4,
              num_gpu_blocks: int = 4096):
    requests = [Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
    return simulate(requests,
                    SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=MAX_REQUESTS, max_model_len=64),
                    CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0,
                                watermark=0.0))


def _describe_workload(prompt_lens, output_lens, token_budget, *rest) -> str:
    extra = f", block_size={rest[0]}, num_gpu_blocks={rest[1]}" if rest else ""
    return f"prompt_lens={prompt_lens}, output_lens={output_lens}, token_budget={token_budget}{extra}"


def check_round_phases(fn: Callable[[list[int], list[int], int], list[str]], num_cases: int = 40,
                       seed: int = 0) -> bool:
    """``fn(prompt_lens, output_lens, token_budget)`` returns the phase, "prefill" or "decode", of
    every round under the vllm policy until all requests have finished. All requests arrive
    before round 1; a prefill produces a request's first output token; memory never runs out."""
    return _run_cases("check_round_phases", _workload_cases(num_cases, seed),
                      lambda p, o, b: [r.phase for r in _simulate(p, o, b)],
                      lambda p, o, b: list(fn(list(p), list(o), b)), _describe_workload)


def check_tokens_per_round(fn: Callable[[list[int], list[int], int], list[int]], num_cases: int = 40,
                           seed: int = 1) -> bool:
    """``fn(prompt_lens, output_lens, token_budget)`` returns how many tokens the model processes
    in every round (``num_batched_tokens``), under the same rules as ``check_round_phases``."""
    return _run_cases("check_tokens_per_round", _workload_cases(num_cases, seed),
                      lambda p, o, b: [r.num_batched_tokens for r in _simulate(p, o, b)],
                      lambda p, o, b: list(fn(list(p), list(o), b)), _describe_workload)


def check_free_blocks(fn: Callable[[list[int], list[int], int, int, int], list[int]], num_cases: int = 40,
                      seed: int = 2) -> bool:
    """``fn(prompt_lens, output_lens, token_budget, block_size, num_gpu_blocks)`` returns the
    number of free GPU blocks after every round. A request holds blocks for every token whose
    K/V has been computed; it gives them all back in the round it finishes. The cache is large
    enough that nobody is preempted."""
    rng = random.Random(seed)
    cases = []
    for prompts, outputs, budget in _workload_cases(num_cases, seed):
        block_size = rng.choice([1, 2, 4, 5, 8])
        need = sum(-(-(p + o) // block_size) for p, o in zip(prompts, outputs))
        cases.append((prompts, outputs, budget, block_size, need + rng.randint(0, 4)))
    return _run_cases("check_free_blocks", cases,
                      lambda p, o, b, bs, g: [r.free_gpu_blocks for r in _simulate(p, o, b, bs, g)],
                      lambda p, o, b, bs, g: list(fn(list(p), list(o), b, bs, g)), _describe_workload)


# -- chapter 09: packed inputs ------------------------------------------------------------------

def _packed_cases(num_cases: int, seed: int) -> list[tuple[list[tuple[int, int, list[int]]], int]]:
    """(seqs, block_size); each seq is (num_computed_tokens, num_new_tokens, block_table)."""
    rng = random.Random(seed)
    cases = [
        ([(0, 5, [0]), (0, 5, [1])], 5),  # round 1 of the walkthrough: two prefills
        ([(5, 1, [0, 3]), (5, 1, [1, 2])], 5),  # round 3: two decodes, each starting a new block
    ]
    while len(cases) < num_cases:
        block_size = rng.choice([1, 2, 4, 5, 16])
        free = list(range(64))
        rng.shuffle(free)
        seqs = []
        for _ in range(rng.randint(1, 5)):
            kind = rng.choice(["prefill", "decode", "chunk"])
            if kind == "prefill":
                computed, new = 0, rng.randint(1, 12)
            elif kind == "decode":
                computed, new = rng.randint(1, 20), 1
            else:  # a later prefill chunk, or a prefill after a cached prefix
                computed, new = rng.randint(1, 12), rng.randint(2, 8)
            needed = -(-(computed + new) // block_size)
            seqs.append((computed, new, [free.pop() for _ in range(needed)]))
        cases.append((seqs, block_size))
    return cases


def packed_inputs_reference(seqs: list[tuple[int, int, list[int]]], block_size: int) -> dict[str, list[int]]:
    """What ``prepare_inputs`` builds for these sequences (one group per sequence)."""
    metas = []
    for i, (computed, new, table) in enumerate(seqs):
        seq = Sequence(i, None, list(range(1000, 1000 + computed + new)), block_size)
        seq.num_computed_tokens = computed
        metas.append(SequenceGroupMetadata(request_id=f"r{i}", is_prompt=new > 1, seq_data={i: seq},
                                           sampling_params=SamplingParams(), block_tables={i: list(table)},
                                           token_chunk_size=new))
    inputs = prepare_inputs(metas, block_size)
    md = inputs.attn_metadata
    return {"positions": inputs.positions.tolist(), "slot_mapping": md.slot_mapping.tolist(),
            "query_start_loc": md.query_start_loc.tolist(), "context_lens": md.context_lens.tolist()}


def check_packed_inputs(fn: Callable[[list[tuple[int, int, list[int]]], int], dict[str, list[int]]],
                        num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(seqs, block_size)`` packs one round. ``seqs`` lists, in batch order, one
    ``(num_computed_tokens, num_new_tokens, block_table)`` per sequence: the sequence brings the
    tokens at positions ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``. It
    returns a dict with the lists ``positions`` and ``slot_mapping`` (one entry per new token,
    packed back to back), ``query_start_loc`` (num_seqs + 1 offsets) and ``context_lens``."""
    def given(seqs, block_size):
        got = fn([(c, n, list(t)) for c, n, t in seqs], block_size)
        return {k: list(got[k]) for k in ("positions", "slot_mapping", "query_start_loc", "context_lens")}

    return _run_cases("check_packed_inputs", _packed_cases(num_cases, seed), packed_inputs_reference, given,
                      lambda seqs, bs: f"seqs={seqs}, block_size={bs}")


# -- chapter 09: top-k and top-p ----------------------------------------------------------------

def kept_tokens_reference(probs: list[float], top_k: int, top_p: float) -> list[int]:
    """Indices that ``apply_top_k_top_p`` leaves unmasked (top_k=-1: no top-k cut)."""
    logits = torch.tensor(probs, dtype=torch.float64).log().unsqueeze(0)
    k = top_k if top_k != -1 else len(probs)
    masked = apply_top_k_top_p(logits, torch.tensor([k]), torch.tensor([top_p], dtype=torch.float64))
    return torch.isfinite(masked[0]).nonzero().flatten().tolist()


def _distribution_cases(num_cases: int, seed: int) -> list[tuple[list[float], int, float]]:
    rng = random.Random(seed)
    fixed = [0.05, 0.40, 0.25, 0.20, 0.10]
    cases = [(fixed, -1, 0.5), (fixed, 2, 1.0), (fixed, 3, 0.7), (fixed, -1, 0.9), (fixed, 1, 1.0)]
    while len(cases) < num_cases:
        vocab = rng.randint(2, 24)
        weights = [rng.random() ** 3 + 1e-3 for _ in range(vocab)]
        total = sum(weights)
        probs = [w / total for w in weights]
        top_k = rng.choice([-1, -1, rng.randint(1, vocab)])
        top_p = rng.choice([1.0, round(rng.uniform(0.05, 0.99), 3)])
        cases.append((probs, top_k, top_p))
    return cases


def check_top_k_top_p(fn: Callable[[list[float], int, float], list[int]], num_cases: int = 80,
                      seed: int = 0) -> bool:
    """``fn(probs, top_k, top_p)`` returns, sorted, the token indices the sampler may still
    draw: the ``top_k`` likeliest (all of them when ``top_k == -1``), and among those the
    likeliest tokens that reach a total probability of ``top_p`` (the smallest such set; the
    likeliest token always stays)."""
    return _run_cases("check_top_k_top_p", _distribution_cases(num_cases, seed), kept_tokens_reference,
                      lambda p, k, q: sorted(int(i) for i in fn(list(p), k, q)),
                      lambda p, k, q: f"probs={[round(x, 3) for x in p]}, top_k={k}, top_p={q}")


# -- chapter 09: the worker's order of operations ------------------------------------------------

class _ToyWorker:
    """Stands in for a Worker whose "model" writes one value per new token at its slot."""

    def __init__(self, cache_engine: CacheEngine, writes: dict[int, int]) -> None:
        self.cache_engine = cache_engine
        self.block_size = 1
        self.device = torch.device("cpu")
        self.writes = writes

    def run(self, inputs) -> torch.Tensor:
        k_cache = self.cache_engine.gpu_cache[0][0]
        for slot in inputs.attn_metadata.slot_mapping.tolist():
            k_cache[slot, 0, 0, 0] = float(self.writes[slot])
        return torch.zeros(len(inputs.sample_indices), 1)


def worker_order_reference(gpu: list[int], cpu: list[int], swap_out: dict[int, int], swap_in: dict[int, int],
                           copy: dict[int, list[int]], writes: dict[int, int]) -> tuple[list[int], list[int]]:
    """Run ``Worker.execute_model`` on a real CacheEngine whose blocks hold one number each
    (block size 1, one layer, one head of width 1); the model writes ``writes[block]``."""
    cache = CacheEngine(CacheConfig(block_size=1, num_gpu_blocks=len(gpu), num_cpu_blocks=len(cpu), watermark=0.0),
                        num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device="cpu")
    cache.gpu_cache[0][0][:, 0, 0, 0] = torch.tensor(gpu, dtype=torch.float64)
    if cpu:
        cache.cpu_cache[0][0][:, 0, 0, 0] = torch.tensor(cpu, dtype=torch.float64)
    groups = []
    for i, block in enumerate(writes):
        seq = Sequence(i, None, [0], 1)
        groups.append(SequenceGroupMetadata(request_id=f"r{i}", is_prompt=True, seq_data={i: seq},
                                            sampling_params=SamplingParams(), block_tables={i: [block]},
                                            token_chunk_size=1))
    Worker.execute_model(_ToyWorker(cache, writes), groups, dict(swap_in), dict(swap_out),
                         {s: list(d) for s, d in copy.items()})
    read = lambda pool: [int(v) for v in pool[0][0][:, 0, 0, 0].tolist()]  # noqa: E731
    return read(cache.gpu_cache), read(cache.cpu_cache)


def _order_cases(num_cases: int, seed: int) -> list[tuple]:
    """Rounds whose orders collide: a block swapped out is reused (as a copy destination, a
    swap-in destination or a new token's slot); a swapped-in block is a copy's source."""
    rng = random.Random(seed)
    # Round 3 of the walkthrough: s2's block 2 goes to CPU block 0 and s1's new token lands in it.
    cases = [([100, 101, 102, 103], [200, 201, 202, 203], {2: 0}, {}, {}, {3: 300, 2: 301})]
    while len(cases) < num_cases:
        num_gpu, num_cpu = rng.randint(4, 9), rng.randint(2, 6)
        gpu = [100 + i for i in range(num_gpu)]
        cpu = [200 + i for i in range(num_cpu)]
        blocks = list(range(num_gpu))
        rng.shuffle(blocks)
        cpu_blocks = list(range(num_cpu))
        rng.shuffle(cpu_blocks)
        n_out = rng.randint(0, min(2, num_cpu))
        swap_out = {blocks[i]: cpu_blocks[i] for i in range(n_out)}
        freed = list(swap_out)
        # Swap-in reads CPU blocks other than the ones written by this round's swap-out.
        spare_cpu = cpu_blocks[n_out:]
        swap_in: dict[int, int] = {}
        copy: dict[int, list[int]] = {}
        writes: dict[int, int] = {}
        others = blocks[n_out:]
        if spare_cpu and rng.random() < 0.5:
            dst = freed.pop() if freed and rng.random() < 0.6 else others.pop()
            swap_in[rng.choice(spare_cpu)] = dst
        if len(others) >= 1 and rng.random() < 0.7:
            # The copy's source: a block swapped in this round, or any block still in place.
            src = next(iter(swap_in.values())) if swap_in and rng.random() < 0.5 else others.pop()
            dst = freed.pop() if freed and rng.random() < 0.6 else (others.pop() if others else None)
            if dst is not None and dst != src:
                copy[src] = [dst]
                if rng.random() < 0.5:
                    writes[dst] = 0  # the new token lands in the fresh copy
        for b in freed + others[: rng.randint(0, 2)] + list(swap_in.values())[: rng.randint(0, 1)]:
            writes.setdefault(b, 0)
        if not writes:
            writes[rng.choice(range(num_gpu))] = 0
        writes = {b: 300 + i for i, b in enumerate(writes)}
        cases.append((gpu, cpu, swap_out, swap_in, copy, writes))
    return cases


def check_worker_order(fn: Callable[..., tuple[list[int], list[int]]], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(gpu, cpu, swap_out, swap_in, copy, writes)`` plays one round of the worker on toy
    caches in which each block holds one number (``gpu[b]``, ``cpu[c]``):
    ``swap_out`` {gpu block: cpu block}, ``swap_in`` {cpu block: gpu block}, ``copy`` {gpu src:
    [gpu dsts]} and ``writes`` {gpu block: value}, what the model stores for the round's new
    tokens. It returns the final ``(gpu, cpu)`` lists, without changing its arguments."""
    def given(gpu, cpu, swap_out, swap_in, copy, writes):
        got_gpu, got_cpu = fn(list(gpu), list(cpu), dict(swap_out), dict(swap_in),
                              {s: list(d) for s, d in copy.items()}, dict(writes))
        return [int(v) for v in got_gpu], [int(v) for v in got_cpu]

    return _run_cases("check_worker_order", _order_cases(num_cases, seed), worker_order_reference, given,
                      lambda g, c, so, si, cp, w: f"gpu={g}, cpu={c}, swap_out={so}, swap_in={si}, copy={cp}, "
                                                  f"writes={w}")
