"""The chapters' prose names what exists.

The prose of a chapter is its markdown cells and the Markdown its code cells display (prose built
from measured numbers). Three checks run over it, chapter by chapter:

- **Names.** Every backticked name resolves:
  - a dotted name (`kernel_plan.plan_decode`, `tinyserve.lab.whatif`, `Scheduler._schedule`) by
    import and attribute lookup in tinyserve, starting from the chapter's own imports
    (`from tinyserve.viz import attention_kernel as ak` makes `ak.` that module), a tinyserve
    module (`block.slot_for`), or a name a tinyserve module defines. A module's attribute counts
    only where the module defines it: `ak.plan_decode` is wrong although the drawing module
    imports `plan_decode` from the lab (a package's ``__init__`` may re-export). Instance
    attributes (`self.x = ...` in a method) and dataclass fields count as attributes; past an
    instance attribute the type is unknown, so the rest of the name is not checked. A few names of
    instances (`group.`, `seq.`, ...) stand for their classes (``INSTANCES``); a few stand for
    nothing fixed and are not checked (``UNCHECKED_ROOTS``).
  - A name tinyserve does not have must be vLLM v0.4.0's: it is looked up in the installed
    `vllm==0.4.0` (``make venv``) by reading its source, class by class (bases included), without
    importing it. So a "v0.4 name" that v0.4.0 does not have fails too.
  - a call's keywords (`Scheduler(block_manager=...)`, `LLM(swap_space=...)`) are parameters of
    the callee, tinyserve's or v0.4.0's.
  - a path (`vllm/core/scheduler.py::Scheduler._schedule`, `tinyserve/preemption.py`,
    `attention/batched.py`, `tests/test_prefix_caching.py`) exists: `vllm/...` in the installed
    v0.4.0 (with the attribute after ``::``), anything else in the checkout, in the package or in
    vLLM. A CSV or JSON the project writes (a benchmark's results) may be missing. v0.4's files
    that its wheel does not carry (its CUDA sources, benchmarks, tests) are the explicit list
    ``V04_NOT_IN_WHEEL``.
  - a bare identifier (`_stand_in`, `retryable`) is a word of the package's, the tests', v0.4.0's
    or the chapter's own code (without its strings: the prose a code cell displays must not vouch
    for itself), or a symbol of v0.4.0's compiled CUDA extensions (its kernels' names). Names of
    other libraries are ``OTHER_LIBRARIES`` (checked by import), names of later vLLM releases
    that the prose names as such are ``LATER_VLLM``; names of the reader's own (`my_...`,
    `My...`) and three-letter math (`Y_r`) are not checked.
  - Chapter 13 is about vLLM V1: a name there that neither tinyserve nor v0.4.0 has may be one of
    vLLM 0.9.2's V1 (a file, a class or function with one attribute, or a word of those), looked up
    in ``tests/vllm_v1_index.json``, which ``scripts/v1_index.py`` writes from V1's source and
    ``make v1-oracle`` checks against the 0.9.2 wheel.
- **Exercises.** Every "exercise N" (and "exercises N and M", "exercises N to M") names an
  exercise of the same chapter ("**Exercise N", or an item "N. **" of its Exercises section).
- **No repeats.** No paragraph of prose (a dozen words or more) appears twice in a chapter.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import io
import json
import pkgutil
import re
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))

# Files of vLLM v0.4.0's repository that its wheel does not carry (checked against the v0.4.0 tag
# by hand; the wheel has neither csrc/ nor benchmarks/, nor vllm/core/block/, a folder without an
# __init__.py that its packaging left out).
V04_NOT_IN_WHEEL = {
    "tests/core/test_block_manager.py",  # its tests, which tests/test_v04_ported_*.py port
    "tests/core/test_scheduler.py",
    "vllm/core/block/",  # BlockSpaceManagerV2's tables and allocators (block_manager_v2.py imports them)
    "csrc/attention/attention_kernels.cu",
    "csrc/cache_kernels.cu",
    "benchmarks/benchmark_latency.py",
    "benchmarks/benchmark_serving.py",
    "benchmarks/benchmark_throughput.py",
}

# Names of instances in the prose, and the class each stands for (tinyserve's, whose v0.4 namesake
# counts too, or "vllm:Name", v0.4's only).
INSTANCES = {
    "group": "tinyserve.sequence.SequenceGroup",
    "seq_group": "tinyserve.sequence.SequenceGroup",
    "seq": "tinyserve.sequence.Sequence",
    "meta": "tinyserve.attention.metadata.AttentionMetadata",
    "request": "tinyserve.sampler.SampleRequest",
    "engine": "tinyserve.engine.LLMEngine",
    "block_manager": "tinyserve.block_manager.BlockSpaceManager",
    "backend": "tinyserve.attention.backend.AttentionBackend",
    "model_executor": "vllm:ExecutorBase",  # v0.4's LLMEngine.model_executor
}
# Roots that are not names of anything fixed: the object they stand for depends on the sentence
# (`self.` in a method the sentence is about, a Hugging Face config or model, the reader's variables).
UNCHECKED_ROOTS = {"self", "cfg", "model", "s0", "x"}

IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})+")
FILE_SUFFIXES = {"py", "cu", "csv", "ipynb", "md", "txt", "json", "png"}
OUTPUT_SUFFIXES = {"csv", "json", "png", "md"}
TOP_FOLDERS = {"vllm", "tinyserve", "tests", "benchmarks", "chapters", "figures", "scripts", "csrc"}
# Libraries a dotted name may start with (`torch.cuda.mem_get_info`) besides the chapter's imports:
# the standard library and these. Never any module found on the path, which may be anything.
LIBRARIES = set(sys.stdlib_module_names) | {"torch", "triton", "transformers", "numpy", "matplotlib"}
# Names of other libraries the prose names bare -> the module that defines each (checked by import).
OTHER_LIBRARIES = {
    "repeat_kv": "transformers.integrations.sdpa_attention",
    "sdpa_attention_forward": "transformers.integrations.sdpa_attention",
}
# Names of vLLM releases after v0.4.0 that the prose names as such ("later releases renamed ...").
LATER_VLLM = {"can_append_slots", "append_slots",
              "_schedule_chunked_prefill", "_schedule_prefills"}  # v0.4.1's scheduler (chapter 12)


# The chapters about vLLM V1, whose prose may name V1's code (``tests/vllm_v1_index.json``).
V1_CHAPTERS = {"13_from_v04_to_v1"}


@functools.cache
def v1_index() -> dict:
    return json.loads((REPO / "tests" / "vllm_v1_index.json").read_text())


def _v1_members(name: str, seen: frozenset = frozenset()) -> set[str]:
    members: set[str] = set()
    for _, own, bases in v1_index()["names"].get(name, []):
        members |= set(own)
        for base in bases:
            if base not in seen:
                members |= _v1_members(base, seen | {name})
    return members


def resolve_in_v1(parts: list[str], file: str | None = None) -> bool:
    entries = [e for e in v1_index()["names"].get(parts[0], []) if file is None or e[0] == file]
    return bool(entries) and (len(parts) == 1 or parts[1] in _v1_members(parts[0]))


@functools.cache
def v1_words() -> frozenset[str]:
    names = v1_index()["names"]
    return frozenset(names) | {m for entries in names.values() for _, own, _ in entries for m in own}


def resolves_in_v1(span: str) -> bool:
    """Whether a backticked span of chapter 13 names something of vLLM V1's."""
    call = _call_parts(span)
    if call is not None:
        return resolve_in_v1(call[0].split("."))
    if is_path(span):
        path, _, attr = span.partition("::")
        path = path.rstrip("/")
        if path not in v1_index()["files"] and path not in v1_index()["folders"]:
            return False
        return not attr or resolve_in_v1(attr.split("."), file=path)
    if DOTTED.fullmatch(span):
        return resolve_in_v1(span.split("."))
    return span in v1_words()


