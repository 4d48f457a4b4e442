"""The shared way a checker runs the reader's function and reports: one line per failed case,
then a verdict."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Callable
from dataclasses import dataclass

_repr = reprlib.Repr()
_repr.maxlist = 12
_repr.maxstring = 60


def verdict(name: str, failures: list[str], num_cases: int) -> bool:
    if failures:
        print(f"✗ {name}: {len(failures)} of {num_cases} cases failed. First failures:")
        for f in failures[:3]:
            print(f"    {f}")
        return False
    print(f"✓ {name}: all {num_cases} cases passed.")
    return True


def run_cases(name: str, fn: Callable, cases: list[tuple[tuple, object]],
              describe: Callable[[tuple], str] | None = None,
              same: Callable[[object, object], bool] = operator.eq) -> bool:
    """Call ``fn(*args)`` for each ``(args, expected)``; a case fails if it raises, or if
    ``same(got, expected)`` is false (or itself raises, as on a result of the wrong shape)."""
    describe = describe or (lambda args: ", ".join(_repr.repr(a) for a in args))
    failures = []
    for args, expected in cases:
        try:
            got = fn(*args)
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"{name}({describe(args)}) raised {type(e).__name__}: {e}")
            continue
        try:
            ok = same(got, expected)
        except Exception:
            ok = False
        if not ok:
            failures.append(f"{name}({describe(args)}) -> {_repr.repr(got)}, expected {_repr.repr(expected)}")
    return verdict(name, failures, len(cases))


# -- the registry: every checker of the book, by chapter -------------------------------------------

@dataclass(frozen=True)
class Checker:
    """One exercise's checker. ``answer`` is the name of the reader's function or class that the
    chapter's solution (``chapters/solutions/chNN.py``) defines and the checker takes."""

    chapter: int
    answer: str
    check: Callable[..., bool]


CHECKERS: dict[str, Checker] = {}


def checker(chapter: int, answer: str) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Register ``check_*`` as the checker of chapter ``chapter``'s exercise whose answer is named
    ``answer``. The book's tests run every registered checker on the chapter's solution (it must
    pass) and on deliberately wrong answers (each must fail)."""
    def register(fn: Callable[..., bool]) -> Callable[..., bool]:
        if fn.__name__ in CHECKERS:
            raise ValueError(f"two checkers are named {fn.__name__}")
        CHECKERS[fn.__name__] = Checker(chapter, answer, fn)
        return fn
    return register
