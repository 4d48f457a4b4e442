"""No paragraph of prose renders twice: once as a code cell's source and again as its output.

A chapter's prose belongs in markdown cells. Prose built from measured numbers is the exception:
it is displayed by a code cell (``display(Markdown(f"..."))``), and then the reader would see the
sentence twice, once as an f-string in the code and once rendered under it. Such a cell keeps its
source hidden (``"jupyter": {"source_hidden": true}`` in its metadata, which JupyterLab honours,
and the tag ``hide-input``), and holds the prose with no more code than it takes to word it: the
runs, tables and figures it reports on stay in visible cells above it.

The check: for each code cell whose source shows, every prose paragraph of its outputs (Markdown
it displays, or text it prints: a dozen words or more, mostly words, with a sentence in it) is
compared with the string literals of the cell's source, word by word. A paragraph that the
literals spell out for the most part (the numbers filled in between do not count) renders twice.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))

MIN_WORDS = 12  # a sentence or more, as tests/test_prose.py counts a paragraph
SHINGLE = 3  # words in a row that must appear in the source's literals for a word to count as spelled out
SPELLED_OUT = 0.5  # the share of a paragraph's words that makes it a repeat of the source
HIDE_TAG = "hide-input"


def source_hidden(cell: dict) -> bool:
    return bool(cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"))


def literal_segments(source: str) -> list[str]:
    """The text of the source's string literals, split wherever a value is filled in (an
    f-string's ``{...}``) or one literal ends: words on either side of a split were never
    written next to each other."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return re.findall(r"(?s)\"(.*?)\"|'(.*?)'", source)
    inside_fstring: set[int] = set()
    segments: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and id(node) not in inside_fstring:
            inside_fstring.update(id(n) for n in ast.walk(node) if n is not node)
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    segments.append(part.value)
                else:
                    segments.append("")  # a filled-in value: a break
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstring:
            segments.append(node.value)
    return [s for s in segments if s.strip()]


def _shingles(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def source_shingles(source: str) -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for segment in literal_segments(source):
        found |= _shingles(segment.split())
    return found


def _is_prose(paragraph: str, printed: bool = False) -> bool:
    """A dozen words or more, mostly words, with a sentence in it. A printed line must end a
    sentence with a full stop: a result line ("k=1 ready in 0.6 s; k=2 ...") is no paragraph."""
    words = paragraph.split()
    wordy = sum(bool(re.fullmatch(r"[(\"'`*]*[A-Za-z][A-Za-z'’-]*[)\"'`*.,;:]*", w)) for w in words)
    sentence = r"[a-z)'\"`][.!?](\s|$)" if printed else r"[a-z)'\"`*][.:;!?](\s|$)"
    return len(words) >= MIN_WORDS and wordy >= 0.6 * len(words) and re.search(sentence, paragraph) is not None


def output_paragraphs(cell: dict) -> list[str]:
    """The prose paragraphs a code cell's outputs render: Markdown it displays, text it prints."""
    paragraphs = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "text/markdown" in data:
            text = re.sub(r"```.*?```", "", "".join(data["text/markdown"]), flags=re.S)
            paragraphs += [p for p in re.split(r"\n\s*\n", text)
                           if not p.lstrip().startswith("|") and _is_prose(p)]  # a table is no paragraph
        elif output.get("output_type") == "stream":
            # Printed results come one to a line; a printed paragraph is one long line.
            paragraphs += [line for line in "".join(output.get("text", "")).splitlines()
                           if _is_prose(line, printed=True)]
    return [" ".join(p.split()) for p in paragraphs]


def spelled_out(paragraph: str, shingles: set[tuple[str, ...]]) -> float:
    """The share of the paragraph's words that stand in a run of SHINGLE words found in the source."""
    words = paragraph.split()
    covered = [False] * len(words)
    for i in range(len(words) - SHINGLE + 1):
        if tuple(words[i:i + SHINGLE]) in shingles:
            covered[i:i + SHINGLE] = [True] * SHINGLE
    return sum(covered) / len(words)


def repeated_in_cell(cell: dict) -> list[str]:
    """The paragraphs a code cell renders both as source and as output."""
    if cell["cell_type"] != "code" or source_hidden(cell):
        return []
    shingles = source_shingles("".join(cell["source"]))
    return [p for p in output_paragraphs(cell) if spelled_out(p, shingles) >= SPELLED_OUT]


def prose_twice(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return [f"{path.stem} cell {i}: {para[:80]!r}..." for i, cell in enumerate(cells)
            for para in repeated_in_cell(cell)]


def hidden_cells_problems(path: Path) -> list[str]:
    """A hidden cell holds prose only: it is tagged for other frontends, and it displays Markdown."""
    problems = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code" or not source_hidden(cell):
            continue
        source = "".join(cell["source"])
        if HIDE_TAG not in cell["metadata"].get("tags", []):
            problems.append(f"{path.stem} cell {i}: a hidden cell without the tag {HIDE_TAG!r}")
        if "Markdown(" not in source:
            problems.append(f"{path.stem} cell {i}: a hidden cell that displays no Markdown hides code")
        if re.search(r"^\s*(print|show)\(|plt\.|figures\.save", source, flags=re.M):
            problems.append(f"{path.stem} cell {i}: a hidden cell does more than display prose")
    return problems


IDS = [p.stem for p in CHAPTERS]


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_prose_renders_twice(path: Path):
    problems = prose_twice(path)
    assert not problems, ("these code cells show prose as source and again as output; move the prose "
                          "into a hidden cell of its own (see this test's docstring):\n" + "\n".join(problems))


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_hidden_cells_hide_only_prose(path: Path):
    problems = hidden_cells_problems(path)
    assert not problems, "\n".join(problems)


def _code(source: str, outputs: list[dict], hidden: bool = False) -> dict:
    metadata = {"jupyter": {"source_hidden": True}, "tags": [HIDE_TAG]} if hidden else {}
    return {"cell_type": "code", "metadata": metadata, "source": source, "outputs": outputs}


def _markdown_output(text: str) -> dict:
    return {"output_type": "display_data", "data": {"text/markdown": text, "text/plain": "<Markdown>"}}


def test_the_check_catches_prose_in_code():
    # Prose with numbers filled in, displayed as Markdown or printed, is caught where it shows.
    source = ('n, m = 9, 7\ndisplay(Markdown(f"The same three requests take {n} rounds under the first '
              'policy and {m} under the second, because the second one never waits for a prefill."))')
    rendered = ("The same three requests take 9 rounds under the first policy and 7 under the second, "
                "because the second one never waits for a prefill.")
    assert repeated_in_cell(_code(source, [_markdown_output(rendered)]))
    printed = source.replace("display(Markdown(", "print(").replace('."))', '.")')
    assert repeated_in_cell(_code(printed, [{"output_type": "stream", "name": "stdout", "text": rendered + "\n"}]))
    # Hidden, it renders once.
    assert not repeated_in_cell(_code(source, [_markdown_output(rendered)], hidden=True))
    # Prose the code does not spell out (a package function's), and a printed table, are not repeats.
    assert not repeated_in_cell(_code("display(Markdown(explain(cell)))", [_markdown_output(rendered)]))
    table = "budget 56.93 GiB / 8 MiB per block = 7286 blocks (by hand), and more numbers: 1 2 3 4 5 6"
    assert not repeated_in_cell(_code('print(f"budget {b:.2f} GiB / {m} MiB per block = {n} blocks (by hand)")',
                                      [{"output_type": "stream", "name": "stdout", "text": table}]))