# ---- the prose ------------------------------------------------------------------------------

def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def prose_blocks(path: Path) -> list[tuple[str, str]]:
    """(where, text) for each markdown cell and each Markdown a code cell displays."""
    blocks = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "markdown":
            blocks.append((f"cell {i}", "".join(cell["source"])))
        elif cell["cell_type"] == "code":
            for output in cell.get("outputs", []):
                markdown = output.get("data", {}).get("text/markdown")
                if markdown:
                    blocks.append((f"cell {i} (output)", "".join(markdown)))
    return blocks


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _without_code_blocks(text))


def code_names(path: Path) -> set[str]:
    """The names a chapter's code uses, without its strings and comments (the prose a code cell
    displays is a string, and must not vouch for itself)."""
    names: set[str] = set()
    for cell in _cells(path):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        try:
            names.update(t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                         if t.type == tokenize.NAME)
        except (tokenize.TokenError, SyntaxError):
            names.update(re.findall(r"\w+", re.sub(r"(?s)(['\"]{3}).*?\1|#.*", "", source)))
    return names


# ---- tinyserve, imported --------------------------------------------------------------------

@functools.cache
def tinyserve_modules() -> dict[str, object]:
    import tinyserve

    modules = {"tinyserve": tinyserve}
    for info in pkgutil.walk_packages(tinyserve.__path__, "tinyserve."):
        if info.name.endswith("__main__"):
            continue
        modules[info.name] = importlib.import_module(info.name)
    return modules


