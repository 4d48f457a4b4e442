"""Paged attention in plain PyTorch, written to be read: the reference every backend is tested against.

An attention layer over a paged cache has two jobs:

- ``store_kv`` writes the new tokens' keys and values into the cache, each to its own flat slot
  ``block * block_size + offset``, as the block manager's slot mapping says.
- ``paged_attention`` reads each sequence's keys and values back through its block table and
  attends to them, causally.

This file does both the obvious way: one sequence at a time, gather its context into a dense
``[context_len, num_kv_heads, head_dim]`` tensor, then softmax attention over it, written out.
``batched.py`` computes the same thing faster on a CPU and the Triton kernels on a GPU; the tests
hold both to this file.
"""

from __future__ import annotations

import torch

from tinyserve.attention.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value [num_tokens, num_kv_heads, head_dim]`` into the caches in place:
    token ``t`` to flat slot ``slot_mapping[t]``. A negative slot marks a padding token,
    stored nowhere."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # Viewed as [num_blocks * block_size, ...], the cache is simply one row per slot.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def context_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slot of each of a sequence's first ``context_len`` positions: position ``p``
    lives at offset ``p % block_size`` of physical block ``block_table[p // block_size]``."""
    pos = torch.arange(context_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q [n_q, num_heads, head_dim]``, the last ``n_q`` positions of a
    context ``k, v [n_ctx, num_kv_heads, head_dim]``: query ``i`` sits at position
    ``n_ctx - n_q + i`` and sees every position up to its own."""
    n_q, num_heads, _ = q.shape
    n_ctx, num_kv_heads, _ = k.shape
    # Grouped-query attention: consecutive query heads share one KV head.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # float32, even for half inputs
    q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)
    k_pos = torch.arange(n_ctx, device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


def sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Attention of one sequence's new queries ``q [n_q, num_heads, head_dim]`` over its
    ``context_len`` cached tokens, found through its ``block_table``."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    # Only the slots the sequence owns are read: a slot outside its blocks may hold anything,
    # even NaN, and a masked NaN would still poison softmax @ V (0 * NaN = NaN).
    slots = context_slots(block_table, context_len, block_size)
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    return causal_attention(q, k, v, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for a packed batch ``q [num_tokens, num_heads, head_dim]``.

    Sequence ``i``'s queries are the last ``meta.query_lens[i]`` positions of its context of
    ``meta.context_lens_list[i]`` tokens, all already in the cache. That one rule covers
    prefill, decode, prefill over a cached prefix, chunked prefill and mixed batches.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    start = 0
    for i, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
        rows = slice(start, start + n_q)
        out[rows] = sequence_attention(q[rows], k_cache, v_cache, meta.block_tables[i], n_ctx, scale)
        start += n_q
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new query per sequence: ``q [num_seqs, num_heads, head_dim]`` attends to the
    ``context_lens[s]`` cached tokens of its sequence (the last one is its own).
    Returns ``[num_seqs, num_heads, head_dim]``."""
    out = torch.empty_like(q)
    # Host ints to loop over: a device sync on CUDA, fine for a reference.
    for s, n_ctx in enumerate(context_lens.tolist()):
        out[s:s + 1] = sequence_attention(q[s:s + 1], k_cache, v_cache, block_tables[s], n_ctx, scale)
    return out


class TorchBackend:
    """The reference backend (``"torch"``): works wherever PyTorch does."""

    name = "torch"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale)
