"""No two tinyserve modules import each other, however indirectly.

tests/test_layers.py orders the layers but lets the modules of one layer import each other, and a
function-level import may reach one layer down; neither may close a circle. Every ``import``
statement counts, at module level or inside a function (a lazy import is a dependency all the
same). An import names the most specific module it loads: ``from tinyserve.block_manager import
BlockSpaceManager`` depends on ``tinyserve.block_manager``, ``from tinyserve.viz import rounds`` on
``tinyserve.viz.rounds``, ``from tinyserve import LLM`` on the package ``tinyserve`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tinyserve"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, me: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = me.split(".") if is_package else me.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The tinyserve modules that ``name`` imports anywhere in its file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, path.name == "__init__.py")
            if module is None:
                continue
            # ``from pkg import sub`` loads the submodule when there is one, else takes a name of pkg.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import tinyserve.x.y`` of an attribute: its module
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """For every strongly connected component that holds a cycle (found with Tarjan's algorithm):
    its shortest cycle through its first module, as a closed path (that module repeated at the
    end), and all the component's modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~150)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        start = min(component)
        # The shortest way back to start, inside the component (breadth first).
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append((found, sorted(component)))
    return sorted(cycles)


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert find_cycles(graph) == [(["a", "b", "c", "a"], ["a", "b", "c"]), (["e", "e"], ["e"])]


def test_the_graph_sees_lazy_and_package_imports():
    graph = import_graph()
    assert "tinyserve.block_manager" in graph["tinyserve.scheduler"]
    assert "tinyserve.parallel" in graph["tinyserve.engine"]  # a function-level import


def test_no_import_cycles_among_tinyserve_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(cycle) + (f"  (one circle with {', '.join(m for m in members if m not in cycle)})"
                              if len(members) > len(cycle) - 1 else "")
        for cycle, members in cycles)
