"""The bandwidth floor of a decode step: the K/V bytes it must read and the time that takes.

``kv_bytes_per_step`` and ``floor_us`` are the arithmetic ``benchmarks/kernel.py`` measures
against; ``load_kernel_results`` reads the CSV a GPU run of that benchmark leaves behind.
"""

from __future__ import annotations

import csv
from pathlib import Path

H200_BANDWIDTH = 4.8e12  # bytes/s, the H200's datasheet HBM3e bandwidth
KERNEL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernel.csv"


def kv_bytes_per_step(context_lens: list[int], num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K/V bytes one layer's decode step reads: every cached token's K and V row, once per KV
    head (the query heads of a group share the read)."""
    return sum(context_lens) * num_kv_heads * head_dim * 2 * dtype_bytes


def floor_us(nbytes: int, bandwidth: float = H200_BANDWIDTH) -> float:
    """Microseconds to stream ``nbytes`` from memory at ``bandwidth`` bytes/s: no decode kernel
    can be faster, since it must read them all."""
    return nbytes / bandwidth * 1e6


# Layers of the book's models, as the benchmark's shapes: (query heads, KV heads, head_dim).
FLOOR_SHAPES = {
    "SmolLM2-135M layer (9 q / 3 kv heads, d=64)": (9, 3, 64),
    "Llama-3-8B layer (32 q / 8 kv heads, d=128)": (32, 8, 128),
}
FLOOR_CONTEXTS = (128, 512, 2048, 8192, 32768)


def floor_table(batches: tuple[int, ...] = (1, 16, 256), contexts: tuple[int, ...] = FLOOR_CONTEXTS,
                dtype_bytes: int = 2, bandwidth: float = H200_BANDWIDTH) -> list[dict]:
    """One row per layer shape, batch and context: the K/V bytes of one decode step and the floor."""
    rows = []
    for name, (_, kv_heads, head_dim) in FLOOR_SHAPES.items():
        for batch in batches:
            for ctx in contexts:
                nbytes = kv_bytes_per_step([ctx] * batch, kv_heads, head_dim, dtype_bytes)
                rows.append(dict(shape=name, batch=batch, context=ctx, kv_MiB=nbytes / 2**20,
                                 floor_us=floor_us(nbytes, bandwidth)))
    return rows


def load_kernel_results(path: str | Path = KERNEL_RESULTS) -> list[dict] | None:
    """The rows of the benchmark's CSV with numbers parsed, or None when no GPU run left one."""
    path = Path(path)
    if not path.exists():
        return None
    rows = []
    with path.open() as f:
        for raw in csv.DictReader(f):
            row = {}
            for key, value in raw.items():
                try:
                    row[key] = int(value)
                except ValueError:
                    try:
                        row[key] = float(value)
                    except ValueError:
                        row[key] = value if value != "" else None
            rows.append(row)
    return rows
