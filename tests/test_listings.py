"""The book's listings: well-formed chapter markers, folding at each chapter's stage, and fresh
committed outputs.

``tinyserve.viz.show`` renders package source with later chapters' marked blocks folded to one
line. These tests check the markers in every package file, the renderer on a module written for
the purpose, and every chapter: each ``show(...)`` call of its code cells is evaluated again
(with the names the chapter imports) and compared with the listing committed in the notebook, and
no listing shows an identifier of a later chapter's feature outside a fold line. A failure of the
freshness test after a code change means: run ``make book``.
"""

from __future__ import annotations

import ast
import functools
import html
import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tinyserve.viz import source
from tinyserve.viz.markers import parse_file, parse_markers
from tinyserve.viz.source import METADATA_KEY, SourceView, set_chapter, show

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
IDS = [p.stem for p in CHAPTERS]

# Identifiers of a chapter's feature, which no listing of an earlier chapter may show outside a
# fold line. Chapters 02-05 are held to the broad pattern of issue 14 (their code predates every
# form of caching and chunking); later chapters use "cache" and "chunk" in other senses (the KV
# cache, sub-batches), so they are held to the features' own identifiers.
LATER_FEATURES = {
    8: r"\btriton\b",  # the Triton kernels
    10: r"tensor_parallel|TensorParallel|\btp_(rank|size)\b|world_size|all_reduce",
    11: r"_decode_chunks|GATHER_BUDGET",  # the memory-bounded decode of chapter 11
    12: r"prefix_cach|enable_prefix|block_hash|has_prefix|num_cached_tokens|chunked_prefill|enable_chunked",
}
EARLY_STAGE = r"prefix|block_hash|\bcomputed\b|cached|chunked"


def forbidden(chapter: int) -> re.Pattern | None:
    patterns = [p for introduced, p in LATER_FEATURES.items() if introduced > chapter]
    if 2 <= chapter <= 5:
        patterns.append(EARLY_STAGE)
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


# A listing's first plain-text line (also the old format without the line range and stage).
HEADER = re.compile(r"# [\w.<>]+  \(\S+:\d+(-\d+)?(, [^)]*)?\)")
FOLD = re.compile(rf"\s*# {source.FOLD_MARK} (chapter \d+: )?.+ \(\d+ lines?\)")


# -- reading notebooks ------------------------------------------------------------------------

def chapter_number(path: Path) -> int:
    return int(path.name[:2])


def cell_tree(src: str, where: str) -> ast.Module:
    # IPython magics and shell escapes are not Python; they never hold a show() call.
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError as e:
        pytest.fail(f"{where}: cannot parse: {e}")


def code_cells(nb) -> list[tuple[int, nbformat.NotebookNode]]:
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def show_calls(tree: ast.Module) -> list[ast.Call]:
    calls = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "show"]
    return sorted(calls, key=lambda n: (n.lineno, n.col_offset))


def text(data: dict, mime: str) -> str:
    value = data.get(mime, "")
    return "".join(value) if isinstance(value, list) else value


def is_listing(output) -> bool:
    if METADATA_KEY in output.get("metadata", {}):
        return True
    first = text(output.get("data", {}), "text/plain").split("\n", 1)[0]
    return bool(HEADER.fullmatch(first))


def listing_outputs(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.get("output_type") in ("display_data", "execute_result")
            and is_listing(o)]


def html_text(fragment: str) -> str:
    """What an HTML listing reads as: tags and comments gone, entities decoded."""
    return html.unescape(re.sub(r"<[^>]*>", "", re.sub(r"<!--.*?-->", "", fragment, flags=re.S)))


@functools.cache
def load(path: Path):
    return nbformat.read(path, as_version=4)


