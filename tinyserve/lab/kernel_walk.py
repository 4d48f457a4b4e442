"""One program of the decode kernel, walked one K/V block at a time in plain PyTorch.

A program of chapter 08's kernel attends the query heads that share one KV head (a GQA group)
to one sequence's cached tokens. It never holds a whole row of scores: it loads the sequence's
K/V block by block, through the block table, and keeps an *online softmax* state per query row:

- ``m``, the largest score seen so far,
- ``l``, the sum of ``exp(score - m)`` over the tokens seen so far,
- ``acc``, the sum of ``exp(score - m) * v`` over the same tokens.

When a block brings a larger score, the old ``l`` and ``acc`` are rescaled by
``alpha = exp(m_old - m_new)`` before the block's terms are added. After the last block,
``acc / l`` is the attention output. ``walk_sequence_blocks`` records that state after every
block and checks the result against ``attention.reference.paged_decode_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinyserve.attention import reference


@dataclass
class BlockVisit:
    """The program's state after loading logical block ``logical`` (physical block ``physical``)."""

    logical: int
    physical: int
    start: int             # the block holds context tokens [start, end)
    end: int
    scores: torch.Tensor   # [group, end - start]: q . k * scale for this block's tokens
    m_before: torch.Tensor  # [group] the running max before this block (-inf at first)
    m: torch.Tensor        # [group] running max after it
    alpha: torch.Tensor    # [group] exp(m_before - m): how much the old sums shrink
    l: torch.Tensor        # [group] running sum after it  # noqa: E741 (the l of the math)
    acc: torch.Tensor      # [group, head_dim] running weighted sum of V after it

    def output(self) -> torch.Tensor:
        """``acc / l``: attention over the tokens seen so far (the final output after the last block)."""
        return self.acc / self.l[:, None]


@dataclass
class KernelWalk:
    seq: int
    kv_head: int
    heads: list[int]       # the query heads of this KV head's group
    block_size: int
    context_len: int
    block_table: list[int]
    visits: list[BlockVisit]
    reference: torch.Tensor  # [group, head_dim] from reference.paged_decode_attention

    @property
    def out(self) -> torch.Tensor:
        return self.visits[-1].output()

    @property
    def max_error(self) -> float:
        """Largest |walk - reference| over the group's outputs."""
        return float((self.out - self.reference).abs().max())


def _as_lists(block_tables, context_lens) -> tuple[list[list[int]], list[int]]:
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else [list(t) for t in block_tables]
    lens = context_lens.tolist() if isinstance(context_lens, torch.Tensor) else list(context_lens)
    return tables, [int(n) for n in lens]


def walk_sequence_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor | Sequence[Sequence[int]],
                         context_lens: torch.Tensor | Sequence[int], scale: float, seq: int = 0,
                         kv_head: int = 0) -> KernelWalk:
    """Walk the program of (``seq``, ``kv_head``) through its sequence's blocks.

    Arguments are those of ``reference.paged_decode_attention``: ``q [num_seqs, num_heads, D]``,
    caches ``[num_blocks, block_size, num_kv_heads, D]``, block tables (a tensor or lists) and
    context lengths. The walk computes in float32 whatever the cache dtype."""
    tables, lens = _as_lists(block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not 0 <= seq < num_seqs:
        raise ValueError(f"seq must be in [0, {num_seqs}), got {seq}")
    if not 0 <= kv_head < num_kv_heads:
        raise ValueError(f"kv_head must be in [0, {num_kv_heads}), got {kv_head}")
    if lens[seq] < 1:
        raise ValueError(f"context_lens[{seq}] must be >= 1, got {lens[seq]}")
    group = num_heads // num_kv_heads
    heads = list(range(kv_head * group, (kv_head + 1) * group))
    qg = q[seq, heads].float().cpu()
    m = torch.full((group,), float("-inf"))
    l = torch.zeros(group)  # noqa: E741
    acc = torch.zeros(group, head_dim)
    visits = []
    for j in range(-(-lens[seq] // block_size)):
        start, end = j * block_size, min((j + 1) * block_size, lens[seq])
        physical = tables[seq][j]
        # The program's one read of this block: its tokens' K and V for this KV head.
        k = k_cache[physical, :end - start, kv_head].float().cpu()
        v = v_cache[physical, :end - start, kv_head].float().cpu()
        scores = (qg @ k.T) * scale
        m_new = torch.maximum(m, scores.max(dim=1).values)
        alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block: nothing to rescale yet
        p = torch.exp(scores - m_new[:, None])
        l, acc = l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v  # noqa: E741
        visits.append(BlockVisit(j, physical, start, end, scores, m, m_new, alpha, l, acc))
        m = m_new
    # The reference reads the same cache its own way (gather, then softmax over whole rows).
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=q.device)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, padded,
                                           torch.tensor(lens, dtype=torch.int32, device=q.device), scale)
    return KernelWalk(seq, kv_head, heads, block_size, lens[seq], tables[seq][:len(visits)], visits,
                      ref[seq, heads].float().cpu())
