"""``%%workspace <component> [chapter]``: run a notebook cell, then save it as the reader's component.

The cell runs in the notebook's namespace, as any cell does; only if it ran without an error is
its source, the whole cell, saved (``store.save``), so a cell that raises leaves the saved
component as it was. The cell must be plain Python (no ``%`` or ``!`` lines): it becomes a module.

    %load_ext tinyserve.workspace        # or: from tinyserve.workspace import register_magic; register_magic()

    %%workspace allocator 2
    class BlockAllocator:
        ...
"""

from __future__ import annotations

import linecache

from tinyserve.workspace.store import component, save

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
    save(comp.name, cell, chapter=chapter)


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
