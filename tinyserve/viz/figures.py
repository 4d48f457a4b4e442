"""Regenerate every figure in ``figures/`` from the drawing functions (``make figures``).

A drawing module registers a figure with ``@figure("NN_name")``; the function returns a
matplotlib Figure built from real objects (simulator runs, live block managers, benchmark CSVs).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REGISTRY: dict[str, Callable] = {}


def figure(name: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        REGISTRY[name] = fn
        return fn
    return register


def _load_all() -> None:
    # Every module that registers a figure, imported by name (tests/test_names.py checks the list).
    import tinyserve.viz.architecture  # noqa: F401
    import tinyserve.viz.attention  # noqa: F401
    import tinyserve.viz.attention_kernel  # noqa: F401
    import tinyserve.viz.beyond  # noqa: F401
    import tinyserve.viz.blocks  # noqa: F401
    import tinyserve.viz.cache  # noqa: F401
    import tinyserve.viz.engine  # noqa: F401
    import tinyserve.viz.kv_cache  # noqa: F401
    import tinyserve.viz.parallel  # noqa: F401
    import tinyserve.viz.performance  # noqa: F401
    import tinyserve.viz.rounds  # noqa: F401
    import tinyserve.viz.slots  # noqa: F401
    import tinyserve.viz.sweep  # noqa: F401


def figures_dir() -> Path:
    """Where chapters save their figures: ``$TINYSERVE_FIGURES_DIR`` when it is set (``make book``
    points it at the repository's ``figures/``), else a scratch folder in the temp directory.

    Reading a chapter must never rewrite committed files, so only the make targets write
    ``figures/``; a reader's run leaves the clone clean."""
    env = os.environ.get("TINYSERVE_FIGURES_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "tinyserve-figures"


def repo_figures_dir() -> Path:
    """The repository's committed ``figures/`` (what ``make figures`` writes)."""
    return Path(__file__).resolve().parents[2] / "figures"


def save(fig, name: str, out_dir: str | Path | None = None) -> Path:
    """Save a figure as ``name.png`` in the figures directory (chapters call this)."""
    out = Path(out_dir) if out_dir is not None else figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def main(out_dir: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _load_all()
    paths = []
    for name, fn in sorted(REGISTRY.items()):
        fig = fn()
        paths.append(save(fig, name, out_dir))
        plt.close(fig)
        print(f"wrote {paths[-1]}")
    return paths


if __name__ == "__main__":
    # Run as a script this file is ``__main__``, but drawing modules register into the importable
    # ``tinyserve.viz.figures``: call that module's main so its registry is the one filled.
    from tinyserve.viz.figures import main as _main

    _main(sys.argv[1] if len(sys.argv) > 1 else str(repo_figures_dir()))
