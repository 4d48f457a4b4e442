"""The engine drawings and the tools that look inside a running engine (TracingWorker, peek).

Expected values are worked out independently: by hand from the seed preset, or with a few
lines of plain PyTorch. The engine runs use the tiny random Llama of conftest.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.lab import tracing  # noqa: E402
from tinyserve.model_runner import prepare_inputs  # noqa: E402
from tinyserve.scheduler import Scheduler  # noqa: E402
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceGroupMetadata  # noqa: E402
from tinyserve.viz import (
    architecture,  # noqa: E402
    figures,  # noqa: E402
)
from tinyserve.viz import engine as ev  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def all_gids(ax) -> list[str]:
    out = []
    for artist in [*ax.patches, *ax.texts, *ax.lines]:
        if artist.get_gid():
            out.append(artist.get_gid())
    return out


def seed_scheduler() -> tuple[Scheduler, presets.Preset]:
    """The seed preset's scheduler with s0, s1, s2 waiting (made-up prompt token ids)."""
    p = presets.seed_rounds("swap")
    s = Scheduler(p.scheduler_config, p.cache_config)
    for i, r in enumerate(p.requests):
        seq = Sequence(i, None, list(range(100 * (i + 1), 100 * (i + 1) + r.prompt_len)), p.cache_config.block_size)
        s.add_seq_group(SequenceGroup(r.request_id, [seq], SamplingParams(temperature=0.0), arrival_time=0.0))
    return s, p


# -- the architecture ---------------------------------------------------------------------------

