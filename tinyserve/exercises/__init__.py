"""Checkers for the chapters' exercises, one module per chapter: ``chNN.py`` holds chapter NN's.

A reader writes a function or a class in an exercise cell and passes it to a checker, which
runs it on fixed and random cases, and for the exercises whose answer is a component, inside
the real scheduler or engine, against an independent expectation, and prints a verdict. Each
checker returns True or False and is registered, with its chapter, in ``verdict.CHECKERS``:
the book's tests run every one on the chapter's solution and on deliberately wrong answers.
"""

from __future__ import annotations

# Importing a chapter's module registers its checkers; each is then a name of this package.
from tinyserve.exercises import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12, ch13, ch14  # noqa: F401
from tinyserve.exercises.verdict import CHECKERS

globals().update({name: entry.check for name, entry in CHECKERS.items()})
__all__ = sorted(CHECKERS)
