"""One definition's source out of a chapter's solutions file, for its Solutions section.

The solutions (``chapters/solutions/chNN.py``) are not part of the package, so ``viz.source.show``
cannot list them; a chapter shows a solution with ``viz.source.show_solution``, which reads it
here and renders it as the package's listings are rendered, beside the package's listing of the
same component.
"""

from __future__ import annotations

import ast
from pathlib import Path


def definition_span(path: str | Path, name: str) -> tuple[int, int, str]:
    """(first line, last line, source) of the top-level class or function ``name`` in the file
    ``path``, decorators and comments inside it included. ValueError naming the file if it
    defines no such thing."""
    text = Path(path).read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return first, node.end_lineno, "\n".join(text.splitlines()[first - 1:node.end_lineno])
    raise ValueError(f"{path} defines no top-level class or function {name!r}")


def definition_source(path: str | Path, name: str) -> str:
    """The source of the top-level class or function ``name`` in the file ``path``."""
    return definition_span(path, name)[2]
