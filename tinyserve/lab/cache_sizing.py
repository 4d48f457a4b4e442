"""Chapter 06's arithmetic of cache memory: how a device is split, and how keys are laid out.

- ``memory_budget`` runs the CUDA sizing rule (``CacheEngine.profile_num_gpu_blocks``) on a
  pretend device (``pretend_gpu``) and splits the device four ways; ``block_bytes_rows`` gives
  the bytes of one block for a few model shapes and dtypes.
- The split-x key layout of vLLM's CUDA kernel, as index arithmetic next to tinyserve's plain
  layout (``plain_offset``, ``split_x_offset``) and as tensors (``to_split_x``, ``from_split_x``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from tinyserve.cache_engine import CacheEngine

GiB = 2**30


def budget_parts(total: int, used: int, activation: int, cache_bytes: int, utilization: float) -> dict[str, int]:
    """The device split four ways (what is left over, less than one block, is not drawn)."""
    return {"weights + context": used, "activations": activation, "KV cache": cache_bytes,
            "headroom (1 − utilization)": total - int(total * utilization)}


def memory_budget(total: int, used: int, activation: int, shape: tuple[int, int, int], dtype: torch.dtype,
                  utilization: float, block_size: int) -> tuple[int, dict[str, int]]:
    """``(number of KV blocks, the device split four ways)`` once the CUDA sizing rule has run on
    a device of ``total`` bytes with ``used`` taken (``shape``: layers, KV heads, head_dim)."""
    with pretend_gpu(total, total - used):
        blocks = CacheEngine.profile_num_gpu_blocks(block_size, *shape, dtype, utilization, activation)
    cache_bytes = blocks * CacheEngine.get_cache_block_size(block_size, *shape, dtype)
    return blocks, budget_parts(total, used, activation, cache_bytes, utilization)


@contextlib.contextmanager
def pretend_gpu(total_bytes: int, free_bytes: int) -> Iterator[None]:
    """Make ``torch.cuda`` report a device with this much memory, so the CUDA sizing rule
    (``CacheEngine.profile_num_gpu_blocks``) can be run on a machine without one."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "mem_get_info", return_value=(int(free_bytes), int(total_bytes))):
        yield


# -- the split-x key layout of vLLM's CUDA kernel ---------------------------------------------------


def split_x(dtype: torch.dtype) -> int:
    """Elements in 16 bytes: 4 for float32, 8 for float16/bfloat16, 16 for 8-bit types."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def to_split_x(k_cache: torch.Tensor, x: int) -> torch.Tensor:
    """tinyserve's ``[num_blocks, block_size, num_kv_heads, head_dim]`` keys rearranged into
    vLLM's ``[num_blocks, num_kv_heads, head_dim / x, block_size, x]`` (a contiguous copy)."""
    nb, bs, heads, head_dim = k_cache.shape
    if head_dim % x:
        raise ValueError(f"head_dim {head_dim} is not a multiple of x={x}")
    return k_cache.view(nb, bs, heads, head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()


def from_split_x(k_split: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_split_x``."""
    nb, heads, chunks, bs, x = k_split.shape
    return k_split.permute(0, 3, 1, 2, 4).reshape(nb, bs, heads, chunks * x)


def plain_offset(block: int, token: int, head: int, d: int, block_size: int, num_heads: int,
                 head_dim: int) -> int:
    """Element offset of key channel ``d`` of (block, token, head) in tinyserve's layout."""
    return ((block * block_size + token) * num_heads + head) * head_dim + d


def split_x_offset(block: int, token: int, head: int, d: int, block_size: int, num_heads: int,
                   head_dim: int, x: int) -> int:
    """The same element's offset in the split-x layout: channels are cut into ``x``-wide pieces,
    and piece ``d // x`` of every token of the block lies side by side."""
    chunk, inner = divmod(d, x)
    return (((block * num_heads + head) * (head_dim // x) + chunk) * block_size + token) * x + inner


def block_bytes_rows(shapes: dict[str, tuple[int, int, int]], dtypes: tuple[torch.dtype, ...],
                     block_size: int = 16) -> list[dict]:
    """Bytes of one block (K and V, every layer) for each model shape and dtype."""
    rows = []
    for name, (layers, kv_heads, head_dim) in shapes.items():
        for dtype in dtypes:
            per_block = CacheEngine.get_cache_block_size(block_size, layers, kv_heads, head_dim, dtype)
            rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "block_bytes": per_block,
                         "per_token": per_block // block_size})
    return rows