@functools.cache
def fresh_listings(path: Path) -> dict[int, list]:
    """Every show() call of the chapter rendered now, by cell: a SourceView, or the error text
    when the call cannot be rendered from the chapter's imports."""
    nb = load(path)
    chapter = chapter_number(path)
    trees = {i: cell_tree(c.source, f"{path.name} cell {i}") for i, c in code_cells(nb)}
    namespace: dict = {}
    for i, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), f"{path.name} cell {i}", "exec"), namespace)
    out: dict[int, list] = {}
    for i, tree in trees.items():
        views = []
        for call in show_calls(tree):
            expr = ast.unparse(call)
            try:
                args = [eval(compile(ast.Expression(a), expr, "eval"), namespace) for a in call.args]
                kwargs = {k.arg: eval(compile(ast.Expression(k.value), expr, "eval"), namespace)
                          for k in call.keywords}
            except Exception as e:  # any failure of the call is reported as a problem of it
                views.append(f"cell {i}: {expr}: {type(e).__name__}: {e} (a listing must name an "
                             "object that the chapter imports)")
                continue
            kwargs.setdefault("chapter", chapter)
            try:
                views.append(SourceView(*args, **kwargs))
            except (ValueError, TypeError, OSError) as e:
                views.append(f"cell {i}: {expr}: {type(e).__name__}: {e}")
        if views:
            out[i] = views
    return out


def freshness_problems(path: Path) -> list[str]:
    """How the committed listings of a chapter differ from rendering its show() calls now."""
    nb = load(path)
    fresh = fresh_listings(path)
    problems = []
    for i, cell in code_cells(nb):
        want, got = fresh.get(i, []), listing_outputs(cell)
        if len(want) != len(got):
            problems.append(f"cell {i}: {len(want)} show() call(s) but {len(got)} committed listing(s)")
            continue
        for view, out in zip(want, got):
            if isinstance(view, str):
                problems.append(view)
                continue
            data, metadata = view._repr_mimebundle_()
            committed = text(out["data"], "text/plain")
            committed_id = out.get("metadata", {}).get(METADATA_KEY)
            if committed_id is None:
                problems.append(f"cell {i}: the committed listing of {view.name} has no id (an older show())")
            elif committed_id != metadata[METADATA_KEY]:
                problems.append(f"cell {i}: the committed listing is of {committed_id}, the call now shows "
                                f"{metadata[METADATA_KEY]}")
            elif committed != data["text/plain"]:
                old, new = committed.splitlines(), data["text/plain"].splitlines()
                k = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
                problems.append(f"cell {i}: {view.name} differs at line {k + 1}: committed "
                                f"{old[k] if k < len(old) else '<end>'!r}, now {new[k] if k < len(new) else '<end>'!r}")
            elif html_text(text(out["data"], "text/html")) != html_text(data["text/html"]):
                problems.append(f"cell {i}: {view.name}: the committed HTML reads differently from a fresh render")
    return problems


def stage_problems(chapter: int, listings: list[tuple[str, str]]) -> list[str]:
    """The lines of a chapter's plain-text listings, given as (where, text) pairs, that show an
    identifier of a later chapter's feature outside a fold line (the header line is not code)."""
    pattern = forbidden(chapter)
    problems = []
    for where, listing in listings:
        for n, line in enumerate(listing.splitlines()[1:], 2):
            if pattern is not None and not FOLD.fullmatch(line) and pattern.search(line):
                problems.append(f"{where}, line {n}: {line.strip()}")
    return problems


# -- the markers in the package ---------------------------------------------------------------

PACKAGE_FILES = sorted((ROOT / "tinyserve").rglob("*.py"))