@functools.cache
def tinyserve_names() -> dict[str, list[object]]:
    """Each name a tinyserve module defines (its classes, functions, constants) -> the objects."""
    names: dict[str, list[object]] = {}
    for module_name, module in tinyserve_modules().items():
        for name, obj in vars(module).items():
            if name.startswith("__"):
                continue
            home = getattr(obj, "__module__", module_name)
            if inspect.ismodule(obj) or not str(home).startswith("tinyserve"):
                continue
            if all(o is not obj for o in names.setdefault(name, [])):
                names[name].append(obj)
    return names


def _instance_attributes(cls: type) -> set[str]:
    """Attributes set on instances: annotations (dataclass fields) and `self.x = ...` in methods."""
    found: set[str] = set()
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        found.update(getattr(klass, "__annotations__", {}))
        found.update(getattr(klass, "__slots__", ()) if not isinstance(klass.__dict__.get("__slots__"), str) else ())
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and isinstance(node.ctx, ast.Store)):
                found.add(node.attr)
    return found


_MISSING = object()


def _defined_in(value: object, module, attr: str) -> bool:
    """Whether module is where value lives: a tinyserve module's attribute counts only if the
    module defines it (`ak.plan_decode`, which the drawing module imports from the lab, does not);
    a package's `__init__` may re-export, as may other libraries."""
    if value is _MISSING or not module.__name__.startswith("tinyserve") or hasattr(module, "__path__"):
        return True
    if inspect.ismodule(value) or attr in getattr(module, "__all__", ()):
        return True
    home = getattr(value, "__module__", None)
    if not (inspect.isclass(value) or inspect.isfunction(value)) or home is None:
        return True  # a constant: its home is unknown
    return home == module.__name__


def resolve_on(obj: object, attrs: list[str]) -> bool:
    """Whether attrs name a chain of attributes of obj (instance attributes count, and end the check)."""
    for attr in attrs:
        value = getattr(obj, attr, _MISSING)
        if inspect.ismodule(obj) and not _defined_in(value, obj, attr):
            return False
        if value is _MISSING and inspect.ismodule(obj):
            try:
                value = importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                value = _MISSING
        if value is _MISSING:
            cls = obj if inspect.isclass(obj) else type(obj)
            return attr in _instance_attributes(cls)
        obj = value
    return True


