"""The decode kernel's inner loop in plain PyTorch: online softmax, tile by tile.

``online_softmax`` computes ``softmax(scores) @ values`` a tile of columns at a time with a
running max and a running sum, keeping every intermediate state so it can be printed and
plotted; ``walk_program`` does what one program of the Triton kernel does, reading K/V through a
block table; ``combine_partitions`` is the second kernel's merge of partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SoftmaxState:
    """The running state of an online softmax over the tiles seen so far, per query row."""

    m: torch.Tensor    # [R] running max of the scores
    l: torch.Tensor    # [R] running sum of exp(score - m)  # noqa: E741 (the l of the math)
    acc: torch.Tensor  # [R, D] running sum of exp(score - m) * value

    @classmethod
    def empty(cls, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> SoftmaxState:
        return cls(torch.full((rows,), float("-inf"), dtype=dtype), torch.zeros(rows, dtype=dtype),
                   torch.zeros(rows, dim, dtype=dtype))

    def output(self) -> torch.Tensor:
        return self.acc / self.l[:, None]

    def lse(self) -> torch.Tensor:
        """log(sum of exp(score)) over everything seen: all a later merge needs to know."""
        return self.m + torch.log(self.l)


def online_softmax_step(state: SoftmaxState, scores: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """Fold one tile, ``scores [R, N]`` and ``values [N, D]``, into the running state."""
    m_new = torch.maximum(state.m, scores.max(dim=-1).values)
    alpha = torch.exp(state.m - m_new)  # rescales the old sums to the new max; exp(-inf) = 0 at first
    p = torch.exp(scores - m_new[:, None])
    return SoftmaxState(m_new, state.l * alpha + p.sum(dim=-1), state.acc * alpha[:, None] + p @ values)


def online_softmax(scores: torch.Tensor, values: torch.Tensor, tile: int) -> tuple[torch.Tensor, list[SoftmaxState]]:
    """``softmax(scores) @ values`` computed ``tile`` columns at a time, never holding a whole row.

    ``scores [R, N]`` (or ``[N]``), ``values [N, D]``. Returns the output and the state after
    each tile.
    """
    rows = scores.reshape(-1, scores.shape[-1])
    state = SoftmaxState.empty(rows.shape[0], values.shape[-1], rows.dtype)
    states = []
    for t in range(0, rows.shape[1], tile):
        state = online_softmax_step(state, rows[:, t:t + tile], values[t:t + tile])
        states.append(state)
    out = state.output()
    return (out[0] if scores.dim() == 1 else out), states


def combine_partitions(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partitions' normalized outputs ``outs [P, ..., D]`` by their ``lses [P, ...]``
    (natural log; -inf marks an empty partition), as ``combine_partitions_kernel`` does in base 2.

    Partition p holds ``o_p = sum_i e^{s_i} v_i / e^{lse_p}``, so the softmax over all tokens
    weighs it by ``e^{lse_p} / sum_q e^{lse_q}``; subtracting the largest lse keeps that finite.
    """
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # every partition empty
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    out = (outs * weights[..., None]).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    return out, top + torch.log(total)


@dataclass
class TileStep:
    """One iteration of a program's loop."""

    start: int             # tokens [start, end)
    end: int
    blocks: list[int]      # physical blocks the tile's tokens live in
    m: torch.Tensor        # running max per query row after this tile
    l: torch.Tensor        # running sum per query row after this tile  # noqa: E741


@dataclass
class ProgramWalk:
    out: torch.Tensor      # [group, D], softmax over the program's tokens applied to V
    lse: torch.Tensor      # [group], natural log
    steps: list[TileStep]


def walk_program(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int],
                 kv_head: int, scale: float, start: int, end: int, tile: int) -> ProgramWalk:
    """Do in PyTorch what one decode program does: attend the query heads of ``kv_head``
    (``q [num_heads, D]`` is one sequence's query) to tokens ``[start, end)``, read tile by tile
    through the block table. The kernel works in base 2 (exp2); this walk in base e, in float32.
    """
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[0] // num_kv_heads
    qg = q[kv_head * group:(kv_head + 1) * group].float().cpu()
    table = torch.tensor(block_table)
    state = SoftmaxState.empty(group, q.shape[-1])
    steps = []
    for t0 in range(start, end, tile):
        tokens = torch.arange(t0, min(t0 + tile, end))
        blocks, rows = table[tokens // block_size], tokens % block_size
        k = k_cache[blocks.to(k_cache.device), rows.to(k_cache.device), kv_head].float().cpu()
        v = v_cache[blocks.to(v_cache.device), rows.to(v_cache.device), kv_head].float().cpu()
        state = online_softmax_step(state, (qg @ k.T) * scale, v)
        steps.append(TileStep(int(tokens[0]), int(tokens[-1]) + 1, list(dict.fromkeys(blocks.tolist())),
                              state.m.clone(), state.l.clone()))
    return ProgramWalk(state.output(), state.lse(), steps)
