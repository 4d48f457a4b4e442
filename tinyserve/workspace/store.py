"""Where the workspace is, which components it holds, and saving and loading them.

A saved component is a module of the reader's source, after a header that names the chapter,
the component and the time, and a prelude that imports the names its interface uses (so a class
written in a notebook cell that relied on an earlier cell's imports still loads on its own).
Writes are atomic: a temporary file in the same folder, then ``os.replace``.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import tempfile
import textwrap
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

ENV = "TINYSERVE_WORKSPACE"
MODULE_PREFIX = "_tinyserve_workspace"  # sys.modules names of loaded components


class WorkspaceError(ImportError):
    """A saved component that cannot be loaded: the message names its file and the error."""


@dataclass(frozen=True)
class Component:
    name: str
    module: str  # file name in the workspace
    object: str  # the fixed name the module must define
    chapter: int  # the chapter that writes it
    hook: str  # where it goes in
    prelude: str  # imports the saved module starts with
    # The checker ``%%workspace`` runs before it saves ("tinyserve.exercises.chNN:check_x"; "" for
    # none) and the name of the chapter's solution (chapters/solutions/chNN.py) that answers it.
    check: str = ""
    answer: str = ""


COMPONENTS: dict[str, Component] = {c.name: c for c in [
    Component("allocator", "allocator.py", "BlockAllocator", 2, "BlockSpaceManager(allocator=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock",
              check="tinyserve.exercises.ch02:check_block_allocator", answer="FreeListAllocator"),
    Component("block_manager", "block_manager.py", "BlockSpaceManager", 3, "Scheduler(block_manager=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock\n"
              # The reader's class subclasses BlockSpaceManager, the package's (the alias at the
              # module's end then rebinds the name to the reader's class).
              "from tinyserve.block_manager import AllocStatus, BlockSpaceManager\n"
              "from tinyserve.block_manager import BlockSpaceManager as PackageBlockSpaceManager\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch03:check_block_manager", answer="CopyOnWriteManager"),
    Component("admission", "admission.py", "can_admit", 4, "Scheduler(can_admit=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("orca_round", "orca_round.py", "Scheduler", 4, "LLMEngine(scheduler=), the policy='orca' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch04:check_orca_round", answer="OrcaRound"),
    Component("scheduler_round", "scheduler_round.py", "Scheduler", 5, "LLMEngine(scheduler=), the policy='vllm' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch05:check_scheduler_round", answer="VllmRound"),
    Component("victim", "victim.py", "choose_victim", 5, "Scheduler(choose_victim=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("cache_engine", "cache_engine.py", "CacheEngine", 6, "Worker(cache_engine=)",
              "import torch\nfrom tinyserve.cache_engine import CacheEngine as PackageCacheEngine",
              check="tinyserve.exercises.ch06:check_cache_engine", answer="SwappingCacheEngine"),
    Component("attention", "attention.py", "AttentionBackend", 7, "attention_backend=<object>",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata",
              check="tinyserve.exercises.ch07:check_attention_backend", answer="PagedAttentionBackend"),
    Component("decode_kernel", "decode_kernel.py", "paged_decode", 8, "TritonBackend(decode=)",
              "import torch\nfrom tinyserve.attention.triton_env import max_along, next_pow2, sum_along, tl, triton",
              check="tinyserve.exercises.ch08:check_decode_kernel", answer="paged_decode"),
    Component("input_builder", "input_builder.py", "prepare_inputs", 9, "LLMEngine(prepare_inputs=)",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata\n"
              "from tinyserve.model_runner import ModelInput\n"
              "from tinyserve.sequence import Sequence, SequenceGroupMetadata",
              check="tinyserve.exercises.ch09:check_input_builder", answer="prepare_inputs"),
    Component("sampler", "sampler.py", "Sampler", 9, "LLMEngine(sampler=)",
              # The reader's class subclasses the package's Sampler for section 9.7's extras.
              "import torch\nfrom tinyserve.sampler import SampleRequest, apply_min_p\n"
              "from tinyserve.sampler import Sampler as PackageSampler",
              check="tinyserve.exercises.ch09:check_sampler", answer="Sampler"),
    Component("parallel_mlp", "parallel_mlp.py", "ParallelMLP", 10,
              "TensorParallelExecutor(mlp=) / build_model(mlp=), every rank's MLP",
              "import torch\nimport torch.nn.functional as F\nfrom torch import nn",
              check="tinyserve.exercises.ch10:check_parallel_mlp", answer="ParallelMLP"),
    Component("v1_round", "v1_round.py", "Scheduler", 13, "LLMEngine(scheduler=), the policy='v1' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch13:check_v1_round", answer="V1Round"),
]}


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


def component(name: str) -> Component:
    """The component called ``name``; ValueError naming the choices otherwise."""
    if name not in COMPONENTS:
        raise ValueError(f"unknown workspace component {name!r}: choose one of {', '.join(COMPONENTS)}")
    return COMPONENTS[name]


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
    cell of the IPython session that defines it. If the source does not define the component's
    fixed name but defines exactly one class or function (or ``answer`` names the one it is), the
    module gets ``Fixed = Theirs``.
    ValueError for an unknown component or a source without the name; SyntaxError (with the line)
    for one that does not compile.
    """
    comp = component(name)
    source = obj_or_source if isinstance(obj_or_source, str) else source_of(obj_or_source)
    text = module_text(comp, source, chapter, answer)
    path = workspace_dir(create=True) / comp.module
    _write_atomic(path, text)
    if not quiet:
        print(f"saved your {name} ({comp.object}) to {path}")
    return path


