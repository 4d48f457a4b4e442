"""What ``load`` checks around the reader's module: changes it made to the package while it was
imported (found, undone and refused), and whether the object it gives is the reader's and of the
kind the engine calls (a class where a class is needed, a callable that takes the arguments the
scheduler passes).

The snapshot is cheap: a dict copy of ``vars()`` of every loaded ``tinyserve.*`` module and of
every class defined in one. A component may subclass the package's classes; changing them would
change the package for code that never asked for the reader's parts (a later plain ``LLM()``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

# The package's class that a component's class must subclass: the engine joins the rounds with
# the Scheduler and calls every method of the manager and the engine (``tinyserve.workspace.assemble``).
SUBCLASS_OF = {
    "block_manager": ("tinyserve.block_manager", "BlockSpaceManager"),
    "orca_round": ("tinyserve.scheduler", "Scheduler"),
    "scheduler_round": ("tinyserve.scheduler", "Scheduler"),
    "v1_round": ("tinyserve.scheduler", "Scheduler"),
    "engine_step": ("tinyserve.engine", "LLMEngine"),
}
# How the package calls a function component, from its call sites (scheduler.py's _admit_waiting
# and _decode_running, worker.py's execute_model, triton_backend.py's forward).
CALLED_AS = {
    "admission": "can_admit(group, budget, block_manager)",
    "victim": "choose_victim(running)",
    "input_builder": "prepare_inputs(groups, block_size, device)",
    "decode_kernel": "paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)",
}
# Components that may be an object rather than a class: what it must have.
OBJECT_NEEDS = {"attention": ("store_kv", "forward"), "sampler": ("__call__",)}


def _package_module(name: str) -> bool:
    return name == "tinyserve" or name.startswith("tinyserve.")


# -- import-time changes to the package -------------------------------------------------------


def snapshot() -> list[tuple[object, str, dict]]:
    """``(owner, label, vars copy)`` for every loaded tinyserve module and every class defined in one."""
    taken = []
    for name, module in list(sys.modules.items()):
        if not _package_module(name) or not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        taken.append((module, name, dict(namespace)))
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == name and value.__name__ in namespace:
                taken.append((value, f"{name}.{value.__qualname__}", dict(vars(value))))
    return taken


def undo_changes(taken: list[tuple[object, str, dict]]) -> list[str]:
    """Put back every attribute changed since ``taken``; return what changed, one line each."""
    changed = []
    for owner, label, before in taken:
        now = vars(owner)
        module = isinstance(owner, types.ModuleType)
        for key in set(before) | set(now):
            old, new = before.get(key, _MISSING), now.get(key, _MISSING)
            if old is new or (module and (key.startswith("__") or isinstance(new, types.ModuleType))):
                continue  # a submodule imported for the first time binds itself in its package
            if old is _MISSING:
                changed.append(f"added {label}.{key}")
                delattr(owner, key)
            else:
                changed.append(f"{'deleted' if new is _MISSING else 'replaced'} {label}.{key}")
                setattr(owner, key, old)
    return sorted(changed)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


# -- the loaded object ------------------------------------------------------------------------


def package_origin(obj) -> str | None:
    """``module.qualname`` of ``obj`` if it is the package's class or function (or an instance of a
    package class), else None."""
    target = obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) else type(obj)
    module = getattr(target, "__module__", "") or ""
    if _package_module(module):
        return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', '?'))}"
    return None


def problem_with(comp, obj) -> str | None:
    """Why ``obj`` cannot be ``comp``'s answer (the message names the component), or None."""
    kind = "class" if comp.object[:1].isupper() else "function"
    origin = package_origin(obj)
    if origin is not None:
        return (f"your {comp.module}'s {comp.object} is the package's {origin}, not a {kind} you wrote "
                f"(write your own, or subclass the package's under a name of your own)")
    what = f"your {comp.name} ({comp.object} in {comp.module})"
    if comp.name in SUBCLASS_OF:
        module, cls_name = SUBCLASS_OF[comp.name]
        base = getattr(importlib.import_module(module), cls_name)
        if not (isinstance(obj, type) and issubclass(obj, base)):
            return f"{what} must be a class that subclasses {module}.{cls_name}, got {_shown(obj)}"
        return None
    if comp.name in CALLED_AS:
        return _signature_problem(what, obj, CALLED_AS[comp.name])
    if comp.name in OBJECT_NEEDS and not isinstance(obj, type):
        missing = [m for m in OBJECT_NEEDS[comp.name] if not callable(getattr(obj, m, None))]
        return f"{what} is an object without {', '.join(missing)}: got {_shown(obj)}" if missing else None
    if not callable(obj):
        return f"{what} must be a class (or a function that makes one), got {_shown(obj)}"
    return None


def _signature_problem(what: str, obj, call: str) -> str | None:
    args = call[call.index("(") + 1:-1].split(", ")
    if isinstance(obj, type):
        return (f"{what} is a class, but the package calls {call}: save a function, or an instance of "
                f"your class ({call.split('(')[0]} = {obj.__name__}())")
    if not callable(obj):
        return f"{what} must be a function called as {call}, got {_shown(obj)}"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: its first call will tell
    try:
        signature.bind(*args)
    except TypeError as e:
        return f"{what} takes {signature}, but the package calls {call}: {e}"
    return None


def _shown(obj) -> str:
    text = repr(obj)
    return f"{type(obj).__name__} {text[:80] + '…' if len(text) > 80 else text}"
