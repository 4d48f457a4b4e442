"""Solutions to the exercises of chapter 08, the Triton paged-attention kernel.

Exercise 1 is a split-context decode kernel that walks the block table one cache block at a time
(the PagedAttention paper's loop), with a second kernel that reduces the partitions, and its
launcher ``paged_decode``. Importing this module defines Triton kernels, so ``triton_env`` comes
first: without CUDA it makes them run in Triton's interpreter.
"""

from __future__ import annotations

import torch

from tinyserve.attention.triton_env import max_along, next_pow2, sum_along, tl, triton
from tinyserve.lab import softmax_walk

PARTITION_BLOCKS = 4  # cache blocks per partition of a context, when the caller does not say


@triton.jit
def partition_kernel(
    acc_ptr, max_ptr, sum_ptr,            # per partition: acc [S, H, P, D], running max and sum [S, H, P]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
    stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_as, stride_ah, stride_ap, stride_ms, stride_mh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, PARTITION_BLOCKS: tl.constexpr,
):
    """One program: one sequence, one KV head and its GROUP query heads, one partition of
    PARTITION_BLOCKS logical blocks of the context, walked one cache block per iteration."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = part * PARTITION_BLOCKS
    last = tl.minimum((context_len + BLOCK_SIZE - 1) // BLOCK_SIZE, first + PARTITION_BLOCKS)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)

    rows = tl.arange(0, BLOCK_PAD)
    for b in range(first, last):
        # One block number per iteration: its rows are contiguous in the cache.
        block = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        # The last block may end mid-way (and BLOCK_PAD may exceed a block size that is not a
        # power of two): those rows are not the context's, whatever the cache holds there.
        tok_mask = (rows < BLOCK_SIZE) & (b * BLOCK_SIZE + rows < context_len)
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + block * stride_kb + rows[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        # [GROUP_PAD, 1, D] * [1, BLOCK_PAD, D] summed over D: every query row of the group
        # against every key of the block, from one read of the block.
        scores = sum_along(q[:, None, :] * k[None, :, :], 2) * scale
        scores = tl.where(tok_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, max_along(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + sum_along(p, 1)
        v = tl.load(v_cache_ptr + block * stride_vb + rows[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + sum_along(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new

    # Unnormalized: the reduction rescales acc and l to the max over all partitions. An empty
    # partition (past a short context) writes m = -inf, l = 0, acc = 0: weight 0.
    tl.store(acc_ptr + seq * stride_as + heads[:, None] * stride_ah + part * stride_ap + dims[None, :], acc,
             mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(max_ptr + seq * stride_ms + heads * stride_mh + part, m_i, mask=head_mask)
    tl.store(sum_ptr + seq * stride_ms + heads * stride_mh + part, l_i, mask=head_mask)


@triton.jit
def reduce_kernel(
    out_ptr, acc_ptr, max_ptr, sum_ptr, num_parts,
    stride_os, stride_oh, stride_as, stride_ah, stride_ap, stride_ms, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PART_PAD: tl.constexpr,
):
    """One program: one sequence, one query head. Partition p summed exp(s - m_p): moved onto
    the global max M, its acc and sum weigh exp(m_p - M), and the output is their ratio."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PART_PAD)
    part_mask = parts < num_parts
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    m = tl.load(max_ptr + seq * stride_ms + head * stride_mh + parts, mask=part_mask, other=float("-inf"))
    l_p = tl.load(sum_ptr + seq * stride_ms + head * stride_mh + parts, mask=part_mask, other=0.0)
    acc = tl.load(acc_ptr + seq * stride_as + head * stride_ah + parts[:, None] * stride_ap + dims[None, :],
                  mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
    # Partition 0 holds the context's first token, so M is finite; empty ones get exp(-inf) = 0.
    w = tl.exp(m - max_along(m, 0))
    out = sum_along(acc * w[:, None], 0) / sum_along(l_p * w, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, partition_blocks=PARTITION_BLOCKS):
    """One new query per sequence, ``q [num_seqs, num_heads, head_dim]``, against the
    ``context_lens[s]`` tokens its block table ``block_tables[s]`` points to in the paged caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``: the contract of
    ``reference.paged_decode_attention``. Each context is cut into partitions of
    ``partition_blocks`` blocks, one program per (sequence, KV head, partition), then reduced.
    Returns ``[num_seqs, num_heads, head_dim]`` in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    q = q.contiguous()  # the kernels assume unit stride along head_dim
    group = num_heads // num_kv_heads
    # The table's width bounds every context: no device-to-host copy of context_lens.
    num_parts = triton.cdiv(block_tables.shape[1], partition_blocks)
    acc = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    l_p = torch.empty_like(m)
    partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        acc, m, l_p, q, k_cache, v_cache, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_PAD=next_pow2(block_size), PARTITION_BLOCKS=partition_blocks,
    )
    reduce_kernel[(num_seqs, num_heads)](
        out, acc, m, l_p, num_parts,
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), PART_PAD=next_pow2(num_parts),
    )
    return out


def walk_at_tiles(ex, tiles=(1, 16, 64, 1000), seq=0, kv_head=1):
    """Exercise 3: one program of the example batch ``ex`` (``kernel_plan.example_inputs()``),
    sequence ``seq`` and KV head ``kv_head`` over its whole context, walked in PyTorch at each
    tile size; a dict from tile size to the ``ProgramWalk``."""
    return {tile: softmax_walk.walk_program(ex.q[seq], ex.k_cache, ex.v_cache, ex.tables[seq], kv_head, ex.scale,
                                            0, ex.context_lens[seq], tile)
            for tile in tiles}
