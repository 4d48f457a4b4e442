"""Paged attention in plain PyTorch: the reference every other backend is tested against.

Two jobs, as in every backend:

- ``store_kv`` writes the new tokens' keys and values into the paged cache, one flat slot per
  token (``slot = block * block_size + offset``).
- ``paged_attention`` reads each sequence's keys and values back through its block table and
  attends to them, causally, for a packed batch of queries.

The approach is "gather, then attend". For every sequence we build the flat slot index of each
of its context positions from its block table, gather those K/V rows into a padded
``[num_seqs, max_context, num_kv_heads, head_dim]`` tensor with one indexing call, and hand the
whole batch to ``F.scaled_dot_product_attention`` with a mask. Nothing loops over tokens in
Python, so the same code serves a 1-token decode and a 2000-token prefill.

Grouped-query attention (GQA) never copies K/V per query head: the ``group`` query heads that
share one KV head are folded into the query-length axis, so SDPA sees ``num_kv_heads`` heads with
``group * query_len`` queries each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.attention.metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches in place.

    Token ``t`` goes to flat slot ``slot_mapping[t]``; a negative slot marks a padding token whose
    K/V must not be stored anywhere.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _context_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_key_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slot of every context position of every sequence, and which positions exist.

    Returns ``slots [num_seqs, L]`` and ``valid [num_seqs, L]`` with ``L = num_key_blocks *
    block_size``. Positions past a sequence's context point at its own first token instead of at
    whatever the padded block table says: the cache outside a sequence's blocks may hold anything,
    even NaN, and a masked NaN still poisons ``softmax @ V`` (0 * NaN = NaN).
    """
    pos = torch.arange(num_key_blocks * block_size, device=block_tables.device)
    tables = block_tables[:, :num_key_blocks].long()
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    valid = pos[None, :] < context_lens[:, None].long()
    slots = torch.where(valid, slots, slots[:, :1])
    return slots, valid


def _attend_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    num_key_blocks: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention for padded queries ``q [num_seqs, max_query_len, num_heads, head_dim]``.

    Query ``i`` of sequence ``s`` sits at position ``context_lens[s] - query_lens[s] + i`` and sees
    every cached position up to and including its own. Rows past ``query_lens[s]`` are padding;
    their output is finite and meaningless.
    """
    num_seqs, max_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads

    slots, valid = _context_slots(block_tables, context_lens, block_size, num_key_blocks)
    ctx_len = slots.shape[1]
    # Gather straight into SDPA's [S, Hkv, L, D] layout: row (slot, h) of the cache viewed as
    # [num_slots * Hkv, D]. A contiguous result lets SDPA skip a second copy of K/V.
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    k = k_cache.view(-1, head_dim).index_select(0, rows).view(num_seqs, num_kv_heads, ctx_len, head_dim)
    v = v_cache.view(-1, head_dim).index_select(0, rows).view(num_seqs, num_kv_heads, ctx_len, head_dim)

    # Fold the query heads of one KV group into the query axis: [S, Hkv, max_q * group, D].
    q = q.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(num_seqs, num_kv_heads, max_q * group, head_dim)

    q_pos = (context_lens - query_lens).long()[:, None] + torch.arange(max_q, device=q.device)[None, :]
    key_pos = torch.arange(ctx_len, device=q.device)
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [S, max_q, L]
    mask = allowed[:, None, :, None, :].expand(num_seqs, 1, max_q, group, ctx_len)
    mask = mask.reshape(num_seqs, 1, max_q * group, ctx_len)

    # SDPA keeps the softmax in float32 for half inputs (fused kernels by design, the math
    # fallback because torch's reduced-precision math SDP is off by default).
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_seqs, max_q, num_heads, head_dim)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query per sequence: ``q [num_seqs, num_heads, head_dim]`` attends to the
    ``context_lens[s]`` cached tokens of its sequence (the last one is its own).

    Returns ``[num_seqs, num_heads, head_dim]``. The gather covers every block in the table's
    width, so this needs no host copy of ``context_lens`` (no device sync).
    """
    num_seqs = q.shape[0]
    ones = torch.ones(num_seqs, dtype=torch.int32, device=q.device)
    out = _attend_padded(q[:, None], k_cache, v_cache, block_tables, context_lens, ones,
                         block_tables.shape[1], scale)
    return out[:, 0]


def _attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention for the sequences ``rows`` of a packed batch, written into their rows of ``out``."""
    device = q.device
    query_lens = [meta.query_lens[r] for r in rows]
    context_lens = [meta.context_lens_list[r] for r in rows]
    max_q = max(query_lens)
    block_size = k_cache.shape[1]
    num_key_blocks = -(-max(context_lens) // block_size)

    starts = meta.query_start_loc[:-1].long()
    idx = torch.tensor(rows, device=device)
    q_lens = torch.tensor(query_lens, device=device)
    offs = torch.arange(max_q, device=device)
    token_idx = starts[idx][:, None] + offs[None, :]
    real = offs[None, :] < q_lens[:, None]
    token_idx = torch.where(real, token_idx, 0)  # padding rows read token 0 and are dropped

    q_pad = q[token_idx]
    res = _attend_padded(q_pad, k_cache, v_cache, meta.block_tables[idx], meta.context_lens[idx],
                         q_lens, num_key_blocks, scale)
    out[token_idx[real]] = res[real]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a packed batch ``q [num_tokens, num_heads, head_dim]``.

    Sequence ``i``'s queries are the last ``meta.query_lens[i]`` positions of its context of
    ``meta.context_lens_list[i]`` tokens, all already in the cache. That one rule covers
    prefill, decode, prefill over a cached prefix, chunked prefill and mixed batches.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    if meta.num_seqs == 0:
        return torch.empty_like(q)
    out = torch.empty_like(q)
    # Padding a batch to its longest query would make every decode row of a mixed batch pay
    # for the longest prompt, so decode rows and prefill rows are padded separately.
    decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
    other_rows = [i for i, n in enumerate(meta.query_lens) if n > 1]
    for rows in (decode_rows, other_rows):
        if rows:
            _attend_rows(q, k_cache, v_cache, meta, rows, scale, out)
    return out


class TorchBackend:
    """The reference attention backend: works wherever PyTorch does."""

    name = "torch"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode and meta.num_seqs > 0:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return paged_attention(q, k_cache, v_cache, meta, scale)
