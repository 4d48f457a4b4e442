"""The listing-order rule: no chapter lists the package's version of a workspace component before
the exercise that asks the reader for it.

Each component of ``tinyserve.workspace.store.COMPONENTS`` is written in its chapter
(``Component.chapter``) in the code cell that starts ``%%workspace <name>``; ``Component.own``
names the package's implementation of it ("module:qualname"). No cell before that exercise cell
may show a listing of one of those objects, nor of anything that contains one (its class, its
module). Two independent detectors look for such a listing:

- **the code**: every ``show(...)``/``SourceView(...)`` call of a cell before the exercise is
  parsed, and its argument resolved in a namespace made of the imports of those cells (the
  chapter's own import lines, executed; nothing else of the chapter runs);
- **the committed outputs**: every listing a cell displayed, read from its output metadata
  (``tinyserve.listing``), else from the id its HTML view repeats in a comment, else from the
  header of its plain text (``# module.qualname  (file:lines, ...)``).

A second rule keeps the chapter from *using* the package's version by name before the exercise
(a cell that imports or calls ``paged_attention`` hands the reader what a two-line wrapper needs):
every name chain of those cells that resolves, through the same imports, to a counterpart fails.
The engine or the model may still run as a whole (the component then works inside, unnamed).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import types
from pathlib import Path

import pytest

from tinyserve.viz.source import METADATA_KEY
from tinyserve.workspace.store import COMPONENTS, Component

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"

_SHOW_CALLS = {"show", "SourceView"}
_HEADER = re.compile(r"^# (\S+)  \(")
_HTML_ID = re.compile(r"<!-- " + re.escape(METADATA_KEY) + r" (\{.*?\}) -->")


# -- what a component's counterpart is --------------------------------------------------------


def _resolve(spec: str) -> object | None:
    module, _, qualname = spec.partition(":")
    try:
        obj: object = importlib.import_module(module)
    except ImportError:
        return None
    for part in filter(None, qualname.split(".")):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def dotted(obj: object) -> str | None:
    """The name a listing of ``obj`` carries ("module.qualname"), as ``SourceView`` names it."""
    obj = getattr(obj, "fn", obj) if type(obj).__module__.startswith("triton") else obj  # a @triton.jit kernel
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or "<locals>" in qualname:
        return None
    return f"{module}.{qualname}"


def counterpart_specs(comp: Component) -> tuple[str, ...]:
    return tuple(comp.own)


def counterparts(comp: Component) -> dict[str, str]:
    """{dotted name: the "module:qualname" it came from} of the package's own implementation
    (an inherited method is named where it is defined, as its listing would name it)."""
    names = {}
    for spec in counterpart_specs(comp):
        obj = _resolve(spec)
        assert obj is not None, f"{comp.name}: its counterpart {spec!r} does not resolve"
        name = dotted(obj)
        assert name, f"{comp.name}: its counterpart {spec!r} has no module-level name"
        names[name] = spec
    return names


def shows_counterpart(listed: str, own: dict[str, str]) -> str | None:
    """The counterpart that a listing of ``listed`` (a dotted name) shows: the same object, or one
    inside it (a method of a listed class, anything of a listed module); else None."""
    for name in own:
        if name == listed or name.startswith(listed + "."):
            return name
    return None


# -- reading a chapter ---------------------------------------------------------------------------


def chapter_path(chapter: int) -> Path:
    (path,) = CHAPTERS.glob(f"{chapter:02d}_*.ipynb")
    return path


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def python_of(cell_source: str) -> str:
    """A code cell's Python, with IPython's magics and shell lines blanked (line numbers kept)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell_source.splitlines())


def exercise_index(cells: list[dict], name: str) -> int | None:
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and re.match(rf"%%workspace\s+{re.escape(name)}\b", source(cell).lstrip()):
            return i
    return None


def import_namespace(code_cells: list[str]) -> dict:
    """The names the cells' import statements bind (only the imports run), the chapter's way."""
    ns: dict = {}
    for text in code_cells:
        try:
            tree = ast.parse(python_of(text))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                    isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                try:
                    exec(compile(ast.Module([node], []), "<chapter imports>", "exec"), ns)  # noqa: S102
                except Exception:  # an import the test's environment lacks names nothing of ours
                    continue
    return ns


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _lookup(chain: list[str], ns: dict) -> object | None:
    if chain[0] not in ns:
        return None
    obj = ns[chain[0]]
    for part in chain[1:]:
        try:
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
        except AttributeError:
            return None
    return obj


