"""Chapter 11.14's numbers and figure: ``lab.graph_costs`` and ``viz.graphs``, headless.

The references are independent of the code under test: CSV rows written here by hand, v0.4's
padding rule spelled out again (1, 2, 4, then multiples of 8) and worked examples of it, exact
lines for the cost fit, ``torch.nn.functional.rms_norm`` for the model's eager norm, ``F.linear``
for the packed weight, and the tiny model's own configuration (its layers, four projections
each, and one LM head) for the op count.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tinyserve import LLM  # noqa: E402
from tinyserve.graphs.sizes import capture_sizes  # noqa: E402
from tinyserve.lab import graph_costs as gc  # noqa: E402
from tinyserve.models.llama import RMSNorm  # noqa: E402
from tinyserve.models.packed_linear import packing_supported  # noqa: E402
from tinyserve.viz.graphs import draw_compiled_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_figure_legibility import legibility_problems  # noqa: E402

COLUMNS = ["dtype", "batch", "graph_size", "eager_ms", "compiled_ms", "transformers_ms", "floor_ms",
           "compiled_vs_eager", "compiled_vs_transformers", "roofline_share"]


def row(dtype: str, batch: int, graph: int, eager: float, compiled: float, hf: float, floor: float) -> dict:
    return dict(dtype=dtype, batch=batch, graph_size=graph, eager_ms=eager, compiled_ms=compiled, transformers_ms=hf,
                floor_ms=floor, compiled_vs_eager=round(compiled / eager, 3),
                compiled_vs_transformers=round(compiled / hf, 3), roofline_share=round(floor / compiled, 3))


# Out of order on purpose, two dtypes, batch 12 and 20 padded (12 to 16; 20 to 24, which has no row).
ROWS = [row("bfloat16", 16, 16, 116.0, 60.0, 120.0, 26.0), row("bfloat16", 1, 1, 40.0, 20.0, 42.0, 10.0),
        row("bfloat16", 12, 16, 100.0, 58.5, 104.0, 21.0), row("float32", 16, 16, 150.0, 90.0, 155.0, 40.0),
        row("bfloat16", 20, 24, 130.0, 70.0, 135.0, 30.0)]


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture
def results(tmp_path) -> Path:
    write_csv(tmp_path / "compiled_step.csv", ROWS, COLUMNS)
    write_csv(tmp_path / "compiled_step_compile.csv",
              [dict(run="first", batch=16, compile_s=41.5), dict(run="cached", batch=16, compile_s=6.25)],
              ["run", "batch", "compile_s"])
    return tmp_path


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# -- read from the benchmark -------------------------------------------------------------------


def test_step_rows_reads_one_dtype_by_batch(results):
    rows = gc.step_rows(results, "bfloat16")
    assert [r["batch"] for r in rows] == [1, 12, 16, 20]
    assert rows[1]["graph_size"] == 16 and rows[1]["compiled_ms"] == 58.5 and rows[1]["eager_ms"] == 100.0
    assert {r["dtype"] for r in gc.step_rows(results)} == {"bfloat16", "float32"}
    assert len(gc.step_rows(results)) == len(ROWS)


def test_compile_times_first_and_cached(results, tmp_path_factory):
    assert gc.compile_times(results) == {"first": 41.5, "cached": 6.25}
    with pytest.raises(FileNotFoundError):
        gc.compile_times(tmp_path_factory.mktemp("empty"))


# -- derived -----------------------------------------------------------------------------------


def test_padding_table_follows_the_capture_sizes():
    table = gc.padding_table(32)
    assert [r["batch"] for r in table] == list(range(1, 33))
    by_batch = {r["batch"]: r for r in table}
    # Worked examples of v0.4's rule: 3 runs on 4, 5 on 8, 9 to 16 on 16, 17 on 24, 25 on 32.
    examples = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 12: 16, 16: 16, 17: 24, 24: 24, 25: 32, 32: 32}
    for batch, size in examples.items():
        assert by_batch[batch]["graph_size"] == size, batch
    assert by_batch[12]["padded_rows"] == 4 and by_batch[12]["padded_share"] == 0.25
    assert max(table, key=lambda r: r["padded_share"])["batch"] == 9  # 7 of 16 rows padding
    # The rule spelled out again: the smallest of 1, 2, 4, 8, 16, ... that holds the batch.
    sizes = [1, 2, 4] + list(range(8, 33, 8))
    assert sorted({r["graph_size"] for r in table}) == sizes == capture_sizes(32)
    for r in table:
        assert r["graph_size"] == min(s for s in sizes if s >= r["batch"])
        assert r["padded_rows"] == r["graph_size"] - r["batch"]
    # A max_num_seqs that is not a capture size still gets a graph for its largest batch.
    assert gc.padding_table(20)[-1]["graph_size"] == 24


def test_padding_costs_compare_a_padded_batch_with_its_graphs_own(results):
    costs = gc.padding_costs(gc.step_rows(results, "bfloat16"))
    assert [c["batch"] for c in costs] == [12]  # 20's graph (24) has no row of its own
    (c,) = costs
    assert c["graph_size"] == 16 and c["full_ms"] == 60.0 and c["compiled_ms"] == 58.5
    assert c["step_ratio"] == pytest.approx(58.5 / 60.0)
    assert c["padded_share"] == 0.25
    assert c["ms_per_token"] == pytest.approx(58.5 / 12) and c["full_ms_per_token"] == pytest.approx(60.0 / 16)
    assert gc.padding_costs([r for r in ROWS if r["batch"] == r["graph_size"]]) == []


# -- measured live -----------------------------------------------------------------------------


def test_fit_recovers_an_exact_line_and_clips_noise():
    fixed, per = 3e-6, 2e-10
    cost = gc.fit_op_cost([(n, fixed + per * n) for n in gc.OP_SIZES])
    assert cost.fixed_s == pytest.approx(fixed) and cost.per_element_s == pytest.approx(per)
    assert cost.seconds(1000) == pytest.approx(fixed + per * 1000)
    assert cost.fixed_share(9216) == pytest.approx(fixed / (fixed + per * 9216))
    assert cost.break_even() == pytest.approx(fixed / per)
    falling = gc.fit_op_cost([(1, 5e-6), (1000, 4e-6)])  # noise: larger and faster
    assert falling.per_element_s == 0.0 and falling.fixed_s == pytest.approx(4.5e-6)
    assert falling.break_even() == float("inf")
    with pytest.raises(ValueError):
        gc.fit_op_cost([(10, 1e-6), (10, 2e-6)])


def test_op_times_calls_the_op_on_each_size():
    seen: list[int] = []

    def op(a, b):
        assert a.shape == b.shape
        seen.append(a.numel())
        return a

    points = gc.op_times(op, sizes=(1, 576), calls=7, rounds=3)
    assert [n for n, _ in points] == [1, 576] and all(t > 0 for _, t in points)
    assert seen == [1] * (1 + 7 * 3) + [576] * (1 + 7 * 3)  # one warm-up call, then rounds x calls


def test_counting_ops_sees_the_models_rms_norm_as_eight_ops():
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x = torch.randn(16, 576)
    with torch.inference_mode(), gc.counting_ops() as ops:
        out = norm(x)
    ref = torch.nn.functional.rms_norm(x, (576,), norm.weight.detach(), eps=1e-5)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # Eight dispatches: the two conversions reach the dispatcher too, though in float32 they copy nothing.
    assert ops == {"to": 2, "pow": 1, "mean": 1, "add": 1, "rsqrt": 1, "mul": 2}
    assert gc.time_call(lambda: norm(x), calls=3, rounds=2) > 0


def test_packing_gain_times_the_same_projection_both_ways():
    gain = gc.packing_gain(rows=4, in_features=64, out_features=128)
    if not packing_supported(torch.empty(1, dtype=torch.bfloat16)):
        assert gain is None
        return
    assert gain["same"] is True  # oneDNN's packed and plain bf16 kernels, bit for bit here
    assert gain["plain_s"] > 0 and gain["packed_s"] > 0


def test_count_step_ops_counts_one_eager_decode_forward(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks=64, num_cpu_blocks=0,
              max_num_seqs=8, enforce_eager=True)
    config = llm.engine.executor.model.config
    layers = config.num_hidden_layers
    ops = gc.count_step_ops(llm, batch=4, prompt_len=6)
    # Per layer: q/k/v, o, gate/up and down projections; then the LM head.
    assert ops["linear"] == 4 * layers + 1
    assert ops["rsqrt"] == 2 * layers + 1  # two norms a layer and the final one
    assert sum(ops.values()) > 20 * layers
    assert not llm.engine.scheduler.has_unfinished_seqs()  # its requests are gone again
    assert "run" not in vars(llm.engine.executor)  # the worker's own run is back
    again = gc.count_step_ops(llm, batch=4, prompt_len=6)
    assert again["linear"] == ops["linear"]


# -- the figure --------------------------------------------------------------------------------


def test_the_figure_draws_every_series_legibly(results):
    rows = gc.step_rows(results, "bfloat16")
    fig = draw_compiled_step(rows)
    left, right = fig.axes
    labels = [line.get_label() for line in left.get_lines()]
    for label in ("tinyserve, eager", "tinyserve, compiled graph", "compiled, batch padded up",
                  "transformers' forward", "floor (roofline)"):
        assert label in labels
    hollow = next(line for line in left.get_lines() if line.get_label() == "compiled, batch padded up")
    assert list(hollow.get_xdata()) == [12, 20]
    assert len(right.patches) == 2 * 20  # real and padding bars for batches 1..20
    assert legibility_problems(fig) == []
    full = draw_compiled_step([r for r in rows if r["batch"] == r["graph_size"]], max_num_seqs=32)
    assert "compiled, batch padded up" not in [line.get_label() for line in full.axes[0].get_lines()]
    assert legibility_problems(full) == []
    with pytest.raises(ValueError):
        draw_compiled_step([])
