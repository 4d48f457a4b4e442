"""Paged attention in plain PyTorch: the reference every other backend is tested against.

Two jobs, as in every backend:

- ``store_kv`` writes the new tokens' keys and values into the paged cache, one flat slot per
  token (``slot = block * block_size + offset``).
- ``paged_attention`` reads each sequence's keys and values back through its block table and
  attends to them, causally, for a packed batch of queries.

The approach is "gather, then attend". For every sequence we build the flat slot index of each
of its context positions from its block table, gather those K/V rows into a padded
``[num_seqs, num_kv_heads, max_context, head_dim]`` tensor with one indexing call, and hand the
whole batch to ``F.scaled_dot_product_attention`` with a mask. Nothing loops over tokens in
Python, so the same code serves a 1-token decode and a 2000-token prefill. (A large decode batch
is cut into a few sub-batches of similar context length, ``_decode_chunks``, so that each
gathered tensor stays in the CPU's caches until SDPA reads it.)

Grouped-query attention (GQA) never copies K/V per query head: the ``group`` query heads that
share one KV head are folded into the query-length axis, so SDPA sees ``num_kv_heads`` heads with
``group * query_len`` queries each.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # Checking for padding reads a flag back from the device (a sync on CUDA); the engine packs
    # batches without padding, so the filtering below rarely runs.
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


@dataclass
class _Group:
    """What attention needs to know about a padded sub-batch, the same for every layer.

    ``rows`` indexes the cache viewed as ``[num_slots * num_kv_heads, head_dim]`` and gathers K/V
    straight into SDPA's ``[num_seqs, num_kv_heads, ctx_len, head_dim]`` layout. ``token_idx``
    ``[num_seqs, max_q]`` says which packed query row fills each padded row (``None``: the batch
    is already one query per sequence, in order) and ``real`` which padded rows are not padding.
    """

    rows: torch.Tensor
    mask: torch.Tensor  # [num_seqs, 1, max_q * group, ctx_len], True = may attend
    num_seqs: int
    max_q: int
    ctx_len: int
    token_idx: torch.Tensor | None = None
    real: torch.Tensor | None = None
    dst: torch.Tensor | None = None  # packed rows that receive the real padded rows, in order
    keep: torch.Tensor | None = None  # flat padded rows that are real (None: all of them)


def _plan_group(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    max_q: int,
    num_key_blocks: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
) -> _Group:
    """Gather index and causal mask for sequences whose queries are padded to ``max_q``.

    Query ``i`` of sequence ``s`` sits at position ``context_lens[s] - query_lens[s] + i`` and sees
    every cached position up to and including its own. Padding rows (``i >= query_lens[s]``) see
    the whole context, so none of their softmax rows is empty (which would be NaN).
    """
    num_seqs = block_tables.shape[0]
    device = block_tables.device
    slots, valid = _context_slots(block_tables, context_lens, block_size, num_key_blocks)
    ctx_len = slots.shape[1]
    heads = torch.arange(num_kv_heads, device=device)
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)

    q_pos = (context_lens - query_lens).long()[:, None] + torch.arange(max_q, device=device)[None, :]
    key_pos = torch.arange(ctx_len, device=device)
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [S, max_q, L]
    # Every query head of a KV group gets the same mask (see _attend for the folding).
    mask = allowed[:, None, :, None, :].expand(num_seqs, 1, max_q, group, ctx_len)
    mask = mask.reshape(num_seqs, 1, max_q * group, ctx_len)
    return _Group(rows, mask, num_seqs, max_q, ctx_len)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group,
            scale: float) -> torch.Tensor:
    """Attention for padded queries ``q [num_seqs, max_q, num_heads, head_dim]``."""
    num_seqs, max_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    shape = (num_seqs, num_kv_heads, g.ctx_len, head_dim)
    # One gather per cache, directly into SDPA's layout: a contiguous K/V needs no second copy.
    k = k_cache.view(-1, head_dim).index_select(0, g.rows).view(shape)
    v = v_cache.view(-1, head_dim).index_select(0, g.rows).view(shape)

    # GQA without copying K/V per query head: the ``group`` query heads that share a KV head
    # are folded into the query axis, so SDPA sees [S, Hkv, max_q * group, D] queries.
    q = q.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(num_seqs, num_kv_heads, max_q * group, head_dim)

    # SDPA keeps the softmax in float32 for half inputs (fused kernels by design, the math
    # fallback because torch's reduced-precision math SDP is off by default).
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask, scale=scale)
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
    g = _plan_decode(block_tables, context_lens, block_tables.shape[1], k_cache.shape, q.shape[1])
    return _attend(q[:, None], k_cache, v_cache, g, scale)[:, 0]


def _plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, num_key_blocks: int,
                 cache_shape: torch.Size, num_heads: int) -> _Group:
    ones = torch.ones_like(context_lens)
    return _plan_group(block_tables, context_lens, ones, 1, num_key_blocks, cache_shape[1], cache_shape[2],
                       num_heads // cache_shape[2])


def _plan_rows(meta: AttentionMetadata, rows: list[int], cache_shape: torch.Size, num_heads: int) -> _Group:
    """The sub-batch of sequences ``rows`` of a packed batch, padded to its longest query."""
    device = meta.block_tables.device
    block_size, num_kv_heads = cache_shape[1], cache_shape[2]
    query_lens = [meta.query_lens[r] for r in rows]
    max_q = max(query_lens)
    num_key_blocks = -(-max(meta.context_lens_list[r] for r in rows) // block_size)

    idx = torch.tensor(rows, device=device)
    q_lens = torch.tensor(query_lens, device=device)
    offs = torch.arange(max_q, device=device)
    token_idx = meta.query_start_loc[:-1].long()[idx][:, None] + offs[None, :]
    real = offs[None, :] < q_lens[:, None]
    token_idx = torch.where(real, token_idx, 0)  # padding rows read token 0 and are dropped

    g = _plan_group(meta.block_tables[idx], meta.context_lens[idx], q_lens, max_q, num_key_blocks,
                    block_size, num_kv_heads, num_heads // num_kv_heads)
    g.token_idx, g.real = token_idx, real
    # Flat indices, worked out once per batch, so that every layer copies rows in and out with
    # plain index_select/index_copy_ rather than boolean masks (a decode batch cut into
    # sub-batches spent ~12% of its step on those).
    g.dst = token_idx[real]
    g.keep = None if all(n == max_q for n in query_lens) else real.flatten().nonzero().squeeze(1)
    return g


# The most K (and V) values one decode sub-batch gathers (4 MiB in float32). A gathered K/V that
# outgrows the CPU's caches is evicted before SDPA reads it back: on the book's 2-core machine a
# batch-32 decode step over 380-token contexts (9 MiB per gather) took 1.7x as long with the
# gather in one piece as cut into sub-batches (chapter 11 measures it).
GATHER_BUDGET = 1 << 20


def _decode_chunks(rows: list[int], context_lens: list[int], cache_shape: torch.Size,
                   budget: int | None = None) -> list[list[int]]:
    """Decode rows cut into sub-batches of similar context length, each gathering at most
    ``budget`` values (a lone row may exceed it); sorting by length also cuts the padding to each
    sub-batch's longest context."""
    budget = GATHER_BUDGET if budget is None else budget
    block_size, num_kv_heads, head_dim = cache_shape[1], cache_shape[2], cache_shape[3]
    chunks: list[list[int]] = [[]]
    for r in sorted(rows, key=lambda r: context_lens[r]):
        width = -(-context_lens[r] // block_size) * block_size  # the longest of its chunk so far
        if chunks[-1] and (len(chunks[-1]) + 1) * width * num_kv_heads * head_dim > budget:
            chunks.append([])
        chunks[-1].append(r)
    return [sorted(c) for c in chunks]


def _plan_batch(meta: AttentionMetadata, cache_shape: torch.Size, num_heads: int) -> list[_Group]:
    decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
    chunks = _decode_chunks(decode_rows, meta.context_lens_list, cache_shape) if decode_rows else []
    if meta.is_decode and len(chunks) == 1:
        # One query per sequence, already in order: no padding, no reordering.
        num_key_blocks = -(-meta.max_context_len // cache_shape[1])
        return [_plan_decode(meta.block_tables, meta.context_lens, num_key_blocks, cache_shape, num_heads)]
    # Padding a batch to its longest query would make every decode row of a mixed batch pay
    # for the longest prompt, so decode rows and prefill rows are padded separately.
    other_rows = [i for i, n in enumerate(meta.query_lens) if n > 1]
    return [_plan_rows(meta, rows, cache_shape, num_heads) for rows in (*chunks, other_rows) if rows]


def _run_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[_Group],
              scale: float) -> torch.Tensor:
    if len(plan) == 1 and plan[0].token_idx is None:
        return _attend(q[:, None], k_cache, v_cache, plan[0], scale)[:, 0]
    out = torch.empty_like(q)
    for g in plan:
        qg = q.index_select(0, g.token_idx.flatten()).view(g.num_seqs, g.max_q, *q.shape[1:])
        res = _attend(qg, k_cache, v_cache, g, scale).flatten(0, 1)
        out.index_copy_(0, g.dst, res if g.keep is None else res.index_select(0, g.keep))
    return out


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
    if meta.num_seqs == 0 or q.shape[0] == 0:
        return torch.empty_like(q)
    return _run_plan(q, k_cache, v_cache, _plan_batch(meta, k_cache.shape, q.shape[1]), scale)


class TorchBackend:
    """The reference attention backend: works wherever PyTorch does.

    Every layer of one forward pass gets the same metadata, so the gather indices and masks are
    worked out once per batch (on the first layer) and reused by the other layers.
    """

    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._key: tuple | None = None
        self._plan: list[_Group] = []

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return torch.empty_like(q)
        key = (tuple(k_cache.shape), q.shape[1])
        if meta is not self._meta or key != self._key:
            self._meta, self._key = meta, key
            self._plan = _plan_batch(meta, k_cache.shape, q.shape[1])
        return _run_plan(q, k_cache, v_cache, self._plan, scale)
