"""Chapter 04's orca_round in the reader's engine: "your engine so far" runs s0/s1/s2 under the
orca policy too (the only policy whose round it is), and the reader's orca_round joins chapter 05's
scheduler_round by inheritance.

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinyserve import presets
from tinyserve import workspace as ws
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate
from tinyserve.workspace.so_far import round_difference

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"
SOLUTION = (SOLUTIONS / "ch04.py").read_text(encoding="utf-8")
# The solution with one slip: new prompts are admitted while a group waits in swap space.
ADMITS_WHILE_SWAPPED = SOLUTION.replace("        if not self.swapped:  # groups admitted before come back",
                                        "        if True:  # groups admitted before come back")


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


def _save_orca_round(source: str) -> None:
    ws.save("orca_round", source, chapter=4, quiet=True, answer="OrcaRound")


def test_the_slip_is_in_the_source():
    assert ADMITS_WHILE_SWAPPED != SOLUTION


def test_chapter_4_runs_both_policies_and_names_them(capsys):
    _save_orca_round(SOLUTION)
    v = ws.your_engine_so_far(4)
    assert v.ok and v.report.yours() == ["orca_round"]
    assert "policy='vllm'" in v.verdict and "policy='orca'" in v.verdict
    out = capsys.readouterr().out
    assert "under policy='vllm' and policy='orca'" in out and "✓ same rounds" in out
    # The verdict's rounds are the orca run's: some of them mix prefills and decodes.
    assert any(r.phase == "mixed" for r in v.packages) and len(v.yours) == len(v.packages)


def test_a_wrong_orca_round_shows_in_chapter_4_and_not_in_the_vllm_run():
    _save_orca_round(ADMITS_WHILE_SWAPPED)
    v = ws.your_engine_so_far(4, quiet=True)
    assert not v.ok and v.verdict.startswith("policy='orca': round "), v.verdict
    assert "policy='vllm'" not in v.verdict  # the vLLM round is the package's, and agrees
    assert any(r.phase == "mixed" for r in v.yours)


def test_chapters_2_3_and_5_run_the_vllm_policy_only():
    _save_orca_round(ADMITS_WHILE_SWAPPED)  # wrong, but only under the orca policy
    for chapter in (2, 3, 5):
        v = ws.your_engine_so_far(chapter, quiet=True)
        assert v.ok and "policy=" not in v.verdict, (chapter, v.verdict)
        assert all(r.phase != "mixed" for r in v.packages)


def test_the_readers_two_rounds_join_and_each_runs_its_own_policy():
    ws.save_solutions(SOLUTIONS, chapters=[4, 5])
    assert {"orca_round", "scheduler_round"} <= set(ws.saved_components())
    for policy in ("vllm", "orca"):
        preset = presets.seed_rounds("swap", policy=policy)
        scheduler, report = ws.build_scheduler(preset)
        assert {"orca_round", "scheduler_round"} <= set(report.yours()), str(report)
        cls = type(scheduler)
        assert cls._schedule_mixed.__qualname__.startswith("OrcaRound.")
        assert cls._schedule_vllm is not Scheduler._schedule_vllm
        mine = simulate(preset.requests, preset.scheduler_config, preset.cache_config, scheduler=scheduler)
        package = simulate(preset.requests, preset.scheduler_config, preset.cache_config)
        assert round_difference(mine, package) is None, policy
    assert ws.your_engine_so_far(4, quiet=True).ok and ws.your_engine_so_far(5, quiet=True).ok
