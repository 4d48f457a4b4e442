"""The Triton K/V store: each new token's key and value copied into its slot of the paged cache.

The simplest kernel of the backend, and the one every step runs in every layer: one program per
new token reads the token's K and V (all KV heads) and writes them to flat slot
``slot_mapping[t] = block * block_size + offset``, skipping padding tokens (a negative slot).
It does what ``reference.store_kv`` does with one ``index_copy_``.
"""

from __future__ import annotations

import torch

from tinyserve.attention.triton_env import next_pow2, tl, triton


@triton.jit
def store_kv_kernel(
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
    store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1])
