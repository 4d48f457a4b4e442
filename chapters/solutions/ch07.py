"""Solutions to the exercises of chapter 07, a Llama model on a paged cache."""

from __future__ import annotations

import torch


class PagedAttentionBackend:
    """Paged attention in plain PyTorch, for prefill and decode alike: ``store_kv`` puts each new
    token's K/V at its slot, ``forward`` gathers each sequence's context through its block table
    and attends to it, causally, every group of query heads to its own KV head."""

    name = "paged-torch (solution)"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0  # -1 marks a padding token, stored nowhere
        slots = slot_mapping[keep].long()
        block_size = k_cache.shape[1]
        # A flat slot is block * block_size + offset: index the 4-d cache by both at once.
        blocks, offsets = slots // block_size, slots % block_size
        k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)

    def forward(self, q, k_cache, v_cache, meta, scale):
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (n_q, n) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            rows = slice(starts[i], starts[i] + n_q)
            # Context position p lives at offset p % block_size of block block_table[p // block_size].
            # Only those n slots are read: any other slot may hold anything, NaN included.
            pos = torch.arange(n, device=q.device)
            blocks = meta.block_tables[i, pos // block_size].long()
            k = k_cache[blocks, pos % block_size].float()  # [n, num_kv_heads, head_dim]
            v = v_cache[blocks, pos % block_size].float()
            # Query head h = kv_head * group + g: viewed as [kv_head, g], each group meets its KV
            # head in the einsum, and K/V are never repeated. float32 even for half inputs.
            queries = q[rows].float().view(n_q, num_kv_heads, group, head_dim)
            scores = torch.einsum("qkgd,nkd->kgqn", queries, k) * scale
            # The queries are the last n_q positions: query j sits at n - n_q + j and sees up to it.
            q_pos = torch.arange(n - n_q, n, device=q.device)
            scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
            mixed = torch.einsum("kgqn,nkd->qkgd", scores.softmax(dim=-1), v)
            out[rows] = mixed.reshape(n_q, num_heads, head_dim).to(q.dtype)
        return out


class BlockwiseAttention:
    """Paged attention that reads a sequence's context block by block, straight from the cache:
    the scores of each block's tokens, then one softmax over all of them."""

    name = "blockwise"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        block_size = k_cache.shape[1]
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:  # -1 marks a padding token, stored nowhere
                k_cache[slot // block_size, slot % block_size] = key[t]
                v_cache[slot // block_size, slot % block_size] = value[t]

    def forward(self, q, k_cache, v_cache, meta, scale):
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = q.shape[1] // num_kv_heads  # query heads per KV head
        out = torch.empty_like(q)
        start = 0
        for i, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            queries = q[start:start + n_q].float()
            table = meta.block_tables[i].tolist()
            scores, values = [], []
            for b in range(-(-n_ctx // block_size)):
                rows = min(block_size, n_ctx - b * block_size)  # the last block may be partly filled
                k = k_cache[table[b], :rows].float().repeat_interleave(group, dim=1)
                values.append(v_cache[table[b], :rows].float().repeat_interleave(group, dim=1))
                scores.append(torch.einsum("qhd,khd->hqk", queries, k) * scale)
            scores = torch.cat(scores, dim=-1)  # [heads, n_q, n_ctx]
            q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)[:, None]
            later = torch.arange(n_ctx, device=q.device)[None, :] > q_pos
            weights = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
            out[start:start + n_q] = torch.einsum("hqk,khd->qhd", weights, torch.cat(values)).to(q.dtype)
            start += n_q
        return out


def rotary_interleaved(x, positions, theta):
    head_dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out
