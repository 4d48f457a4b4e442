"""Not on trust: while a checker runs, the package's own implementation of the component it checks
is unavailable to the reader's code.

``unavailable(component, answer)`` is a context manager. For each entry of the component's
``own`` (``"module:qualname"``: a function, or ``Class.method``) it puts a guarded stand-in where
the package keeps it (the module attribute, or the class attribute) and wherever the answer's
code could reach the original by name: other tinyserve modules that import it, and the globals
and class bodies of the answer (a cell that ran ``from tinyserve.attention.reference import
paged_attention`` before the check). On leaving, even on an exception, everything is put back.

A guarded call fails with ``PackageCalled`` ("you called the package's paged_attention; this
exercise is yours to write") when

- its caller is the reader's code (the answer's modules or globals, a notebook's ``__main__``,
  a workspace module), ``super()`` and explicit ``PackageClass.method(self)`` calls included; or
- it is a method called on the reader's object that serves it only because the reader's class
  inherits it (``class R(PackageScheduler): pass`` run by the package's ``schedule``).

The checker's own reference runs still work: package objects called from package code, and
package methods that a checker puts into a class of its own on purpose (``only_your_x``
classes, which run one of the reader's methods among the package's others). Every blocked call
is also kept in ``Guard.calls``: an answer that catches the exception still fails.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

WORKSPACE_MODULES = "_tinyserve_workspace"


class PackageCalled(RuntimeError):
    """The reader's answer called the package's own implementation of the component it answers."""


def _package(module: str | None) -> bool:
    return bool(module) and (module == "tinyserve" or module.startswith("tinyserve."))


def _library(module: str) -> bool:
    """A module of Python's or of an installed package (torch, abc, typing …): never the reader's."""
    if module in sys.builtin_module_names or module == "builtins":
        return True
    path = getattr(sys.modules.get(module), "__file__", None) or ""
    return bool(path) and ("site-packages" in path or path.startswith((sys.base_prefix, sys.prefix)))


class Guard:
    """What one ``unavailable`` block guards, who counts as the reader, and the calls it stopped."""

    def __init__(self, component: str, answer) -> None:
        self.component = component
        self.active = True
        self.calls: list[str] = []
        self.reader_modules = {"__main__"}
        self.reader_globals: list[dict] = []
        self.reader_classes: list[type] = []
        self._decisions: dict[tuple[type, str], bool] = {}
        self._find_reader(answer)

    def _find_reader(self, answer) -> None:
        """The answer's classes (those of its MRO outside the package), modules and globals."""
        target = answer if isinstance(answer, (type, types.FunctionType)) else type(answer)
        classes = [c for c in getattr(target, "__mro__", ()) if not _package(c.__module__)
                   and not _library(c.__module__)]
        self.reader_classes = classes
        functions = [target] if isinstance(target, types.FunctionType) else []
        for cls in classes:
            self.reader_modules.add(cls.__module__)
            for value in vars(cls).values():
                value = getattr(value, "__func__", value)  # staticmethod, classmethod
                if isinstance(value, types.FunctionType):
                    functions.append(value)
        seen = set()
        for fn in functions:
            if not _package(fn.__module__):
                self.reader_modules.add(fn.__module__)
            if id(fn.__globals__) not in seen and not _package(fn.__globals__.get("__name__")):
                seen.add(id(fn.__globals__))
                self.reader_globals.append(fn.__globals__)
        self._reader_globals_ids = seen

    def reader_frame(self, frame) -> bool:
        name = frame.f_globals.get("__name__") or ""
        return (id(frame.f_globals) in self._reader_globals_ids or name in self.reader_modules
                or name.startswith(WORKSPACE_MODULES))

    def reader_object(self, obj_type: type, name: str, owner: type, stand_in) -> bool:
        """Whether the package's method ``owner.name`` serves an object of ``obj_type`` only by
        being inherited by a class of the reader's (cached per type)."""
        key = (obj_type, name)
        if key not in self._decisions:
            self._decisions[key] = _inherited_by_reader(obj_type, name, owner, stand_in)
        return self._decisions[key]

    def refuse(self, label: str, what: str = "you called") -> None:
        message = f"{what} the package's {label}; this exercise is yours to write"
        self.calls.append(message)
        raise PackageCalled(message)


