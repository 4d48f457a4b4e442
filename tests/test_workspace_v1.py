"""Chapter 13's v1_round in the reader's engine: it joins the reader's other rounds, runs under
policy="v1" only, shows in chapter 13's "your engine so far" (which runs s0/s1/s2 under
policy="v1" too), and is left out of the earlier chapters' views and of chapter 09's capstone.

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tinyserve import presets
from tinyserve import workspace as ws
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate
from tinyserve.workspace.so_far import round_difference

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"
SOLUTION = (SOLUTIONS / "ch13.py").read_text(encoding="utf-8")
# The solution with one slip each: no prefix-cache hits (with prefix caching on, s1, preempted,
# comes back without its cached block), and blocks for the whole prompt at admission (the tiny model's prompts of 9 and
# 7 tokens are cut into pieces, and hold blocks they do not fill yet).
NO_HITS = SOLUTION.replace("cached = self._num_cached_tokens(group)  #", "cached = 0  #")
WHOLE_PROMPT = SOLUTION.replace("            bm.grow(seq, cached + num_new_tokens, cached)\n",
                                "            bm.grow(seq, seq.get_len())\n")
EARLIER_PARTS = ["allocator", "block_manager", "admission", "orca_round", "scheduler_round", "victim"]


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


def _save_v1_round(source: str) -> None:
    ws.save("v1_round", source, chapter=13, quiet=True, answer="V1Round")


def _same_rounds(preset) -> bool:
    scheduler, _ = ws.build_scheduler(preset)
    mine = simulate(preset.requests, preset.scheduler_config, preset.cache_config, scheduler=scheduler)
    package = simulate(preset.requests, preset.scheduler_config, preset.cache_config)
    return round_difference(mine, package) is None


def test_the_slips_are_in_the_source_and_one_makes_a_difference_without_a_model():
    assert NO_HITS != SOLUTION and WHOLE_PROMPT != SOLUTION
    _save_v1_round(NO_HITS)
    preset = presets.seed_rounds(None, policy="v1")
    preset.cache_config = dataclasses.replace(preset.cache_config, enable_prefix_caching=True)
    assert not _same_rounds(preset)


def test_the_readers_v1_round_is_the_schedulers_class_under_v1():
    _save_v1_round(SOLUTION)
    preset = presets.seed_rounds(None, policy="v1")
    scheduler, report = ws.build_scheduler(preset)
    assert report["v1_round"] == "yours" and report.yours() == ["v1_round"]
    assert type(scheduler)._schedule_v1 is not Scheduler._schedule_v1
    assert _same_rounds(preset)


def test_the_three_rounds_join_and_each_runs_its_own_policy():
    ws.save_solutions(SOLUTIONS, chapters=[4, 5, 13])
    assert {"orca_round", "scheduler_round", "v1_round"} <= set(ws.saved_components())
    for preset in (presets.seed_rounds("swap"), presets.seed_rounds("swap", policy="orca"),
                   presets.seed_rounds(None, policy="v1"), presets.orca_example("v1")):
        scheduler, report = ws.build_scheduler(preset)
        assert {"orca_round", "scheduler_round", "v1_round"} <= set(report.yours()), str(report)
        assert type(scheduler)._schedule_v1.__qualname__.startswith("V1Round.")
        assert _same_rounds(preset), preset.scheduler_config.policy


def test_a_readers_orca_round_does_not_take_over_the_v1_policy():
    # Chapter 04's answer overrides _schedule_mixed, where the package turns to the v1 round.
    ws.save_solutions(SOLUTIONS, chapters=[4])
    assert _same_rounds(presets.seed_rounds(None, policy="v1"))
    assert _same_rounds(presets.seed_rounds("swap", policy="orca"))


def test_earlier_views_and_the_capstones_do_not_name_it():
    assert list(ws.build_scheduler()[1]) == EARLIER_PARTS  # nothing saved
    _save_v1_round(SOLUTION)
    assert list(ws.build_scheduler(chapter=9)[1]) == EARLIER_PARTS
    assert list(ws.build_scheduler(chapter=13)[1]) == EARLIER_PARTS + ["v1_round"]
    assert list(ws.build_scheduler()[1]) == EARLIER_PARTS + ["v1_round"]
    ws.remove("v1_round")
    assert ws.build_scheduler(chapter=13)[1]["v1_round"] == "package's"


def test_chapter_13_runs_both_policies_and_a_wrong_v1_round_shows_under_v1_only():
    from tinyserve.exercises.engine_runs import tiny

    _save_v1_round(SOLUTION)
    v = ws.your_engine_so_far(13, model=tiny(), quiet=True)
    assert v.ok and "policy='vllm'" in v.verdict and "policy='v1'" in v.verdict, v.verdict
    assert v.report["v1_round"] == "yours"
    _save_v1_round(WHOLE_PROMPT)
    v = ws.your_engine_so_far(13, model=tiny(), quiet=True)
    assert not v.ok and v.verdict.startswith("policy='v1': "), v.verdict
    assert "policy='vllm'" not in v.verdict
    assert ws.your_engine_so_far(12, model=tiny(), quiet=True).ok  # chapter 12's view runs no v1 round