# ---- vLLM v0.4.0, read ----------------------------------------------------------------------

@functools.cache
def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm==0.4.0 is not installed in .venv: run `make venv` (make test installs it)")
    from importlib.metadata import version

    if version("vllm") != "0.4.0":
        pytest.fail(f"vllm {version('vllm')} is installed, the prose names v0.4.0's: run `make venv`")
    return Path(list(spec.submodule_search_locations)[0])


def _class_members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
            members.add(item.name)
        elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and isinstance(item.value, ast.Name):
            members.add(item.attr)  # self.x = ..., cls.x = ...
    for item in node.body:
        targets = (item.targets if isinstance(item, ast.Assign)
                   else [item.target] if isinstance(item, ast.AnnAssign) else [])
        members.update(t.id for t in targets if isinstance(t, ast.Name))
    return members


@functools.cache
def vllm_index() -> dict[str, list[tuple[str, set[str], list[str]]]]:
    """Each top-level name in vLLM v0.4.0 -> [(file, members, base names)] (members of a class)."""
    index: dict[str, list[tuple[str, set[str], list[str]]]] = {}
    root = vllm_root()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(root.parent))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                index.setdefault(node.name, []).append((where, _class_members(node), bases))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                index.setdefault(node.name, []).append((where, set(), []))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        index.setdefault(t.id, []).append((where, set(), []))
    return index


def _vllm_members(name: str, seen: frozenset = frozenset()) -> set[str]:
    members: set[str] = set()
    for _, own, bases in vllm_index().get(name, []):
        members |= own
        for base in bases:
            if base not in seen:
                members |= _vllm_members(base, seen | {name})
    return members


def resolve_in_vllm(parts: list[str], file: str | None = None) -> bool:
    entries = vllm_index().get(parts[0], [])
    if file is not None:
        entries = [e for e in entries if e[0] == file]
    if not entries:
        return False
    # One attribute after a class is checked; past it the type is unknown.
    return len(parts) == 1 or parts[1] in _vllm_members(parts[0])


@functools.cache
def vllm_words() -> frozenset[str]:
    return frozenset(w for p in vllm_root().rglob("*.py") for w in re.findall(r"\w+", p.read_text()))


@functools.cache
def _vllm_extension_bytes() -> bytes:
    return b"\n".join(so.read_bytes() for so in sorted(vllm_root().glob("*.so")))


def in_vllm_extensions(name: str) -> bool:
    """Whether a compiled CUDA extension of v0.4.0 has the name among its symbols: its kernels'
    names are there, and the CUDA calls they make, though the wheel carries no csrc/."""
    # A mangled name, <length><name>[I<args>], or a plain symbol such as the CUDA calls it makes.
    pattern = rb"(?:\d|\x00)" + name.encode() + rb"(?:I|(?!\w))"
    return re.search(pattern, _vllm_extension_bytes()) is not None


@functools.cache
def vllm_init_parameters(name: str) -> set[str] | None:
    """The parameters of a vLLM class's __init__ (or a function), None if any **kwargs."""
    params: set[str] = set()
    for where, _, _ in vllm_index().get(name, []):
        tree = ast.parse((vllm_root().parent / where).read_text())
        for node in tree.body:
            if getattr(node, "name", None) != name:
                continue
            funcs = [node] if isinstance(node, ast.FunctionDef) else [
                f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            for f in funcs:
                if f.args.kwarg is not None:
                    return None
                params |= {a.arg for a in f.args.args + f.args.kwonlyargs}
    return params


# ---- resolving one chapter's names ----------------------------------------------------------

def chapter_aliases(path: Path) -> dict[str, str]:
    """Names the chapter's imports bind -> dotted import path ("a.b" or "a.b:attr")."""
    aliases: dict[str, str] = {}
    for cell in _cells(path):
        if cell["cell_type"] != "code":
            continue
        source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                           if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}:{a.name}"
    return aliases


