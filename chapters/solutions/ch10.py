"""Solutions to the exercises of chapter 10, tensor parallelism."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class ColumnParallelLinear(nn.Module):
    """Rank ``tp_rank``'s share of ``y = x W^T + b`` cut column-parallel: a block of W's output rows."""

    def __init__(self, weight, bias, tp_rank, tp_size):
        super().__init__()
        per_rank = weight.shape[0] // tp_size
        rows = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        # Copies, so the full matrices the shards were cut from can be freed.
        self.weight = nn.Parameter(weight[rows].clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias[rows].clone(), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)  # this rank's slice of y: no communication


class RowParallelLinear(nn.Module):
    """Rank ``tp_rank``'s share of ``y = x W^T + b`` cut row-parallel: a block of W's input columns."""

    def __init__(self, weight, bias, tp_rank, tp_size, all_reduce):
        super().__init__()
        per_rank = weight.shape[1] // tp_size
        cols = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        self.weight = nn.Parameter(weight[:, cols].clone(), requires_grad=False)
        # The bias is whole on every rank, and added once, after the sum (not k times, before it).
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x_part):
        y = self.all_reduce(F.linear(x_part, self.weight))  # one term per rank, summed over the ranks
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """Rank ``tp_rank``'s share of the SwiGLU MLP ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce,
                 gate_bias=None, up_bias=None, down_bias=None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(gate_weight, gate_bias, tp_rank, tp_size)
        self.up_proj = ColumnParallelLinear(up_weight, up_bias, tp_rank, tp_size)
        # The same block of the intermediate columns that gate and up produce on this rank.
        self.down_proj = RowParallelLinear(down_weight, down_bias, tp_rank, tp_size, all_reduce)

    def forward(self, x):
        # silu(gate) * up is elementwise: each rank applies it to its own columns.
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def shard_shapes(cfg, k):
    q = cfg.num_attention_heads // k * cfg.head_dim
    kv = cfg.num_key_value_heads // k * cfg.head_dim
    inter = cfg.intermediate_size // k
    return {"qkv_proj": (q + 2 * kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
            "gate_up_proj": (2 * inter, cfg.hidden_size), "down_proj": (cfg.hidden_size, inter)}


def weight_bytes(cfg, k, bytes_per_param):
    per_layer = sum(out * inp for out, inp in shard_shapes(cfg, k).values()) + 2 * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    return (cfg.num_hidden_layers * per_layer + embed + head + cfg.hidden_size) * bytes_per_param


def communication_plan(kinds):
    # Track how the activation lies across the ranks after each layer.
    makes = {"column": "slices", "row": "partial sums", "replicated": "whole"}
    needs = {"column": "whole", "row": "slices", "replicated": "whole"}
    plan = []
    for i, kind in enumerate(kinds):
        have = makes[kind]
        want = needs[kinds[i + 1]] if i + 1 < len(kinds) else "whole"
        if have == "partial sums":
            plan.append("all-reduce" if want == "whole" else "reduce-scatter")
        elif have == "slices" and want == "whole":
            plan.append("all-gather")
        else:
            plan.append("none")  # whole -> slices: each rank just keeps its own slice
    return plan
