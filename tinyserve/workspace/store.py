"""Where the workspace is, which components it holds, and saving and loading them (the table of
components is ``components.py``; picking the answer out of a source, ``answer.py``).

A saved component is a module of the reader's source, after a header that names the chapter,
the component and the time, and a prelude that imports the names its interface uses (so a class
written in a notebook cell that relied on an earlier cell's imports still loads on its own).
Writes are atomic: a temporary file in the same folder, then ``os.replace``.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
import textwrap
import time
import traceback
import types
from pathlib import Path

from tinyserve.workspace import intake
from tinyserve.workspace.answer import answer_name, kind_of, refuse_shell_lines, source_of  # noqa: F401 (re-exported)
from tinyserve.workspace.components import COMPONENTS, Component, component  # noqa: F401 (re-exported)

ENV = "TINYSERVE_WORKSPACE"
MODULE_PREFIX = "_tinyserve_workspace"  # sys.modules names of loaded components


class WorkspaceError(ImportError):
    """A saved component that cannot be loaded: the message names its file and the error."""




def workspace_dir(create: bool = False) -> Path:
    """``$TINYSERVE_WORKSPACE``, else ``~/.tinyserve/workspace``; ``create`` makes it a package."""
    root = Path(os.environ.get(ENV) or Path.home() / ".tinyserve" / "workspace").expanduser()
    if create:
        root.mkdir(parents=True, exist_ok=True)
        init = root / "__init__.py"
        if not init.exists():
            _write_atomic(init, '"""The reader\'s tinyserve workspace: one module per component '
                                '(see tinyserve.workspace)."""\n')
    return root


def path_of(name: str) -> Path:
    return workspace_dir() / component(name).module


def saved_components() -> list[str]:
    """The components the reader has saved, in the book's order."""
    return [name for name in COMPONENTS if path_of(name).exists()]


def remove(name: str) -> bool:
    """Delete a saved component (the package's takes its place again); True if there was one."""
    path = path_of(name)
    if path.exists():
        path.unlink()
        return True
    return False


# -- saving -----------------------------------------------------------------------------------


def save(name: str, obj_or_source, *, chapter: int | None = None, quiet: bool = False,
         answer: str | None = None) -> Path:
    """Save the reader's component ``name`` into the workspace and return the file.

    ``obj_or_source`` is the source text, or the class or function itself: its source is read with
    ``inspect.getsource``, or, for one defined in a notebook (where that may fail), from the latest
    cell of the IPython session that defines it. The answer is ``answer`` if given (what
    ``%%workspace`` passes: the object its checker passed), else the fixed name if the source
    defines it (a class, a def or an assignment; an import is not a definition), else the
    source's one class (for a class component) or one public function; the module then ends with
    ``Fixed = Answer``. Helpers, constants and imports beside the answer are saved with it.
    ValueError for an unknown component, IPython lines, or no answer to pick (naming the
    candidates); SyntaxError (with the line) for a source that does not compile.
    """
    comp = component(name)
    source = obj_or_source if isinstance(obj_or_source, str) else source_of(obj_or_source)
    if answer is None and not isinstance(obj_or_source, str):
        given = getattr(obj_or_source, "__name__", "")
        answer = given if given.isidentifier() else None  # the object given is the answer
    text = module_text(comp, source, chapter, answer)
    path = workspace_dir(create=True) / comp.module
    _write_atomic(path, text)
    if not quiet:
        print(f"saved your {name} ({comp.object}) to {path}")
    return path


