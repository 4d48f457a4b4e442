"""Checkers for chapter 09, the worker and the engine.

- ``check_nucleus_sampler``: the reader's Sampler subclass that does top-p itself. Its draws are
  compared, row by row, with draws from the nucleus written out here (the likeliest tokens until
  their probability reaches ``top_p``, renormalized) from generators with the same seeds; then
  the tiny model runs in the real engine with ``LLMEngine(..., sampler=...)``, seeded requests,
  side by side with the package's Sampler.
- ``check_worker_order``: one round of the worker on toy caches (each block holds one number),
  against the real CacheEngine driven by ``Worker.execute_model``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.exercises.engine_runs import run_engine, same_tokens
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampler import SampleRequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroupMetadata
from tinyserve.worker import Worker

# -- top-p sampling -----------------------------------------------------------------------------


def nucleus_reference(logits: torch.Tensor, params: SamplingParams, num_samples: int,
                      generator: torch.Generator) -> list[int]:
    """Greedy: the argmax. Otherwise softmax at the temperature (in float64), keep the likeliest
    tokens until their mass reaches ``top_p`` (at least one), renormalize, and draw."""
    if params.greedy:
        return [int(logits.argmax())] * num_samples
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    kept, mass = [], 0.0
    for token in probs.argsort(descending=True).tolist():
        if kept and mass >= params.top_p:
            break
        kept.append(token)
        mass += float(probs[token])
    nucleus = torch.zeros_like(probs)
    nucleus[kept] = probs[kept]
    nucleus /= nucleus.sum()
    return torch.multinomial(nucleus.float(), num_samples, replacement=True, generator=generator).tolist()


def _sampler_case(rng: random.Random, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = rng.randint(1, 6)
    logits = torch.randn(rows, rng.choice([5, 40, 300]), generator=gen) * rng.choice([1.0, 3.0])
    requests = []
    for _ in range(rows):
        if rng.random() < 0.25:
            params, n = SamplingParams(temperature=0.0), 1
        else:
            params = SamplingParams(temperature=rng.choice([0.5, 0.8, 1.0, 1.5]),
                                    top_p=rng.choice([1.0, round(rng.uniform(0.05, 0.95), 3)]))
            n = rng.choice([1, 1, 3])
        # Most rows draw from their own generator (a request's seed), some from the sampler's.
        requests.append((params, n, rng.randrange(2**31) if rng.random() < 0.8 else None))
    return logits, requests


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


@checker(chapter=9, answer="NucleusSampler")
def check_nucleus_sampler(cls: type, num_cases: int = 40, seed: int = 0) -> bool:
    """``cls(seed)`` is a Sampler: called with ``logits [rows, vocab]`` and one SampleRequest per
    row, it returns each row's ``num_samples`` tokens: the argmax for a greedy request; otherwise
    a draw, with ``torch.multinomial(probs, num_samples, replacement=True, generator=...)`` from
    the request's generator (the sampler's own when it has none, rows in order), from the
    distribution at the request's temperature cut to its top-p nucleus.

    The last case runs the tiny model in the real engine with ``sampler=cls(0)`` on seeded top-p
    requests; its tokens must equal those of the package's Sampler (only when the others pass)."""
    rng = random.Random(seed)
    failures = []
    for case in range(num_cases):
        logits, rows = _sampler_case(rng, seed * 1000 + case)
        own = 1000 + case  # the seed of the sampler's own generator
        expected_own = torch.Generator().manual_seed(own)
        want = [nucleus_reference(logits[i], p, n, _generator(s) or expected_own) for i, (p, n, s) in enumerate(rows)]
        requests = [SampleRequest(p, n, _generator(s)) for p, n, s in rows]
        shown = (f"{logits.shape[0]} rows of {logits.shape[1]} logits, (temperature, top_p, n) = "
                 f"{[(p.temperature, p.top_p, n) for p, n, _ in rows]}")
        try:
            got = cls(own)(logits.clone(), requests)
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"{shown}: raised {type(e).__name__}: {e}")
            continue
        try:
            same = [[int(t) for t in row] for row in got] == want
        except Exception:
            same = False
        if not same:
            failures.append(f"{shown}: drew {got}, expected {want}")
    if not failures:
        params = {rid: SamplingParams(temperature=0.9, top_p=0.6, seed=i, max_tokens=10, ignore_eos=True)
                  for i, rid in enumerate(("s0", "s1"))}
        params["s2"] = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        package = run_engine("package's Sampler", params=params)
        yours = run_engine("your sampler", params=params, sampler=cls(0))
        if not same_tokens(yours, package):
            failures.append(f"in the engine: {yours.error or 'other tokens than the package Sampler'}")
    return verdict("nucleus_sampler", failures, num_cases + 1)


# -- the worker's order of operations ----------------------------------------------------------------

class _ToyWorker:
    """Stands in for a Worker whose "model" writes one value per new token at its slot."""

    def __init__(self, cache_engine: CacheEngine, writes: dict[int, int]) -> None:
        self.cache_engine = cache_engine
        self.block_size = 1
        self.device = torch.device("cpu")
        self.writes = writes
        self.prepare_inputs = prepare_inputs

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
        blocks = rng.sample(range(num_gpu), num_gpu)
        cpu_blocks = rng.sample(range(num_cpu), num_cpu)
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
        if others and rng.random() < 0.7:
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
            writes[rng.randrange(num_gpu)] = 0
        writes = {b: 300 + i for i, b in enumerate(writes)}
        cases.append((gpu, cpu, swap_out, swap_in, copy, writes))
    return cases


@checker(chapter=9, answer="apply_round")
def check_worker_order(fn: Callable[..., tuple[list[int], list[int]]], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(gpu, cpu, swap_out, swap_in, copy, writes)`` plays one round of the worker on toy
    caches in which each block holds one number (``gpu[b]``, ``cpu[c]``): ``swap_out`` {gpu block:
    cpu block}, ``swap_in`` {cpu block: gpu block}, ``copy`` {gpu src: [gpu dsts]} and ``writes``
    {gpu block: value}, what the model stores for the round's new tokens. It returns the final
    ``(gpu, cpu)`` lists, without changing its arguments."""
    def given(gpu, cpu, swap_out, swap_in, copy, writes):
        got_gpu, got_cpu = fn(list(gpu), list(cpu), dict(swap_out), dict(swap_in),
                              {s: list(d) for s, d in copy.items()}, dict(writes))
        return [int(v) for v in got_gpu], [int(v) for v in got_cpu]

    cases = [(case, worker_order_reference(*case)) for case in _order_cases(num_cases, seed)]
    return run_cases("worker_order", given, cases,
                     describe=lambda a: f"gpu={a[0]}, cpu={a[1]}, swap_out={a[2]}, swap_in={a[3]}, copy={a[4]}, "
                                        f"writes={a[5]}")
