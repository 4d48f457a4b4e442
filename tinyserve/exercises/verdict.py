"""The shared way a checker reports: one line per failed case, then a verdict."""

from __future__ import annotations


def verdict(name: str, failures: list[str], num_cases: int) -> bool:
    if failures:
        print(f"✗ {name}: {len(failures)} of {num_cases} cases failed. First failures:")
        for f in failures[:3]:
            print(f"    {f}")
        return False
    print(f"✓ {name}: all {num_cases} cases passed.")
    return True
