"""Chapter 08's views: the launch plan is the kernel's real launch, the PyTorch walk is the kernel's
math, the byte count is the benchmark's, and the drawings show what they claim.

The kernels run through Triton's interpreter without CUDA, so shapes stay small.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tinyserve.attention import reference  # noqa: E402
from tinyserve.attention import triton_paged as tp  # noqa: E402
from tinyserve.lab import bandwidth, kernel_plan, softmax_walk  # noqa: E402
from tinyserve.viz import attention_kernel as ak  # noqa: E402
from tinyserve.viz import style  # noqa: E402
from tinyserve.viz.figures import REGISTRY  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("bench_kernel", REPO / "benchmarks" / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# -- the plan is the launch ---------------------------------------------------------------------


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch, runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((tuple(grid), args, kwargs))


LAUNCHES = [
    # context_lens, num_heads, num_kv_heads, head_dim, num_sms, num_splits, tile_tokens
    ([700, 300, 45], 6, 2, 64, 132, None, None),
    ([5000], 32, 8, 128, 132, None, None),
    ([5000] * 40, 32, 8, 128, 132, None, None),   # enough programs: no split
    ([300, 520], 4, 4, 80, 132, None, None),
    ([100, 40, 1], 4, 2, 64, 0, 64, 16),          # more splits than tiles
    ([333, 40], 9, 3, 64, 0, 3, 32),
    ([17], 2, 1, 16, 0, 1, None),
]


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim,num_sms,num_splits,tile", LAUNCHES)
def test_plan_is_the_kernels_launch(monkeypatch, lens, num_heads, num_kv_heads, head_dim, num_sms, num_splits, tile):
    decode, combine = Recorder(), Recorder()
    monkeypatch.setattr(tp, "paged_decode_kernel", decode)
    monkeypatch.setattr(tp, "combine_partitions_kernel", combine)
    monkeypatch.setattr(tp, "sm_count", lambda device: num_sms)
    block_size = 16
    width = math.ceil(max(lens) / block_size)
    k_cache = torch.zeros(1, block_size, num_kv_heads, head_dim)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    q = torch.zeros(len(lens), num_heads, head_dim)
    tp.paged_decode_attention(q, k_cache, k_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.1,
                              num_splits=num_splits, max_context_len=max(lens), tile_tokens=tile)

    plan = kernel_plan.plan_decode(lens, num_heads, num_kv_heads, head_dim, block_size, num_sms=num_sms,
                          num_splits=num_splits, tile_tokens=tile)
    ((grid, args, kwargs),) = decode.launches
    assert grid == plan.grid
    assert args[8] == plan.partition_size  # out, lse, q, k, v, tables, lens, scale, partition_size
    assert (kwargs["GROUP"], kwargs["GROUP_PAD"], kwargs["TILE_N"]) == (plan.group, plan.group_pad, plan.tile_tokens)
    assert kwargs["SPLIT"] == plan.split
    assert len(combine.launches) == (1 if plan.split else 0)


def test_plan_splits_a_short_batch_on_a_gpu_and_never_on_the_cpu():
    lens = [700, 300, 45]
    gpu = kernel_plan.plan_decode(lens, 6, 2, 64, 16, num_sms=kernel_plan.H200_SMS)
    cpu = kernel_plan.plan_decode(lens, 6, 2, 64, 16, num_sms=0)
    assert gpu.grid == (3, 2, 2) and gpu.partition_size == 384
    assert cpu.grid == (3, 2, 1) and not cpu.split


@pytest.mark.parametrize("num_sms,num_splits", [(kernel_plan.H200_SMS, None), (0, None), (0, 5), (0, 64)])
def test_programs_cover_every_token_and_head_exactly_once(num_sms, num_splits):
    lens = [700, 300, 45, 1, 16]
    tables, _ = kernel_plan.example_batch(tuple(lens), 16, prompt_lens=(40, 24, 12, 1, 3))
    plan = kernel_plan.plan_decode(lens, 12, 3, 64, 16, tables, num_sms=num_sms, num_splits=num_splits, tile_tokens=16)
    assert len(plan.programs) == math.prod(plan.grid)
    for s, ctx in enumerate(lens):
        heads = sorted(h for p in plan.programs if p.seq == s and p.part == 0 for h in p.q_heads)
        assert heads == list(range(12))
        for kv in range(3):
            mine = [p for p in plan.programs if (p.seq, p.kv_head) == (s, kv)]
            tokens = [t for p in mine for t in range(p.start, p.end)]
            assert tokens == list(range(ctx))  # in order, each once
            for p in mine:
                expected = list(dict.fromkeys(tables[s][t // 16] for t in range(p.start, p.end)))
                assert p.blocks == expected
                assert p.num_tiles == math.ceil(max(0, p.end - p.start) / 16)


def test_partition_layout_examples():
    assert kernel_plan.partition_layout(700, 2, 64) == (384, 2)
    assert kernel_plan.partition_layout(100, 64, 16) == (16, 7)  # rounding to tiles leaves fewer partitions
    assert kernel_plan.partition_layout(64, 1, 64) == (64, 1)
    assert kernel_plan.partition_layout(65, 1, 64) == (128, 1)


def test_example_batch_interleaves_blocks_like_a_server():
    lens = (700, 300, 45)
    tables, bm = kernel_plan.example_batch(lens, 16)
    assert [len(t) for t in tables] == [math.ceil(c / 16) for c in lens]
    all_blocks = [b for t in tables for b in t]
    assert len(set(all_blocks)) == len(all_blocks)
    assert tables[0] != list(range(tables[0][0], tables[0][0] + len(tables[0])))  # scattered, not one run
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_blocks - len(all_blocks)


# -- online softmax in PyTorch ------------------------------------------------------------------


@pytest.mark.parametrize("rows,n,tile,offset", [(1, 10, 3, 0.0), (3, 64, 16, 0.0), (2, 7, 1, 5.0), (4, 5, 100, 0.0),
                                                (2, 33, 8, 1000.0), (2, 33, 8, -1000.0)])
def test_online_softmax_equals_softmax(rows, n, tile, offset):
    gen = torch.Generator().manual_seed(n)
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 4 + offset
    values = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    out, states = softmax_walk.online_softmax(scores, values, tile)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, rtol=1e-12, atol=1e-12)
    assert len(states) == math.ceil(n / tile)
    torch.testing.assert_close(states[-1].m, scores.max(-1).values)
    torch.testing.assert_close(states[-1].lse(), torch.logsumexp(scores, -1))
    # After tile i the state is the softmax of the columns seen so far.
    i = len(states) // 2
    seen = scores[:, :(i + 1) * tile]
    torch.testing.assert_close(states[i].output(), torch.softmax(seen, -1) @ values[:seen.shape[1]])


def test_online_softmax_accepts_one_row():
    scores, values = torch.tensor([1.0, 3.0, -2.0, 0.5]), torch.eye(4)
    out, _ = softmax_walk.online_softmax(scores, values, 3)
    torch.testing.assert_close(out, torch.softmax(scores, 0))


@pytest.mark.parametrize("cuts", [[0, 5, 12, 20], [0, 0, 9, 20], [0, 20, 20, 20], [0, 1, 2, 20]])
def test_combine_partitions_equals_one_softmax(cuts):
    gen = torch.Generator().manual_seed(len(cuts))
    scores = torch.randn(2, 20, generator=gen, dtype=torch.float64) * 3 + 300
    values = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        if a == b:  # an empty partition, as the kernel writes it
            outs.append(torch.zeros(2, 4, dtype=torch.float64))
            lses.append(torch.full((2,), float("-inf"), dtype=torch.float64))
        else:
            out, states = softmax_walk.online_softmax(scores[:, a:b], values[a:b], 4)
            outs.append(out)
            lses.append(states[-1].lse())
    out, lse = softmax_walk.combine_partitions(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_combine_partitions_of_nothing_is_zero():
    out, lse = softmax_walk.combine_partitions(torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf")))
    assert torch.equal(out, torch.zeros(2, 4)) and torch.isinf(lse).all()


# -- the walk is the kernel ---------------------------------------------------------------------


def example_inputs(lens=(150, 40, 7), num_heads=6, num_kv_heads=2, head_dim=32, block_size=16):
    tables, bm = kernel_plan.example_batch(lens, block_size, prompt_lens=(20, 10, 3))
    k, v = kernel_plan.random_cache(tables, list(lens), bm.gpu_allocator.num_blocks, block_size, num_kv_heads, head_dim,
                           device=DEVICE)
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    return tables, q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def test_random_cache_is_nan_outside_the_contexts():
    tables, _, k, v, _, lens = example_inputs()
    flat = k.view(-1, *k.shape[2:]).cpu()
    owned = {t[p // 16] * 16 + p % 16 for t, c in zip(tables, lens.tolist()) for p in range(c)}
    for slot in range(flat.shape[0]):
        assert bool(torch.isnan(flat[slot]).all()) is (slot not in owned)


def test_walk_program_matches_the_kernel_single_pass_and_split():
    tables, q, k, v, bt, lens = example_inputs()
    scale = 32 ** -0.5
    kernel = tp.paged_decode_attention(q, k, v, bt, lens, scale, num_splits=1)
    split = tp.paged_decode_attention(q, k, v, bt, lens, scale, num_splits=3, tile_tokens=16, max_context_len=150)
    plan = kernel_plan.plan_decode(lens.tolist(), 6, 2, 32, 16, tables, num_splits=3, tile_tokens=16)
    assert plan.num_parts == 3
    for s, ctx in enumerate(lens.tolist()):
        for kv in range(2):
            heads = slice(3 * kv, 3 * kv + 3)
            whole = softmax_walk.walk_program(q[s], k, v, tables[s], kv, scale, 0, ctx, 16)
            torch.testing.assert_close(whole.out, kernel[s, heads].float().cpu(), rtol=1e-5, atol=1e-5)
            parts = []
            for p in range(plan.num_parts):
                prog = plan.program(s, kv, p)
                if prog.empty:
                    parts.append((torch.zeros(3, 32), torch.full((3,), float("-inf"))))
                    continue
                walk = softmax_walk.walk_program(q[s], k, v, tables[s], kv, scale, prog.start, prog.end,
                                                 plan.tile_tokens)
                # The walk reads exactly the blocks the plan says, tile by tile.
                assert list(dict.fromkeys(b for st in walk.steps for b in st.blocks)) == prog.blocks
                assert len(walk.steps) == prog.num_tiles
                parts.append((walk.out, walk.lse))
            out, _ = softmax_walk.combine_partitions(torch.stack([o for o, _ in parts]),
                                                     torch.stack([lse for _, lse in parts]))
            torch.testing.assert_close(out, split[s, heads].float().cpu(), rtol=1e-5, atol=1e-5)
    ref = reference.paged_decode_attention(q, k, v, bt, lens, scale)
    torch.testing.assert_close(kernel, ref, rtol=1e-5, atol=1e-5)


# -- bytes and the floor ------------------------------------------------------------------------


def test_kv_bytes_is_the_benchmarks_count():
    bench = load_benchmark()
    for batch, ctx, kv, d, dtype in [(1, 128, 8, 128, torch.bfloat16), (16, 2048, 4, 64, torch.float16),
                                     (3, 5, 3, 64, torch.float32)]:
        size = torch.empty((), dtype=dtype).element_size()
        assert bandwidth.kv_bytes_per_step([ctx] * batch, kv, d, size) == bench.kv_bytes(batch, ctx, kv, d, dtype)
    # Llama-3-8B layer, 16 sequences of 4096 tokens, bf16: 16 * 4096 * 8 * 128 * 2 * 2 bytes = 256 MiB.
    assert bandwidth.kv_bytes_per_step([4096] * 16, 8, 128, 2) == 256 * 2**20


def test_floor_table_is_bytes_over_bandwidth():
    rows = bandwidth.floor_table(batches=(1, 16), contexts=(128, 4096), bandwidth=4.8e12)
    assert len(rows) == len(bandwidth.FLOOR_SHAPES) * 2 * 2
    row = next(r for r in rows if r["shape"].startswith("Llama") and r["batch"] == 16 and r["context"] == 4096)
    assert row["kv_MiB"] == 256
    assert row["floor_us"] == pytest.approx(256 * 2**20 / 4.8e12 * 1e6)  # about 56 µs
    assert bandwidth.floor_us(4_800_000) == pytest.approx(1.0)


# -- drawings -----------------------------------------------------------------------------------


def patches(ax, prefix):
    return [p for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


def test_program_grid_draws_every_program_and_block():
    lens = [700, 300, 45]
    tables, _ = kernel_plan.example_batch(tuple(lens), 16)
    plan = kernel_plan.plan_decode(lens, 6, 2, 64, 16, tables, num_sms=kernel_plan.H200_SMS)
    fig = ak.draw_program_grid(plan, tables)
    ax_grid, ax_blocks = fig.axes
    boxes = patches(ax_grid, "program:")
    assert len(boxes) == 12
    empty = {p.get_gid() for p in boxes if matplotlib.colors.to_hex(p.get_facecolor()) == "#eeeeee"}
    assert empty == {"program:1,0,1", "program:1,1,1", "program:2,0,1", "program:2,1,1"}
    texts = {t.get_gid(): t.get_text() for t in ax_grid.texts if t.get_gid()}
    assert "tokens 384-699, 5 tiles" in texts["program_text:0,1,1"]
    assert "q heads 3-5" in texts["program_text:0,1,1"]
    assert len(patches(ax_blocks, "block:")) == sum(math.ceil(c / 16) for c in lens)
    numbers = [t.get_text() for t in ax_blocks.texts if t.get_text().isdigit()]
    assert numbers == [str(b) for t in tables for b in t]
    # Blocks past the partition boundary (token 384 = logical block 24) take partition 1's colour.
    colors = {p.get_gid(): matplotlib.colors.to_hex(p.get_facecolor()) for p in patches(ax_blocks, "block:")}
    assert colors["block:0,23"] == style.PALETTE[0] and colors["block:0,24"] == style.PALETTE[1]


def test_program_walk_marks_the_programs_blocks():
    walk, e = kernel_plan.example_walk()
    tables, num_blocks = e.tables, e.num_blocks
    fig = ak.draw_program_walk(walk, tables, num_blocks, seq=0)
    ax_pool, ax_state = fig.axes[:2]
    pool = {p.get_gid(): matplotlib.colors.to_hex(p.get_facecolor()) for p in patches(ax_pool, "pool:")}
    assert len(pool) == num_blocks
    for b in range(num_blocks):
        color = pool[f"pool:{b}"]
        if b in tables[0]:
            assert color not in ("#d0d0d0", "#ffffff")
        elif any(b in t for t in tables[1:]):
            assert color == "#d0d0d0"
        else:
            assert color == "#ffffff"
    (m_line,) = ax_state.get_lines()
    assert list(m_line.get_ydata()) == [float(s.m[0]) for s in walk.steps]
    assert len(walk.steps) == math.ceil(700 / 64)


def test_bandwidth_floor_figure_plots_the_table():
    rows = bandwidth.floor_table(batches=(1, 16), contexts=(128, 1024))
    fig = ak.draw_bandwidth_floor(rows)
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(bandwidth.FLOOR_SHAPES) * 2
    assert sorted(y for ln in lines for y in ln.get_ydata()) == sorted(r["floor_us"] for r in rows)


def test_kernel_results_missing_is_none(tmp_path):
    assert bandwidth.load_kernel_results(tmp_path / "kernel.csv") is None


def test_kernel_bandwidth_plot_reads_the_benchmarks_csv(tmp_path):
    bench = load_benchmark()
    path = tmp_path / "kernel.csv"
    log = bench.CsvLog(path, dict(copy_gbps=4000.0))
    expected = {}
    for batch in (1, 16):
        for ctx in (128, 2048):
            pct = 10.0 + batch + ctx / 100  # made-up numbers: this only tests the plumbing
            row = dict(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, gqa=4, batch=batch, context=ctx,
                       block_size=16, num_splits=1, kv_bytes=1, triton_us=1.0, triton_gbps=pct * 40,
                       pct_of_copy=pct, ref_us=2.0, ref_gbps=pct * 20, speedup=2.0, note="")
            log.write(row)
            expected[(batch, ctx)] = pct
    log.write(dict(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, gqa=4, batch=256, context=32768,
                   block_size=16, num_splits=1, kv_bytes=1, triton_us=None, triton_gbps=None, pct_of_copy=None,
                   ref_us=None, ref_gbps=None, speedup=None, note="skipped: cache larger than --cache-gib"))
    log.close()
    rows = bandwidth.load_kernel_results(path)
    assert len(rows) == 5 and rows[-1]["pct_of_copy"] is None and rows[0]["batch"] == 1
    fig = ak.draw_kernel_bandwidth(rows)
    assert len(fig.axes) == 2  # batches 1 and 16; the skipped row draws nothing
    for ax, batch in zip(fig.axes, (1, 16)):
        solid, dotted, floor = ax.get_lines()
        assert list(solid.get_ydata()) == [expected[(batch, c)] for c in (128, 2048)]
        assert list(dotted.get_ydata()) == pytest.approx([expected[(batch, c)] / 2 for c in (128, 2048)])
        assert list(floor.get_ydata()) == [100, 100]


def test_example_walk_is_the_kernel_on_the_example_batch():
    walk, e = kernel_plan.example_walk(seq=0, kv_head=1, example=kernel_plan.example_inputs(device=DEVICE))
    out = tp.paged_decode_attention(e.q, e.k_cache, e.v_cache, e.block_tables, e.lens, e.scale)
    torch.testing.assert_close(walk.out, out[0, 3:6].float().cpu(), rtol=1e-5, atol=1e-5)
    assert e.block_tables.tolist()[0] == e.tables[0] and e.lens.tolist() == e.context_lens


def test_figures_are_registered():
    for name in ("08_program_grid", "08_program_walk", "08_bandwidth_floor"):
        assert name in REGISTRY
    assert ("08_kernel_bandwidth" in REGISTRY) is bandwidth.KERNEL_RESULTS.exists()
