"""Checkers for chapter 10, tensor parallelism.

- ``check_shard_shapes``: the shapes of one rank's q/k/v, o, gate/up and down matrices, against
  ``parallel.shard_shapes`` (which the tests hold to the real sharded model's parameters).
- ``check_weight_bytes_per_rank``: the bytes of weights one rank holds, against
  ``parallel.weight_bytes_per_rank``.
- ``check_communication``: which collective a chain of column-, row-parallel and replicated
  layers needs after each layer, against a small reference that tracks how the activation is
  laid out across the ranks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

from tinyserve.exercises.verdict import run_cases
from tinyserve.parallel import shard_shapes, weight_bytes_per_rank

SPLIT_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
KINDS = ("column", "row", "replicated")


def _random_config(rng: random.Random) -> tuple[SimpleNamespace, int]:
    """A Llama-shaped config and a tensor-parallel size that splits it evenly."""
    k = rng.choice([1, 2, 2, 3, 4, 4, 8])
    kv_heads = k * rng.choice([1, 1, 2, 4])
    heads = kv_heads * rng.choice([1, 2, 3, 4, 8])
    head_dim = rng.choice([32, 64, 128])
    cfg = SimpleNamespace(
        vocab_size=rng.choice([32000, 49152, 128256]), hidden_size=heads * head_dim,
        intermediate_size=k * rng.randint(8, 64) * 16, num_hidden_layers=rng.randint(1, 80),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=rng.random() < 0.5,
    )
    return cfg, k




def _describe_config(cfg, k, *rest) -> str:
    extra = f", bytes_per_param={rest[0]}" if rest else ""
    return (f"hidden={cfg.hidden_size}, heads={cfg.num_attention_heads}, kv_heads={cfg.num_key_value_heads}, "
            f"head_dim={cfg.head_dim}, intermediate={cfg.intermediate_size}, layers={cfg.num_hidden_layers}, "
            f"vocab={cfg.vocab_size}, tied={cfg.tie_word_embeddings}, k={k}{extra}")


def check_shard_shapes(fn: Callable, num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(cfg, k)`` returns ``{"qkv_proj": (out, in), "o_proj": ..., "gate_up_proj": ...,
    "down_proj": ...}``: the [out_features, in_features] of each matrix on one rank, with q, k, v
    fused into one matrix and gate, up into another (as tinyserve keeps them)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        cfg, k = _random_config(rng)
        full = shard_shapes(cfg, k)
        cases.append(((cfg, k), {name: full[name] for name in SPLIT_WEIGHTS}))

    def only_split(cfg, k):
        got = fn(cfg, k)
        return {name: tuple(got[name]) for name in SPLIT_WEIGHTS} if isinstance(got, dict) else got

    return run_cases("shard_shapes", only_split, cases, lambda args: _describe_config(*args))


def check_weight_bytes_per_rank(fn: Callable, num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(cfg, k, bytes_per_param)``: the bytes of weights one rank holds (no biases): its
    share of every layer's matrices, plus the embedding, the LM head (unless tied) and the
    norms, which every rank keeps whole."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        cfg, k = _random_config(rng)
        b = rng.choice([1, 2, 4])
        cases.append(((cfg, k, b), weight_bytes_per_rank(cfg, k, b)["total"]))
    return run_cases("weight_bytes_per_rank", fn, cases, lambda args: _describe_config(*args))


# How each kind of layer wants its input and leaves its output, across the ranks:
# "full" = every rank has the whole activation, "split" = each rank has its slice of the
# features, "partial" = each rank has a full-size tensor that is one term of the true sum.
_NEEDS = {"column": "full", "row": "split", "replicated": "full"}
_MAKES = {"column": "split", "row": "partial", "replicated": "full"}
_BRIDGE = {
    ("full", "full"): "none", ("full", "split"): "none",  # a rank just keeps its own slice
    ("split", "split"): "none", ("split", "full"): "all-gather",
    ("partial", "full"): "all-reduce", ("partial", "split"): "reduce-scatter",
}


def communication_plan(kinds: list[str]) -> list[str]:
    """The collective after each layer of a chain whose input and output are whole on every rank."""
    wants = [_NEEDS[k] for k in kinds[1:]] + ["full"]
    return [_BRIDGE[(_MAKES[k], want)] for k, want in zip(kinds, wants)]


def check_communication(fn: Callable[[list[str]], list[str]], num_cases: int = 80, seed: int = 0) -> bool:
    """``fn(kinds)``: ``kinds`` lists layers applied one after another, each "column",
    "row" or "replicated"; the input is whole on every rank and so must the output be. Return,
    for each layer, what the ranks must do right after it: "none", "all-reduce", "all-gather" or
    "reduce-scatter"."""
    rng = random.Random(seed)
    llama = ["replicated"] + ["column", "row", "column", "row"] * 2 + ["replicated"]
    fixed = [["column", "row"], ["column"], ["row"], ["replicated"], llama, ["row", "row"], ["column", "column"]]
    cases = [(kinds,) for kinds in fixed]
    while len(cases) < num_cases:
        cases.append(([rng.choice(KINDS) for _ in range(rng.randint(1, 8))],))
    return run_cases("communication", fn, [(c, communication_plan(*c)) for c in cases],
                     lambda args: str(args[0]))
