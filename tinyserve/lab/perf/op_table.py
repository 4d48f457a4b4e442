"""One decode step op by op: a ``torch.profiler`` trace grouped into kinds, each beside its floor.

``benchmarks/profile_step.py`` profiles engine steps with labels (``torch.profiler.record_function``)
around the step's parts: the step itself, the engine's phases, the backend's attention and, in an
eager step, the model's modules. ``op_kinds`` walks the trace and gives every event's *self* time
(its time less its children's, so nothing counts twice) one kind:

- An op inside a matmul (``aten::linear`` and what runs under it, ``tinyserve::packed_linear``
  and oneDNN's ``mkldnn::_linear_pointwise`` under that), attention (the backend's calls, or
  ``tinyserve::paged_attention`` in a compiled step), the LM head, sampling, scheduling or input
  preparation takes that kind, whatever runs inside it (the outermost of them wins: the LM
  head's matmul is the LM head).
- Any other op of the forward pass takes the kind of the innermost module around it: norm,
  rotary, activation (the MLP between its two matmuls), layout (the attention block's slicing
  and copies), residual (the decoder layer's adds); ``other_ops`` where no label is.
- A label's own time is the Python between its ops (``python``). In a compiled step the graph's
  call is the fused kernels inductor generated (``fused``: they run inside it, unseen by the
  profiler unless inductor was told to name them), and the guard check before it ``guards``.
- The step's time outside every phase is the engine's own (``postprocess``).

``floors`` gives each kind the least time this machine could spend on its work: a matmul's FLOPs
at the rate measured for its shape, attention's K/V bytes (and the rest's activation bytes) at
the measured memory bandwidth. Python, guards and layout have no work of their own: floor 0.
"""

from __future__ import annotations

import statistics
from collections import Counter

from tinyserve.models.llama import Linear

STEP = "ts.step"
FORWARD = "ts.forward"
# Outermost wins: everything under one of these is that kind.
CONTAINERS = {
    "ts.schedule": "schedule", "ts.prepare_inputs": "prepare_inputs", "ts.lm_head": "lm_head",
    "ts.sample": "sample", "ts.attention": "attention", "tinyserve::paged_attention": "attention",
    "aten::linear": "matmul", "aten::matmul": "matmul", "aten::mm": "matmul", "aten::addmm": "matmul",
    "mkldnn::_linear_pointwise": "matmul", "tinyserve::packed_linear": "matmul", "aten::embedding": "embedding",
}
# Innermost wins, for the ops of the forward pass outside every container.
MODULES = {"ts.norm": "norm", "ts.rotary": "rotary", "ts.mlp": "activation", "ts.attn": "layout",
           "ts.layer": "residual"}
COMPILED_CALL = "## Call CompiledFxGraph"  # inductor's generated code: the fused kernels run in it
# A kernel of that code, named in the trace only where inductor compiled it with
# ``torch._inductor.config.cpp.enable_kernel_profile`` (``--kernel-profile``).
KERNEL = "cpp_fused"
GUARDS = "TorchDynamo Cache Lookup"  # the compiled function's guards, checked every call

ELEMENTWISE = ("norm", "rotary", "activation", "residual", "embedding")  # what inductor fuses into ``fused``
KINDS = ["schedule", "prepare_inputs", "matmul", "attention", "norm", "rotary", "activation", "residual", "layout",
         "embedding", "fused", "guards", "other_ops", "python", "lm_head", "sample", "postprocess"]


def is_op(name: str) -> bool:
    """An operator the dispatcher ran (``aten::mm``, ``tinyserve::paged_attention``), not a label."""
    return "::" in name


def _chain(event) -> list:
    """``event``'s ancestors, outermost first, then ``event``."""
    chain = [event]
    while chain[-1].cpu_parent is not None:
        chain.append(chain[-1].cpu_parent)
    return chain[::-1]


def kind_of(event) -> str | None:
    """The kind ``event``'s self time counts as, or None outside a step."""
    return _kind(_chain(event))


def _kind(chain: list) -> str | None:
    names = [e.name for e in chain]
    if STEP not in names:
        return None
    for name in names:
        if name in CONTAINERS:
            return CONTAINERS[name]
    if FORWARD not in names:
        return "postprocess"
    name = names[-1]
    if name.startswith(COMPILED_CALL) or KERNEL in name:
        return "fused"
    if name == GUARDS:
        return "guards"
    if not is_op(name):
        return "python"
    return next((MODULES[n] for n in reversed(names) if n in MODULES), "other_ops")


