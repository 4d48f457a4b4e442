"""Which object of a reader's source is the answer to save: the component's fixed name, or its
one class or public function (never a name the source only imports), and where the source of an
object defined in a notebook is found."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap

from tinyserve.workspace.components import Component


def kind_of(comp: Component) -> str:
    """"class" for a component answered by a class (its fixed name is capitalised), else "function"."""
    return "class" if comp.object[:1].isupper() else "function"


def refuse_shell_lines(comp: Component, source: str) -> None:
    """ValueError for IPython lines (``%magic``, ``!shell``): a saved component is a plain module.
    (Only in a source that does not parse: a docstring line may start with % too.)"""
    try:
        ast.parse(textwrap.dedent(source))
        return
    except SyntaxError:
        pass
    shell = [f"line {i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1)
             if line.lstrip().startswith(("%", "!"))]
    if shell:
        raise ValueError(f"your {comp.name} cannot be saved: {'; '.join(shell)} is IPython, not Python "
                         f"(a saved component is a module): move it to a cell of its own")


def answer_name(comp: Component, tree: ast.Module, answer: str | None = None) -> str:
    """The name of the object to save as ``comp``'s answer: ``answer`` if given, else the fixed
    name if the source defines it, else its one class (a class component) or its one public
    function (a function component). Names bound only by imports are not the reader's.
    ValueError naming the candidates and how to choose otherwise."""
    defined = _defined_names(tree)
    if answer is None:
        if comp.object in defined:
            answer = comp.object
        else:
            want = (ast.ClassDef,) if kind_of(comp) == "class" else (ast.FunctionDef, ast.AsyncFunctionDef)
            found = [n for n, node in defined.items()
                     if isinstance(node, want) and (kind_of(comp) == "class" or not n.startswith("_"))]
            if len(found) != 1:
                what = f"one {kind_of(comp)}" + ("" if kind_of(comp) == "class" else " not starting with _")
                raise ValueError(
                    f"your {comp.name} must define {comp.object} (the name the engine takes from {comp.module}), "
                    f"or {what} to save as it; it defines {', '.join(sorted(defined)) or 'nothing'}: name your "
                    f"answer {comp.object}, or pass answer='TheName' to save()")
            answer = found[0]
    if answer not in defined:
        imported = answer in _imported_names(tree)
        raise ValueError(f"your {comp.name} cannot be saved: {answer} is "
                         + ("imported, not defined in it (the package's, not yours)" if imported else
                            "not defined at the top level of the source (a class, a def or an assignment)"))
    node = defined[answer]
    if isinstance(getattr(node, "value", None), ast.Lambda):
        raise ValueError(f"your {comp.name} cannot be saved: {answer} is a lambda; write it with def {answer}(...)")
    return answer


def _defined_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The top-level names the source itself binds (classes, functions, assignments), each to the
    statement that binds it last; imports are left out."""
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update((t.id, node) for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:  # an import after a definition rebinds the name to the package's
                names.pop((a.asname or a.name).split(".")[0], None)
    return names


def _imported_names(tree: ast.Module) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}


def source_of(obj) -> str:
    """The source of a class or function: ``inspect.getsource``, else the latest IPython cell that
    defines it by name. ValueError if neither knows it (pass the source text instead)."""
    name = getattr(obj, "__name__", None)
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        pass
    if name:
        for cell in reversed(_ipython_cells()):
            try:
                tree = ast.parse(cell)
            except SyntaxError:
                continue
            if any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name for n in tree.body):
                return cell
    raise ValueError(f"cannot find the source of {obj!r}: pass the source text to save() "
                     "(or use the %%workspace cell magic)")


def _ipython_cells() -> list[str]:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return []
    return [c for c in shell.user_ns.get("In", []) if isinstance(c, str)]
