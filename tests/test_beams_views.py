"""Chapter 14's pictures of a beam search: ``lab.beams.record_beam_search`` records a real run step by
step, ``viz.beams`` draws it (the tree, the blocks held) and steps through it (``BeamStepper``).

The record is checked against independent references: the same request run without the recorder
(the same beams), the block manager's own ref counts against the beams' tables (a block's ref
count is the number of running beams whose table holds it), every child's tokens against its
parent's, and the width. The stepper is driven headless (slider, buttons) over its whole range,
and every figure passes the legibility measure of ``tests/test_figure_legibility.py``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.lab.beams import record_beam_search, stopping_decisions  # noqa: E402
from tinyserve.viz.beams import BeamStepper, blocks_text, draw_beam_tree, draw_blocks_held, layout  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_figure_legibility import legibility_problems  # noqa: E402

PROMPT = "The future of AI is"


def _params(width: int, max_tokens: int = 7) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), block_size=4)


@pytest.fixture(scope="module")
def runs(llm):
    return {width: record_beam_search(llm.engine, PROMPT, _params(width)) for width in (2, 4)}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_the_recorder_does_not_change_the_beams(llm, runs):
    for width, run in runs.items():
        plain = llm.generate([PROMPT], _params(width))[0]
        assert [(list(o.token_ids), o.cumulative_logprob) for o in run.outputs] == \
               [(list(o.token_ids), o.cumulative_logprob) for o in plain.outputs]
    assert llm.engine.beam_select.__name__ == "select"  # the engine's own decision is back in place


def test_each_step_keeps_at_most_the_width_and_accounts_for_every_candidate(runs):
    for width, run in runs.items():
        assert run.width == width and run.steps
        for step in run.steps:
            ids = [c.seq_id for c in step.children]
            assert len(step.children) <= 2 * width
            assert set(step.kept) <= set(ids)
            assert len(step.beams) <= width
            running_kept = {c.seq_id for c in step.children if c.seq_id in step.kept and not c.finished}
            assert {b.seq_id for b in step.beams} == (set() if step.stopped else running_kept)
            assert len(step.finished) <= width
        assert run.steps[-1].stopped and not run.steps[-1].beams


def test_ref_counts_are_the_beams_holding_each_block(runs):
    """Independent of the block manager's counter: count the tables that hold each block."""
    shared_somewhere = False
    for run in runs.values():
        for step in run.steps:
            holders = Counter(b for beam in step.beams for b, _ in beam.blocks)
            for beam in step.beams:
                for block, ref_count in beam.blocks:
                    assert ref_count == holders[block], (step.step, beam.seq_id, block)
                    shared_somewhere |= ref_count > 1
            assert step.blocks_shared == len(holders)
            assert step.blocks_unshared == sum(holders.values())
            # Each beam's table holds exactly the blocks of its tokens before the last one.
            for beam in step.beams:
                assert len(beam.blocks) == -(-(len(run.prompt_token_ids) + len(beam.tokens) - 1) // run.block_size)
    assert shared_somewhere  # the prompt's blocks, at least


def test_every_child_continues_its_parent(runs):
    for run in runs.values():
        before = {run.steps[0].children[0].parent: ()}
        for step in run.steps:
            for beam in step.beams:
                child = next(c for c in step.children if c.seq_id == beam.seq_id)
                assert child.parent in before
                assert beam.tokens == before[child.parent] + (child.token,)
            before = {b.seq_id: b.tokens for b in step.beams}


def test_the_tree_places_every_node_once_per_step(runs):
    run = runs[4]
    ys = layout(run)
    for step in run.steps:
        column = [ys[(step.step, c.seq_id)] for c in step.children]
        assert len(set(column)) == len(column)  # no two boxes of a step on one place


def test_tree_and_blocks_figures_are_legible_at_every_step(runs):
    run = runs[4]
    for step in range(1, len(run.steps) + 1):
        fig = draw_beam_tree(run, step)
        assert legibility_problems(fig) == [], step
        plt.close(fig)
    assert legibility_problems(draw_blocks_held({f"width {w}": r for w, r in runs.items()}, step_run="width 4")) == []
    with pytest.raises(ValueError, match="step must be"):
        draw_beam_tree(run, len(run.steps) + 1)


def test_the_chapter_run_on_smollm2_draws_legibly(smollm2_loaded):
    """The chapter's own run: SmolLM2, width 4, blocks of 4, whose block lists grow the longest."""
    from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from tinyserve.engine import LLMEngine
    from tinyserve.worker import Worker

    config = ModelConfig(model="smollm2-135m")
    engine = LLMEngine(config, CacheConfig(block_size=4, num_gpu_blocks=256, num_cpu_blocks=0, watermark=0.0),
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=128),
                       executor=Worker(config, attention_backend="torch", loaded=smollm2_loaded))
    run = record_beam_search(engine, "The best way to learn a language is", _params(4, 8))
    for step in range(1, len(run.steps) + 1):
        assert legibility_problems(draw_beam_tree(run, step)) == [], step
        plt.close("all")


