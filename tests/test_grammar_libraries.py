"""The grammar-library benchmark's measurements on the tiny tokenizer: no timing is asserted, only
what is measured.

- llguidance (a tinyserve requirement) drives a valid document of every grammar token by token: every
  token allowed, the end allowed once the document is complete, a breaking token masked, at batch 1
  and batch 16; xgrammar and outlines-core the same where installed (they are extra installs).
- The mask each library writes for the choice and the date-regex grammars, against an independent
  reference (the tokens whose bytes keep the text a prefix of a string of the language): equal at the
  start, and never more than it, always holding the document's next token, at every later step.
- The CSV has one row per library and grammar with the expected columns, a library that is not
  installed is a row saying so, and the choice paragraph follows the numbers of made-up rows.
"""

from __future__ import annotations

import csv

import pytest
from bench_loader import load_benchmark

from tinyserve.models.tiny import make_tiny_tokenizer

gl = load_benchmark("grammar_libraries")
# Only llguidance is a requirement; the others are skipped where not installed.
IMPORTS = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}
# outlines-core compiles {"type": "object"} into a regex for seconds even on a 400-token vocabulary.
GRAMMARS = {"llguidance": gl.GRAMMARS, "xgrammar": gl.GRAMMARS,
            "outlines-core": {k: v for k, v in gl.GRAMMARS.items() if k != "json_object"}}


def _require(name: str) -> None:
    if name != "llguidance":
        pytest.importorskip(IMPORTS[name])


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def llguidance_result(tokenizer):
    return gl.measure_library("llguidance", tokenizer, "default slices", repeats=1)


@pytest.mark.parametrize("name", list(IMPORTS))
def test_every_token_of_a_valid_document_is_allowed(name, tokenizer, llguidance_result):
    _require(name)
    res = llguidance_result if name == "llguidance" else gl.measure_library(name, tokenizer, repeats=1,
                                                                             grammars=GRAMMARS[name])
    assert [r["grammar"] for r in res["rows"]] == list(GRAMMARS[name])
    for r in res["rows"]:
        assert r["error"] == "", r
        assert r["tokens"] == len(tokenizer.encode(gl.GRAMMARS[r["grammar"]][2], add_special_tokens=False))
        assert r["allowed"] == r["tokens"] and r["eos_allowed"], r
        assert r["violation_masked"] and r["batch_all_allowed"], r
        assert r["torch_apply_matches"], r  # the plain-torch apply writes the library's -inf too
    assert res["first_fill_ms"] > 0 and res["prepare_s"] > 0


def _date_language() -> tuple[set[bytes], set[bytes]]:
    """Every string of DATE_REGEX (it is finite) and every prefix of one."""
    full = {f"{y}-{m:02d}-{d:02d}".encode() for y in range(1900, 2100) for m in range(1, 13) for d in range(1, 32)}
    return full, {s[:i] for s in full for i in range(len(s) + 1)}


@pytest.mark.parametrize("name", list(IMPORTS))
@pytest.mark.parametrize("grammar", ["choice_5", "regex_date"])
def test_mask_equals_the_prefixes_of_the_language(name, grammar, tokenizer):
    _require(name)
    if grammar == "choice_5":
        full = {c.encode() for c in gl.CHOICES}
        prefixes = {c[:i] for c in full for i in range(len(c) + 1)}
    else:
        full, prefixes = _date_language()
    lib = gl.BACKENDS[name](tokenizer, "default slices" if name == "llguidance" else "")
    kind, spec, doc = gl.GRAMMARS[grammar]
    m = lib.matcher(lib.compile(kind, spec))
    bm = lib.alloc(1)
    pieces = gl.token_bytes(tokenizer)
    done = b""
    for tid in tokenizer.encode(doc, add_special_tokens=False) + [None]:
        lib.fill([m], bm)
        expected = {t for t, b in enumerate(pieces) if b and done + b in prefixes}
        if done in full:
            expected.add(tokenizer.eos_token_id)
        allowed = gl.allowed_ids(bm[0], len(tokenizer))
        if done:
            # Nothing outside the language; where the rest is forced ("ye" -> "llow") a library may keep only
            # the tokenizer's own spelling of it (llguidance allows "ll" there, not "l").
            assert allowed <= expected and (tid if tid is not None else tokenizer.eos_token_id) in allowed, done
        else:  # at the start the choices branch: exactly the tokens that begin a string of the language
            assert allowed == expected
        if tid is not None:
            assert lib.consume(m, tid)
            done += pieces[tid]
    assert done == doc.encode()


