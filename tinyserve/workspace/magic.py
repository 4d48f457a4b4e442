"""``%%workspace <component> [chapter]``: run a notebook cell, check it, then save it as the reader's component.

The cell runs in the notebook's namespace, as any cell does. If it ran without an error and the
component has a checker (``Component.check``), the checker runs on the object the cell defined
(its fixed name, else its one class or public function; helpers and imports beside it are fine),
with the package's own implementation of the component unavailable to it
(``tinyserve.exercises.guard``), and prints its verdict; a component without a checker is
validated as ``load`` will (its kind and signature). Only an answer that passes is saved
(``store.save``), as exactly the object checked, so a cell that raises, or an answer not
written yet, still wrong or the package's own, leaves the saved component as it was (the
package's, if none was saved) and the chapter goes on. The cell must be plain Python (no ``%``
or ``!`` lines): it becomes a module.

    %load_ext tinyserve.workspace        # or: from tinyserve.workspace import register_magic; register_magic()

    %%workspace allocator 02
    class BlockAllocator:
        ...
"""

from __future__ import annotations

import ast
import importlib
import linecache

from tinyserve.exercises.guard import PackageCalled, unavailable
from tinyserve.workspace.intake import problem_with
from tinyserve.workspace.store import Component, answer_name, component, refuse_shell_lines, save

_cell_counter = [0]


def workspace_cell(line: str, cell: str, shell) -> None:
    """What the magic does: check the arguments and the source, run the cell, check it, save it."""
    args = line.split()
    if not args or len(args) > 2:
        raise ValueError("usage: %%workspace <component> [chapter]")
    comp = component(args[0])  # an unknown name is refused before the cell runs
    chapter = int(args[1]) if len(args) == 2 else None
    refuse_shell_lines(comp, cell)  # the cell becomes a module: plain Python only
    compile(cell, f"<%%workspace {comp.name}>", "exec")  # a SyntaxError names the line
    _cell_counter[0] += 1
    filename = f"<workspace-cell-{_cell_counter[0]}: {comp.name}>"
    # Tracebacks and inspect.getsource can then show the cell's lines.
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    exec(compile(cell, filename, "exec"), shell.user_ns)
    name = passes(comp, cell, shell.user_ns)
    if name is None:
        print(f"not saved: your {comp.name} is kept out of your engine until "
              f"{'its checker passes' if comp.check else 'it can be saved'} "
              f"(the one saved before, or the package's, stays in)")
        return
    save(comp.name, cell, chapter=chapter, answer=name)


def answer_in(comp: Component, cell: str, namespace: dict) -> tuple[str, object]:
    """The name and object the cell defines as ``comp``'s answer (``store.answer_name``: its fixed
    name, else its one class or public function); ValueError saying why there is none."""
    name = answer_name(comp, ast.parse(cell))
    if name not in namespace:
        raise ValueError(f"the cell defines no {name} (the name your {comp.name} is saved from)")
    return name, namespace[name]


def checker_of(comp: Component):
    module, _, name = comp.check.partition(":")
    return getattr(importlib.import_module(module), name)


def passes(comp: Component, cell: str, namespace: dict) -> str | None:
    """Run the component's checker on the cell's answer, with the package's own implementation of
    the component unavailable to it (``tinyserve.exercises.guard``), and print its verdict; or,
    for a component without a checker, validate the answer as ``load`` will. The answer's name
    if it passed (the object saved is exactly the one checked), else None."""
    try:
        name, answer = answer_in(comp, cell, namespace)
    except ValueError as e:
        print(f"✗ {e}")
        return None
    problem = problem_with(comp, answer)
    if problem is not None:
        print(f"✗ {problem}")
        return None
    if not comp.check:
        return name
    guard = None
    try:
        with unavailable(comp, answer) as guard:
            ok = checker_of(comp)(answer) is True
    except NotImplementedError:
        print(f"✗ your {comp.name} is not written yet (NotImplementedError): fill in the cell and run it again")
        ok = False
    except PackageCalled as e:
        print(f"✗ your {comp.name}: {e}")
        return None
    except Exception as e:  # the reader's code raised where the checker did not expect it
        print(f"✗ your {comp.name} raised {type(e).__name__}: {e}")
        ok = False
    if guard is not None and guard.calls:  # even if the answer caught the exception
        print(f"✗ your {comp.name}: {guard.calls[0]}; it is not saved")
        return None
    return name if ok else None


def register_magic(shell=None) -> None:
    """Register ``%%workspace`` in ``shell`` (default: the running IPython)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            raise RuntimeError("register_magic() needs a running IPython (a notebook or the ipython shell)")

    def workspace(line: str, cell: str) -> None:
        workspace_cell(line, cell, shell)

    workspace.__doc__ = workspace_cell.__doc__
    shell.register_magic_function(workspace, magic_kind="cell", magic_name="workspace")


def load_ipython_extension(shell) -> None:
    """``%load_ext tinyserve.workspace``."""
    register_magic(shell)
