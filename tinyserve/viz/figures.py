"""Regenerate every figure in ``figures/`` from the drawing functions (``make figures``).

``REGISTRY`` is the list: each figure's name and the function that draws it, as ``"module:function"``
in ``tinyserve.viz``. The function takes no argument and returns a matplotlib Figure built from real
objects (simulator runs, live block managers, benchmark CSVs). The drawing modules know nothing of
this list: it names them, and ``draw`` imports the one it needs, so importing this module for
``save`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tinyserve.lab.bandwidth import KERNEL_RESULTS

REGISTRY: dict[str, str] = {
    "00_architecture": "architecture:fig_architecture",
    "00_chapter_map": "architecture:fig_chapter_map",
    "01_fragmentation": "kv_cache:fragmentation_figure",
    "01_kv_sizes": "kv_cache:kv_sizes_figure",
    "02_block_tables": "blocks:block_tables_figure",
    "02_slot_mapping": "slots:slot_mapping_figure",
    "03_block_life": "diagrams:fig_block_life",
    "03_block_table_history": "blocks:block_table_history_figure",
    "04_orca_vs_vllm_timeline": "rounds:fig_orca_vs_vllm",
    "04_static_vs_iteration": "rounds:fig_static_vs_iteration",
    "05_queue_transitions": "diagrams:fig_queue_transitions",
    "05_recompute_vs_swap": "rounds:fig_recompute_vs_swap",
    "05_seed_rounds_blocks": "rounds:fig_seed_rounds_blocks",
    "05_watermark_sweep": "rounds:fig_watermark_sweep",
    "06_copy_on_write": "cache:fig_copy_on_write",
    "06_memory_budget": "cache:fig_memory_budget",
    "06_split_x_layout": "cache:fig_split_x_layout",
    "06_swap_pools": "cache:fig_swap_pools",
    "07_token_slots": "attention:fig_token_slots",
    "08_bandwidth_floor": "attention_kernel:fig_bandwidth_floor",
    "08_program_grid": "attention_kernel:fig_program_grid",
    "08_program_walk": "attention_kernel:fig_program_walk",
    "09_packed_inputs": "engine:fig_packed_inputs",
    "09_sampling": "engine:fig_sampling",
    "09_seed_rounds": "engine:fig_seed_rounds",
    "09_step_sequence": "diagrams:fig_step_sequence",
    "09_step_times": "engine:fig_step_times",
    "10_column_row_parallel": "parallel:column_row_parallel_figure",
    "10_memory_per_rank": "parallel:memory_per_rank_figure",
    "11_compiled_step": "graphs:compiled_step_figure",
    "11_kv_utilization": "performance:kv_utilization_figure",
    "11_step_breakdown": "performance:step_breakdown_figure",
    "11_sweeps": "performance:sweeps_figure",
    "11_throughput": "performance:throughput_figure",
    "11_throughput_sweep": "sweep:sweep_figure",
    "11_throughput_sweep_bfloat16": "sweep:bfloat16_sweep_figure",
    "11_throughput_sweep_compiled": "sweep:compiled_sweep_figure",
    "12_chunked_prefill": "beyond:fig_chunked_prefill",
    "12_prefix_sharing": "beyond:fig_prefix_sharing",
    "13_policy_rounds": "policies:fig_policy_rounds",
    "13_rate_sweep": "policies:fig_rate_sweep",
    "13_serving_latency": "serving:serving_latency_figure",
}
if KERNEL_RESULTS.exists():  # measured results only where a GPU run left them
    REGISTRY["08_kernel_bandwidth"] = "attention_kernel:fig_kernel_bandwidth"


def drawing_function(name: str) -> Callable:
    """The function that draws the registered figure ``name``."""
    module, _, function = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(f"tinyserve.viz.{module}"), function)


def draw(name: str):
    """Draw the registered figure ``name``: a matplotlib Figure."""
    return drawing_function(name)()


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

    paths = []
    for name in sorted(REGISTRY):
        fig = draw(name)
        paths.append(save(fig, name, out_dir))
        plt.close(fig)
        print(f"wrote {paths[-1]}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(repo_figures_dir()))