def test_csv_has_a_row_per_library_and_grammar(tmp_path, llguidance_result):
    info = gl.install_info("llguidance")
    assert info["installed"] and info["binary_wheel_here"]
    assert info["requires"] == "" and info["deps_mb"] == 0  # llguidance has no Requires-Dist
    assert gl.install_info("no-such-grammar-library") == dict(installed=False)
    results = [dict(info, **llguidance_result), dict(library="xgrammar", variant="", error="not installed")]
    rows = gl.flatten(results)
    path = gl.write_csv(rows, tmp_path / "grammar_libraries.csv")
    with open(path) as f:
        reader = csv.DictReader(f)
        read = list(reader)
    assert reader.fieldnames == gl.COLUMNS
    assert [(r["library"], r["grammar"]) for r in read] == [("llguidance", g) for g in gl.GRAMMARS] + [("xgrammar", "")]
    assert read[-1]["error"] == "not installed"
    assert all(r["allowed"] == r["tokens"] and r["violation_masked"] == "True" for r in read[:-1])
    md = gl.markdown(rows, {"torch_apply1_med_us": 1.0, f"torch_apply{gl.BATCH}_med_us": 2.0}, "# t")
    assert "| xgrammar | not installed |" in md and "So tinyserve uses llguidance" in md


def _row(library, grammar, mask, b16, compile_ms, heavy="", beyond=0.0):
    return dict(library=library, variant="", grammar=grammar, tokens=3, allowed=3, error="", eos_allowed=True,
                batch_all_allowed=True, violation_masked=True, fill_med_us=mask, step_med_us=mask + 100,
                b16_fill_med_us=b16, b16_fill_loop_med_us=b16 + 1, b16_step_med_us=b16 + 1000,
                compile_ms=compile_ms, heavy_deps=heavy, requires="torch" if heavy else "",
                beyond_tinyserve_mb=beyond, beyond_tinyserve=f"x {beyond:.0f} MB" if beyond else "",
                binary_wheel_here=True)


def test_choice_follows_the_numbers():
    # a: slow mask, fast compile; b: fast mask, slow compile; c: fastest of all but a heavy addition.
    rows = [_row("a", "g1", 40, 320, 1.0), _row("a", "g2", 60, 480, 3.0),
            _row("b", "g1", 10, 80, 100.0), _row("b", "g2", 10, 80, 300.0),
            _row("c", "g1", 5, 16, 0.5, "torch 700 MB", 900.0), _row("c", "g2", 5, 16, 0.5, "torch 700 MB", 900.0)]
    text = gl.choice(rows)
    assert "Cheapest mask for one row: c, 5 µs (then b 10, a 50)" in text
    assert f"for a batch of {gl.BATCH}: c, 16 µs (then b 80, a 400)" in text
    assert "Fastest to compile (median over the grammars): c, 0.5 ms (then a 2.0, b 200.0)" in text
    assert "slowest compile of each: c 0.5 ms, a 3.0 ms, b 300.0 ms" in text
    assert "c needs torch 700 MB (beyond tinyserve's requirements: x 900 MB)" in text
    # 256 tokens at batch 16: a 2.0 + 16 * 0.4 = 8.4 ms, b 200 + 16 * 0.08 = 201.3 ms, c 0.5 + 0.256 = 0.8 ms
    assert "costs c, 0.8 ms (then a 8.4, b 201.3)" in text
    assert "So tinyserve uses a: " in text and "(none at all; a binary wheel for this CPU)" in text
    assert f"c computes the mask for {gl.BATCH} rows in 16 µs against 400, but needs torch 700 MB." in text
    rows[1]["allowed"] = 2  # a library that rejects a valid token is not picked
    text = gl.choice(rows)
    assert "Failed a grammar or a check: a." in text and "So tinyserve uses b" in text
    assert f"c computes the mask for {gl.BATCH} rows in 16 µs against 80, but needs torch 700 MB." in text
