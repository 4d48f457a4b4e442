"""Deliberately wrong tensor-parallel MLPs for chapter 10's core exercise (merged into
tests/exercise_mistakes.py). Each is a slip a reader makes in the column-/row-parallel split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _block(n: int, rank: int, size: int) -> slice:
    per = n // size
    return slice(rank * per, (rank + 1) * per)


class _Column(nn.Module):
    def __init__(self, weight, bias, rows):
        super().__init__()
        self.weight, self.bias = weight[rows], None if bias is None else bias[rows]

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _Row(nn.Module):
    def __init__(self, weight, bias, cols, all_reduce, bias_before_sum=False, use_result=True, reduce=True):
        super().__init__()
        self.weight, self.bias, self.all_reduce = weight[:, cols], bias, all_reduce
        self.bias_before_sum, self.use_result, self.reduce = bias_before_sum, use_result, reduce

    def forward(self, x_part):
        y = F.linear(x_part, self.weight)
        if self.bias is not None and self.bias_before_sum:
            y = y + self.bias
        if self.reduce:
            summed = self.all_reduce(y)
            y = summed if self.use_result else y
        if self.bias is not None and not self.bias_before_sum:
            y = y + self.bias
        return y


class _MLP(nn.Module):
    """The right MLP, with one of the slips below switched on by a subclass."""

    row_kwargs: dict = {}

    def __init__(self, gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                 gate_bias=None, up_bias=None, down_bias=None):
        super().__init__()
        inter = gate_weight.shape[0]
        self.gate_proj = _Column(gate_weight, gate_bias, self.gate_rows(inter, tp_rank, tp_size))
        self.up_proj = _Column(up_weight, up_bias, _block(inter, tp_rank, tp_size))
        self.down_proj = _Row(down_weight, down_bias, _block(inter, tp_rank, tp_size), all_reduce, **self.row_kwargs)

    def gate_rows(self, inter, rank, size):
        return _block(inter, rank, size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _BiasOnEveryRank(_MLP):  # adds down's bias before the all-reduce: counted tp_size times
    row_kwargs = {"bias_before_sum": True}


class _NoAllReduce(_MLP):  # returns the rank's partial sum: right only with one rank
    row_kwargs = {"reduce": False}


class _InPlaceAssumed(_MLP):  # calls all_reduce but drops what it returns (as if it summed in place)
    row_kwargs = {"use_result": False}


class _InterleavedGate(_MLP):  # gate takes every tp_size-th row, up and down a contiguous block
    def gate_rows(self, inter, rank, size):
        return slice(rank, inter, size)


class _FusedGateUpCut(_MLP):  # stacks gate and up into one [2I, H] matrix and cuts that: rank 0 gets only gate rows
    def __init__(self, gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                 gate_bias=None, up_bias=None, down_bias=None):
        super().__init__(gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                         gate_bias, up_bias, down_bias)
        fused = torch.cat([gate_weight, up_weight])
        fused_bias = None if gate_bias is None else torch.cat([gate_bias, up_bias])
        mine = _block(fused.shape[0], tp_rank, tp_size)
        half = fused[mine].shape[0] // 2
        b = None if fused_bias is None else fused_bias[mine]
        self.gate_proj = _Column(fused[mine][:half], None if b is None else b[:half], slice(None))
        self.up_proj = _Column(fused[mine][half:], None if b is None else b[half:], slice(None))


class _DownCutByRows(_MLP):  # cuts down_proj's output rows (column-parallel) and all-gathers by concatenation
    def __init__(self, gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                 gate_bias=None, up_bias=None, down_bias=None):
        super().__init__(gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                         gate_bias, up_bias, down_bias)
        self.down_proj = _Column(down_weight, down_bias, _block(down_weight.shape[0], tp_rank, tp_size))


class _SiluOnUp(_MLP):  # silu applied to up instead of gate
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))


class _NotAModule:  # a plain class with the right arithmetic: a decoder layer cannot hold it as its mlp
    def __init__(self, *args, **kwargs):
        self.inner = _MLP(*args, **kwargs)
        self.gate_proj, self.up_proj, self.down_proj = self.inner.gate_proj, self.inner.up_proj, self.inner.down_proj

    def __call__(self, x):
        return self.inner(x)


MISTAKES = {
    "check_parallel_mlp": [_BiasOnEveryRank, _NoAllReduce, _InPlaceAssumed, _InterleavedGate, _FusedGateUpCut,
                           _DownCutByRows, _SiluOnUp, _NotAModule],
}
