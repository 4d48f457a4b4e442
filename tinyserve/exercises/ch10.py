"""Checkers for chapter 10, tensor parallelism.

- ``check_parallel_mlp``: the reader's tensor-parallel MLP (gate and up column-parallel, down
  row-parallel with the all-reduce), sharded over 1, 2 and 4 ranks run as threads
  (``exercises.tp_mlp.ThreadGroup``), against the unsharded MLP on random weights and inputs: each
  projection on each rank (naming the rank, the shard and the projection), then the forward pass.
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
import torch.nn.functional as F

from tinyserve.exercises.tp_mlp import ThreadGroup
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.models.sharding import column_shard, row_shard
from tinyserve.parallel import shard_shapes, weight_bytes_per_rank

SPLIT_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
KINDS = ("column", "row", "replicated")

# -- the reader's tensor-parallel MLP, rank by rank, against the unsharded one ------------------------

# (hidden, intermediate, tokens, biases): small shapes whose intermediate splits 1, 2 and 4 ways.
MLP_SHAPES = ((8, 16, 3, False), (12, 24, 5, True), (16, 32, 1, False), (24, 48, 7, True))
MLP_TP_SIZES = (1, 2, 4)
PROJECTIONS = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}


def _mlp_case(hidden: int, inter: int, tokens: int, biases: bool, gen: torch.Generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    case = {"gate": randn(inter, hidden), "up": randn(inter, hidden), "down": randn(hidden, inter) / inter**0.5,
            "x": randn(tokens, hidden)}
    case.update({"gate_bias": randn(inter), "up_bias": randn(inter), "down_bias": randn(hidden)} if biases
                else {"gate_bias": None, "up_bias": None, "down_bias": None})
    return case


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def mlp_reference(case: dict) -> torch.Tensor:
    """The unsharded SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, in float64."""
    d = {k: None if v is None else v.double() for k, v in case.items()}
    h = F.silu(_linear(d["x"], d["gate"], d["gate_bias"])) * _linear(d["x"], d["up"], d["up_bias"])
    return _linear(h, d["down"], d["down_bias"])


def _expected_parts(case: dict, rank: int, k: int) -> dict:
    """What rank ``rank`` of ``k`` must compute, in float64: its gate and up outputs (its block of
    the intermediate columns), and its slice of ``h`` that ``down_proj`` takes."""
    d = {name: None if v is None else v.double() for name, v in case.items()}
    gate = _linear(d["x"], column_shard(d["gate"], rank, k),
                   None if d["gate_bias"] is None else column_shard(d["gate_bias"], rank, k))
    up = _linear(d["x"], column_shard(d["up"], rank, k),
                 None if d["up_bias"] is None else column_shard(d["up_bias"], rank, k))
    return {"gate_proj": gate, "up_proj": up, "h": F.silu(gate) * up}


def _mlp_close(got, want: torch.Tensor) -> bool:
    return (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape)
            and torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4))


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _row_diagnosis(got: torch.Tensor, case: dict, h_r: torch.Tensor, rank: int, k: int) -> str:
    """Why a rank's down_proj output is wrong, where it matches a known slip."""
    partial = h_r @ row_shard(case["down"].double(), rank, k).T
    bias = case["down_bias"]
    if _mlp_close(got, partial) or (bias is not None and _mlp_close(got, partial + bias.double())):
        return ": it is this rank's partial sum alone (the all-reduce is missing, or its result is not used)"
    if bias is not None:
        total = mlp_reference(case) - bias.double()
        if _mlp_close(got, total + k * bias.double()):
            return f": the bias is counted {k} times (added on every rank before the all-reduce, not once after)"
        if _mlp_close(got, total):
            return ": the bias is missing"
    return ""