def test_architecture_has_both_halves_and_one_steps_arrows():
    fig = architecture.draw_architecture()
    ax = fig.axes[0]
    names = all_gids(ax)
    for part in ("LLMEngine", "Scheduler", "Worker", "BlockSpaceManager", "CacheEngine", "Sampler", "model",
                 "waiting", "running", "swapped"):
        assert f"box:{part}" in names, part
    arrows = [p.get_gid() for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert sorted(arrows) == sorted(["arrow:prompts", "arrow:text", "arrow:schedule", "arrow:orders",
                                     "arrow:logits", "arrow:tokens"])
    assert not any(n.startswith("badge:") for n in names)
    # The Scheduler sits left of the Worker, both under the LLMEngine.
    box = {p.get_gid(): p.get_bbox() for p in ax.patches if (p.get_gid() or "").startswith("box:")}
    assert box["box:Scheduler"].x1 < box["box:Worker"].x0
    assert box["box:LLMEngine"].y0 > max(box["box:Scheduler"].y1, box["box:Worker"].y1)


def test_chapter_map_badges_every_chapter_but_the_overview():
    ax = architecture.draw_architecture(chapters=True).axes[0]
    badges = {n.split(":")[1] for n in all_gids(ax) if n.startswith("badge:")}
    chapters = Path(__file__).resolve().parents[1] / "chapters"
    assert badges == {nb.name[:2] for nb in chapters.glob("[0-9][0-9]_*.ipynb")} - {"00"}


# -- peek and the packed-inputs drawing ---------------------------------------------------------

def test_peek_schedules_a_copy_and_leaves_the_engine_alone():
    s, p = seed_scheduler()
    engine = SimpleNamespace(scheduler=s, cache_config=p.cache_config)
    metas, out, inputs = tracing.peek(engine)
    assert [m.request_id for m in metas] == ["s0", "s1"] and out.phase == "prefill"
    # Nothing moved: all three still wait, every block is free.
    assert [g.request_id for g in s.waiting] == ["s0", "s1", "s2"]
    assert s.block_manager.get_num_free_gpu_blocks() == 4 and not s.block_manager.block_tables
    # The real schedule() then does exactly what peek showed.
    real_metas, real_out = s.schedule()
    real = prepare_inputs(real_metas, p.cache_config.block_size)
    assert real_out.num_batched_tokens == out.num_batched_tokens == 10
    assert torch.equal(real.input_ids, inputs.input_ids)
    assert inputs.attn_metadata.slot_mapping.tolist() == list(range(10))
    assert inputs.attn_metadata.query_start_loc.tolist() == [0, 5, 10]
    assert inputs.sample_indices.tolist() == [4, 9]


def test_sequence_names_suffix_groups_with_several_sequences():
    seqs = {7: Sequence(7, None, [1, 2], 4), 9: Sequence(9, None, [1, 2], 4)}
    metas = [SequenceGroupMetadata("a", False, {3: Sequence(3, None, [1], 4)}, SamplingParams(), {3: [0]}),
             SequenceGroupMetadata("b", False, seqs, SamplingParams(), {7: [1], 9: [2]})]
    assert tracing.sequence_names(metas) == ["a", "b.0", "b.1"]


class FakeTokenizer:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def test_packed_inputs_drawing_shows_every_row_and_boundary():
    s, p = seed_scheduler()
    metas, _ = s.schedule()
    inputs = prepare_inputs(metas, 5)
    ax = ev.draw_packed_inputs(metas, inputs, 5).axes[0]
    names = all_gids(ax)
    rows = ["input_ids", "positions", "slot_mapping"]
    assert sorted(n for n in names if n.startswith("cell:")) == sorted(f"cell:{r}:{c}" for r in rows for c in range(10))
    assert sorted(n for n in names if n.startswith("boundary:")) == ["boundary:0", "boundary:1", "boundary:2"]
    xs = {line.get_gid(): line.get_xdata()[0] for line in ax.lines if (line.get_gid() or "").startswith("boundary:")}
    assert [xs[f"boundary:{i}"] for i in range(3)] == [0, 5, 10]
    assert sorted(n for n in names if n.startswith("sample:")) == ["sample:4", "sample:9"]
    texts = [t.get_text() for t in ax.texts]
    assert "7\n(1·2)" in texts  # s1's third token: block 1, offset 2
    assert not any(n.startswith("cell:token:") for n in names)
    with_tokens = ev.draw_packed_inputs(metas, inputs, 5, tokenizer=FakeTokenizer()).axes[0]
    assert sum(1 for n in all_gids(with_tokens) if n.startswith("cell:token:")) == 10
    assert "t100" in [t.get_text() for t in with_tokens.texts]


# -- sampling -------------------------------------------------------------------------------------

def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent reference: scale, keep the top-k, then the smallest nucleus reaching top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k != -1:
        order = order[:top_k]
    kept, mass = [], 0.0
    sub = probs[order] / probs[order].sum()
    for i, q in zip(order, sub.tolist()):
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += q
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def test_sampling_panels_match_an_independent_computation():
    torch.manual_seed(0)
    logits = torch.randn(40) * 2.0
    settings = [("greedy", SamplingParams(temperature=0.0)), ("t0.5", SamplingParams(temperature=0.5)),
                ("k3", SamplingParams(temperature=1.0, top_k=3)), ("p0.7", SamplingParams(temperature=1.0, top_p=0.7)),
                ("k5p0.5", SamplingParams(temperature=0.8, top_k=5, top_p=0.5))]
    fig = ev.draw_sampling(logits, settings=settings, top=8)
    top8 = logits.argsort(descending=True)[:8].tolist()
    greedy_ax = fig.axes[0]
    bars = [p for p in greedy_ax.patches if (p.get_gid() or "").startswith("bar:")]
    assert [b.get_gid() for b in bars] == [f"bar:{top8[0]}"] and bars[0].get_height() == pytest.approx(1.0)
    for ax, (_, params) in zip(fig.axes[1:], settings[1:]):
        want = expected_probs(logits, params.temperature, params.top_k, params.top_p)
        heights = {p.get_gid(): p.get_height() for p in ax.patches if p.get_gid()}
        for t in top8:
            if want[t] > 0:
                assert heights[f"bar:{t}"] == pytest.approx(float(want[t]), rel=1e-4)
            else:
                assert f"cut:{t}" in heights and f"bar:{t}" not in heights
        assert f"{int((want > 0).sum())} token" in ax.get_title()


# -- timelines, step times, renaming ---------------------------------------------------------------

def seed_records():
    p = presets.seed_rounds("swap")
    return sim.simulate(p.requests, p.scheduler_config, p.cache_config)


def test_token_timeline_writes_each_produced_token_in_its_cell():
    records = seed_records()
    records[0] = dataclasses.replace(records[0], tokens={"s0": " Alex", "s1": " a very long token"})
    records[1] = dataclasses.replace(records[1], tokens={"s2.1": " b"})  # a sample of a group
    ax = ev.draw_token_timeline(records).axes[0]
    by_gid = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    assert by_gid["token:1:s0"].get_text() == " Alex"
    assert by_gid["token:1:s1"].get_text() == " a very …"  # cut to 9 characters
    # Cell centres: column = round - 1, row = the request's row (s0, s1, s2 in order).
    assert by_gid["token:1:s0"].get_position()[0] == pytest.approx(0.5)
    assert by_gid["token:2:s2.1"].get_position() == pytest.approx((1.5, 2.8))


def test_step_times_stack_the_four_parts_in_milliseconds():
    times = [(0.001, 0.2, 0.01, 0.002), (0.0005, 0.05, 0.004, 0.001)]
    records = seed_records()[:2]
    ax = ev.draw_engine_step_times(times, records).axes[0]
    for k, name in enumerate(ev.TIME_PARTS):
        bars = [p for p in ax.patches if p.get_gid() == f"time:{name}"]
        assert [b.get_height() for b in bars] == pytest.approx([1e3 * t[k] for t in times])
    tops = [sum(1e3 * x for x in t) for t in times]
    labels = {t.get_text(): t.get_position() for t in ax.texts}
    assert labels["P2"] == pytest.approx((1, tops[0])) and labels["P1"] == pytest.approx((2, tops[1]))


def test_rename_requests_renames_every_field_and_keeps_sample_suffixes():
    records = seed_records()
    records[0] = dataclasses.replace(records[0], tokens={"s0": "x", "s2.1": "y"})
    names = {"s0": "gen-0", "s1": "gen-1", "s2": "gen-2"}
    renamed = tracing.rename_requests(records, names)
    assert records[0].batch == ["s0", "s1"]  # the originals are untouched
    assert renamed[0].batch == ["gen-0", "gen-1"] and renamed[0].waiting == ["gen-2"]
    assert renamed[0].tokens == {"gen-0": "x", "gen-2.1": "y"}
    assert renamed[2].preempted == ["gen-2"] and renamed[2].cpu_block_tables == {"gen-2": [0]}
    assert renamed[2].block_tables == {"gen-0": records[2].block_tables["s0"], "gen-1": records[2].block_tables["s1"]}
    back = tracing.rename_requests(renamed, {v: k for k, v in names.items()})
    assert back == records


# -- the tracing worker and the registered figures, on the tiny model ------------------------------

def test_seed_run_on_the_tiny_model(tiny_loaded, monkeypatch, tmp_path):
    # The tiny model has its own tokenizer: give it prompts of the story's 5, 5 and 3 tokens.
    ids = {"s0": [30, 31, 32, 33, 34], "s1": [40, 41, 42, 43, 44], "s2": [50, 51, 52]}
    run = tracing.seed_run(tiny_loaded, prompt_token_ids=ids)
    engine, calls = run.engine, run.engine.executor.calls
    # One call per round (no round of this run is empty), with the orders the scheduler gave.
    assert len(calls) == len(engine.history) == 18
    assert calls[2].blocks_to_swap_out == {2: 0} and calls[0].blocks_to_swap_out == {}
    # A swap-in brings back exactly the CPU blocks the request held, into its new GPU table.
    for prev, r, call in zip(engine.history, engine.history[1:], calls[1:]):
        want = {}
        for rid in r.swapped_in:
            want.update(zip(prev.cpu_block_tables[rid], r.block_tables[rid]))
        assert call.blocks_to_swap_in == want
    assert sum(bool(c.blocks_to_swap_in) for c in calls) == 2
    # What the worker ran in rounds 1 and 3 is what peek showed before them.
    for (_metas, peeked), call in ((run.prefill, calls[0]), (run.decode, calls[2])):
        assert torch.equal(call.inputs.input_ids, peeked.input_ids)
        assert torch.equal(call.inputs.attn_metadata.slot_mapping, peeked.attn_metadata.slot_mapping)
    assert run.decode[1].attn_metadata.slot_mapping.tolist() == [15, 10]
    # Logits: one row per sampled sequence, the full vocabulary, float32 on the CPU.
    vocab = tiny_loaded.hf_config.vocab_size
    assert [tuple(c.logits.shape) for c in calls[:3]] == [(2, vocab), (1, vocab), (2, vocab)]
    assert calls[0].logits.dtype == torch.float32
    # The greedy token of round 1 is the argmax of the logits the worker returned.
    s0_token = engine.tokenizer.decode([int(calls[0].logits[0].argmax())])
    assert engine.history[0].tokens["s0"] == s0_token
    # The rounds are the simulator's (the tiny model does not stop early).
    p = presets.seed_rounds("swap")
    simulated = sim.simulate(p.requests, p.scheduler_config, p.cache_config)
    assert [(r.batch, r.block_tables) for r in engine.history] == [(r.batch, r.block_tables) for r in simulated]

    # The registered chapter 09 figures draw from this run when no model is given.
    monkeypatch.setattr(tracing, "_default_loaded", lambda: tiny_loaded)
    for name in ("09_packed_inputs", "09_sampling", "09_seed_rounds", "09_step_times"):
        path = figures.save(figures.draw(name), name, tmp_path)
        assert path.stat().st_size > 10_000, name


def test_tracing_worker_records_copy_on_write(tiny_loaded):
    from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from tinyserve.engine import LLMEngine

    config = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    worker = tracing.TracingWorker(config, loaded=tiny_loaded)
    engine = LLMEngine(config, CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, watermark=0.0),
                       SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), executor=worker,
                       record_history=True)
    engine.add_request("r", None, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3),
                       prompt_token_ids=[11, 12, 13])
    while engine.has_unfinished_requests():
        engine.step()
    # Round 1 forks the 3-token prompt (one shared, partly filled block); round 2 copies it.
    assert worker.calls[0].blocks_to_copy == {} and worker.calls[1].blocks_to_copy == {0: [1]}
    # Both samples' first tokens are recorded for round 1, under their sample keys.
    assert set(engine.history[0].tokens) == {"r.0", "r.1"}
    assert engine.history[0].block_tables == {"r.0": [0], "r.1": [0]}


def test_registered_overview_figures(tmp_path):
    for name in ("00_architecture", "00_chapter_map"):
        path = figures.save(figures.draw(name), name, tmp_path)
        assert path.stat().st_size > 20_000