def test_stepper_sweeps_every_step_and_shows_it(runs):
    run = runs[4]
    stepper = BeamStepper(run)
    assert stepper.slider.min == 1 and stepper.slider.max == len(run.steps)
    for value in range(1, len(run.steps) + 1):
        stepper.slider.value = value
        step = run.steps[value - 1]
        shown = stepper.view.value
        assert stepper.current is step
        assert f"{step.blocks_shared} ({step.blocks_unshared} without sharing)" in shown
        assert ("stopped" if step.stopped else "goes on") in shown
        for beam in step.beams:
            assert blocks_text(beam.blocks) in shown
        assert "<img" in shown
    stepper.slider.value = 1
    assert stepper.prev_button.disabled and not stepper.next_button.disabled
    stepper.next_button.click()
    assert stepper.slider.value == 2 and stepper.current is run.steps[1]
    stepper.prev_button.click()
    assert stepper.slider.value == 1
    stepper.slider.value = stepper.slider.max
    assert stepper.next_button.disabled
    bundle = stepper._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "image/png" in data or "text/html" in data


def test_stepper_refuses_an_empty_run(runs):
    import dataclasses

    with pytest.raises(ValueError, match="at least one step"):
        BeamStepper(dataclasses.replace(runs[2], steps=[]))


def test_stopping_decisions_follow_the_three_modes():
    # Hand-computed: prompt 8, running 6 tokens at -3.0 (length 14, or 32 at max_len), finished 4
    # tokens ending in EOS at -2.2 (length 11).
    rows = {r["length_penalty"]: r for r in stopping_decisions((-3.0, 6), (-2.2, 4), 8, 32)}
    assert rows[1.0]["best running"] == pytest.approx(-3.0 / 14)
    assert rows[1.0]["best running at max_len"] == pytest.approx(-3.0 / 32)
    assert rows[1.0]["worst finished"] == pytest.approx(-2.2 / 11)
    assert [rows[0.0][m] for m in ("True", "False", "'never'")] == [True, True, True]
    assert [rows[1.0][m] for m in ("True", "False", "'never'")] == [True, True, False]
    assert [rows[2.0][m] for m in ("True", "False", "'never'")] == [True, False, False]


def test_record_refuses_what_it_cannot_record(llm):
    with pytest.raises(ValueError, match="use_beam_search=True"):
        record_beam_search(llm.engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=3))


def test_stepper_stays_put_and_fits_a_laptop_screen(runs):
    """One text height and one picture size at every step, the whole widget within 700 px
    (``tests/test_stepper.py``'s measure); the columns never come and go."""
    from test_stepper import assert_stays_put

    stepper = BeamStepper(runs[4], draw=False)
    assert_stays_put(stepper)
    assert len({len(stepper.step_columns(i)) for i in range(stepper.num_steps)}) == 1


def test_a_saved_beam_select_runs_in_the_workspace_engine(tmp_path, monkeypatch):
    """Chapter 14's component goes in through ``LLMEngine(beam_select=)``: ``build_engine`` builds
    the engine with the saved function (the book's solution here), which serves the beam steps
    (counted) and gives the package's beams; up to chapter 13 it is left out."""
    from tinyserve.config import CacheConfig, SchedulerConfig
    from tinyserve.exercises.engine_runs import tiny
    from tinyserve.workspace import build_engine
    from tinyserve.workspace.store import save

    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(tmp_path))
    solution = Path(__file__).resolve().parents[1] / "chapters" / "solutions" / "ch14.py"
    save("beam_select", solution.read_text(), chapter=14, quiet=True, answer="beam_select")
    configs = (SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=64),
               CacheConfig(block_size=4, num_gpu_blocks=256, num_cpu_blocks=16, watermark=0.0))
    outputs = {}
    for chapter in (13, 14):
        engine, report = build_engine(tiny(), preset=configs, chapter=chapter)
        run = record_beam_search(engine, PROMPT, _params(3))
        outputs[chapter] = [(list(o.token_ids), o.cumulative_logprob) for o in run.outputs]
        assert ("beam_select" in report.yours()) == (chapter == 14)
        assert (engine.beam_select.__module__ or "").startswith("tinyserve.") == (chapter == 13)
        if chapter == 14:
            assert report.calls["beam_select"] == len(run.steps)
    assert outputs[13] == outputs[14]
