"""Torch's idle OpenMP threads sleep however a chapter is opened: tinyserve sets the wait policy
before torch loads, and every chapter imports tinyserve before anything that loads torch.

OpenMP reads OMP_WAIT_POLICY once, when torch's runtime loads; spinning threads made a learner's
engine run 1.3 tok/s instead of 16.6 with another process on the cores.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).resolve().parents[1] / "chapters").glob("[0-9][0-9]_*.ipynb"))
TORCH_LOADERS = {"torch", "transformers", "triton"}


def _policy_after(code: str, env_policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_import_sets_passive_before_torch():
    assert _policy_after("import tinyserve, torch", None) == "PASSIVE"


def test_a_readers_own_setting_wins():
    assert _policy_after("import tinyserve", "ACTIVE") == "ACTIVE"


def test_too_late_after_torch_is_not_pretended():
    # Once torch's runtime is loaded the setting would change nothing; the package leaves it unset.
    assert _policy_after("import torch, tinyserve", None) == "None"


def _first_imports(nb_path: Path) -> list[str]:
    nb = json.loads(nb_path.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    src = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
    names = []
    for node in ast.parse(src).body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_imports_tinyserve_before_torch(path: Path):
    names = _first_imports(path)
    assert "tinyserve" in names, f"{path.name}: the first code cell does not import tinyserve"
    first_torch = min((i for i, n in enumerate(names) if n in TORCH_LOADERS), default=len(names))
    assert names.index("tinyserve") < first_torch, (
        f"{path.name}: {names[first_torch]} is imported before tinyserve, so torch's threads spin")
