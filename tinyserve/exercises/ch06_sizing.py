"""Chapter 06's shorter exercises: how many sequences a memory budget holds
(``check_max_seqs_in_budget``, against the real BlockSpaceManager allocating them in a pool of the
CacheEngine's size) and where an element of vLLM's split-x key cache comes from
(``check_split_x_position``, against a real tensor rearranged into that layout).
"""
from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.cache_engine import CacheEngine
from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroup

# -- sizing: sequences per budget -------------------------------------------------------------------

_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}


def max_seqs_reference(budget_bytes: int, seq_len: int, block_size: int, num_layers: int, num_kv_heads: int,
                       head_dim: int, dtype_bytes: int) -> int:
    """Size the pool as the CacheEngine does, then let the real block manager admit sequences of
    ``seq_len`` tokens until it says no."""
    num_blocks = CacheEngine.num_blocks_for_budget(budget_bytes, block_size, num_layers, num_kv_heads, head_dim,
                                                   _DTYPES[dtype_bytes])
    manager = BlockSpaceManager(block_size, num_blocks, 0, watermark=0.0)
    count = 0
    while True:
        group = SequenceGroup(f"r{count}", [Sequence(count, None, [1] * seq_len, block_size)], SamplingParams(), 0.0)
        if manager.can_allocate(group) != AllocStatus.OK:
            return count
        manager.allocate(group)
        count += 1


@checker(chapter=6, answer="max_seqs_in_budget")
def check_max_seqs_in_budget(fn: Callable[..., int], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(budget_bytes, seq_len, block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)``:
    how many sequences of ``seq_len`` tokens a KV cache of ``budget_bytes`` holds at the same time."""
    rng = random.Random(seed)
    cases = [(2**20, 16, 16, 2, 2, 64, 2), (2**20, 17, 16, 2, 2, 64, 2), (1000, 5, 4, 1, 1, 8, 4)]
    while len(cases) < num_cases:
        bs = rng.choice([1, 4, 8, 16, 32])
        layers, heads = rng.randint(1, 4), rng.randint(1, 4)
        head_dim, b = rng.choice([8, 16, 64]), rng.choice([1, 2, 4])
        seq_len = rng.randint(1, 300)
        block = 2 * layers * bs * heads * head_dim * b
        blocks = rng.randint(0, 600)
        cases.append((blocks * block + rng.randint(0, block - 1), seq_len, bs, layers, heads, head_dim, b))
    return run_cases("max_seqs_in_budget", fn, [(c, max_seqs_reference(*c)) for c in cases])


# -- the split-x key layout, read backwards ----------------------------------------------------------

def _split_x(plain: torch.Tensor, x: int) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` rearranged into vLLM's key layout
    ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]``."""
    nb, bs, heads, head_dim = plain.shape
    return plain.view(nb, bs, heads, head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()


@checker(chapter=6, answer="split_x_position")
def check_split_x_position(fn: Callable[..., tuple[int, int, int, int]], num_cases: int = 300,
                           seed: int = 0) -> bool:
    """``fn(offset, block_size, num_kv_heads, head_dim, x)`` -> ``(block, token, head, d)``: the
    key element stored at element ``offset`` of vLLM's split-x key cache
    ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]``: channel ``d`` of the key of the
    ``token``-th token of ``block``, for KV head ``head``."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        nb, bs, heads = rng.randint(1, 4), rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 4)
        x = rng.choice([2, 4, 8, 16])
        head_dim = x * rng.randint(1, 4)
        # Number every element by (block, token, head, d), rearrange the real tensor, read it back.
        shape = (nb, bs, heads, head_dim)
        flat = _split_x(torch.arange(nb * bs * heads * head_dim).view(shape), x).reshape(-1)
        for _ in range(6):
            offset = rng.randrange(flat.numel())
            where = torch.unravel_index(flat[offset], shape)
            cases.append(((offset, bs, heads, head_dim, x), tuple(int(i) for i in where)))
    return run_cases("split_x_position", fn, cases[:num_cases], same=lambda got, want: tuple(got) == want)
