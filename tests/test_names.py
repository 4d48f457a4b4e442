"""Every name has one home: views only draw, models and measurements live apart from them.

- No top-level name is defined twice across ``tinyserve/viz`` and ``tinyserve/exercises``, and
  nothing resolves names lazily (a first-match resolver hid such clashes).
- ``tinyserve/lab`` (what the views draw from) never imports matplotlib, ipywidgets or the views,
  and neither do the benchmarks or the exercise checkers.
- ``make figures`` lists every figure function (``fig_*``, ``*_figure``) by name, and no module
  imports that list.
- Every view, lab, exercise-checker and workspace module stays small (300 lines at most).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tinyserve"
VIEWS, LAB, EXERCISES = PKG / "viz", PKG / "lab", PKG / "exercises"
DRAWING_LIBRARIES = ("matplotlib", "ipywidgets", "traitlets", "tinyserve.viz")


def top_level_names(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def imported_modules(path: Path) -> list[str]:
    """Every module an ``import`` statement anywhere in the file names (top level or in a function)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_top_level_name_is_defined_twice_in_views_and_exercises():
    homes: dict[str, list[str]] = defaultdict(list)
    for path in sorted([*VIEWS.rglob("*.py"), *EXERCISES.rglob("*.py")]):
        for name in top_level_names(ast.parse(path.read_text())):
            if name not in ("__all__",):
                homes[name].append(rel(path))
    twice = {name: files for name, files in homes.items() if len(files) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(files)}" for name, files in sorted(twice.items()))


def test_no_package_resolves_names_lazily():
    found = [rel(p) for p in sorted(PKG.rglob("*.py")) if "lazy_getattr" in p.read_text()]
    for path in sorted([*VIEWS.rglob("*.py"), *LAB.rglob("*.py"), *EXERCISES.rglob("*.py")]):
        if "__getattr__" in top_level_names(ast.parse(path.read_text())):
            found.append(f"{rel(path)} defines a module __getattr__")
    assert not found, "\n".join(found)


def test_the_lab_benchmarks_and_exercises_import_no_drawing_library():
    files = [*LAB.rglob("*.py"), *EXERCISES.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    # A benchmark script may plot its own results with matplotlib; it still must not need the views.
    bad = []
    for path in sorted(files):
        banned = ("tinyserve.viz",) if path.parent.name == "benchmarks" else DRAWING_LIBRARIES
        bad += [f"{rel(path)} imports {m}" for m in imported_modules(path)
                if any(m == b or m.startswith(b + ".") for b in banned)]
    assert not bad, "\n".join(bad)


def test_make_figures_lists_every_figure_function_and_no_view_imports_the_list():
    """The registry (``viz/figures.py``) names each figure's function as ``"module:function"``; the
    drawing modules never import it, so the list and the drawings form no circle."""
    listed = {c.value for c in ast.walk(ast.parse((VIEWS / "figures.py").read_text()))
              if isinstance(c, ast.Constant) and isinstance(c.value, str) and re.fullmatch(r"\w+:\w+", c.value)}
    defined = set()
    for path in sorted(VIEWS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and (node.name.startswith("fig_") or node.name.endswith("_figure")):
                defined.add(f"{path.stem}:{node.name}")
    assert listed and listed == defined, (f"listed, not defined: {sorted(listed - defined)}; "
                                          f"figure functions not listed: {sorted(defined - listed)}")
    importers = [rel(p) for p in sorted(PKG.rglob("*.py")) if p.name != "figures.py"
                 and any(m == "tinyserve.viz.figures" or m.startswith("tinyserve.viz.figures.")
                         for m in imported_modules(p))]
    assert not importers, f"these modules import the figure registry: {importers}"


def test_view_lab_exercise_and_workspace_modules_are_small():
    # viz/source.py (the listing renderer) is measured by its own owner's issue.
    small = [*VIEWS.rglob("*.py"), *LAB.rglob("*.py"), *EXERCISES.glob("*.py"), *(PKG / "workspace").glob("*.py")]
    long = [f"{rel(p)}: {n} lines" for p in sorted(small)
            if p.name != "source.py" and (n := len(p.read_text().splitlines())) > 300]
    assert not long, "\n".join(long)
