"""The checker of chapter 09's worker-order exercise, ``check_worker_order``: one round of the
worker on toy caches (each block holds one number), against the real CacheEngine driven by
``Worker.execute_model``.
"""


from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroupMetadata
from tinyserve.worker import Worker

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
