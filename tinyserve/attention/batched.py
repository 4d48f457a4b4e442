"""Paged attention tuned for the CPU (``"torch-batched"``): the reference's math, batched.

``reference.py`` attends one sequence at a time. Here a whole batch is attended with a few large
tensor operations, which is what a CPU (and PyTorch's per-call overhead) rewards:

- Each *sub-batch* of sequences is padded to its longest query and longest context. One
  ``index_select`` per cache gathers every sequence's K/V straight into SDPA's
  ``[num_seqs, num_kv_heads, context, head_dim]`` layout, and one ``scaled_dot_product_attention``
  call attends them all, with a mask for causality and for the padding.
- Grouped-query attention never copies K/V per query head: the ``group`` query heads that share a
  KV head are folded into the query axis, so SDPA sees ``num_kv_heads`` heads with
  ``group * query_len`` queries each.
- Decode rows and prefill rows go in separate sub-batches (a decode row padded to the longest
  prompt would pay for it), and a large decode batch is cut into sub-batches of similar context
  length whose gathered K/V stays within ``gather_budget`` values, so that it is still in the
  CPU's caches when SDPA reads it back (chapter 11 measures this).
- The gather indices and masks (the *plan*) depend only on the batch, so they are worked out on
  the first layer and kept with the batch's metadata for the other layers.

Everything here is checked against ``reference.py`` in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyserve.attention.metadata import AttentionMetadata

# The most K (and V) values one decode sub-batch gathers by default (4 MiB in float32). On the
# book's 2-core machine a batch-32 decode step over 380-token contexts (9 MiB per gather) took 1.7x
# as long with the gather in one piece as cut into sub-batches of this size.
GATHER_BUDGET = 1 << 20


@dataclass
class SubBatch:
    """The plan of one padded sub-batch: how to gather its K/V and which scores to keep.

    ``rows`` indexes the cache viewed as ``[num_slots * num_kv_heads, head_dim]``; ``mask`` is
    ``[num_seqs, 1, max_q * group, ctx_len]``, True where a query may attend. ``token_idx``
    ``[num_seqs, max_q]`` says which packed query row fills each padded row and ``dst``/``keep``
    where the real ones go back (all None for a decode batch already in order, one row each).
    """

    rows: torch.Tensor
    mask: torch.Tensor
    num_seqs: int
    max_q: int
    ctx_len: int
    token_idx: torch.Tensor | None = None
    dst: torch.Tensor | None = None  # packed rows that receive the real padded rows, in order
    keep: torch.Tensor | None = None  # flat padded rows that are real (None: all of them)


def decode_sub_batches(rows: list[int], context_lens: list[int], block_size: int, row_values: int,
                       budget: int = GATHER_BUDGET) -> list[list[int]]:
    """Decode rows cut into sub-batches of similar context length, each gathering at most
    ``budget`` values (a lone row may exceed it). ``row_values`` is what one cached token costs
    (``num_kv_heads * head_dim``). Sorting by length also cuts the padding to each sub-batch's
    longest context: the row being added is always the longest of its sub-batch so far."""
    chunks: list[list[int]] = [[]]
    for r in sorted(rows, key=lambda r: context_lens[r]):
        width = -(-context_lens[r] // block_size) * block_size
        if chunks[-1] and (len(chunks[-1]) + 1) * width * row_values > budget:
            chunks.append([])
        chunks[-1].append(r)
    return [sorted(c) for c in chunks]


def _sub_batch(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor, max_q: int,
               num_key_blocks: int, cache_shape: torch.Size, group: int) -> SubBatch:
    """Gather rows and causal mask for sequences whose queries are padded to ``max_q``.

    Query ``i`` of sequence ``s`` sits at position ``context_lens[s] - query_lens[s] + i``.
    Positions past a sequence's context read its own first slot instead of whatever the padded
    table says (a masked NaN would still poison softmax @ V); padding queries see the whole
    context, so no softmax row is empty (which would be NaN).
    """
    block_size, num_kv_heads = cache_shape[1], cache_shape[2]
    num_seqs, device = block_tables.shape[0], block_tables.device
    pos = torch.arange(num_key_blocks * block_size, device=device)
    slots = block_tables[:, :num_key_blocks].long()[:, pos // block_size] * block_size + pos % block_size
    valid = pos[None, :] < context_lens[:, None].long()
    slots = torch.where(valid, slots, slots[:, :1])
    heads = torch.arange(num_kv_heads, device=device)
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)

    q_pos = (context_lens - query_lens).long()[:, None] + torch.arange(max_q, device=device)[None, :]
    allowed = (pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [S, max_q, L]
    # Every query head of a KV group gets the same mask (see _attend for the folding).
    mask = allowed[:, None, :, None, :].expand(num_seqs, 1, max_q, group, pos.numel())
    return SubBatch(rows, mask.reshape(num_seqs, 1, max_q * group, pos.numel()), num_seqs, max_q, pos.numel())


def _select(meta: AttentionMetadata, rows: list[int], cache_shape: torch.Size, group: int) -> SubBatch:
    """The sub-batch of sequences ``rows`` of a packed batch, padded to its longest query."""
    device = meta.block_tables.device
    query_lens = [meta.query_lens[r] for r in rows]
    max_q = max(query_lens)
    num_key_blocks = -(-max(meta.context_lens_list[r] for r in rows) // cache_shape[1])
    idx = torch.tensor(rows, device=device)
    q_lens = torch.tensor(query_lens, device=device)
    offs = torch.arange(max_q, device=device)
    token_idx = meta.query_start_loc[:-1].long()[idx][:, None] + offs[None, :]
    real = offs[None, :] < q_lens[:, None]
    sub = _sub_batch(meta.block_tables[idx], meta.context_lens[idx], q_lens, max_q, num_key_blocks,
                     cache_shape, group)
    sub.token_idx = torch.where(real, token_idx, 0)  # padding rows read token 0 and are dropped
    # Flat indices, so every layer copies rows in and out with plain index_select/index_copy_
    # (boolean masks cost a decode step cut into sub-batches ~12% of its time).
    sub.dst = token_idx[real]
    sub.keep = None if all(n == max_q for n in query_lens) else real.flatten().nonzero().squeeze(1)
    return sub


def plan_batch(meta: AttentionMetadata, cache_shape: torch.Size, num_heads: int,
               budget: int = GATHER_BUDGET, split=decode_sub_batches) -> list[SubBatch]:
    """The sub-batches a packed batch is attended in (see the module docstring). ``split`` cuts
    the decode rows (``decode_sub_batches``'s signature); any cut gives the same attention."""
    block_size, num_kv_heads, head_dim = cache_shape[1], cache_shape[2], cache_shape[3]
    group = num_heads // num_kv_heads
    decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
    chunks = split(decode_rows, meta.context_lens_list, block_size, num_kv_heads * head_dim,
                   budget) if decode_rows else []
    if meta.is_decode and len(chunks) == 1:
        # One query per sequence, already in order: no padding, no reordering.
        num_key_blocks = -(-meta.max_context_len // block_size)
        ones = torch.ones_like(meta.context_lens)
        return [_sub_batch(meta.block_tables, meta.context_lens, ones, 1, num_key_blocks, cache_shape, group)]
    prefill_rows = [i for i, n in enumerate(meta.query_lens) if n > 1]
    return [_select(meta, rows, cache_shape, group) for rows in (*chunks, prefill_rows) if rows]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sub: SubBatch,
            scale: float) -> torch.Tensor:
    """Attention for padded queries ``q [num_seqs, max_q, num_heads, head_dim]``."""
    num_seqs, max_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    shape = (num_seqs, num_kv_heads, sub.ctx_len, head_dim)
    # One gather per cache, directly into SDPA's layout: a contiguous K/V needs no second copy.
    k = k_cache.view(-1, head_dim).index_select(0, sub.rows).view(shape)
    v = v_cache.view(-1, head_dim).index_select(0, sub.rows).view(shape)
    q = q.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
    # SDPA keeps the softmax in float32 for half inputs.
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=sub.mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_seqs, max_q, num_heads, head_dim)


