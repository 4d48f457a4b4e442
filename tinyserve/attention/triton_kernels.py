"""The Triton decode kernels over the paged cache: one pass, or a split context and its merge.

The reference (``reference.py``) gathers a sequence's scattered K/V blocks into one dense tensor
and then attends. A kernel never builds that copy. Each program walks the block table itself and
reads every K/V row exactly once, straight from wherever its block sits in the cache. Decoding is
memory-bound: one query row meets the whole context, so the time is the bytes of K/V read, and
reading them once is the whole game.

- ``paged_decode_kernel``: one program per (sequence, KV head[, context partition]). It loads
  the queries of every head that shares this KV head (grouped-query attention), walks the
  context tile by tile and keeps an online softmax (running max, running sum) in float32.
- ``combine_partitions_kernel``: for long contexts the context of a sequence is split into
  partitions that run in parallel (flash-decoding, vLLM's "paged attention v2"); this kernel
  merges their partial results with a log-sum-exp.

``triton_paged.paged_decode_attention`` launches them. ``triton_env``, imported first, has
decided whether they compile or run in the interpreter.
"""

from __future__ import annotations

from tinyserve.attention.triton_env import max_along, sum_along, tl, triton

# log2(e): the kernels use exp2/log2, which map to single GPU instructions, so the softmax scale
# is multiplied by log2(e) once and every exponent is taken base 2.
LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    out_ptr, lse_ptr,                     # out [S, H, D] (one pass) or [S, H, P, D] fp32 (split)
    q_ptr, k_cache_ptr, v_cache_ptr,      # q [S, H, D]; caches [num_blocks, block_size, Hkv, D]
    block_tables_ptr, context_lens_ptr,   # [S, max_blocks] int32, [S] int32
    scale_log2,                           # softmax scale * log2(e)
    partition_size,                       # tokens per partition, a multiple of TILE_N
    stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_os, stride_oh, stride_op,
    stride_ls, stride_lh,
    GROUP: tl.constexpr,          # query heads per KV head
    GROUP_PAD: tl.constexpr,      # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,   # power of two >= 16
    BLOCK_SIZE: tl.constexpr,     # tokens per cache block
    TILE_N: tl.constexpr,         # tokens per loop iteration, a power of two >= 16
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 caches, so fp32 stays fp32 (no TF32)
    SPLIT: tl.constexpr,          # write a partial result per partition instead of the output
    UPCAST: tl.constexpr,         # multiply in float32 (the interpreter's bf16 tl.dot is wrong)
):
    """One program: one sequence, one KV head, one partition of the context.

    It attends the GROUP query heads that read this KV head to the partition's tokens
    ``[part * partition_size, min(context_len, (part + 1) * partition_size))``. Without a split
    there is one partition, the whole context, and the program writes the final output.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    start = part * partition_size
    end = tl.minimum(context_len, start + partition_size)

    # All query heads of this KV head, as the rows of one small matrix: each K/V tile is then
    # read once for the whole group and both products run on the tensor cores. Rows past GROUP
    # are padding (zero queries) that are never stored.
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)             # running sum of exp(score - max)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)     # running sum of exp(..) * V

    table = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        tok_mask = tokens < end
        # The paging: token t lives at row t % BLOCK_SIZE of physical block table[t // BLOCK_SIZE].
        # Looking the block up per token lets one tile span several small blocks (or part of a
        # large one); the repeated table reads hit the cache. int64: a big cache has more than
        # 2**31 elements.
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        rows = tokens % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        # Masked-out rows are never read (other=0), so garbage or NaN in slots past the context
        # cannot leak into the sums.
        k = tl.load(k_cache_ptr + blocks[:, None] * stride_kb + rows[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G, N]
        scores = tl.where(tok_mask[None, :], scores, float("-inf"))

        # Online softmax: rescale what was summed so far to the new running max. Every tile holds
        # at least one real token, so m_new is finite and alpha is exp2(-inf) = 0 on the first.
        m_new = tl.maximum(m_i, max_along(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + sum_along(p, 1)

        v = tl.load(v_cache_ptr + blocks[:, None] * stride_vb + rows[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        # p is in [0, 1], so casting it to the cache's 16-bit type for the tensor cores loses
        # little; the product still accumulates in float32.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty partition (a sequence shorter than the longest) has l_i = 0: write 0, not 0/0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + part * stride_op + dims[None, :]
    if SPLIT:
        # Base-2 log-sum-exp of this partition's scores: enough to reweight its normalized
        # output later. An empty partition gets -inf, i.e. weight 0.
        tl.store(out_ptrs, out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + part, lse, mask=head_mask)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def combine_partitions_kernel(
    out_ptr, part_out_ptr, lse_ptr,
    num_partitions,
    stride_os, stride_oh,
    stride_ps, stride_ph, stride_pp,
    stride_ls, stride_lh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PART_PAD: tl.constexpr,       # num_partitions rounded up to a power of two
):
    """One program: one sequence, one query head. Merges the partitions' normalized outputs.

    Partition p saw scores whose base-2 log-sum-exp is ``lse_p`` and produced ``o_p``, softmax
    over its own tokens applied to V. The softmax over all tokens weighs partition p by
    ``2**lse_p / sum_q 2**lse_q``; subtracting the largest lse first keeps the powers in range.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PART_PAD)
    part_mask = parts < num_partitions
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + parts, mask=part_mask,
                  other=float("-inf"))
    lse_max = max_along(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # an empty context: all weights 0
    weights = tl.exp2(lse - lse_max)
    total = sum_along(weights, 0)
    total = tl.where(total > 0, total, 1.0)

    part_out = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + parts[:, None] * stride_pp
                       + dims[None, :], mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
    out = sum_along(part_out * weights[:, None], 0) / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)