def _load(target: str) -> object:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if not attr:
        return module
    value = getattr(module, attr, _MISSING)
    return importlib.import_module(f"{module_name}.{attr}") if value is _MISSING else value


def resolve_dotted(name: str, aliases: dict[str, str]) -> bool:
    parts = name.split(".")
    root, rest = parts[0], parts[1:]
    candidates: list[object] = []
    if root in aliases:
        try:
            candidates.append(_load(aliases[root]))
        except ImportError:
            pass
    if root in INSTANCES and not INSTANCES[root].startswith("vllm:"):
        module_name, _, class_name = INSTANCES[root].rpartition(".")
        candidates.append(_load(f"{module_name}:{class_name}"))
    modules = tinyserve_modules()
    candidates += [m for n, m in modules.items() if n == root or n.endswith(f".{root}")]
    candidates += tinyserve_names().get(root, [])
    if hasattr(builtins, root):
        candidates.append(getattr(builtins, root))
    if root not in aliases and root in LIBRARIES:
        candidates.append(importlib.import_module(root))
    if any(resolve_on(c, rest) for c in candidates):
        return True
    if root in INSTANCES:  # v0.4's class of the same name (`seq.data`, a v0.4 Sequence's)
        return resolve_in_vllm([re.split(r"[.:]", INSTANCES[root])[-1]] + rest)
    return resolve_in_vllm(parts)


def is_path(text: str) -> bool:
    """A file or folder: `a/b.py`, `a/b/`, `vllm/x.py::A.b`, `tinyserve/parallel/` (not `1/k`)."""
    if not re.fullmatch(r"[\w.~-]*/[\w./-]*(::[\w.]+)?", text):
        return False
    path = text.partition("::")[0]
    return (path.endswith("/") or path.rsplit("/", 1)[-1].rpartition(".")[2] in FILE_SUFFIXES
            or path.split("/")[0] in TOP_FOLDERS)


def resolve_path(text: str) -> bool:
    path, _, attr = text.partition("::")
    path = path.rstrip("/")
    if not attr and path in {f.rstrip("/") for f in V04_NOT_IN_WHEEL}:
        return True
    if path.startswith("vllm/"):
        file = vllm_root().parent / path
        if not file.exists():
            return False
        return not attr or resolve_in_vllm(attr.split("."), file=path)
    if attr:
        return False
    if (REPO / path).exists() or (REPO / "tinyserve" / path).exists():
        return True
    if path.rpartition(".")[2] in OUTPUT_SUFFIXES and path.rsplit("/", 1)[-1] in project_words_text():
        return True  # a file the project writes (a benchmark's CSV), present or not
    if "/" not in path:  # a file name: somewhere in the package, the checkout's top or vLLM
        return (any(p.name == path for p in (REPO / "tinyserve").rglob(path))
                or any(p.rsplit("/", 1)[-1] == path for p in V04_NOT_IN_WHEEL)
                or any(True for _ in vllm_root().rglob(path)))
    return any(True for _ in vllm_root().rglob(path))


@functools.cache
def project_words_text() -> str:
    return "\n".join(p.read_text() for folder in ("tinyserve", "benchmarks", "scripts")
                     for p in (REPO / folder).rglob("*.py"))


@functools.cache
def project_words() -> frozenset[str]:
    words: set[str] = set()
    for folder in ("tinyserve", "tests", "benchmarks", "scripts", "chapters/solutions"):
        for p in (REPO / folder).rglob("*.py"):
            words.update(re.findall(r"\w+", p.read_text()))
    return frozenset(words)