def run_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[SubBatch],
             scale: float) -> torch.Tensor:
    """Attend the packed queries ``q [num_tokens, num_heads, head_dim]`` by ``plan``."""
    if len(plan) == 1 and plan[0].token_idx is None:
        return _attend(q[:, None], k_cache, v_cache, plan[0], scale)[:, 0]
    out = torch.empty_like(q)
    for sub in plan:
        qs = q.index_select(0, sub.token_idx.flatten()).view(sub.num_seqs, sub.max_q, *q.shape[1:])
        res = _attend(qs, k_cache, v_cache, sub, scale).flatten(0, 1)
        out.index_copy_(0, sub.dst, res if sub.keep is None else res.index_select(0, sub.keep))
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, budget: int = GATHER_BUDGET) -> torch.Tensor:
    """``reference.paged_attention``, batched: the same contract and result."""
    if meta.num_seqs == 0 or q.shape[0] == 0:
        return torch.empty_like(q)
    return run_plan(q, k_cache, v_cache, plan_batch(meta, k_cache.shape, q.shape[1], budget), scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``reference.paged_decode_attention``, batched. The gather covers the whole width of the
    block tables, so it needs no host copy of ``context_lens`` (no device sync)."""
    ones = torch.ones_like(context_lens)
    sub = _sub_batch(block_tables, context_lens, ones, 1, block_tables.shape[1], k_cache.shape,
                     q.shape[1] // k_cache.shape[2])
    return _attend(q[:, None], k_cache, v_cache, sub, scale)[:, 0]


class BatchedTorchBackend:
    """The CPU-tuned PyTorch backend. ``gather_budget`` caps one decode sub-batch's gather
    (values of K, or of V); it may be changed between steps. ``split`` is the rule that cuts a
    decode batch into sub-batches (chapter 11's exercise 3 plugs its own in)."""

    name = "torch-batched"

    def __init__(self, gather_budget: int = GATHER_BUDGET, split=decode_sub_batches) -> None:
        self.gather_budget, self.split = gather_budget, split
        self._slots: tuple | None = None  # (slot_mapping, keep mask or None, slots) of the last call

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # reference.store_kv's contract. Every layer of a step passes the same slot_mapping, so
        # its padding is filtered out on the first layer only: a mask, a nonzero and two masked
        # copies in every layer cost 6.6-8.0 ms of a batch-16 or -32 step (benchmarks/levers.py).
        # (Compared by value: a few microseconds, and right even for a tensor changed in place.)
        memo = self._slots
        if memo is None or not torch.equal(memo[0], slot_mapping):
            keep = slot_mapping >= 0
            memo = self._slots = (slot_mapping.clone(), None if bool(keep.all()) else keep, slot_mapping[keep].long())
        _, keep, slots = memo
        if keep is not None:
            key, value = key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return torch.empty_like(q)
        # Planned on the first layer, kept with the batch for the others. The key holds
        # everything else the plan depends on, by value.
        key = (self.name, tuple(k_cache.shape), q.shape[1], self.gather_budget, self.split)
        plan = meta.per_batch.get(key)
        if plan is None:
            plan = meta.per_batch[key] = plan_batch(meta, k_cache.shape, q.shape[1], self.gather_budget,
                                                    self.split)
        return run_plan(q, k_cache, v_cache, plan, scale)
