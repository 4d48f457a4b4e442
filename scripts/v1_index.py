"""Index the names of vLLM V1's source, for chapter 13's prose test.

Chapter 13 names V1's files, classes, functions and attributes (`vllm/v1/core/sched/scheduler.py`,
`KVCacheManager.allocate_slots`, ...). `make test` has vLLM v0.4.0 installed, not V1, so
`tests/test_prose.py` checks those names against `tests/vllm_v1_index.json`, which this script
writes from a vLLM source tree (`make v1-oracle` unpacks the 0.9.2 wheel and checks that the
committed index is the one this script makes from it).

    python scripts/v1_index.py PATH/TO/site-packages [OUT.json]

The index holds, for the files under ``vllm/v1/`` and those in EXTRA: every file's path, and each
top-level name -> [file, members, base names], members being a class's methods, nested classes,
``self.x`` attributes and class-level names, as tests/test_prose.py indexes v0.4.0.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

EXTRA = ["vllm/config.py", "vllm/engine/arg_utils.py", "vllm/sampling_params.py"]


def class_members(node: ast.ClassDef) -> list[str]:
    members = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
            members.add(item.name)
        elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and isinstance(item.value, ast.Name):
            members.add(item.attr)
    for item in node.body:
        targets = (item.targets if isinstance(item, ast.Assign)
                   else [item.target] if isinstance(item, ast.AnnAssign) else [])
        members.update(t.id for t in targets if isinstance(t, ast.Name))
    return sorted(members)


def index(site: Path) -> dict:
    files = sorted(site.glob("vllm/v1/**/*.py")) + [site / p for p in EXTRA if (site / p).exists()]
    names: dict[str, list] = {}
    for path in files:
        where = str(path.relative_to(site))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                names.setdefault(node.name, []).append([where, class_members(node), bases])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.setdefault(node.name, []).append([where, [], []])
    folders = sorted({str(p.relative_to(site).parent) for p in files})
    return {"version": version(site), "files": [str(p.relative_to(site)) for p in files], "folders": folders,
            "names": dict(sorted(names.items()))}


def version(site: Path) -> str:
    for dist in site.glob("vllm-*.dist-info"):
        return dist.name.removeprefix("vllm-").removesuffix(".dist-info")
    return "unknown"


def main() -> None:
    site = Path(sys.argv[1])
    default = Path(__file__).resolve().parents[1] / "tests" / "vllm_v1_index.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else default
    out.write_text(json.dumps(index(site), indent=0, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