def _call_parts(text: str) -> tuple[str, list[str]] | None:
    """(callee, keyword names) when text is a call with a dotted or plain callee."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    callee = ast.unparse(node.func)
    if not re.fullmatch(rf"{IDENT}(?:\.{IDENT})*", callee):
        return None
    return callee, [k.arg for k in node.keywords if k.arg]


def _takes_keywords(callee: str, keywords: list[str], aliases: dict[str, str]) -> bool:
    parts = callee.split(".")
    objects = []
    if parts[0] in aliases:
        try:
            objects.append(_load(aliases[parts[0]]))
        except ImportError:
            pass
    objects += tinyserve_names().get(parts[0], [])
    for obj in objects:
        for attr in parts[1:]:
            obj = getattr(obj, attr, None)
        if not callable(obj):
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return True
        if any(p.kind is p.VAR_KEYWORD for p in params.values()) or all(k in params for k in keywords):
            return True
    if len(parts) == 1 and vllm_index().get(parts[0]):  # v0.4's (`SamplingParams(use_beam_search=True)`)
        params = vllm_init_parameters(parts[0])
        return params is None or all(k in params for k in keywords)
    return False


def unresolved_names(path: Path) -> list[str]:
    aliases = chapter_aliases(path)
    own_words = code_names(path)
    problems = []
    for where, text in prose_blocks(path):
        for span in backticked(text):
            span = span.strip()
            problem = None
            call = _call_parts(span)
            if call is not None:
                callee, keywords = call
                if ("." in callee and callee.split(".")[0] not in UNCHECKED_ROOTS
                        and not resolve_dotted(callee, aliases)):
                    problem = f"`{callee}` names nothing"
                elif keywords and not _takes_keywords(callee, keywords, aliases):
                    problem = f"`{callee}` takes no keyword {keywords}"
            elif is_path(span):
                if not span.startswith(("/", "~")) and not resolve_path(span):
                    problem = f"`{span}` is no file"
            elif DOTTED.fullmatch(span):
                if span.rsplit(".", 1)[1] in FILE_SUFFIXES:
                    if not resolve_path(span):
                        problem = f"`{span}` is no file"
                elif span.split(".")[0] not in UNCHECKED_ROOTS and not resolve_dotted(span, aliases):
                    problem = f"`{span}` names nothing"
            elif span in OTHER_LIBRARIES:
                if not hasattr(importlib.import_module(OTHER_LIBRARIES[span]), span):
                    problem = f"`{span}` is not in {OTHER_LIBRARIES[span]}"
            elif re.fullmatch(IDENT, span) and len(span) > 3 and not span.startswith(("my_", "My")) \
                    and span not in LATER_VLLM:
                # (V1's words before v0.4's compiled symbols: searching those is slow.)
                if not (span in own_words or span in project_words() or span in vllm_words()
                        or (path.stem in V1_CHAPTERS and span in v1_words()) or in_vllm_extensions(span)):
                    problem = f"`{span}` is no word of the package, the tests, the chapter or vLLM v0.4"
            if problem and path.stem in V1_CHAPTERS and resolves_in_v1(span):
                problem = None
            if problem:
                problems.append(f"{path.stem} {where}: {problem}")
    return problems


# ---- exercises and repeats ------------------------------------------------------------------

EXERCISE_REF = re.compile(r"(?i)\bexercises?\s+(\d+)((?:\s*(?:,|and|or|to)\s*\d+)*)")


def defined_exercises(path: Path) -> set[int]:
    """The chapter's exercises: "**Exercise N", or items "N. **" between its Exercises and Solutions."""
    defined, inside = set(), False
    for _, text in prose_blocks(path):
        if re.search(r"^## Exercises", text, flags=re.M):
            inside = True
        if re.search(r"^## Solutions", text, flags=re.M):
            inside = False
        defined |= {int(n) for n in re.findall(r"\*\*Exercise (\d+)", text)}
        if inside:
            defined |= {int(n) for n in re.findall(r"^\s*(\d+)\. \*\*", text, flags=re.M)}
    return defined


