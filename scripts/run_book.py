"""Execute chapter notebooks in place (``make book``): outputs kept, widget state stripped.

Usage: python scripts/run_book.py chapters/01_kv_cache.ipynb [...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def strip_widget_state(nb: nbformat.NotebookNode) -> None:
    """Saved widget models go stale the moment the kernel stops; keep only their text fallback."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_MIME in data:
                del data[WIDGET_MIME]


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - start
    strip_widget_state(nb)
    nbformat.write(nb, path)
    return elapsed


def main(paths: list[str]) -> None:
    # The committed outputs are the package's and the solutions', never a reader's saved answers
    # (tinyserve.workspace), and running the book must not overwrite those: an empty workspace.
    os.environ["TINYSERVE_WORKSPACE"] = tempfile.mkdtemp(prefix="tinyserve-book-workspace-")
    # The committed outputs must not depend on whether the machine that ran the book computes
    # bfloat16 natively (where dtype="auto" would pick it): the book runs in float32 on the CPU
    # and chapter 11 reads its bf16 numbers from the benchmarks' results.
    os.environ.setdefault("TINYSERVE_CPU_DTYPE", "float32")
    for p in paths:
        elapsed = execute(Path(p))
        print(f"{p}: executed in {elapsed:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
