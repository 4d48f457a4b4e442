"""Measuring tinyserve: the benchmarks' workloads, systems and measurements, free of matplotlib.

The benchmarks in ``benchmarks/`` run these and commit CSVs to ``benchmarks/results/``; chapter
11 reads those CSVs, reruns a small version live, and ``tinyserve.viz.performance`` draws them.
Each name is defined in one submodule (``workloads``, ``systems``, ``steps``, ``no_model``,
``results``; ``sweep`` reads the sweep's table) and listed here so a benchmark script can use
one namespace (``perf.compare``).
"""

from __future__ import annotations

from tinyserve.lab.perf.no_model import kv_utilization, time_schedule
from tinyserve.lab.perf.results import RESULTS_DIR, SYSTEMS, read_results, write_results
from tinyserve.lab.perf.steps import STEP_PARTS, step_shares, time_decode_step
from tinyserve.lab.perf.systems import (
    GenerateBatchSystem,
    RunResult,
    StaticGenerateSystem,
    TinyserveSystem,
    agreement,
    compare,
    load_hf_model,
    median_rate,
    step_breakdown,
)
from tinyserve.lab.perf.workloads import (
    PASSAGE,
    Workload,
    load_tokenizer,
    make_prompts,
    mixed_workload,
    uniform_workload,
)

__all__ = [
    "PASSAGE", "RESULTS_DIR", "STEP_PARTS", "SYSTEMS", "GenerateBatchSystem", "RunResult", "StaticGenerateSystem",
    "TinyserveSystem", "Workload", "agreement", "compare", "kv_utilization", "load_hf_model", "load_tokenizer",
    "make_prompts", "median_rate", "mixed_workload", "read_results", "step_breakdown", "step_shares",
    "time_decode_step", "time_schedule", "uniform_workload", "write_results",
]
