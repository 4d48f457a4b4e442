"""Paged attention as Triton kernels: the decode kernel, its split-context variant, and K/V store.

The reference (``reference.py``) gathers a sequence's scattered K/V blocks into one dense tensor
and then attends. A kernel never builds that copy. Each program walks the block table itself and
reads every K/V row exactly once, straight from wherever its block sits in the cache. Decoding is
memory-bound: one query row meets the whole context, so the time is the bytes of K/V read, and
reading them once is the whole game.

Three kernels live here:

- ``_paged_decode_kernel``: one program per (sequence, KV head[, context partition]). It loads
  the queries of every head that shares this KV head (grouped-query attention), walks the
  context tile by tile and keeps an online softmax (running max, running sum) in float32.
- ``_combine_partitions_kernel``: for long contexts the context of a sequence is split into
  partitions that run in parallel (flash-decoding, vLLM's "paged attention v2"); this kernel
  merges their partial results with a log-sum-exp.
- ``_store_kv_kernel``: one program per new token copies its K and V into its cache slot.

Without CUDA the same kernels run through Triton's interpreter, which executes each program in
Python over NumPy. It is slow, but it runs the very code that compiles on a GPU, so the tests on a
CPU check the kernels against the reference.
"""

from __future__ import annotations

import math
import os
import sys

import torch

# Triton decides between compiling and interpreting when ``@triton.jit`` runs, by reading
# TRITON_INTERPRET at that moment (triton 3.x; from 3.4 through ``triton.knobs``). So the variable
# must be set before the decorators below run. ``setdefault`` leaves an explicit choice alone,
# e.g. TRITON_INTERPRET=1 on a GPU machine to step through a kernel in Python.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (must come after the TRITON_INTERPRET decision above)
import triton.language as tl  # noqa: E402

from tinyserve.attention.metadata import AttentionMetadata  # noqa: E402
from tinyserve.attention.reference import paged_attention  # noqa: E402


def _interpret_triton_stdlib() -> None:
    """Make triton's own ``@jit`` helpers (tl.zeros, tl.max, tl.sum, ...) interpretable.

    Found on the CPU machine (triton 3.9): setting the variable here is not enough when triton
    was imported before this module. Triton's standard library is decorated when triton itself
    is imported, so those helpers stay compiled-mode JITFunctions, and an interpreted kernel
    that calls ``tl.max`` fails with "Cannot call @triton.jit'd outside of the scope of a
    kernel". That import happens in practice: ``from transformers import LlamaForCausalLM``
    imports torch._dynamo, which imports triton. So, only when interpreting, each such helper is
    re-wrapped exactly as the decorator would have wrapped it had the variable been set first.
    (Tensor-method forms such as ``x.sum()`` keep the compiled helper; the kernels here call the
    ``tl.*`` functions.)
    """
    from triton.runtime.interpreter import InterpretedFunction

    wrapped: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.JITFunction):
                # One wrapper per function, shared by every module that re-exports it: the
                # interpreter recognises tl.max/tl.sum's combine functions by identity to take
                # its fast NumPy path.
                if id(obj) not in wrapped:
                    wrapped[id(obj)] = InterpretedFunction(obj.fn)
                setattr(module, attr, wrapped[id(obj)])


