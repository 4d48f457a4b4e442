"""Shared bits of the CPU benchmarks: where results go, what machine they came from, tables."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """One line naming the CPU, the cores this process may use and torch's thread count."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    from tinyserve.config import cpu_has_native_bf16

    # Two EPYCs of the same name may differ in bf16 (benchmarks/roofline.py measures what it costs).
    cpu += " with native bf16" if cpu_has_native_bf16() else " without native bf16"
    return (f"{cpu}, {cores} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")


def dtype_suffix(dtype: str) -> str:
    """What a benchmark's result files add to their name for ``dtype``: nothing for float32, whose
    files keep the names they had before other dtypes were measured, else ``_<dtype>``."""
    return "" if dtype == "float32" else f"_{dtype}"


def table(rows: list[dict], columns: list[str], formats: dict[str, str] | None = None) -> str:
    """A plain-text table of ``rows`` (dicts), one column per name in ``columns``."""
    formats = formats or {}
    cells = [[format(r[c], formats.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


@contextmanager
def patched(obj, attr: str, value) -> Iterator[None]:
    """``obj.attr = value`` for the duration of the block, then back as it was: the same value
    where ``obj`` held it itself (an instance attribute or a module global), or no attribute of its
    own where it came from a class."""
    had = attr in vars(obj)
    original = vars(obj).get(attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)
