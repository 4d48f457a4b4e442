"""The book's solutions are shown as its listings are: highlighted, with their file's line numbers.

A chapter's "Solutions" section shows a solution (``chapters/solutions/chNN.py``) beside the
package's listing of the same component, with ``viz.source.show_solution``, never printed as
monochrome text. These tests check the renderer on a file written for the purpose, that no chapter
prints a solution's source, and that every committed solution listing is what rendering it now
gives (a failure after editing a solution means: run ``make book``).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tinyserve.viz.source import SOLUTION_KEY, SolutionView, SourceView, show_solution

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
IDS = [p.stem for p in CHAPTERS]

# Ways a chapter once printed a solution's source as plain text.
PRINTED = re.compile(r"print\(\s*(definition_source|ast\.get_source_segment)\(|solution_listing\(")
SOLUTION = '''"""A solutions file."""

import functools


def helper():
    return 1


@functools.cache
def answer(x):
    # the reader's answer, with a comment
    return x + helper()  # and a string: "two"
'''


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def test_a_solution_renders_like_a_listing(tmp_path: Path):
    path = tmp_path / "chXX.py"
    path.write_text(SOLUTION)
    view = SolutionView(str(path), "answer")
    assert (view.first_line, view.last_line) == (10, 13)  # the decorator's line to the last line
    assert view.code.splitlines()[0] == "@functools.cache" and "# the reader's answer" in view.code
    page = view._repr_html_()
    # Highlighted as show() highlights: pygments' inline styles, the file's line numbers.
    assert page.count("<span style=\"color:") > 5 and "font-weight: bold" in page
    numbers = re.findall(r"user-select:none'>\s*(\d+) </span>", page)
    assert numbers == ["10", "11", "12", "13"]
    assert f"{path}:10-13" in page and "<b>answer</b>" in page
    data, metadata = view._repr_mimebundle_()
    assert metadata == {SOLUTION_KEY: {"path": str(path), "name": "answer"}}
    assert data["text/plain"].splitlines()[1:] == SOLUTION.splitlines()[9:13]
    # Outside IPython, show_solution returns the view without displaying anything.
    assert show_solution(str(path), "helper").code == "def helper():\n    return 1\n"
    with pytest.raises(ValueError, match="chXX.py defines no top-level class or function 'missing'"):
        SolutionView(str(path), "missing")


def test_the_html_matches_a_package_listing():
    # The same renderer: a package function and a solution share the frame, fonts and colours.
    solution = SolutionView(str(ROOT / "chapters" / "solutions" / "ch02.py"), "FreeListAllocator")._repr_html_()
    listing = SourceView(SolutionView.__init__)._repr_html_()
    frame = r"<div style='font-size:85%'><!-- [^>]*--><b>[^<]*</b> <span style='color:#888'>"
    assert re.match(frame, solution) and re.match(frame, listing)
    assert "<pre style='line-height:125%;margin:0.3em 0'>" in solution


def solution_outputs(nb) -> list[tuple[int, dict]]:
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.get("outputs", [])
            if SOLUTION_KEY in o.get("metadata", {})]


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_solution_is_printed_as_text(path: Path):
    nb = nbformat.read(path, as_version=4)
    printed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and PRINTED.search(c.source)]
    assert not printed, f"{path.name} cells {printed} print a solution's source; use show_solution"
    calls = sum(len(re.findall(r"\bshow_solution\(", c.source)) for c in nb.cells if c.cell_type == "code")
    assert len(solution_outputs(nb)) == calls, f"{path.name}: a show_solution call without its output (make book)"


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_committed_solution_listings_are_fresh(path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(path.parent)  # the paths are the notebook's, relative to chapters/
    for i, output in solution_outputs(nbformat.read(path, as_version=4)):
        data, _ = SolutionView(**output["metadata"][SOLUTION_KEY])._repr_mimebundle_()
        for mime in ("text/html", "text/plain"):
            assert _text(output["data"][mime]) == data[mime], f"{path.name} cell {i}: stale {mime} (make book)"


def test_the_chapters_show_solutions():
    # The five chapters whose Solutions section lists a written-out component, at least.
    shown = {p.stem[:2] for p in CHAPTERS if solution_outputs(nbformat.read(p, as_version=4))}
    assert {"02", "03", "04", "05", "13"} <= shown
