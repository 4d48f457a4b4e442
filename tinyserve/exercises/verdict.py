"""The shared way a checker runs the reader's function and reports: one line per failed case,
then a verdict."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Callable

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