def _inherited_by_reader(obj_type: type, name: str, owner: type, stand_in) -> bool:
    mro = getattr(obj_type, "__mro__", ())
    for cls in mro:
        held = vars(cls)
        if any(v is stand_in or getattr(v, "__func__", None) is stand_in for v in held.values()):
            if cls is not owner:
                # A class that holds the package's method on purpose: the reader's (copied in
                # their class body), or the package's (a checker composing its parts): the latter
                # only may run it.
                return not _package(cls.__module__)
            before = mro[:mro.index(cls)]
            readers = [c for c in before if not _package(c.__module__)]
            # Overridden by the reader: the call came by super() or by name, and the caller decides.
            return bool(readers) and not any(name in vars(c) for c in readers)
    return False


def _stand_in(original, label: str, guard: Guard, owner: type | None, name: str, kind: str):
    """The guarded version of ``original`` (a function; ``kind``: "function", "method",
    "staticmethod" or "classmethod")."""

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if guard.active:
            if guard.reader_frame(sys._getframe(1)):
                guard.refuse(label)
            if kind in ("method", "classmethod") and args:
                obj_type = args[0] if kind == "classmethod" else type(args[0])
                if guard.reader_object(obj_type, name, owner, guarded):
                    guard.refuse(label)
        return original(*args, **kwargs)

    return guarded


def _resolve(entry: str):
    """``(owner, name, raw attribute, label)`` for ``"module:qualname"``, or None if it is not there
    (a module that does not import here, such as Triton's on a CPU; a method not written yet)."""
    module_name, _, qualname = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    owner: object = module
    *outer, name = qualname.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
    if owner is None or name not in vars(owner):
        return None
    short = qualname if outer else name
    return owner, name, vars(owner)[name], short


class _Patches:
    """Attribute and dict entries replaced, to put back in reverse order."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []

    def set(self, owner, key: str, value) -> None:
        if isinstance(owner, dict):
            self.undo.append((owner, key, owner[key]))
            owner[key] = value
        else:
            self.undo.append((owner, key, vars(owner)[key]))
            setattr(owner, key, value)

    def restore(self) -> None:
        for owner, key, old in reversed(self.undo):
            if isinstance(owner, dict):
                owner[key] = old
            else:
                setattr(owner, key, old)
        self.undo.clear()


def _own_of(component) -> tuple[str, tuple[str, ...]]:
    if isinstance(component, str):
        from tinyserve.workspace.store import component as find  # the same layer; imported when used

        component = find(component)
    return component.name, tuple(component.own)


@contextmanager
def unavailable(component, answer) -> Iterator[Guard]:
    """Run the block with the package's own implementation of ``component`` (a workspace
    component's name, or a ``Component``) unavailable to ``answer``'s code; yields the Guard."""
    name, own = _own_of(component)
    guard = Guard(name, answer)
    patches = _Patches()
    target = answer if isinstance(answer, (type, types.FunctionType)) else type(answer)
    if own and _package(getattr(target, "__module__", None)):  # not a wrapper: the thing itself
        guard.refuse(f"{target.__module__}.{target.__qualname__}", what="your answer is")
    try:
        for entry in own:
            found = _resolve(entry)
            if found is None:
                continue
            owner, attr, raw, label = found
            _guard_one(guard, patches, owner, attr, raw, label)
        yield guard
    finally:
        guard.active = False
        patches.restore()


def _guard_one(guard: Guard, patches: _Patches, owner, attr: str, raw, label: str) -> None:
    if isinstance(owner, types.ModuleType):
        kind, fn = "function", raw
    elif isinstance(raw, staticmethod):
        kind, fn = "staticmethod", raw.__func__
    elif isinstance(raw, classmethod):
        kind, fn = "classmethod", raw.__func__
    else:
        kind, fn = "method", raw
    if not callable(fn):
        return
    wrapped = _stand_in(fn, label, guard, owner if isinstance(owner, type) else None, attr, kind)
    rewrap = {"staticmethod": staticmethod, "classmethod": classmethod}.get(kind, lambda f: f)
    patches.set(owner, attr, rewrap(wrapped))
    # Every other name that reaches the original: re-exports in the package, the answer's globals
    # and its class bodies.
    namespaces = [vars(m) for n, m in list(sys.modules.items())
                  if _package(n) and isinstance(m, types.ModuleType) and m is not owner]
    for namespace in namespaces + guard.reader_globals:
        for key, value in list(namespace.items()):
            if value is fn:
                patches.set(namespace, key, wrapped)
    for cls in guard.reader_classes:
        for key, value in list(vars(cls).items()):
            if value is fn:
                patches.set(cls, key, wrapped)
            elif isinstance(value, (staticmethod, classmethod)) and value.__func__ is fn:
                patches.set(cls, key, type(value)(wrapped))
