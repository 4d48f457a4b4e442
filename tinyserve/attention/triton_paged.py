"""Paged decode attention with Triton: the launch of the kernels, and the choices it makes.

``paged_decode_attention`` has the contract of ``reference.paged_decode_attention`` (one new
query per sequence, against its cached context) and runs ``triton_kernels.paged_decode_kernel``
over a grid of (sequence, KV head, context partition) programs. It chooses:

- the tile, the tokens one loop iteration of a program reads (``default_tile_tokens``);
- whether to split each context into partitions that run in parallel and are merged by
  ``combine_partitions_kernel`` (``choose_num_splits``): only when the batch alone cannot keep
  every streaming multiprocessor busy.

``store_kv`` (``triton_store``) is the other entry point of the kernels. ``INTERPRET`` says
whether they run through Triton's interpreter (no CUDA, or ``TRITON_INTERPRET=1``; see
``triton_env``), read back from the kernel objects. The interpreted path is tested with
triton 3.9; triton 3.6's interpreter under NumPy 2.4 cannot use a loaded scalar as a ``range``
bound, as the decode kernel does. Compiled kernels are unaffected.
"""

from __future__ import annotations

import math

import torch

from tinyserve.attention.triton_env import is_interpreted, next_pow2
from tinyserve.attention.triton_kernels import LOG2E, combine_partitions_kernel, paged_decode_kernel
from tinyserve.attention.triton_store import store_kv, store_kv_kernel

__all__ = ["INTERPRET", "MIN_PARTITION_TOKENS", "choose_num_splits", "combine_partitions_kernel",
           "default_tile_tokens", "next_pow2", "sm_count", "paged_decode_attention", "paged_decode_kernel", "store_kv",
           "store_kv_kernel"]

INTERPRET: bool = is_interpreted(paged_decode_kernel)
"""True when the kernels run through Triton's interpreter rather than compiled."""

# A partition shorter than this costs more in the combine step than its parallelism buys.
MIN_PARTITION_TOKENS = 256


def default_tile_tokens(head_dim_pad: int) -> int:
    """Tokens per loop iteration: a K tile of about 4096 elements (64 tokens at head_dim 64, 32
    at 128) keeps K, V and their per-element addresses in registers without spilling (checked
    with ptxas for sm_90), and at least 16 rows for tl.dot. It need not match the block size:
    the per-token block lookup lets a tile cross block boundaries."""
    return max(16, min(128, 4096 // head_dim_pad))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many partitions to cut each context into (1 = the single-pass kernel).

    Split only when the (sequence, KV head) programs are too few to keep every streaming
    multiprocessor busy (two programs each), and only into partitions of at least
    MIN_PARTITION_TOKENS tokens, below which the combine step costs more than it buys.
    """
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if programs >= target or max_context < 2 * MIN_PARTITION_TOKENS:
        return 1
    return max(1, min(math.ceil(target / programs), max_context // MIN_PARTITION_TOKENS))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors the decode grid can fill on ``device`` (0: never split)."""
    if device.type != "cuda" or INTERPRET:
        return 0  # the interpreter runs programs one by one: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    tile_tokens: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """One new query per sequence, ``q [num_seqs, num_heads, head_dim]``, against its
    ``context_lens[s]`` cached tokens. Same contract as ``reference.paged_decode_attention``.

    ``num_splits`` cuts each context into up to that many partitions (whole tiles each) that run
    in parallel and are merged by a second kernel (None chooses: 1 unless the GPU would sit
    half idle). It is a performance knob only; every value gives the same result up to rounding.
    ``max_context_len`` (host int) must bound the contexts when the context is split; without it
    the width of the block table is used, which needs no device-to-host copy.
    ``tile_tokens`` (a power of two >= 16) and ``num_warps`` are tuning knobs for the benchmark.
    Returns ``[num_seqs, num_heads, head_dim]`` in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    # >>> fold: validation: q fits the cache
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}")
    # <<<
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    # The kernel reads q in the cache's dtype (tl.dot wants both operands alike) and assumes
    # unit stride along head_dim; both are no-ops for what the model passes.
    qk = q.to(k_cache.dtype)
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    # >>> fold: validation: unit stride along head_dim
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches must be contiguous along head_dim")
    # <<<

    group = num_heads // num_kv_heads
    head_dim_pad = next_pow2(head_dim, 16)
    tile = tile_tokens or default_tile_tokens(head_dim_pad)
    # >>> fold: validation: a tile of 2^k >= 16 tokens
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 16, got {tile}")
    # <<<
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, sm_count(q.device))
    partition = tile * math.ceil(math.ceil(max_context_len / max(1, num_splits)) / tile)
    num_parts = math.ceil(max_context_len / partition)  # <= num_splits after the rounding
    if num_parts == 1:
        partition = 2**30  # one pass covers any context, even one longer than the hint said

    # Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot as their raw 16-bit
    # patterns; under the interpreter bf16 tiles are widened to float32 first. Compiled kernels
    # never take that branch (it is a constexpr, so it is not even in the binary).
    upcast = INTERPRET and k_cache.dtype == torch.bfloat16
    consts = dict(
        GROUP=group, GROUP_PAD=next_pow2(group, 16), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tile,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
    )
    common = (
        qk, k_cache, v_cache, block_tables, context_lens, scale * LOG2E, partition,
        qk.stride(0), qk.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    if num_parts == 1:
        paged_decode_kernel[(num_seqs, num_kv_heads, 1)](
            out, out, *common,  # lse_ptr is unused without a split
            out.stride(0), out.stride(1), 0, 0, 0, SPLIT=False, num_warps=num_warps, **consts)
        return out

    part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    paged_decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        part_out, lse, *common,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), lse.stride(0), lse.stride(1),
        SPLIT=True, num_warps=num_warps, **consts)
    combine_partitions_kernel[(num_seqs, num_heads)](
        out, part_out, lse, num_parts,
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PART_PAD=next_pow2(num_parts))
    return out
