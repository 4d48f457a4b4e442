"""Tensor-parallel sharding arithmetic: which slice of each Llama weight one of ``k`` ranks keeps.

Megatron-style tensor parallelism cuts every decoder layer ``k`` ways with two kinds of split:

- **column-parallel** (q/k/v, gate/up): each rank keeps a block of *output rows*, so it computes a
  slice of the layer's outputs (its own attention heads, its own MLP columns) from the whole input;
- **row-parallel** (o_proj, down_proj): each rank keeps the matching block of *input columns*,
  so it turns its slice into a partial sum of the whole output, and an all-reduce adds them up.

Heads are split whole: rank ``r`` of ``k`` owns query heads ``r*H/k ... (r+1)*H/k - 1`` and
their KV heads, so ``k`` must divide the heads, the KV heads (never replicated here) and the MLP
width. The embedding, the LM head and the norms are replicated. The model loads its shard with
``column_shard``/``row_shard`` (``LlamaForCausalLM.load_weights``); the rest of this module is
the arithmetic chapter 10 teaches: the sizes that work, the shapes and the bytes per rank.
"""

from __future__ import annotations

import math

import torch


def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s block of output rows of ``weight [out, in]`` (or of a bias ``[out]``)."""
    per_rank = weight.shape[0] // size
    return weight[rank * per_rank:(rank + 1) * per_rank]


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s block of input columns of ``weight [out, in]``."""
    per_rank = weight.shape[1] // size
    return weight[:, rank * per_rank:(rank + 1) * per_rank]


def valid_tp_sizes(hf_config) -> list[int]:
    """Every tensor-parallel size the model splits into evenly (the divisors of the KV heads that
    also divide the heads and the MLP width)."""
    g = math.gcd(hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size)
    return [k for k in range(1, g + 1) if g % k == 0]


def check_shardable(hf_config, tp_size: int) -> None:
    """Refuse a ``tp_size`` this model cannot be split into, naming the sizes that work."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % kv_heads:
        # >>> fold: ValueError: query heads in whole groups per KV head
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
        # <<<
    if not isinstance(tp_size, int) or tp_size < 1:
        # >>> fold: ValueError: a positive size
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
        # <<<
    if tp_size > kv_heads:
        # >>> fold: ValueError: more ranks than KV heads, with the sizes that work
        raise ValueError(
            f"tensor_parallel_size={tp_size} is larger than the model's {kv_heads} KV heads. Each rank "
            "keeps the KV heads of its own query heads, and tinyserve does not replicate KV heads "
            f"across ranks, so at most {kv_heads} ranks can share this model; sizes that work: "
            f"{valid_tp_sizes(hf_config)}"
        )
        # <<<
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(hf_config, name)
        if value % tp_size:
            # >>> fold: ValueError: not divisible, with the sizes that work
            raise ValueError(
                f"{name}={value} is not divisible by tensor_parallel_size={tp_size}: every rank must hold "
                f"the same share of it. This model has {heads} heads and {kv_heads} KV heads; sizes that "
                f"work: {valid_tp_sizes(hf_config)}"
            )
            # <<<


def shard_shapes(hf_config, tp_size: int) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one decoder layer on one rank, plus the replicated ones.

    The layer weights are named after the fused matrices tinyserve keeps (``qkv_proj`` holds this
    rank's q, k and v rows; ``gate_up_proj`` its gate and up rows)."""
    check_shardable(hf_config, tp_size)
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads // tp_size * head_dim
    kv = hf_config.num_key_value_heads // tp_size * head_dim
    inter = hf_config.intermediate_size // tp_size
    return {
        "embed_tokens": (hf_config.vocab_size, hidden),
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }


def weight_bytes_per_rank(hf_config, tp_size: int, bytes_per_param: int = 2) -> dict[str, int]:
    """Weight bytes one rank holds, split into what every rank repeats and what it shares out.

    ``replicated``: the embedding, the LM head (unless tied to the embedding), the norms and the
    biases added after an all-reduce. ``sharded``: this rank's slice of q/k/v, o, gate/up and down
    (and of their biases)."""
    shapes = shard_shapes(hf_config, tp_size)
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    sharded = sum(math.prod(shapes[name]) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    replicated = 2 * hidden  # the two norms of a layer
    if getattr(hf_config, "attention_bias", False):
        sharded += shapes["qkv_proj"][0]
        replicated += hidden  # o_proj's bias, added once after the sum
    if getattr(hf_config, "mlp_bias", False):
        sharded += shapes["gate_up_proj"][0]
        replicated += hidden
    embed = math.prod(shapes["embed_tokens"])
    head = 0 if getattr(hf_config, "tie_word_embeddings", False) else embed
    out = {"replicated": (embed + head + hidden + layers * replicated) * bytes_per_param,
           "sharded": layers * sharded * bytes_per_param}
    out["total"] = out["replicated"] + out["sharded"]
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a module's parameters, as measured (what one rank's shard holds)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
