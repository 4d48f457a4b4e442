"""The structured-output benchmark's measurements on the tiny model: no timing is asserted, only what
is measured.

- Every constrained output validates against the schema (checked here with jsonschema, not with the
  benchmark's own count), while the same requests unconstrained do not: the mask did the work.
- Both sides generate the same tokens per request (the unconstrained runs are forced to the
  constrained lengths), the constrained runs stop at the grammar's end, and the step counts are
  what those lengths imply; the runs alternate which side goes first.
- The grammar's parts are timed only where a grammar runs (zero on the unconstrained side).
- The CSV has one ``step`` row per batch and one ``once`` row per one-time cost, with the columns
  the README's table reads, and the Markdown's table and reading carry the CSV's numbers.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import jsonschema
import pytest
from bench_loader import load_benchmark

BATCH, REPEATS = 2, 2




so = load_benchmark("structured_output")


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("structured")
    got = so.main(["--quick", "--model", str(tiny_model_dir), "--batches", str(BATCH), "--repeats", str(REPEATS),
                   "--out", str(out)])
    return got, out


def _validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), so.SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_constrained_outputs_validate_and_unconstrained_ones_make_the_same_number_of_tokens(result):
    got, _ = result
    runs = got["runs"][BATCH]
    # The pilot, then constrained first in repeat 1 and unconstrained first in repeat 2.
    assert [r.guided for r in runs] == [True, True, False, False, True]
    lengths = runs[0].lengths
    assert len(lengths) == BATCH and all(n > 1 for n in lengths)
    for r in runs:
        assert r.lengths == lengths and r.errors == [None] * BATCH
        if r.guided:
            assert all(_validates(t) for t in r.texts), r.texts
            assert r.finish_reasons == ["stop"] * BATCH  # the grammar's end, not the token limit
        else:
            assert r.finish_reasons == ["length"] * BATCH
    # Without the mask the tiny random model writes no such document.
    assert not any(_validates(t) for r in runs if not r.guided for t in r.texts)


def test_step_counts_and_grammar_parts_are_what_the_runs_did(result):
    got, _ = result
    row = got["steps"][0]
    lengths = got["runs"][BATCH][0].lengths
    assert row["output_tokens"] == sum(lengths)
    assert row["decode_tokens"] == sum(lengths) - BATCH  # each request's first token comes from its prefill
    assert row["decode_steps"] == max(lengths) - 1
    assert row["valid"] == row["constrained_outputs"] == BATCH * (1 + REPEATS)
    assert row["same_lengths"] is True
    for r in got["runs"][BATCH]:
        steps = r.decode_steps()
        assert len(steps) == max(lengths) - 1 and len(r.steps) == max(lengths)  # one prefill step first
        for s in steps:
            assert s["total"] >= s["model"] > 0
            if r.guided:
                assert s["fill"] > 0 and s["apply"] > 0 and s["sync"] > 0
            else:
                assert s["fill"] == s["apply"] == s["sync"] == 0
    parts = row["sync_ms"] + row["fill_ms"] + row["apply_ms"]
    assert row["mask_ms"] == pytest.approx(parts, abs=1e-3)
    assert row["mask_pct"] == pytest.approx(100 * row["mask_ms"] / row["guided_step_ms"], abs=0.05)


def test_csv_and_markdown_carry_the_measurement(result):
    got, out = result
    with open(out / "structured_output.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["kind"] == "step"]
    once = {r["name"]: float(r["ms"]) for r in rows if r["kind"] == "once"}
    assert [int(r["batch"]) for r in steps] == [BATCH]
    assert set(so.STEP_COLUMNS) <= set(steps[0])
    assert set(once) == {"import_llguidance", "tokenizer_build", "warm_first_mask", "first_apply",
                         "compile_per_request", "matcher_per_request"}
    assert all(v >= 0 for v in once.values())
    assert float(steps[0]["mask_ms"]) == got["steps"][0]["mask_ms"]
    md = (out / "structured_output.md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith(f"| {BATCH} |")]
    assert len(table_rows) == 1 and f"{got['steps'][0]['guided_step_ms']:.1f}" in table_rows[0]
    assert f"at B={BATCH} the grammar costs {got['steps'][0]['mask_ms']:.2f} ms per decode step" in md
    assert f"{BATCH * (1 + REPEATS)} of {BATCH * (1 + REPEATS)} constrained outputs validate" in md
