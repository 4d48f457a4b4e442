"""The three stories behind the pictures of chapters 03, 05 and 09 (tinyserve.lab.lifecycles), each
checked against the run it is read from, and their drawings (tinyserve.viz.diagrams)."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from tinyserve import presets  # noqa: E402
from tinyserve.lab.block_ops import play_block_script  # noqa: E402
from tinyserve.lab.lifecycles import (  # noqa: E402
    ARRIVES,
    FINISHED,
    block_life,
    queue_transitions,
    story_step_calls,
    trace_step,
)
from tinyserve.lab.tracing import seed_llm_engine  # noqa: E402
from tinyserve.sim import simulate  # noqa: E402
from tinyserve.viz import diagrams  # noqa: E402
from tinyserve.viz.figures import REGISTRY  # noqa: E402


def test_the_block_goes_through_every_state_the_chapter_names():
    states = block_life()
    assert [s.state for s in states] == ["free", "allocated", "shared", "copied", "swapped", "back", "freed"]
    assert [s.ref_count for s in states] == [0, 1, 2, 1, 1, 1, 0]
    assert [s.device for s in states] == ["GPU"] * 4 + ["CPU"] + ["GPU"] * 2
    # The copy-on-write line of the script is the one that says so, and the CPU number is the one
    # the manager's swap_out mapped the block to.
    ops = {op.line: op for op in play_block_script()}
    assert "copy-on-write" in ops["append A.0"].meaning
    swapped = states[4]
    assert swapped.op == "swap_out A" and str(swapped.number) in ops["swap_out A"].result


def test_queue_moves_match_the_rounds_they_are_counted_from():
    for mode in ("swap", "recompute"):
        preset = presets.seed_rounds(mode)
        records = simulate(preset.requests, preset.scheduler_config, preset.cache_config)
        moves = queue_transitions(records)
        n = len(preset.requests)
        assert moves[(ARRIVES, "waiting")] == n and moves[("running", FINISHED)] == n
        swaps = sum(len(r.swapped_out) for r in records)
        recomputes = sum(len(r.preempted) for r in records) - swaps
        assert moves[("running", "swapped")] == swaps == moves[("swapped", "running")]
        assert moves[("running", "waiting")] == recomputes
        assert moves[("waiting", "running")] == n + recomputes  # every recomputed request is admitted again
        assert (swaps > 0) == (mode == "swap") and (recomputes > 0) == (mode == "recompute")


def test_a_traced_step_is_in_the_engines_order_and_leaves_the_engine_as_it_was(tiny_loaded):
    calls, round_number = story_step_calls(tiny_loaded)
    names = [(c.callee, c.method) for c in calls]
    first = {key: names.index(key) for key in dict.fromkeys(names)}
    assert first[("Scheduler", "schedule")] < first[("Worker", "execute_model")] < first[("Sampler", "__call__")]
    assert first[("BlockSpaceManager", "swap_out")] < first[("Worker", "execute_model")]
    assert first[("CacheEngine", "swap_out")] < first[("Worker", "prepare_inputs")] < first[("Model", "forward")]
    assert all(c.depth == 1 for c in calls if c.caller == "LLMEngine")
    # The wrappers are gone after the step: a traced engine ends as an untraced one does.
    ids = {rid: [10 + i] * n for i, (rid, n) in enumerate(presets.SEED_PROMPT_LENS.items())}
    traced, plain = (seed_llm_engine(tiny_loaded, "swap", prompt_token_ids=ids) for _ in range(2))
    trace_step(traced)
    assert "schedule" not in vars(traced.scheduler) and "forward" not in vars(traced.executor.model)
    assert "can_allocate" not in vars(traced.scheduler.block_manager)
    assert "copy" not in vars(traced.executor.cache_engine)
    for engine in (traced, plain):
        while engine.has_unfinished_requests():
            engine.step()
    assert [r.tokens for r in traced.history] == [r.tokens for r in plain.history]
    assert plain.history[round_number - 1].swapped_out


@pytest.mark.parametrize("policy", ["orca", "v1"])
def test_a_step_traces_under_the_other_policies_too(tiny_loaded, policy):
    ids = {rid: [10 + i] * n for i, (rid, n) in enumerate(presets.SEED_PROMPT_LENS.items())}
    traced, plain = (seed_llm_engine(tiny_loaded, prompt_token_ids=ids, policy=policy) for _ in range(2))
    names = [(c.callee, c.method) for c in trace_step(traced)]
    assert names.index(("Scheduler", "schedule")) < names.index(("Worker", "execute_model"))
    for engine in (traced, plain):
        while engine.has_unfinished_requests():
            engine.step()
    assert [r.tokens for r in traced.history] == [r.tokens for r in plain.history]
    assert traced.scheduler.scheduler_config.policy == policy


def test_the_three_diagrams_draw_and_are_registered():
    for name, fn in [("03_block_life", diagrams.fig_block_life), ("05_queue_transitions",
                                                                   diagrams.fig_queue_transitions)]:
        assert REGISTRY[name] == f"diagrams:{fn.__name__}"
        fig = fn()
        assert fig.axes[0].texts
    assert REGISTRY["09_step_sequence"] == "diagrams:fig_step_sequence"
