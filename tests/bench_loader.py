"""Load a benchmark script from ``benchmarks/`` as a module, for the tests that check one.

The scripts are not a package: each puts ``benchmarks/`` on ``sys.path`` for its siblings
(``common``, ``profile_step``, ...), so the folder goes there first. Each call loads the file
afresh, registered in ``sys.modules`` as ``bench_<name>`` (dataclasses look their module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
