"""Checkers for the chapters' exercises.

A reader writes a function in an exercise cell and passes it to a checker, which tests it on
random cases against the package's own implementation and prints a clear verdict. Each checker
also returns True or False, so the book's tests can check the checkers.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("memory", "scheduling", "cache", "attention", "engine", "parallel", "beyond", "kernel")


def __getattr__(name: str):
    for sub in _SUBMODULES:
        try:
            module = importlib.import_module(f"{__name__}.{sub}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{sub}":
                continue
            raise
        if hasattr(module, name) and not name.startswith("_"):
            return getattr(module, name)
    raise AttributeError(f"module 'tinyserve.exercises' has no attribute {name!r}")
