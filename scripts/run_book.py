"""Execute chapter notebooks in place (``make book``): outputs kept, widget state stripped.

A widget's committed output is its saved view (``tinyserve.viz.widget_view``): one key frame
under a caption, which JupyterLab, nbviewer and GitHub show; the live view, whose model dies with
the kernel, is dropped, as the .venv's Jupyter server drops it whenever a reader saves.

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

from tinyserve.viz.widget_view import drop_widget_views


def strip_widget_state(nb: nbformat.NotebookNode) -> int:
    """Saved widget models go stale the moment the kernel stops; keep only the saved views.
    Returns how many widget views were dropped."""
    nb.metadata.pop("widgets", None)
    return drop_widget_views(nb)


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
