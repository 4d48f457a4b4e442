"""Wrong answers for chapter 07's core exercise, the reader's paged attention backend
(``check_attention_backend``); merged into ``MISTAKES`` by tests/exercise_mistakes.py.

Each is the right backend (gather the context slot by slot, attend, causally, with GQA) with one
slip a reader makes, switched on by a class attribute."""

from __future__ import annotations

import torch


class _Backend:
    """A correct backend; each subclass below slips once."""

    scale_it = causal = cast_back = True
    round_robin = store_padding = mask_from_zero = contiguous_blocks = whole_blocks = False

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0 or self.store_padding:  # slot -1 would land in the last slot of the cache
                flat_k[slot], flat_v[slot] = key[t], value[t]

    def forward(self, q, k_cache, v_cache, meta, scale):
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        group = q.shape[1] // num_kv_heads
        heads = [h % num_kv_heads if self.round_robin else h // group for h in range(q.shape[1])]
        out, start = [], 0
        for i, (n_q, n) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            table = meta.block_tables[i].tolist()
            read = -(-n // block_size) * block_size if self.whole_blocks else n
            if self.contiguous_blocks:
                slots = [table[0] * block_size + p for p in range(read)]
            else:
                slots = [table[p // block_size] * block_size + p % block_size for p in range(read)]
            k, v = flat_k[slots][:, heads].float(), flat_v[slots][:, heads].float()
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n_q].float(), k)
            scores = scores * (scale if self.scale_it else 1.0)
            first = 0 if self.mask_from_zero else n - n_q
            later = torch.arange(read)[None, :] > torch.arange(first, first + n_q)[:, None]
            if self.causal:
                scores = scores.masked_fill(later, float("-inf"))
            elif self.whole_blocks:
                scores = scores.masked_fill(torch.arange(read)[None, :] >= n, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
            start += n_q
        out = torch.cat(out)
        return out.to(q.dtype) if self.cast_back else out


class _NoScale(_Backend):  # forgets the 1/sqrt(head_dim): softmax far too peaked
    scale_it = False


class _NotCausal(_Backend):  # a prefill's early tokens see later ones (decodes still right)
    causal = False


class _RoundRobinHeads(_Backend):  # query head h reads KV head h % num_kv_heads, not h // group
    round_robin = True


class _StoresPadding(_Backend):  # writes the slot -1 tokens too, into the cache's last slot
    store_padding = True


class _MaskFromZero(_Backend):  # query j sees positions <= j: right for a prefill, wrong for a decode
    mask_from_zero = True


class _ContiguousBlocks(_Backend):  # assumes a sequence's blocks follow its first one in the pool
    contiguous_blocks = True


class _ReadsWholeBlocks(_Backend):  # reads the last block's unfilled slots and masks them: 0 * NaN = NaN
    whole_blocks = True


class _ReturnsFloat32(_Backend):  # computes in float32 and never casts back to q's dtype
    cast_back = False


MISTAKES = {
    "check_attention_backend": [_NoScale, _NotCausal, _RoundRobinHeads, _StoresPadding, _MaskFromZero,
                                _ContiguousBlocks, _ReadsWholeBlocks, _ReturnsFloat32],
}