def module_text(comp: Component, source: str, chapter: int | None = None, answer: str | None = None) -> str:
    """The module saved for ``source``: header, prelude, source, and an alias if one is needed."""
    source = textwrap.dedent(source)  # a method or nested class, as inspect gives it
    refuse_shell_lines(comp, source)
    try:
        tree = ast.parse(source, filename=f"<your {comp.name}>")
    except SyntaxError as e:
        raise SyntaxError(f"your {comp.name} does not compile: line {e.lineno}: {e.msg}: "
                          f"{(e.text or '').strip()!r}") from None
    name = answer_name(comp, tree, answer)
    # The fixed name rebound at the end, after the source: it wins over any import of that name
    # (``from tinyserve.scheduler import Scheduler`` beside ``class MyOrcaRound(Scheduler)``).
    alias = f"\n\n{comp.object} = {name}  # the name tinyserve.workspace loads\n" if name != comp.object else ""
    # The prelude goes after any __future__ import, which must stay first.
    lines = source.splitlines()
    futures = [n.end_lineno for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    cut = max(futures, default=0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    where = f"chapter {chapter:02d}" if chapter is not None else f"chapter {comp.chapter:02d}'s component"
    header = (f"# tinyserve workspace: your {comp.name} ({comp.object}), {where}, saved {stamp}.\n"
              f"# Loaded by tinyserve.workspace.load({comp.name!r}); goes in through {comp.hook}.\n")
    body = "\n".join(lines[:cut] + ([""] if cut else []) + [comp.prelude, ""] + lines[cut:])
    text = header + body.rstrip() + "\n" + alias
    compile(text, comp.module, "exec")  # the prelude and alias must not break it
    return text


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_solutions(solutions_dir: str | Path, chapters=None, quiet: bool = True) -> list[str]:
    """Save the book's solutions as the reader's components (what ``make test`` runs the book
    with): for each component with an ``answer``, the whole ``solutions_dir/chNN.py`` becomes its
    module, the answer aliased to the fixed name. Returns the components saved."""
    saved = []
    for comp in COMPONENTS.values():
        if not comp.answer or (chapters is not None and comp.chapter not in chapters):
            continue
        path = Path(solutions_dir) / f"ch{comp.chapter:02d}.py"
        save(comp.name, path.read_text(encoding="utf-8"), chapter=comp.chapter, quiet=quiet, answer=comp.answer)
        saved.append(comp.name)
    return saved


# -- loading ----------------------------------------------------------------------------------


def load(name: str, *, strict: bool = False):
    """The reader's component ``name`` (the object of its fixed name), or None if not saved.

    The module is executed afresh from its file on every call (no stale ``sys.modules`` entry, no
    bytecode cache). A module that fails to import (any exception, ``SystemExit`` and
    ``KeyboardInterrupt`` included), lacks the name, gives the package's own object, one of the
    wrong kind (``intake.problem_with``), or changes the package while it is imported (undone,
    ``intake.undo_changes``) prints a message naming the file and the error and gives None, or
    with ``strict=True`` raises WorkspaceError.
    """
    comp = component(name)
    path = workspace_dir() / comp.module
    if not path.exists():
        return None
    try:
        module = _import_contained(comp, path)
        if not hasattr(module, comp.object):
            raise WorkspaceError(f"{path} does not define {comp.object}")
        obj = getattr(module, comp.object)
        problem = intake.problem_with(comp, obj)
        if problem is not None:
            raise WorkspaceError(f"{problem} ({path})")
        return obj
    except BaseException as e:  # the reader's module may raise anything, SystemExit included
        err = e if isinstance(e, WorkspaceError) else WorkspaceError(
            f"your {name} in {path} failed to import: {type(e).__name__}: {e}{_where(e, path)}")
        if strict:
            raise err from e
        print(f"✗ {err} (the package's {name} is used instead)")
        return None


def _import_contained(comp: Component, path: Path) -> types.ModuleType:
    """``import_file``, with every change the module makes to tinyserve while it runs undone and,
    if there was one, refused."""
    before = intake.snapshot()
    try:
        module = import_file(path, f"{MODULE_PREFIX}.{comp.name}")
    finally:
        changed = intake.undo_changes(before)
        if changed:
            # Raised from finally: it replaces whatever the module raised after its change.
            raise WorkspaceError(f"your {comp.module} {'; '.join(changed)} when imported; undone: a component may "
                                 f"subclass the package's classes, not change them ({path})")
    return module


def import_file(path: Path, module_name: str) -> types.ModuleType:
    """Execute ``path`` as a fresh module called ``module_name`` (kept in sys.modules while it
    runs and after, for dataclasses and pickling, and replaced on the next load)."""
    source = path.read_text(encoding="utf-8")
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    parent = module_name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        pkg = types.ModuleType(parent)
        pkg.__path__ = [str(path.parent)]
        sys.modules[parent] = pkg
    sys.modules[module_name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _where(e: BaseException, path: Path) -> str:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    if isinstance(e, SyntaxError) and e.lineno:
        lines.append(e.lineno)
    return f" (line {lines[-1]})" if lines else ""
