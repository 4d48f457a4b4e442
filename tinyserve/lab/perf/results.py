"""The benchmarks' CSVs in ``benchmarks/results/``: where they live, how to read and write them."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
SYSTEMS = ("tinyserve", "tinyserve-orca", "generate", "generate_batch")  # in the order tables list them


def read_results(name: str, results_dir: str | Path | None = None) -> list[dict]:
    """Rows of ``benchmarks/results/<name>.csv``, with numbers converted."""
    path = Path(results_dir or RESULTS_DIR) / f"{name}.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, v in row.items():
            with contextlib.suppress(ValueError, TypeError):
                row[k] = float(v) if any(c in v for c in ".eE") else int(v)
    return rows


def write_results(name: str, rows: list[dict], results_dir: str | Path | None = None) -> Path:
    path = Path(results_dir or RESULTS_DIR) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path