def test_every_package_file_has_well_formed_markers():
    errors, blocks = [], 0
    for path in PACKAGE_FILES:
        try:
            found = parse_file(path)
        except ValueError as e:
            errors.append(str(e))
            continue
        blocks += len(found)
        errors += [f"{path}:{b.open_line}: chapter {b.chapter} is not a chapter of the book"
                   for b in found if b.chapter > max(chapter_number(p) for p in CHAPTERS)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("src, message", [
    ("x = 1\n# >>> chapter 12: prefix caching\ny = 2\n", "never closed"),
    ("# >>> chapter 12: a\nx = 1\n# >>> chapter 12: b\ny = 2\n# <<<\n", "do not nest"),
    ("x = 1\n# <<<\n", "closes no open block"),
    ("# >>> chapter 12 prefix caching\nx = 1\n# <<<\n", "malformed"),
    ("# >>> chapter 7: paging\nx = 1\n# <<<\n", "malformed"),  # two digits, as agreed
    ("# >>> chapter 12: a\nx = 1\n# <<< chapter 12\n", "malformed"),
    ("x = 1  # >>> chapter 12: a\ny = 2\n# <<<\n", "whole-line"),
    ("# >>> chapter 12: a\n# <<<\n", "empty"),
])
def test_markers_are_strict(src, message):
    with pytest.raises(ValueError, match=message):
        parse_markers(src.splitlines(keepends=True), "m.py")


def test_markers_in_strings_are_not_markers():
    src = 's = """\n# >>> chapter 12: not a marker\n"""\n'
    assert parse_markers(src.splitlines(keepends=True), "m.py") == []


# -- the renderer, on a module written for it -------------------------------------------------

DEMO = '''\
"""A module for the listing tests."""


class Manager:
    def allocate(self, n):
        """Take n blocks."""
        blocks = []
        # >>> chapter 12: prefix caching
        if self.prefix_cache:
            blocks = self.prefix_cache.lookup(n)
        # <<<
        for _ in range(n - len(blocks)):
            # >>> chapter 03: watermark
            self.check_watermark()
            # <<<
            blocks.append(self.take())
        return blocks


# >>> chapter 10: tensor parallelism
def shard(x):
    return x
# <<<


def straddles():
    # >>> chapter 11: half in
    return 1
# <<<
'''


@pytest.fixture
def demo(tmp_path, monkeypatch):
    path = tmp_path / "listing_demo.py"
    path.write_text(DEMO)
    spec = importlib.util.spec_from_file_location("listing_demo", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "listing_demo", module)
    spec.loader.exec_module(module)
    return module


def test_show_folds_later_chapters_and_opens_earlier_ones(demo):
    code = show(demo.Manager.allocate, chapter=5).code
    assert code == ('def allocate(self, n):\n'
                    '    """Take n blocks."""\n'
                    '    blocks = []\n'
                    '    # ⋯ chapter 12: prefix caching (2 lines)\n'
                    '    for _ in range(n - len(blocks)):\n'
                    '        self.check_watermark()\n'
                    '        blocks.append(self.take())\n'
                    '    return blocks\n')
    early = show(demo.Manager.allocate, chapter=2).code
    assert "        # ⋯ chapter 3: watermark (1 line)\n" in early and "check_watermark" not in early
    for chapter in (12, None):  # at its own chapter, and in the finished package
        full = show(demo.Manager.allocate, chapter=chapter).code
        assert "self.prefix_cache.lookup(n)" in full and "check_watermark" in full
        assert ">>>" not in full and "<<<" not in full and source.FOLD_MARK not in full


def test_a_whole_module_folds_a_later_function(demo):
    code = show(demo, chapter=9).code
    assert "# ⋯ chapter 10: tensor parallelism (2 lines)\n" in code and "def shard" not in code


def test_an_object_of_a_later_chapter_cannot_be_shown_earlier(demo):
    with pytest.raises(ValueError, match="belongs to chapter 10"):
        show(demo.shard, chapter=9)
    assert "def shard(x)" in show(demo.shard, chapter=10).code
    with pytest.raises(ValueError, match="straddles"):
        show(demo.straddles, chapter=12)


def test_line_numbers_are_the_files_own(demo):
    file_lines = DEMO.splitlines()
    view = show(demo.Manager.allocate, chapter=5)
    assert view.header().startswith("# listing_demo.Manager.allocate  (listing_demo.py:5-17, at chapter 5)")
    rows = html_text(view._repr_html_()).split("\n")
    rows[0] = rows[0].split("at chapter 5", 1)[1]  # the title line runs into the first row
    assert len(rows) == len(view.rows)
    for row, (lineno, line, fold) in zip(rows, view.rows):
        number, rendered = row[:2], row[3:]
        assert int(number) == lineno and rendered == line
        if fold:
            assert file_lines[lineno - 1].strip() == "# >>> chapter 12: prefix caching"
        else:
            assert file_lines[lineno - 1][4:] == line  # the method's own indentation removed
    assert [n for n, _, _ in view.rows] == [5, 6, 7, 8, 12, 14, 16, 17]


def test_the_chapter_comes_from_set_chapter(demo, monkeypatch):
    monkeypatch.setattr(source, "_chapter", None)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert show(demo.Manager.allocate).chapter is None
    set_chapter(2)
    view = show(demo.Manager.allocate)
    assert view.chapter == 2 and "chapter 3: watermark" in view.code
    assert show(demo.Manager.allocate, chapter=12).chapter == 12  # an explicit chapter wins
    set_chapter(None)
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/reader/tinyserve/chapters/05_vllm_scheduler.ipynb")
    assert show(demo.Manager.allocate).chapter == 5
    for bad in (-1, 2.0, "3", True):
        with pytest.raises(ValueError, match="chapter"):
            set_chapter(bad)
        with pytest.raises(ValueError, match="chapter"):
            show(demo.Manager.allocate, chapter=bad)


def test_a_listing_renders_again_from_its_id(demo):
    view = show(demo.Manager.allocate, chapter=5)
    data, metadata = view._repr_mimebundle_()
    again = SourceView.from_id(metadata[METADATA_KEY])
    assert repr(again) == data["text/plain"] and again._repr_html_() == data["text/html"]
    assert HEADER.fullmatch(data["text/plain"].split("\n", 1)[0])


def test_every_show_in_a_cell_is_displayed_once(demo, tmp_path):
    """Run in a real kernel: several show() calls in one cell each appear, the cell's last
    expression is not shown twice, and a view shown again in a later cell appears again."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import listing_demo\nfrom tinyserve.viz.source import set_chapter, show\n"
                                  "set_chapter(5)"),
        nbformat.v4.new_code_cell("show(listing_demo.Manager.allocate)\nshow(listing_demo.shard, chapter=10)\n"
                                  "print('between')\nv = show(listing_demo)\nv"),
        nbformat.v4.new_code_cell("v"),
    ])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outs = nb.cells[1].outputs
    assert [o.output_type for o in outs] == ["display_data", "display_data", "stream", "display_data"]
    ids = [o.metadata[METADATA_KEY] for o in listing_outputs(nb.cells[1])]
    assert ids == [{"module": "listing_demo", "qualname": "Manager.allocate", "chapter": 5},
                   {"module": "listing_demo", "qualname": "shard", "chapter": 10},
                   {"module": "listing_demo", "qualname": "", "chapter": 5}]
    assert "# ⋯ chapter 12: prefix caching (2 lines)" in outs[0].data["text/plain"]
    assert len(listing_outputs(nb.cells[2])) == 1


# -- the chapters -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_chapter_sets_its_chapter_first(path):
    nb = load(path)
    first = code_cells(nb)[0][1]
    calls = [n for n in ast.walk(cell_tree(first.source, path.name))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "set_chapter"]
    assert [ast.literal_eval(c.args[0]) for c in calls] == [chapter_number(path)], \
        f"{path.name}: the first code cell must call set_chapter({chapter_number(path)})"


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_listings_render_at_the_chapters_stage(path):
    """The package's code as this chapter shows it, rendered now (no need for ``make book``)."""
    listings = [(f"cell {i}: {v.name}", repr(v)) for i, views in fresh_listings(path).items()
                for v in views if not isinstance(v, str)]
    problems = stage_problems(chapter_number(path), listings)
    assert not problems, (f"{path.name} shows later chapters' code; mark it in the package "
                          "(# >>> chapter NN: feature ... # <<<):\n" + "\n".join(problems))


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_committed_listings_show_only_the_chapters_stage(path):
    listings = [(f"cell {i}", text(o["data"], "text/plain"))
                for i, cell in code_cells(load(path)) for o in listing_outputs(cell)]
    problems = stage_problems(chapter_number(path), listings)
    assert not problems, f"{path.name} has committed listings with later chapters' code:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_committed_listings_are_fresh(path):
    problems = freshness_problems(path)
    assert not problems, (f"{path.name}'s committed listings are out of date (run `make book`):\n"
                          + "\n".join(problems))


# -- listings read as the chapter (issue 22 §4) --------------------------------------------------

# What a line of a chapter 02-10 listing may not do outside a fold line: the chapter's algorithm
# reads without validation (checked at the boundary), compat rules (in their subclasses), hooks
# (seams in constructors) and safety nets (in functions of their own), or with them folded.
LISTING_RULES = {
    "raises an exception": re.compile(r"^\s*raise\b"),
    "branches on compat": re.compile(r"\b(if|elif|while)\b.*\bcompat\b|\bcompat\b.*\bif\b.*\belse\b"),
    "calls a hook": re.compile(r"\bself\.can_admit\s*\("
                               r"|\b(callback|cb)\s*\(self\b|\bself\._callbacks\b"),
    "calls a safety net": re.compile(r"\b_(resolve_stuck_round|stand_in|unschedule|give_up)\s*\("),
}
RULED_CHAPTERS = [p for p in CHAPTERS if 2 <= chapter_number(p) <= 10]


def rule_problems(where: str, view: SourceView) -> list[str]:
    """The unfolded lines of a listing (its rows: line number, text, folded) that break a rule."""
    problems = []
    for n, line, folded in view.rows:
        if folded or line.lstrip().startswith("#"):
            continue
        for rule, pattern in LISTING_RULES.items():
            if pattern.search(line.split("  #", 1)[0]):
                problems.append(f"{where}, {view._where_file()}:{n} {rule}: {line.strip()}")
    return problems


FOLDED_DEMO = '''\
def admit(self, group):
    # >>> fold: validation
    if group.n < 1:
        raise ValueError("n must be at least 1")
    # <<<
    # >>> chapter 05: vLLM v0.4 compat
    if self.compat == "vllm-0.4":
        self.sort()
    # <<<
    # >>> fold: the can_admit hook
    if self.can_admit is not None and not self.can_admit(group, self.budget, self.manager):
        return False
    # <<<
    self.waiting.remove(group)
    self._resolve_stuck_round(group)
    return True
'''


def test_the_listing_rule_finds_each_kind_of_line_and_folds_hide_them(tmp_path, monkeypatch):
    path = tmp_path / "folded_demo.py"
    path.write_text(FOLDED_DEMO)
    spec = importlib.util.spec_from_file_location("folded_demo", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "folded_demo", module)
    spec.loader.exec_module(module)
    at_4, at_5, whole = (SourceView(module.admit, chapter=c) for c in (4, 5, None))
    # Fold blocks fold in every chapter, with the line the issue asks for; chapter blocks open at their chapter.
    assert "    # ⋯ validation (2 lines)" in at_4.code and "    # ⋯ the can_admit hook (2 lines)" in at_4.code
    assert "# ⋯ chapter 5: vLLM v0.4 compat (2 lines)" in at_4.code and "sort()" in at_5.code
    assert [p.split(" ", 2)[2] for p in rule_problems("demo", at_4)] == ["calls a safety net: "
                                                                         "self._resolve_stuck_round(group)"]
    assert {p.split(" ", 2)[2].split(":")[0] for p in rule_problems("demo", at_5)} == {
        "branches on compat", "calls a safety net"}
    found = {p.split(" ", 2)[2].split(":")[0] for p in rule_problems("demo", whole)}
    assert found == set(LISTING_RULES), found  # unfolded, every kind of line is there


@pytest.mark.parametrize("path", RULED_CHAPTERS, ids=[p.stem for p in RULED_CHAPTERS])
def test_listings_read_as_the_chapter(path):
    problems = [p for i, views in fresh_listings(path).items() for v in views if not isinstance(v, str)
                for p in rule_problems(f"cell {i}: {v.name}", v)]
    assert not problems, (f"{path.name}'s listings show lines that belong out of the algorithm's way: move "
                          "them to the boundary, a subclass or a function of their own, or fold them "
                          "(# >>> fold: what ... # <<<):\n" + "\n".join(problems))