def _imported_objects(node: ast.AST) -> list[str]:
    """``from m import a, b`` -> ["m.a", "m.b"] (what the statement names, resolvable by import)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}:{a.name}" for a in node.names if a.name != "*"]
    return []


def listings_in_code(cells: list[dict], before: int) -> list[tuple[int, str]]:
    """(cell index, dotted name) of every ``show``/``SourceView`` call before cell ``before`` whose
    argument resolves through the chapter's imports."""
    codes = [(i, source(c)) for i, c in enumerate(cells[:before]) if c["cell_type"] == "code"]
    ns = import_namespace([text for _, text in codes])
    found = []
    for i, text in codes:
        try:
            tree = ast.parse(python_of(text))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = _chain(node.func)
                arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "obj"), None)
                if callee and callee[-1] in _SHOW_CALLS and arg is not None and (chain := _chain(arg)):
                    obj = _lookup(chain, ns)
                    if obj is not None and (name := dotted(obj)):
                        found.append((i, name))
    return found


def names_used_in_code(cells: list[dict], before: int) -> list[tuple[int, str]]:
    """(cell index, dotted name) of every object a cell before ``before`` imports or names by a
    name chain that resolves through the chapter's imports."""
    codes = [(i, source(c)) for i, c in enumerate(cells[:before]) if c["cell_type"] == "code"]
    ns = import_namespace([text for _, text in codes])
    found = []
    for i, text in codes:
        try:
            tree = ast.parse(python_of(text))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            objs = []
            for spec in _imported_objects(node):
                objs.append(_resolve(spec))
            if isinstance(node, (ast.Name, ast.Attribute)) and (chain := _chain(node)):
                objs.append(_lookup(chain, ns))
            for obj in objs:
                if obj is not None and not isinstance(obj, types.ModuleType) and (name := dotted(obj)):
                    found.append((i, name))
    return found


def listings_in_outputs(cells: list[dict], before: int) -> list[tuple[int, str]]:
    """(cell index, dotted name) of every listing the cells before ``before`` displayed."""
    found = []
    for i, cell in enumerate(cells[:before]):
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            ident = out.get("metadata", {}).get(METADATA_KEY)
            html = out.get("data", {}).get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            if not ident and (m := _HTML_ID.search(html)):  # the id the HTML view repeats in a comment
                ident = json.loads(m.group(1))
            if ident:
                found.append((i, ".".join(filter(None, (ident.get("module"), ident.get("qualname"))))))
                continue
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            if m := _HEADER.match(text):
                found.append((i, m.group(1)))
    return found


def violations(nb: dict, comp: Component, own: dict[str, str] | None = None) -> list[str]:
    """Every listing of ``comp``'s counterpart before its exercise cell in ``nb``, described."""
    own = counterparts(comp) if own is None else own
    cells = nb["cells"]
    at = exercise_index(cells, comp.name)
    if at is None:
        return [f"no cell starts with %%workspace {comp.name}"]
    problems = []
    found_by = (("lists", listings_in_code(cells, at)), ("displayed a listing of", listings_in_outputs(cells, at)))
    for how, found in found_by:
        for i, listed in found:
            if hit := shows_counterpart(listed, own):
                shown = "" if hit == listed else f", which contains {hit}"
                problems.append(f"cell {i} {how} {listed}{shown} (exercise cell: {at})")
    return problems


def uses(nb: dict, comp: Component, own: dict[str, str] | None = None) -> list[str]:
    """Every cell before ``comp``'s exercise that imports or names its counterpart."""
    own = counterparts(comp) if own is None else own
    cells = nb["cells"]
    at = exercise_index(cells, comp.name)
    if at is None:
        return []
    return sorted({f"cell {i} names {name} (exercise cell: {at})"
                   for i, name in names_used_in_code(cells, at) if name in own})


# -- the rule, chapter by chapter ----------------------------------------------------------------


def _read(chapter: int) -> dict:
    return json.loads(chapter_path(chapter).read_text())


WRITTEN = [c for c in COMPONENTS.values() if counterpart_specs(c)]


def test_every_component_names_its_package_counterpart():
    """Every component with an exercise cell says what the package's own version of it is."""
    missing = [c.name for c in COMPONENTS.values()
               if exercise_index(_read(c.chapter)["cells"], c.name) is not None and not counterpart_specs(c)]
    assert not missing, f"no Component.own for {missing}"
    for comp in WRITTEN:
        assert counterparts(comp), comp.name


@pytest.mark.parametrize("comp", WRITTEN, ids=[c.name for c in WRITTEN])
def test_no_listing_of_the_package_version_before_the_exercise(comp: Component):
    problems = violations(_read(comp.chapter), comp)
    assert not problems, (f"chapter {comp.chapter:02d} shows the package's {comp.name} before its exercise:\n  "
                          + "\n  ".join(problems))


@pytest.mark.parametrize("comp", WRITTEN, ids=[c.name for c in WRITTEN])
def test_no_use_of_the_package_version_by_name_before_the_exercise(comp: Component):
    problems = uses(_read(comp.chapter), comp)
    assert not problems, (f"chapter {comp.chapter:02d} uses the package's {comp.name} before its exercise:\n  "
                          + "\n  ".join(problems))


