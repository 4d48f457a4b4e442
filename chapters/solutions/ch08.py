"""Solutions to the exercises of chapter 08, the Triton paged-attention kernel.

Importing this module defines a Triton kernel, so ``triton_env`` comes first: without CUDA it
makes the kernel run in Triton's interpreter.
"""

from __future__ import annotations

import torch

from tinyserve.attention.triton_env import max_along, sum_along, tl, triton
from tinyserve.lab import softmax_walk


@triton.jit
def my_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
    stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)  # one program per query head
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + dims).to(tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.full([1], 0.0, tl.float32)            # running sum of exp(score - m_i)
    acc = tl.full([HEAD_DIM], 0.0, tl.float32)     # running sum of exp(score - m_i) * v
    table = block_tables_ptr + seq * stride_bt
    for tile_start in range(0, context_len, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        mask = tokens < context_len
        # (a) the paging: token t is row t % BLOCK_SIZE of physical block table[t // BLOCK_SIZE].
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        rows = tokens % BLOCK_SIZE
        offsets = blocks[:, None] * stride_kb + rows[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        scores = sum_along(k * q[None, :], 1) * scale
        scores = tl.where(mask, scores, float("-inf"))
        # (b) the online softmax: rescale what was summed so far to the new max.
        m_new = tl.maximum(m_i, max_along(scores, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + sum_along(p, 0)
        acc = acc * alpha + sum_along(p[:, None] * v, 0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Launch one program per (sequence, query head)."""
    num_seqs, num_heads, head_dim = q.shape
    assert k_cache.stride() == v_cache.stride() and q.stride(2) == 1 and k_cache.stride(3) == 1
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power-of-two head_dim"
    out = torch.empty_like(q)
    my_decode_kernel[(num_seqs, num_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], TILE_N=16,
    )
    return out


def walk_at_tiles(ex, tiles=(1, 16, 64, 1000), seq=0, kv_head=1):
    """Exercise 3: one program of the example batch ``ex`` (``kernel_plan.example_inputs()``),
    sequence ``seq`` and KV head ``kv_head`` over its whole context, walked in PyTorch at each
    tile size; a dict from tile size to the ``ProgramWalk``."""
    return {tile: softmax_walk.walk_program(ex.q[seq], ex.k_cache, ex.v_cache, ex.tables[seq], kv_head, ex.scale,
                                            0, ex.context_lens[seq], tile)
            for tile in tiles}