def module_text(comp: Component, source: str, chapter: int | None = None, answer: str | None = None) -> str:
    """The module saved for ``source``: header, prelude, source, and an alias if one is needed."""
    source = textwrap.dedent(source)  # a method or nested class, as inspect gives it
    try:
        tree = ast.parse(source, filename=f"<your {comp.name}>")
    except SyntaxError as e:
        raise SyntaxError(f"your {comp.name} does not compile: line {e.lineno}: {e.msg}: "
                          f"{(e.text or '').strip()!r}") from None
    defined = _top_level_names(tree)
    alias = ""
    if answer is not None and answer != comp.object:
        if answer not in defined:
            raise ValueError(f"the source defines no {answer} to save as your {comp.name}")
        alias = f"\n\n{comp.object} = {answer}  # the name tinyserve.workspace loads\n"
    elif comp.object not in defined:
        defs = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
        if len(defs) != 1:
            raise ValueError(f"your {comp.name} must define {comp.object} (the name the engine takes from "
                             f"{comp.module}); it defines {', '.join(sorted(defined)) or 'nothing'}")
        alias = f"\n\n{comp.object} = {defs[0]}  # the name tinyserve.workspace loads\n"
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


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


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
    bytecode cache). A module that fails to import, or lacks the name, prints a message naming the
    file and the error and gives None, or with ``strict=True`` raises WorkspaceError.
    """
    comp = component(name)
    path = workspace_dir() / comp.module
    if not path.exists():
        return None
    try:
        module = import_file(path, f"{MODULE_PREFIX}.{name}")
        if not hasattr(module, comp.object):
            raise WorkspaceError(f"{path} does not define {comp.object}")
        return getattr(module, comp.object)
    except Exception as e:
        err = e if isinstance(e, WorkspaceError) else WorkspaceError(
            f"your {name} in {path} failed to import: {type(e).__name__}: {e}{_where(e, path)}")
        if strict:
            raise err from e
        print(f"✗ {err} (the package's {name} is used instead)")
        return None


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


def _where(e: Exception, path: Path) -> str:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    if isinstance(e, SyntaxError) and e.lineno:
        lines.append(e.lineno)
    return f" (line {lines[-1]})" if lines else ""
