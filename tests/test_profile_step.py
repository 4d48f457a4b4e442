"""benchmarks/profile_step.py's op table: a profiled decode step of the tiny model, its ops
grouped into kinds (tinyserve.lab.perf.op_table), beside the floors of their work."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bench_loader import load_benchmark
from torch.profiler import ProfilerActivity

from tinyserve.lab.perf import op_table


@pytest.fixture(scope="module")
def profiled(tiny_model_dir: Path):
    """An eager engine of the tiny model with 3 sequences decoding, and the op table of one step."""
    ps = load_benchmark("profile_step")
    llm = ps.build_llm(str(tiny_model_dir), 3, dtype=torch.float32, enforce_eager=True)
    ps.fill(llm, 3, 5, max_tokens=12)
    llm.engine.step()  # warm-up
    return ps, llm, ps.profile_ops(llm, 1)


def _ops_of_one_call(fn) -> int:
    """How many ops ``fn()`` calls at the top level, profiled on its own."""
    with torch.inference_mode(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if op_table.is_op(e.name) and e.cpu_parent is None)


def test_a_profiled_step_splits_into_kinds_that_follow_the_model(profiled):
    ps, llm, kinds = profiled
    model = llm.engine.executor.model
    config = llm.engine.executor.loaded.hf_config
    layers = config.num_hidden_layers
    # Four matmuls a layer (q/k/v fused, o, gate/up fused, down), the LM head its own kind.
    assert kinds["matmul"]["ops"] == 4 * layers
    assert kinds["lm_head"]["ops"] >= 1
    # Two norms a layer and the final one, each the ops of one RMSNorm call on its own.
    x = torch.randn(3, config.hidden_size)
    assert kinds["norm"]["ops"] == (2 * layers + 1) * _ops_of_one_call(lambda: model.norm(x))
    # One SiLU-and-multiply stretch a layer (chunk, silu, mul) and two residual adds.
    assert kinds["activation"]["ops"] == 3 * layers
    assert kinds["residual"]["ops"] == 2 * layers
    assert kinds["embedding"]["ops"] == 1
    for kind in ("attention", "rotary", "python", "schedule", "prepare_inputs", "sample", "postprocess"):
        assert kinds[kind]["us"] > 0, kind
    # Nothing of a compiled step shows up in an eager one.
    assert kinds["fused"]["us"] == kinds["guards"]["us"] == 0
    # Self times partition the step: over one step the kinds add up to it, nothing counted twice.
    assert sum(kinds[k]["us"] for k in op_table.KINDS) == pytest.approx(kinds["total"]["us"], rel=1e-6)


def test_every_matmul_of_the_trace_is_a_matmul_or_the_lm_head(tiny_model_dir: Path, profiled):
    ps, llm, _ = profiled
    # The labels are gone after profiling: the model's classes and the engine are as they were.
    from tinyserve.models import llama

    assert "forward" not in vars(llm.engine.executor.model)
    assert llama.apply_rotary.__module__ == "tinyserve.models.rotary"
    spans = [(llm.engine.executor.model, "forward", op_table.FORWARD), (llama.LlamaMLP, "forward", "ts.mlp")]
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        with ps.labelled(*spans[0]), ps.labelled(*spans[1]), ps.labelled(llm.engine.executor.model,
                                                                          "compute_logits", "ts.lm_head"):
            with torch.profiler.record_function(op_table.STEP):
                llm.engine.step()
    mms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
    assert len(mms) == 4 * llm.engine.executor.loaded.hf_config.num_hidden_layers + 1
    assert sorted(op_table.kind_of(e) for e in mms).count("matmul") == len(mms) - 1
    assert [op_table.kind_of(e) for e in mms if op_table.kind_of(e) != "matmul"] == ["lm_head"]


def _event(name: str, parent=None, self_us: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=self_us, cpu_time_total=self_us)


def test_a_compiled_steps_events_are_its_graph_its_opaque_ops_and_its_guards():
    # The shape of a compiled step's trace (torch 2.13): the graph's call holds the custom ops;
    # inductor's kernels run in its own time.
    step = _event(op_table.STEP)
    forward = _event(op_table.FORWARD, step)
    guards = _event(op_table.GUARDS, forward)
    region = _event("Torch-Compiled Region: 0/0", forward)
    call = _event(op_table.COMPILED_CALL + " abc ##", region, self_us=50.0)
    linear = _event("tinyserve::packed_linear", call)
    inner = _event("mkldnn::_linear_pointwise", linear, self_us=30.0)
    attention = _event("tinyserve::paged_attention", call)
    sdpa = _event("aten::scaled_dot_product_attention", attention, self_us=20.0)
    kernel = _event("graph_0_cpp_fused_add_mean_mul_pow_rsqrt_0", call, self_us=5.0)  # with --kernel-profile
    pad = _event("aten::new_full", forward)
    outside = _event("aten::mm")  # not in a step: not counted
    events = [step, forward, guards, region, call, linear, inner, attention, sdpa, kernel, pad, outside]
    expected = {"ts.step": "postprocess", "ts.forward": "python", op_table.GUARDS: "guards",
                region.name: "python", call.name: "fused", linear.name: "matmul", inner.name: "matmul",
                attention.name: "attention", sdpa.name: "attention", kernel.name: "fused", pad.name: "other_ops",
                outside.name: None}
    assert {e.name: op_table.kind_of(e) for e in events} == expected
    step.cpu_time_total = sum(e.self_cpu_time_total for e in events[:-1])
    kinds = op_table.op_kinds(events)
    assert kinds["matmul"] == {"ops": 1, "us": 31.0}  # packed_linear, with oneDNN's call inside it
    assert kinds["attention"] == {"ops": 1, "us": 21.0}
    assert kinds["fused"] == {"ops": 2, "us": 55.0}  # the graph's call and its one named kernel
    assert kinds["total"]["us"] == step.cpu_time_total


def test_floors_are_positive_and_below_the_measured_kinds(profiled):
    ps, llm, kinds = profiled
    from roofline import copy_bandwidth

    model = llm.engine.executor.model
    rates = ps.matmul_rates(model, 3, repeats=2)
    # Every matmul shape of the step was measured: the layers' four and the LM head.
    assert len(rates) == 5 and all(r > 0 for r in rates.values())
    floors = op_table.floors(model, 3, ps.context_len(llm), 4, rates, copy_bandwidth(mib=32, repeats=2))
    hidden, vocab = model.hidden_size, model.vocab_size
    assert floors["lm_head"]["flops"] == 2 * 3 * hidden * vocab and floors["lm_head"]["bytes"] == 4 * hidden * vocab
    for kind in ("matmul", "lm_head", "attention", "norm"):
        assert 0 < floors[kind]["floor_s"] < kinds[kind]["us"] / 1e6, kind
    rows = op_table.table_rows(kinds, floors, compiled=False)
    total = rows[-1]
    assert total["kind"] == "total" and "fused" not in [r["kind"] for r in rows]
    assert total["floor_ms"] == pytest.approx(sum(r["floor_ms"] for r in rows[:-1]))
    assert 0 < total["floor_ms"] < total["ms_per_step"]
    # A compiled step does the same work: its one fused floor stands for the elementwise kinds'.
    compiled = {r["kind"]: r for r in op_table.table_rows(kinds, floors, compiled=True)}
    assert compiled["fused"]["bytes"] == sum(floors[k]["bytes"] for k in op_table.ELEMENTWISE)
    assert compiled["norm"]["floor_ms"] == 0
    assert compiled["total"]["bytes"] == total["bytes"]