# log2(e): the kernels use exp2/log2, which map to single GPU instructions, so the softmax scale
# is multiplied by log2(e) once and every exponent is taken base 2.
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
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
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)                # running sum of exp(score - max)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of exp(..) * V

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
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

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
def _combine_partitions_kernel(
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
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # an empty context: all weights 0
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    total = tl.where(total > 0, total, 1.0)

    part_out = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + parts[:, None] * stride_pp
                       + dims[None, :], mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(part_out * weights[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program: one new token. Copies its K and V, all KV heads, into its flat cache slot
    ``slot = block * BLOCK_SIZE + row``. A negative slot marks a token that must not be stored.
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: its K/V is stored nowhere
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kcs + heads[:, None] * stride_kch
             + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vcs + heads[:, None] * stride_vch
             + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _is_interpreted(kernel: object) -> bool:
    # A compiled kernel is a JITFunction; the interpreter wraps the Python function instead.
    return not isinstance(kernel, triton.runtime.JITFunction)


INTERPRET: bool = _is_interpreted(_paged_decode_kernel)
"""True when these kernels run through Triton's interpreter (no CUDA, or TRITON_INTERPRET=1).
Read back from the kernel objects, so it says what really happened, not what was asked for.
The interpreted path is tested with triton 3.9; triton 3.6's interpreter under NumPy 2.4 cannot
use a loaded scalar as a ``range`` bound ("only 0-dimensional arrays can be converted"), as
the decode kernel does. Compiled kernels are unaffected (checked: all compile for sm_90 with 3.6)."""

if INTERPRET and isinstance(tl.zeros, triton.runtime.JITFunction):
    _interpret_triton_stdlib()

# A partition shorter than this costs more in the combine step than its parallelism buys.
MIN_PARTITION_TOKENS = 256


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _tile_tokens(head_dim_pad: int) -> int:
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


def _num_sms(device: torch.device) -> int:
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
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    # The kernel reads q in the cache's dtype (tl.dot wants both operands alike) and assumes
    # unit stride along head_dim; both are no-ops for what the model passes.
    qk = q.to(k_cache.dtype)
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches must be contiguous along head_dim")

    group = num_heads // num_kv_heads
    head_dim_pad = _pow2(head_dim, 16)
    tile = tile_tokens or _tile_tokens(head_dim_pad)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 16, got {tile}")
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, _num_sms(q.device))
    partition = tile * math.ceil(math.ceil(max_context_len / max(1, num_splits)) / tile)
    num_parts = math.ceil(max_context_len / partition)  # <= num_splits after the rounding
    if num_parts == 1:
        partition = 2**30  # one pass covers any context, even one longer than the hint said

    # Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot as their raw 16-bit
    # patterns; under the interpreter bf16 tiles are widened to float32 first. Compiled kernels
    # never take that branch (it is a constexpr, so it is not even in the binary).
    upcast = INTERPRET and k_cache.dtype == torch.bfloat16
    consts = dict(
        GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tile,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
    )
    common = (
        qk, k_cache, v_cache, block_tables, context_lens, scale * _LOG2E, partition,
        qk.stride(0), qk.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    if num_parts == 1:
        _paged_decode_kernel[(num_seqs, num_kv_heads, 1)](
            out, out, *common,  # lse_ptr is unused without a split
            out.stride(0), out.stride(1), 0, 0, 0, SPLIT=False, num_warps=num_warps, **consts)
        return out

    part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        part_out, lse, *common,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), lse.stride(0), lse.stride(1),
        SPLIT=True, num_warps=num_warps, **consts)
    _combine_partitions_kernel[(num_seqs, num_heads)](
        out, part_out, lse, num_parts,
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PART_PAD=_pow2(num_parts))
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [num_tokens, num_kv_heads, head_dim]`` into the caches in place:
    token ``t`` to flat slot ``slot_mapping[t]``, skipping negative slots. Same contract as
    ``reference.store_kv``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1])


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for a batch of plain prefills (every context is exactly the new tokens).

    The new tokens' K/V are read back from the cache through the block tables, so this uses the
    same source of truth as the decode kernel, and each sequence goes to torch's fused SDPA.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    # (sequence, position) of every packed token, built on the host from host lists: no sync.
    seq_idx = [i for i, n in enumerate(meta.query_lens) for _ in range(n)]
    pos = [p for n in meta.query_lens for p in range(n)]
    seq_t = torch.tensor(seq_idx, dtype=torch.long, device=q.device)
    pos_t = torch.tensor(pos, dtype=torch.long, device=q.device)
    slots = meta.block_tables.long()[seq_t, pos_t // block_size] * block_size + pos_t % block_size
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)

    out = torch.empty_like(q)
    start = 0
    for n in meta.query_lens:
        sl = slice(start, start + n)
        # [n, H, D] -> [1, H, n, D]; K/V heads are repeated per query head for portability
        # (SDPA's enable_gqa needs torch >= 2.5).
        qs = q[sl].transpose(0, 1)[None]
        ks = k[sl].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vs = v[sl].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[sl] = o[0].transpose(0, 1)
        start += n
    return out


class TritonBackend:
    """The Triton attention backend.

    - ``store_kv``: the store kernel.
    - ``forward``, by the kind of batch:
      - a pure decode batch (one new token per sequence): the paged decode kernel, with the
        context split across programs when the batch alone cannot fill the GPU;
      - plain prefills (no cached prefix): the new tokens' K/V read back through the block tables
        and torch's fused SDPA per sequence, causal. A prefill kernel is a chapter of its own
        (flash attention); SDPA already is one;
      - anything else (a cached prefix, chunked prefill, prefill mixed with decode): the
        reference ``paged_attention``.
    """

    name = "triton"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if meta.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          scale, max_context_len=meta.max_context_len)
        if not meta.has_prefix:
            return _prefill_attention(q, k_cache, v_cache, meta, scale)
        return paged_attention(q, k_cache, v_cache, meta, scale)
