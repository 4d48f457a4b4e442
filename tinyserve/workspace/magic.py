"""``%%workspace <component> [chapter]``: run a notebook cell, check it, then save it as the reader's component.

The cell runs in the notebook's namespace, as any cell does. If it ran without an error and the
component has a checker (``Component.check``), the checker runs on the object the cell defined
and prints its verdict; only an answer that passes is saved (``store.save``), so a cell that
raises, or an answer not written yet or still wrong, leaves the saved component as it was (the
package's, if none was saved) and the chapter goes on. The cell must be plain Python (no ``%``
or ``!`` lines): it becomes a module.

    %load_ext tinyserve.workspace        # or: from tinyserve.workspace import register_magic; register_magic()

    %%workspace allocator 2
    class BlockAllocator:
        ...
"""

from __future__ import annotations

import ast
import importlib
import linecache

from tinyserve.workspace.store import Component, component, save

_cell_counter = [0]


def workspace_cell(line: str, cell: str, shell) -> None:
    """What the magic does: check the arguments and the source, run the cell, save it."""
    args = line.split()
    if not args or len(args) > 2:
        raise ValueError("usage: %%workspace <component> [chapter]")
    comp = component(args[0])  # an unknown name is refused before the cell runs
    chapter = int(args[1]) if len(args) == 2 else None
    compile(cell, f"<%%workspace {comp.name}>", "exec")  # a SyntaxError names the line
    _cell_counter[0] += 1
    filename = f"<workspace-cell-{_cell_counter[0]}: {comp.name}>"
    # Tracebacks and inspect.getsource can then show the cell's lines.
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    exec(compile(cell, filename, "exec"), shell.user_ns)
    if comp.check and not passes(comp, cell, shell.user_ns):
        print(f"not saved: your {comp.name} is kept out of your engine until its checker passes "
              f"(the one saved before, or the package's, stays in)")
        return
    save(comp.name, cell, chapter=chapter)


def answer_in(comp: Component, cell: str, namespace: dict):
    """The object the cell defines for ``comp``: its fixed name, else the cell's one class or function."""
    tree = ast.parse(cell)
    defined = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    if comp.object in defined or (comp.object in namespace and len(defined) != 1):
        return namespace.get(comp.object)
    return namespace.get(defined[0]) if len(defined) == 1 else None


def checker_of(comp: Component):
    module, _, name = comp.check.partition(":")
    return getattr(importlib.import_module(module), name)


def passes(comp: Component, cell: str, namespace: dict) -> bool:
    """Run the component's checker on the cell's answer (its verdict is printed); True if it passed."""
    answer = answer_in(comp, cell, namespace)
    if answer is None:
        print(f"✗ the cell defines no {comp.object} (the name your {comp.name} is loaded by)")
        return False
    try:
        return checker_of(comp)(answer) is True
    except NotImplementedError:
        print(f"✗ your {comp.name} is not written yet (NotImplementedError): fill in the cell and run it again")
    except Exception as e:  # the reader's code raised where the checker did not expect it
        print(f"✗ your {comp.name} raised {type(e).__name__}: {e}")
    return False


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