def _check_one(cls, case: dict, k: int, shown: str) -> list[str]:
    """Every rank's MLP of ``k``: each projection alone, then the whole forward pass."""
    inter, hidden = case["gate"].shape
    per = inter // k
    group = ThreadGroup(k)
    try:
        mlps = [cls(case["gate"].clone(), case["up"].clone(), case["down"].clone(), r, k, group.all_reduce_for(r),
                    **{name: None if case[name] is None else case[name].clone()
                       for name in ("gate_bias", "up_bias", "down_bias")}) for r in range(k)]
    except Exception as e:  # the reader's code: any error is a failed case
        return [f"{shown}: ParallelMLP(...) raised {type(e).__name__}: {e}"]
    if not isinstance(mlps[0], torch.nn.Module):
        return [f"{shown}: ParallelMLP must be a torch.nn.Module (each decoder layer holds it as its mlp)"]
    for name in PROJECTIONS:
        if not callable(getattr(mlps[0], name, None)):
            return [f"{shown}: ParallelMLP has no {name} "
                    f"(the {PROJECTIONS[name]}-parallel linear of {name[:-5]}_weight)"]
    parts = [_expected_parts(case, r, k) for r in range(k)]
    failures = []
    # 1. gate_proj and up_proj: column-parallel, no communication, one rank at a time.
    for r, mlp in enumerate(mlps):
        for name in ("gate_proj", "up_proj"):
            want = parts[r][name]
            try:
                with torch.no_grad():
                    got = getattr(mlp, name)(case["x"].clone())
            except Exception as e:
                failures.append(f"{shown}: rank {r}'s {name}(x) raised {type(e).__name__}: {e}")
                continue
            if not _mlp_close(got, want):
                weight = getattr(getattr(mlp, name), "weight", None)
                held = f"; its .weight is {_shape(weight)}" if isinstance(weight, torch.Tensor) else ""
                differ = ", values differ" if _shape(got) == _shape(want) else ""
                failures.append(f"{shown}: rank {r}'s {name}(x) is {_shape(got)}{differ}, expected "
                                f"{tuple(want.shape)}: x times rows {r * per}:{(r + 1) * per} of {name[:-5]}_weight "
                                f"(shard ({per}, {hidden})){held}")
    if failures:
        return failures
    # 2. down_proj: row-parallel, on every rank at once (it all-reduces).
    want = mlp_reference(case)
    try:
        with torch.no_grad():
            outs = group.run(lambda r, _: mlps[r].down_proj(parts[r]["h"].float()))
    except Exception as e:
        return [f"{shown}: down_proj(h_part) failed on {e}"]
    for r, got in enumerate(outs):
        if not _mlp_close(got, want):
            why = _row_diagnosis(got, case, parts[r]["h"], r, k) if _shape(got) == _shape(want) else ""
            differ = ", values differ" if _shape(got) == _shape(want) else ""
            failures.append(f"{shown}: rank {r}'s down_proj(h_part) is {_shape(got)}{differ}, expected "
                            f"{tuple(want.shape)} (h_part {(case['x'].shape[0], per)} times columns "
                            f"{r * per}:{(r + 1) * per} of down_weight (shard ({hidden}, {per})), "
                            f"summed over the ranks){why}")
    if failures:
        return failures
    # 3. The whole forward pass, every rank with the whole x, exactly one all-reduce each.
    before = list(group.calls)
    try:
        with torch.no_grad():
            outs = group.run(lambda r, _: mlps[r](case["x"].clone()))
    except Exception as e:
        return [f"{shown}: forward(x) failed on {e}"]
    for r, got in enumerate(outs):
        if not _mlp_close(got, want):
            differ = ", values differ" if _shape(got) == _shape(want) else ""
            failures.append(f"{shown}: rank {r}'s forward(x) is {_shape(got)}{differ}, expected {tuple(want.shape)} "
                            "(down_proj(silu(gate_proj(x)) * up_proj(x)), as the unsharded MLP)")
    calls = [after - b for after, b in zip(group.calls, before)]
    if not failures and k > 1 and any(c != 1 for c in calls):
        failures.append(f"{shown}: forward(x) made {calls} all-reduces on the ranks, expected one each")
    return failures


@checker(chapter=10, answer="ParallelMLP")
def check_parallel_mlp(cls: type, seed: int = 0) -> bool:
    """``cls(gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce, gate_bias=None,
    up_bias=None, down_bias=None)`` is rank ``tp_rank``'s share of a SwiGLU MLP, built from the full
    weights (``[intermediate, hidden]``, ``[intermediate, hidden]``, ``[hidden, intermediate]``).
    Its ``gate_proj`` and ``up_proj`` are column-parallel (this rank's block of output rows: ``x
    [tokens, hidden]`` -> ``[tokens, intermediate / tp_size]``), its ``down_proj`` row-parallel (the
    matching block of input columns, the partial sums all-reduced, the bias added once), and
    ``forward(x)`` returns the whole MLP's output on every rank. Each case runs ``tp_size`` ranks as
    threads with an ``all_reduce`` that sums over them, and compares each projection on each rank,
    then the forward pass, with the unsharded MLP (float32, up to rounding)."""
    gen = torch.Generator().manual_seed(seed)
    failures, num_checks = [], 0
    for hidden, inter, tokens, biases in MLP_SHAPES:
        case = _mlp_case(hidden, inter, tokens, biases, gen)
        for k in MLP_TP_SIZES:
            num_checks += 1
            shown = (f"hidden={hidden}, intermediate={inter}, {tokens} tokens, "
                     f"{'with' if biases else 'no'} biases, tp_size={k}")
            failures += _check_one(cls, case, k, shown)[:1]
    return verdict("parallel_mlp", failures, num_checks)


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