def exercise_problems(path: Path) -> list[str]:
    blocks = prose_blocks(path)
    defined = defined_exercises(path)
    problems = []
    for where, text in blocks:
        text = re.sub(r"\*\*Exercise \d+", "", text)  # the definitions themselves
        for m in EXERCISE_REF.finditer(text):
            numbers = [int(m.group(1))] + [int(n) for n in re.findall(r"\d+", m.group(2))]
            if " to " in m.group(0):
                numbers = list(range(numbers[0], numbers[-1] + 1))
            missing = [n for n in numbers if n not in defined]
            if missing:
                problems.append(f"{path.stem} {where}: {m.group(0)!r} names no exercise of the chapter "
                                f"(it has {sorted(defined)})")
    return problems


def _paragraphs(text: str) -> list[str]:
    paragraphs = []
    for para in re.split(r"\n\s*\n", _without_code_blocks(text)):
        words = para.split()
        if len(words) >= 12:  # a sentence or more, not a heading or "Run it:"
            paragraphs.append(" ".join(words))
    return paragraphs


def repeated_paragraphs(path: Path) -> list[str]:
    seen: dict[str, str] = {}
    problems = []
    for where, text in prose_blocks(path):
        for para in _paragraphs(text):
            if para in seen:
                problems.append(f"{path.stem} {where} repeats a paragraph of {seen[para]}: {para[:70]!r}...")
            else:
                seen[para] = where
    return problems


# ---- the tests ------------------------------------------------------------------------------

IDS = [p.stem for p in CHAPTERS]


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_backticked_names_resolve(path: Path):
    problems = unresolved_names(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_exercise_references_exist(path: Path):
    problems = exercise_problems(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_repeated_paragraphs(path: Path):
    problems = repeated_paragraphs(path)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_should():
    # Names the issue found wrong, and names that are right, through the same functions.
    ch08 = REPO / "chapters" / "08_triton_paged_attention.ipynb"
    aliases = chapter_aliases(ch08)
    assert aliases["ak"] == "tinyserve.viz:attention_kernel"
    assert not resolve_dotted("ak.walk_program", aliases)
    assert resolve_dotted("ak.draw_program_grid", aliases)
    assert resolve_dotted("Scheduler._schedule", aliases)  # tinyserve's
    assert resolve_dotted("BlockSpaceManagerV1.can_append_slot", aliases)  # v0.4's
    assert not resolve_dotted("BlockSpaceManagerV1.no_such_method", aliases)
    assert resolve_path("vllm/core/scheduler.py::Scheduler._schedule")
    assert not resolve_path("vllm/core/scheduler.py::Scheduler._no_such")
    assert not resolve_path("vllm/core/no_such.py")
    assert _takes_keywords("Scheduler", ["block_manager"], aliases)
    assert not _takes_keywords("Scheduler", ["no_such_keyword"], aliases)
    # vLLM V1's names, for chapter 13.
    assert resolves_in_v1("KVCacheManager.allocate_slots") and not resolves_in_v1("KVCacheManager.no_such")
    assert resolves_in_v1("vllm/v1/core/sched/scheduler.py::Scheduler.schedule")
    assert not resolves_in_v1("vllm/v1/core/sched/no_such.py")
    assert not resolves_in_v1("vllm/v1/core/sched/scheduler.py::KVCacheManager")  # defined elsewhere


def test_exercises_and_repeats_are_caught(tmp_path: Path):
    para = "This paragraph has more than twelve words in it, so a repeat of it counts as one."
    texts = [para, "## Exercises\n\n1. **One.** Do it.\n", "**Exercise 2 (no checker).** See exercise 1.\n\n" + para,
             "## Solutions\n\nExercises 1 to 3 are solved here."]
    cells = [{"cell_type": "markdown", "metadata": {}, "source": [text]} for text in texts]
    path = tmp_path / "99_example.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert defined_exercises(path) == {1, 2}
    assert [p.split(": ", 1)[1][:19] for p in exercise_problems(path)] == ["'Exercises 1 to 3' "]
    assert len(repeated_paragraphs(path)) == 1