def op_kinds(events) -> dict[str, dict[str, float]]:
    """Per kind, the median over the trace's steps (``prof.events()``, each step inside a
    ``STEP`` label) of ``ops`` (the ops called at the top level of the kind, not counting what
    runs inside them; for ``fused`` the graph's calls, and its kernels where they are named) and
    ``us`` (self microseconds); and ``total``, the steps' own. Medians, so that one step the OS
    interrupted does not count: the kinds need not add up to the total exactly."""
    steps = {id(e): {k: {"ops": 0, "us": 0.0} for k in KINDS} for e in events if e.name == STEP}
    if not steps:
        raise ValueError(f"no {STEP!r} event in the trace: profile inside profile_step's labels")
    for e in events:
        chain = _chain(e)
        kind = _kind(chain)
        if kind is None:
            continue
        cell = steps[id(next(a for a in chain if a.name == STEP))][kind]
        cell["us"] += e.self_cpu_time_total
        parent_ops = [a for a in chain[:-1] if is_op(a.name)]
        if (is_op(e.name) and not parent_ops) or e.name.startswith(COMPILED_CALL) or KERNEL in e.name:
            cell["ops"] += 1
    out = {k: {v: statistics.median(s[k][v] for s in steps.values()) for v in ("ops", "us")} for k in KINDS}
    totals = [e for e in events if e.name == STEP]
    out["total"] = {"ops": statistics.median(sum(c["ops"] for c in s.values()) for s in steps.values()),
                    "us": statistics.median(e.cpu_time_total for e in totals)}
    return out


def matmul_shapes(model, batch: int) -> dict[str, Counter]:
    """The (M, K, N) of each matmul of a decode step at ``batch`` and how many times it runs: the
    layers' projections (``matmul``) and the LM head (``lm_head``)."""
    layers = Counter((batch, m.weight.shape[1], m.weight.shape[0]) for m in model.layers.modules()
                     if isinstance(m, Linear))
    vocab, hidden = model.head_weight.shape
    return {"matmul": layers, "lm_head": Counter({(batch, hidden, vocab): 1})}


def work(model, batch: int, context: int, itemsize: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) per kind of one decode step: ``batch`` sequences ``context`` tokens long
    (the new one included). Matmuls read their weights once for the batch; attention reads each
    sequence's K/V and writes the new row; the elementwise kinds read and write their
    activations once (their FLOPs, a few per value, are left out)."""
    out = {}
    for kind, shapes in matmul_shapes(model, batch).items():
        out[kind] = (sum(2 * m * k * n * c for (m, k, n), c in shapes.items()),
                     sum(k * n * c * itemsize for (m, k, n), c in shapes.items()))
    layers, d = len(model.layers), model.head_dim
    h, heads, kv = model.hidden_size, model.num_heads, model.num_kv_heads
    inter = model.layers[0].mlp.intermediate
    out["attention"] = (layers * batch * 4 * heads * d * context,
                        layers * batch * 2 * kv * d * (context + 1) * itemsize)
    act = batch * itemsize
    out["norm"] = (0.0, (2 * layers + 1) * (2 * act * h + h * itemsize))
    out["rotary"] = (0.0, layers * 2 * act * (heads + kv) * d)
    out["activation"] = (0.0, layers * act * 3 * inter)  # gate and up read, their product written
    out["residual"] = (0.0, 2 * layers * 3 * act * h)
    out["embedding"] = (0.0, 2 * act * h)
    # Fused, the elementwise kinds' work is the same bytes, read and written in fewer passes.
    out["fused"] = (0.0, sum(out[k][1] for k in ELEMENTWISE))
    out["sample"] = (0.0, batch * model.vocab_size * 4)  # float32 logits, read once
    return out


def floors(model, batch: int, context: int, itemsize: int, rates: dict[tuple[int, int, int], float],
           bandwidth: float) -> dict[str, dict[str, float]]:
    """Per kind: ``flops``, ``bytes`` and ``floor_s``, the larger of its FLOPs at the measured
    ``rates`` (FLOP/s per (M, K, N); attention's at the fastest of them) and its bytes at
    ``bandwidth`` (bytes/s)."""
    shapes = matmul_shapes(model, batch)
    best = max(rates.values())
    out = {}
    for kind, (flops, nbytes) in work(model, batch, context, itemsize).items():
        if kind in shapes:
            compute = sum(2 * m * k * n * c / rates[m, k, n] for (m, k, n), c in shapes[kind].items())
        else:
            compute = flops / best
        out[kind] = {"flops": flops, "bytes": nbytes, "floor_s": max(compute, nbytes / bandwidth)}
    return out


def table_rows(kinds: dict[str, dict[str, float]], kind_floors: dict[str, dict[str, float]],
               compiled: bool) -> list[dict]:
    """The table's rows: each kind the step spent time in (or has work for), its ops and
    milliseconds per step, its floor, FLOPs and bytes; then ``total``, the step with the sum of
    the floors. A compiled step's elementwise work is one floor, ``fused``'s; an eager step's is
    split among its kinds."""
    skip = ELEMENTWISE if compiled else ("fused",)
    rows = []
    for kind in KINDS:
        k, f = kinds[kind], kind_floors.get(kind, {}) if kind not in skip else {}
        if k["us"] == 0 and not f:
            continue
        rows.append(dict(kind=kind, ops_per_step=round(k["ops"], 1), ms_per_step=round(k["us"] / 1000, 3),
                         floor_ms=round(1000 * f.get("floor_s", 0.0), 3), flops=int(f.get("flops", 0)),
                         bytes=int(f.get("bytes", 0))))
    rows.append(dict(kind="total", ops_per_step=round(kinds["total"]["ops"], 1),
                     ms_per_step=round(kinds["total"]["us"] / 1000, 3),
                     floor_ms=round(sum(r["floor_ms"] for r in rows), 3), flops=sum(r["flops"] for r in rows),
                     bytes=sum(r["bytes"] for r in rows)))
    return rows
