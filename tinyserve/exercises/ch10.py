"""Checkers for chapter 10, tensor parallelism.

- ``check_row_parallel``: the reader's row-parallel linear layer. Its shards are compared with
  the ones the package's sharded model really loads (``o_proj`` and ``down_proj`` of every rank
  of a random Llama, built by ``models.loader.build_model`` with ``tp_rank``/``tp_size``), and
  the sum of its ranks' partial outputs (what the all-reduce adds up) with the unsharded layer.
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

import torch

from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.models.loader import build_model, random_state_dict
from tinyserve.parallel import shard_shapes, weight_bytes_per_rank

SPLIT_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
KINDS = ("column", "row", "replicated")

# -- a row-parallel linear, against the package's real shards ---------------------------------------


def _sharded_models(rng: random.Random, seed: int):
    """A random one-layer Llama, whole and cut into k ranks, and k."""
    from transformers import LlamaConfig

    kv_heads = rng.choice([2, 4])
    k = rng.choice([d for d in (2, 4) if kv_heads % d == 0])
    heads = kv_heads * rng.choice([1, 2])
    head_dim = rng.choice([8, 16])
    config = LlamaConfig(vocab_size=32, hidden_size=heads * head_dim, intermediate_size=k * rng.choice([8, 24]),
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=64, tie_word_embeddings=True)
    state = random_state_dict(config, seed)
    whole = build_model(config, state, dtype=torch.float32, attention_backend="torch")
    ranks = [build_model(config, state, dtype=torch.float32, tp_rank=r, tp_size=k, all_reduce=lambda x: x,
                         attention_backend="torch") for r in range(k)]
    return whole, ranks, k


def _row_parallel_layers(model) -> dict:
    layer = model.layers[0]
    return {"o_proj": layer.self_attn.o_proj.weight, "down_proj": layer.mlp.down_proj.weight}


@checker(chapter=10, answer="RowParallelLinear")
def check_row_parallel(cls: type, num_cases: int = 6, seed: int = 0) -> bool:
    """``cls(weight, rank, tp_size)`` is rank ``rank``'s share of the linear layer ``y = x W^T``
    (``weight [out_features, in_features]``) cut row-parallel: ``.weight`` holds the block of input
    columns this rank keeps, and ``layer(x_part)``, on this rank's slice of the input features
    ``[tokens, in_features / tp_size]``, returns its partial output ``[tokens, out_features]``.
    The partial outputs of all ranks add up (the all-reduce) to ``x W^T``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    failures, num_checks = [], 0
    for case in range(num_cases):
        whole, ranks, k = _sharded_models(rng, seed * 100 + case)
        for name, weight in _row_parallel_layers(whole).items():
            num_checks += 1
            per = weight.shape[1] // k
            x = torch.randn(rng.randint(1, 5), weight.shape[1], generator=gen)
            shown = f"{name} {tuple(weight.shape)} on {k} ranks"
            try:
                layers = [cls(weight.clone(), r, k) for r in range(k)]
                partials = [layer(x[:, r * per:(r + 1) * per]) for r, layer in enumerate(layers)]
            except Exception as e:  # the reader's code: any error is a failed case
                failures.append(f"{shown}: raised {type(e).__name__}: {e}")
                continue
            wrong = [r for r, (layer, model) in enumerate(zip(layers, ranks))
                     if not (isinstance(getattr(layer, "weight", None), torch.Tensor)
                             and torch.equal(layer.weight, _row_parallel_layers(model)[name]))]
            if wrong:
                failures.append(f"{shown}: the .weight of ranks {wrong} is not the shard the package's rank loads")
                continue
            total = sum(p.double() for p in partials)
            want = x.double() @ weight.double().T
            if not (total.shape == want.shape and torch.allclose(total, want, atol=1e-4, rtol=1e-4)):
                failures.append(f"{shown}: the partial outputs do not add up to x W^T")
    return verdict("row_parallel", failures, num_checks)


def row_parallel_side_by_side(cls: type, hf_config, tp_size: int = 2, seed: int = 0, tokens: int = 5) -> bool:
    """Cut ``down_proj`` of a random one-layer model of ``hf_config``'s shape with ``cls``, rank by
    rank, next to the package's ranks: their shards, their partial outputs, and the all-reduced
    sum against the unsharded layer. Prints the comparison and returns True when all agree."""
    state = random_state_dict(hf_config, seed)
    whole = build_model(hf_config, state, dtype=torch.float32, attention_backend="torch")
    weight = whole.layers[0].mlp.down_proj.weight
    per = weight.shape[1] // tp_size
    x = torch.randn(tokens, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    ok, total = True, torch.zeros(tokens, weight.shape[0], dtype=torch.float64)
    for r in range(tp_size):
        theirs = build_model(hf_config, state, dtype=torch.float32, tp_rank=r, tp_size=tp_size,
                             all_reduce=lambda t: t, attention_backend="torch").layers[0].mlp.down_proj
        x_part = x[:, r * per:(r + 1) * per]
        try:
            yours = cls(weight, r, tp_size)
            with torch.no_grad():
                mine, pkg = yours(x_part), theirs(x_part)
            same_shard = torch.equal(yours.weight, theirs.weight)
            diff = (mine - pkg).abs().max().item()
        except Exception as e:  # the reader's code: show the error in place of the numbers
            print(f"rank {r}: raised {type(e).__name__}: {e}")
            ok = False
            continue
        print(f"rank {r}: your shard {tuple(yours.weight.shape)} {'==' if same_shard else '!='} the package's "
              f"{tuple(theirs.weight.shape)}; largest |your partial - its partial| {diff:.1e}")
        ok = ok and same_shard and diff < 1e-5
        total += mine.double()
    worst = (total - x.double() @ weight.double().T).abs().max().item()
    print(f"the all-reduce of your partials vs the whole layer: largest |difference| {worst:.1e}")
    ok = ok and worst < 1e-4
    print("✓ your row-parallel layer splits and sums as the package's ranks do" if ok else "✗ they differ")
    return ok


# -- the arithmetic of the split -----------------------------------------------------------------------
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


@checker(chapter=10, answer="shard_shapes")
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


@checker(chapter=10, answer="weight_bytes")
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


def communication_reference(kinds: list[str]) -> list[str]:
    """The collective after each layer of a chain whose input and output are whole on every rank."""
    wants = [_NEEDS[k] for k in kinds[1:]] + ["full"]
    return [_BRIDGE[(_MAKES[k], want)] for k, want in zip(kinds, wants)]


@checker(chapter=10, answer="communication_plan")
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
    return run_cases("communication", fn, [(c, communication_reference(*c)) for c in cases],
                     lambda args: str(args[0]))
