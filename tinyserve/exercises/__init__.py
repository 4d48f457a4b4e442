"""Checkers for the chapters' exercises.

A reader writes a function in an exercise cell and passes it to a checker, which tests it on
random cases against the package's own implementation and prints a clear verdict. Each checker
also returns True or False, so the book's tests can check the checkers.
"""

from __future__ import annotations

from tinyserve.viz import lazy_getattr

_SUBMODULES = ("memory", "scheduling", "cache", "attention", "engine", "parallel", "performance", "beyond",
               "kernel")


def __getattr__(name: str):
    return lazy_getattr(__name__, _SUBMODULES, name)
