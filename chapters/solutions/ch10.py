"""Solutions to the exercises of chapter 10, tensor parallelism."""

from __future__ import annotations


class RowParallelLinear:
    """Rank ``rank``'s share of ``y = x W^T`` cut row-parallel: a block of W's input columns."""

    def __init__(self, weight, rank, tp_size):
        per_rank = weight.shape[1] // tp_size
        self.weight = weight[:, rank * per_rank:(rank + 1) * per_rank]

    def __call__(self, x_part):
        return x_part @ self.weight.T  # one term of the sum; the all-reduce adds the ranks' terms


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