# -- the detectors can fail -------------------------------------------------------------------------


def _nb(*cells: tuple[str, str, list]) -> dict:
    return {"cells": [{"cell_type": kind, "source": text, "metadata": {},
                       **({"outputs": outs} if kind == "code" else {})} for kind, text, outs in cells]}


def _listing_output(obj: object) -> dict:
    from tinyserve.viz.source import SourceView

    data, metadata = SourceView(obj, 7)._repr_mimebundle_()
    return {"output_type": "display_data", "data": {"text/plain": data["text/plain"]}, "metadata": metadata}


ATTENTION = COMPONENTS["attention"]
OWN = {"tinyserve.attention.reference.paged_attention": "tinyserve.attention.reference:paged_attention",
       "tinyserve.attention.reference.TorchBackend.forward": "tinyserve.attention.reference:TorchBackend.forward"}


def test_a_listing_in_the_code_before_the_exercise_fails():
    from tinyserve.attention import reference

    nb = _nb(("code", "from tinyserve.attention import reference as ref\nfrom tinyserve.viz.source import show", []),
             ("code", "show(ref.paged_attention)", []),
             ("code", "%%workspace attention 07\nclass AttentionBackend: ...", []),
             ("code", "show(ref.paged_attention)", [_listing_output(reference.paged_attention)]))
    assert violations(nb, ATTENTION, OWN) == [
        "cell 1 lists tinyserve.attention.reference.paged_attention (exercise cell: 2)"]


def test_a_listing_of_the_class_or_module_around_it_fails():
    nb = _nb(("code", "from tinyserve.attention.reference import TorchBackend\n"
                      "import tinyserve.attention.reference as r\nfrom tinyserve.viz.source import show", []),
             ("code", "show(TorchBackend)\nshow(obj=r)", []),
             ("code", "show(TorchBackend.store_kv)", []),  # another method: not the counterpart
             ("code", "%%workspace attention 07\nclass AttentionBackend: ...", []))
    assert violations(nb, ATTENTION, OWN) == [
        "cell 1 lists tinyserve.attention.reference.TorchBackend, which contains "
        "tinyserve.attention.reference.TorchBackend.forward (exercise cell: 3)",
        "cell 1 lists tinyserve.attention.reference, which contains "
        "tinyserve.attention.reference.paged_attention (exercise cell: 3)"]


def test_a_displayed_listing_fails_even_when_the_code_hides_it():
    from tinyserve.attention import reference

    shown = _listing_output(reference.paged_attention)
    bare = {"output_type": "stream", "name": "stdout", "text": shown["data"]["text/plain"]}  # no metadata
    nb = _nb(("code", "listing = __import__('x')  # nothing the code detector resolves", [shown]),
             ("code", "print(listing)", [bare]),
             ("code", "%%workspace attention 07", []))
    assert violations(nb, ATTENTION, OWN) == [
        "cell 0 displayed a listing of tinyserve.attention.reference.paged_attention (exercise cell: 2)",
        "cell 1 displayed a listing of tinyserve.attention.reference.paged_attention (exercise cell: 2)"]


def test_a_listing_shown_only_as_html_fails():
    from tinyserve.attention import reference
    from tinyserve.viz.source import SourceView

    html = {"output_type": "display_data", "metadata": {},
            "data": {"text/html": SourceView(reference.paged_attention, 7)._repr_html_()}}
    nb = _nb(("code", "", [html]), ("code", "%%workspace attention 07", []))
    assert violations(nb, ATTENTION, OWN) == [
        "cell 0 displayed a listing of tinyserve.attention.reference.paged_attention (exercise cell: 1)"]


def test_after_the_exercise_and_other_objects_pass():
    nb = _nb(("code", "from tinyserve.attention import reference\nfrom tinyserve.viz.source import show\n"
                      "show(reference.causal_attention)", []),
             ("code", "%%workspace attention 07", []),
             ("code", "show(reference.paged_attention)", []))
    assert violations(nb, ATTENTION, OWN) == []
    assert uses(nb, ATTENTION, OWN) == []


def test_a_missing_exercise_cell_fails():
    assert violations(_nb(("code", "x = 1", [])), ATTENTION, OWN) == ["no cell starts with %%workspace attention"]


def test_naming_the_package_version_before_the_exercise_fails():
    nb = _nb(("code", "from tinyserve.attention.reference import paged_attention, causal_attention", []),
             ("code", "import tinyserve.attention.reference as r\nout = r.TorchBackend.forward", []),
             ("code", "%%workspace attention 07", []))
    assert uses(nb, ATTENTION, OWN) == [
        "cell 0 names tinyserve.attention.reference.paged_attention (exercise cell: 2)",
        "cell 1 names tinyserve.attention.reference.TorchBackend.forward (exercise cell: 2)"]
