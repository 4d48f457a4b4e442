"""Every exercise checker of the book, run on the chapter's solution and on deliberately wrong answers.

The checkers register themselves (``@checker(chapter=NN, answer=...)`` in
``tinyserve/exercises/chNN.py``); the solutions live in ``chapters/solutions/chNN.py``, one
top-level object per checker, named by the checker's ``answer``, and each chapter's
``## Solutions`` cell runs that file with ``runpy``; the wrong answers live in
``tests/exercise_mistakes.py``. A checker passes here only if it accepts the solution and rejects
every mistake, so a checker that accepts anything (or nothing) fails the book's tests.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

import pytest

import tinyserve.exercises as exercises
from tinyserve.exercises.verdict import CHECKERS

sys.path.insert(0, str(Path(__file__).parent))
from exercise_mistakes import MISTAKES  # noqa: E402

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"


@functools.cache
def solutions(chapter: int) -> dict:
    """The names ``chapters/solutions/chNN.py`` defines, run as the chapters run it (``runpy``,
    which writes no bytecode into the checkout)."""
    return runpy.run_path(str(SOLUTIONS / f"ch{chapter:02d}.py"))


def answer_of(name: str):
    entry = CHECKERS[name]
    return solutions(entry.chapter)[entry.answer]


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_the_solution_passes(name, capsys):
    assert CHECKERS[name].check(answer_of(name)) is True
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("name,index", [(n, i) for n in sorted(MISTAKES) for i in range(len(MISTAKES[n]))])
def test_a_wrong_answer_fails(name, index, capsys):
    assert name in CHECKERS, f"{name} has mistakes but no registered checker"
    assert CHECKERS[name].check(MISTAKES[name][index]) is False
    assert "✗" in capsys.readouterr().out


def test_every_checker_has_a_solution_and_a_mistake():
    assert CHECKERS, "no checker registered: tinyserve.exercises imports none of its chapter modules"
    for name, entry in CHECKERS.items():
        assert entry.answer in solutions(entry.chapter), \
            f"chapters/solutions/ch{entry.chapter:02d}.py defines no {entry.answer} for {name}"
        assert MISTAKES.get(name), f"tests/exercise_mistakes.py has no wrong answer for {name}"


def test_answer_names_are_unique_within_a_chapter():
    seen: dict[tuple[int, str], str] = {}
    for name, entry in CHECKERS.items():
        key = (entry.chapter, entry.answer)
        assert key not in seen, f"{name} and {seen[key]} both take chapter {entry.chapter}'s {entry.answer}"
        seen[key] = name


def test_every_checker_is_importable_from_the_package_by_its_name():
    for name, entry in CHECKERS.items():
        assert getattr(exercises, name) is entry.check
        # A chapter's checkers live in its module or in one of its parts (chNN_<exercise>.py).
        module = entry.check.__module__
        home = f"tinyserve.exercises.ch{entry.chapter:02d}"
        assert module == home or module.startswith(home + "_"), \
            f"{name} lives in {module}, not in a module named by its chapter"
