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

from tinyserve.workspace import intake

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
    # The package's own implementation of this component ("module:qualname", a function or a
    # Class.method): a checker runs the reader's answer with these made unavailable, and no
    # chapter lists them before the component's exercise (tests/test_listing_order.py).
    own: tuple[str, ...] = ()


COMPONENTS: dict[str, Component] = {c.name: c for c in [
    Component("allocator", "allocator.py", "BlockAllocator", 2, "BlockSpaceManager(allocator=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock",
              check="tinyserve.exercises.ch02:check_block_allocator", answer="FreeListAllocator",
              own=(
                  "tinyserve.block:BlockAllocator.allocate",
                  "tinyserve.block:BlockAllocator.free",
                  "tinyserve.block:BlockAllocator.get_num_free_blocks",
              )),
    Component("block_manager", "block_manager.py", "BlockSpaceManager", 3, "Scheduler(block_manager=)",
              "from collections import deque\n"
              "from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock\n"
              # The reader's class subclasses BlockSpaceManager, the package's (the alias at the
              # module's end then rebinds the name to the reader's class).
              "from tinyserve.block_manager import AllocStatus, BlockSpaceManager\n"
              "from tinyserve.block_manager import BlockSpaceManager as PackageBlockSpaceManager\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch03:check_block_manager", answer="CopyOnWriteManager",
              own=(
                  "tinyserve.block_manager:BlockSpaceManager.can_allocate",
                  "tinyserve.block_manager:BlockSpaceManager.allocate",
                  "tinyserve.block_manager:BlockSpaceManager._prompt_blocks",
                  "tinyserve.block_manager:BlockSpaceManager._needs_new_block",
                  "tinyserve.block_manager:BlockSpaceManager.can_append_slot",
                  "tinyserve.block_manager:BlockSpaceManager.append_slot",
                  "tinyserve.block_manager:BlockSpaceManager.fork",
                  "tinyserve.block_manager:BlockSpaceManager.free",
                  "tinyserve.block_manager:V04BlockSpaceManager.can_allocate",
                  "tinyserve.block_manager:V04BlockSpaceManager.can_append_slot",
              )),
    Component("admission", "admission.py", "can_admit", 4, "Scheduler(can_admit=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("orca_round", "orca_round.py", "Scheduler", 4, "LLMEngine(scheduler=), the policy='orca' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch04:check_orca_round", answer="OrcaRound",
              own=(
                  "tinyserve.scheduler:Scheduler._schedule_mixed",
                  "tinyserve.scheduler:Scheduler._decode_running",
                  "tinyserve.scheduler:Scheduler._swap_in_swapped",
                  "tinyserve.scheduler:Scheduler._admit_waiting",
              )),
    Component("scheduler_round", "scheduler_round.py", "Scheduler", 5, "LLMEngine(scheduler=), the policy='vllm' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.block_manager import AllocStatus\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch05:check_scheduler_round", answer="VllmRound",
              own=(
                  "tinyserve.scheduler:Scheduler._schedule_vllm",
                  "tinyserve.scheduler:Scheduler._admit_waiting",
                  "tinyserve.scheduler:Scheduler._decode_running",
                  "tinyserve.scheduler:Scheduler._swap_in_swapped",
              )),
    Component("victim", "victim.py", "choose_victim", 5, "Scheduler(choose_victim=)",
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus"),
    Component("cache_engine", "cache_engine.py", "CacheEngine", 6, "Worker(cache_engine=)",
              "import torch\nfrom tinyserve.cache_engine import CacheEngine as PackageCacheEngine",
              check="tinyserve.exercises.ch06:check_cache_engine", answer="SwappingCacheEngine",
              own=(
                  "tinyserve.cache_engine:CacheEngine.swap_in",
                  "tinyserve.cache_engine:CacheEngine.swap_out",
                  "tinyserve.cache_engine:CacheEngine.copy",
                  "tinyserve.cache_engine:CacheEngine._move",
              )),
    Component("attention", "attention.py", "AttentionBackend", 7, "attention_backend=<object>",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata",
              check="tinyserve.exercises.ch07:check_attention_backend", answer="PagedAttentionBackend",
              own=(
                  "tinyserve.attention.reference:store_kv",
                  "tinyserve.attention.reference:paged_attention",
                  "tinyserve.attention.reference:sequence_attention",
                  "tinyserve.attention.reference:causal_attention",
                  "tinyserve.attention.reference:paged_decode_attention",
                  "tinyserve.attention.reference:TorchBackend.store_kv",
                  "tinyserve.attention.reference:TorchBackend.forward",
                  "tinyserve.attention.batched:paged_attention",
                  "tinyserve.attention.batched:paged_decode_attention",
                  "tinyserve.attention.batched:BatchedTorchBackend.store_kv",
                  "tinyserve.attention.batched:BatchedTorchBackend.forward",
                  "tinyserve.attention.triton_store:store_kv",
                  "tinyserve.attention.triton_backend:prefill_attention",
                  "tinyserve.attention.triton_backend:TritonBackend.store_kv",
                  "tinyserve.attention.triton_backend:TritonBackend.forward",
              )),
    Component("decode_kernel", "decode_kernel.py", "paged_decode", 8, "TritonBackend(decode=)",
              "import torch\nfrom tinyserve.attention.triton_env import max_along, next_pow2, sum_along, tl, triton",
              check="tinyserve.exercises.ch08:check_decode_kernel", answer="paged_decode",
              own=(
                  "tinyserve.attention.triton_paged:paged_decode_attention",
                  "tinyserve.attention.reference:paged_decode_attention",
                  "tinyserve.attention.batched:paged_decode_attention",
              )),
    Component("input_builder", "input_builder.py", "prepare_inputs", 9, "LLMEngine(prepare_inputs=)",
              "import torch\nfrom tinyserve.attention.metadata import AttentionMetadata\n"
              "from tinyserve.model_runner import ModelInput\n"
              "from tinyserve.sequence import Sequence, SequenceGroupMetadata",
              check="tinyserve.exercises.ch09:check_input_builder", answer="prepare_inputs",
              own=(
                  "tinyserve.model_runner:prepare_inputs",
                  "tinyserve.model_runner:_add_slots",
              )),
    Component("sampler", "sampler.py", "Sampler", 9, "LLMEngine(sampler=)",
              # The reader's class subclasses the package's Sampler for section 9.7's extras.
              "import torch\nfrom tinyserve.sampler import SampleRequest, apply_min_p\n"
              "from tinyserve.sampler import Sampler as PackageSampler",
              check="tinyserve.exercises.ch09:check_sampler", answer="Sampler",
              own=(
                  "tinyserve.sampler:Sampler.__call__",
                  "tinyserve.sampler:Sampler._draw",
                  "tinyserve.sampler:Sampler._probs",
                  "tinyserve.sampler:apply_top_k_top_p",
              )),
    Component("engine_step", "engine_step.py", "LLMEngine", 9,
              "build_engine's engine class: the serving loop's step and execute (an LLMEngine subclass)",
              "import torch\nfrom tinyserve.engine import LLMEngine\n"
              "from tinyserve.engine import LLMEngine as PackageEngine\n"
              "from tinyserve.logprobs import sampled_logprobs\n"
              "from tinyserve.outputs import RequestOutput\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch09_step:check_engine_step", answer="ServingLoop",
              own=(
                  "tinyserve.engine:LLMEngine.step",
                  "tinyserve.engine:LLMEngine.execute",
                  "tinyserve.worker:Worker.execute_model",
              )),
    Component("parallel_mlp", "parallel_mlp.py", "ParallelMLP", 10,
              "TensorParallelExecutor(mlp=) / build_model(mlp=), every rank's MLP",
              "import torch\nimport torch.nn.functional as F\nfrom torch import nn",
              check="tinyserve.exercises.ch10:check_parallel_mlp", answer="ParallelMLP",
              own=(
                  "tinyserve.models.llama:LlamaMLP.forward",
              )),
    Component("v1_round", "v1_round.py", "Scheduler", 13, "LLMEngine(scheduler=), the policy='v1' round",
              "from collections import deque\n"
              "from tinyserve import refusals\n"
              "from tinyserve.scheduler import Scheduler, SchedulerOutputs, SchedulingBudget\n"
              "from tinyserve.scheduler import Scheduler as PackageScheduler\n"
              "from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus",
              check="tinyserve.exercises.ch13:check_v1_round", answer="V1Round",
              own=(
                  "tinyserve.v1_round:V1RoundMixin._schedule_v1",
                  "tinyserve.v1_round:V1RoundMixin._run_running_v1",
                  "tinyserve.v1_round:V1RoundMixin._admit_waiting_v1",
              )),
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
