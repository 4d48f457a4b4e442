"""Chapter 09's capstone (tinyserve.workspace.capstone): the reader's parts serve the model beside
the package's engine. With nothing written it runs the package's parts and names them so; with
the book's solutions saved every part is the reader's and the tokens are the package's; a wrong
part is caught and named. (Chapter 09 runs it on SmolLM2 in test_chapters; here the tiny Llama.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyserve import workspace as ws
from tinyserve.workspace.capstone import workloads
from tinyserve.workspace.so_far import _engine_run

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"
PARTS = {"allocator", "block_manager", "orca_round", "scheduler_round", "cache_engine", "attention",
         "input_builder", "sampler", "engine_step"}


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.setenv("TINYSERVE_CAPSTONE_RESULT", str(tmp_path / "capstone.json"))
    return tmp_path


def test_with_nothing_written_the_capstone_runs_the_packages_parts_and_says_so(workspace, tiny_loaded, capsys):
    result = ws.capstone(tiny_loaded)
    out = capsys.readouterr().out
    assert result.ok and result.report.yours() == []
    assert "your parts: none yet" in out and "identical to the package's" in out
    assert {r.workload for r in result.rows} == set(workloads())
    assert sum(result.preemptions.values()) > 0  # the workloads do preempt
    written = json.loads((workspace / "capstone.json").read_text())
    assert written["ok"] and written["yours"] == [] and len(written["rows"]) == len(result.rows)


def test_with_the_solutions_saved_every_part_is_the_readers_and_the_tokens_the_packages(workspace, tiny_loaded):
    saved = ws.save_solutions(SOLUTIONS)
    assert PARTS <= set(saved)
    result = ws.capstone(tiny_loaded, quiet=True)
    assert set(result.report.yours()) >= PARTS, result.report
    assert result.ok, result.problems
    # Every part of the reader's served calls (measured, not assumed): the steps are the reader's,
    # one per round of the three runs, and the Orca workload's rounds are the reader's orca_round's.
    written = json.loads((workspace / "capstone.json").read_text())
    assert set(written["served"]) >= PARTS and all(written["calls"][name] > 0 for name in PARTS), written["calls"]
    package_rounds = {name: len(_engine_run(ws.build_engine(tiny_loaded, preset=preset, chapter=0)[0], preset)[1])
                      for name, preset in workloads().items()}
    assert written["calls"]["engine_step"] == sum(package_rounds.values())
    assert written["calls"]["orca_round"] == package_rounds["s0/s1/s2, Orca"]
    assert f"your engine_step ran {written['calls']['engine_step']} steps" in written["said"]


def test_a_wrong_part_is_caught_and_named(workspace, tiny_loaded, capsys):
    ws.save("sampler", "from tinyserve.sampler import Sampler as _S\n\n"
                       "class Sampler(_S):\n"
                       "    def __call__(self, logits, requests):\n"
                       "        return [[7] * r.num_samples for r in requests]\n")
    result = ws.capstone(tiny_loaded)
    out = capsys.readouterr().out
    assert not result.ok and result.report.yours() == ["sampler"]
    assert not any(r.same for r in result.rows) and "✗" in out and "package's:" in out
