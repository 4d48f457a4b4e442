"""The benchmarks' measurements, on tiny cases: no timing is asserted, only what is measured.

- KV utilization against an independent count of tokens and slots, round by round.
- The scheduler-overhead loop really keeps every sequence decoding.
- ``throughput.py --quick`` on the tiny random model: all three systems generate exactly the
  requested tokens, and the same ones (greedy), and the CSVs the chapter reads are written.
- Decode attention cut into sub-batches equals attention in one piece.
"""

from __future__ import annotations

import csv
import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from tinyserve.viz import performance as perf

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected_utilization(prompts: list[int], outputs: list[int], block_size: int, max_model_len: int):
    """All requests start together and decode one token a round: after round t a request that is
    still running (t < its output length) holds prompt + t - 1 computed tokens."""
    held = paged = to_max = to_need = 0
    for t in range(1, max(outputs) + 1):
        for p, o in zip(prompts, outputs):
            if t < o:
                n = p + t - 1
                held += n
                paged += -(-n // block_size) * block_size
                to_max += max_model_len
                to_need += p + o
    return held / paged, held / to_max, held / to_need


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_kv_utilization_matches_a_direct_count(block_size: int):
    rng = random.Random(block_size)
    prompts = [rng.randint(1, 60) for _ in range(6)]
    outputs = [rng.randint(1, 40) for _ in range(6)]
    got = perf.kv_utilization(prompts, outputs, block_size, max_num_seqs=8, max_model_len=512)
    paged, to_max, to_need = _expected_utilization(prompts, outputs, block_size, 512)
    assert got["paged"] == pytest.approx(paged)
    assert got["reserve_max_model_len"] == pytest.approx(to_max)
    assert got["reserve_prompt_plus_max_tokens"] == pytest.approx(to_need)
    if block_size == 1:
        assert got["paged"] == 1.0  # one-token blocks waste nothing


def test_memory_benchmark_orders_the_schemes():
    rng = random.Random(0)
    rows = _load("memory").measure([rng.randint(20, 120) for _ in range(15)], [rng.randint(8, 128) for _ in range(15)],
                                   max_num_seqs=6)
    by = {r["scheme"]: r["utilization"] for r in rows}
    paged = [by[f"paged, block size {bs}"] for bs in (8, 16, 32)]
    # Bigger blocks leave more of the last block empty; reserving ahead wastes more still.
    assert paged[0] >= paged[1] >= paged[2] > by["contiguous, prompt + max_tokens"] > by[
        "contiguous, max_model_len 2048"] > 0


def test_time_schedule_keeps_every_sequence_decoding():
    times = perf.time_schedule(num_seqs=12, num_blocks=400, rounds=5, prompt_len=20)
    assert len(times) == 5 and all(t > 0 for t in times)
    with pytest.raises(RuntimeError, match="only"):
        perf.time_schedule(num_seqs=12, num_blocks=20, rounds=5, prompt_len=20)  # not enough blocks


def test_decode_chunks_equal_attention_in_one_piece(monkeypatch: pytest.MonkeyPatch):
    from tinyserve.attention import reference
    from tinyserve.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, dim = 4, 2, 4, 8
    k_cache = torch.randn(64, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(64, bs, kv_heads, dim, generator=gen)
    ctx = [3, 17, 9, 30, 1, 12]
    order = torch.randperm(64, generator=gen).tolist()
    tables, slots = [], []
    for c in ctx:
        tables.append([order.pop() for _ in range(-(-c // bs))])
        slots.append(tables[-1][(c - 1) // bs] * bs + (c - 1) % bs)
    meta = AttentionMetadata.build([1] * len(ctx), ctx, tables, slots)
    q = torch.randn(len(ctx), heads, dim, generator=gen)
    whole = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)
    monkeypatch.setattr(reference, "GATHER_BUDGET", 3 * bs * kv_heads * dim)  # a few rows per chunk
    plan = reference._plan_batch(meta, k_cache.shape, heads)
    assert len(plan) > 2
    torch.testing.assert_close(reference.paged_attention(q, k_cache, v_cache, meta, 0.3), whole)
    # A mixed batch: the decode rows are chunked, the prefill row padded on its own.
    mixed = AttentionMetadata.build([1, 5, 1], [17, 9, 30], [tables[1], tables[2], tables[3]],
                                    slots[1:2] + [tables[2][p // bs] * bs + p % bs for p in range(4, 9)]
                                    + slots[3:4])
    qm = torch.randn(7, heads, dim, generator=gen)
    chunked = reference.paged_attention(qm, k_cache, v_cache, mixed, 0.3)
    monkeypatch.setattr(reference, "GATHER_BUDGET", 1 << 30)
    torch.testing.assert_close(chunked, reference.paged_attention(qm, k_cache, v_cache, mixed, 0.3))


@pytest.mark.slow
def test_throughput_quick_run(tiny_model_dir: Path, tmp_path: Path):
    _load("throughput").main(["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path)])
    with open(tmp_path / "throughput.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["system"] for r in rows} == set(perf.SYSTEMS)
    assert len(rows) == 8  # two headline workloads x four systems
    for r in rows:
        # Every system generated the same greedy tokens as tinyserve, for every request.
        assert float(r["same_outputs_as_tinyserve"]) == 1.0, r
        assert float(r["tokens_per_s"]) > 0
    steps = perf.read_results("step_times", tmp_path)
    assert steps[0]["phase"] == "prefill" and {s["phase"] for s in steps} >= {"prefill", "decode"}
    assert all(s[p] >= 0 for s in steps for p in perf.STEP_PARTS)
    # Requests arrive while others decode: only the orca policy mixes them into one round.
    assert "mixed" not in {s["phase"] for s in steps}
    assert "mixed" in {s["phase"] for s in perf.read_results("step_times_orca", tmp_path)}
