"""Chapter 10's arithmetic of weights per rank: what each rank holds at every tensor-parallel size.

``SHAPES`` are the Llama configs of three model sizes (public config.json values);
``memory_table`` gives, per shape and valid ``tensor_parallel_size``, the replicated and sharded
weight bytes on one rank from ``tinyserve.parallel.weight_bytes_per_rank``.
"""

from __future__ import annotations

from types import SimpleNamespace

from tinyserve.models.loader import smollm2_135m_config
from tinyserve.parallel import valid_tp_sizes, weight_bytes_per_rank


def llama_shape(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                tied: bool = False) -> SimpleNamespace:
    """The fields of a Llama config that weight sizes depend on."""
    return SimpleNamespace(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                           tie_word_embeddings=tied)


# Public shapes of three sizes (from their config.json files).
SHAPES = {
    "SmolLM2-135M": smollm2_135m_config(),
    "Llama-2-7B": llama_shape(32000, 4096, 11008, 32, 32, 32),
    "Llama-2-70B": llama_shape(32000, 8192, 28672, 80, 64, 8),
}


def memory_table(shapes: dict | None = None, bytes_per_param: int = 2) -> list[dict]:
    """Weight bytes per rank for every valid tensor-parallel size (up to 8) of each shape."""
    rows = []
    for name, cfg in (shapes or SHAPES).items():
        for k in [k for k in valid_tp_sizes(cfg) if k <= 8]:
            b = weight_bytes_per_rank(cfg, k, bytes_per_param)
            rows.append({"model": name, "tp_size": k, "replicated_GB": b["replicated"] / 1e9,
                         "sharded_GB": b["sharded"] / 1e9, "total_GB": b["total"] / 1e9})
    return rows
