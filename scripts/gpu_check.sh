#!/usr/bin/env bash
# The one prepared script for a machine with a CUDA GPU: the tests with compiled Triton kernels,
# then the kernel benchmark, end to end, CUDA graphs (the step with and without) and throughput.
# Everything it produces goes to $OUT (default ./out).
#
# It expects the repository without .venv and a Python that already has torch, triton,
# transformers and pytest (nothing is installed here). Each step runs under `timeout`, a failed
# step does not stop the later ones, and every step's exit status lands in $OUT/summary.txt; the
# script itself exits non-zero if any step failed. Budget: under 8 minutes in all.
#
#   OUT=/tmp/out bash scripts/gpu_check.sh
#   T_TESTS=240 T_BENCH=120 bash scripts/gpu_check.sh     # per-step limits in seconds
#
# Note: a test module that imports an optional plugin (hypothesis, pytest-timeout) must guard
# it with pytest.importorskip, since this machine may not have it; collection errors are
# reported but do not stop the other test files (--continue-on-collection-errors).

set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, not installed
# Compiled kernels, never the interpreter: the tests and the benchmark must measure the real thing.
unset TRITON_INTERPRET
T_INFO="${T_INFO:-30}"
T_TESTS="${T_TESTS:-120}"
T_BENCH="${T_BENCH:-120}"
T_E2E="${T_E2E:-60}"
T_TPUT="${T_TPUT:-60}"
T_GRAPHS="${T_GRAPHS:-60}"

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$SECONDS

# step NAME LIMIT CMD...: run CMD under `timeout LIMIT`, log to $OUT/NAME.log, record the status.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "!!! $name timed out after ${limit}s" | tee -a "$OUT/$name.log"
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-12s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
}

step info "$T_INFO" bash -c '
    nvidia-smi
    echo
    "$0" - <<"EOF"
import os, sys, platform
from importlib.metadata import PackageNotFoundError, version
print("python", sys.version.split()[0], sys.executable, platform.platform())
for dist in ("torch", "triton", "transformers", "numpy", "pytest", "hypothesis", "pytest-timeout"):
    try:
        print(f"{dist:15s}", version(dist))
    except PackageNotFoundError:
        print(f"{dist:15s} missing")
import torch
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
from tinyserve.attention import triton_paged as tp
print("TRITON_INTERPRET =", os.environ.get("TRITON_INTERPRET"), "| kernels interpreted:", tp.INTERPRET)
assert not tp.INTERPRET, "the Triton kernels would run in the interpreter"
EOF
' "$PY"

step tests "$T_TESTS" "$PY" -m pytest -q tests -k "not slow" --ignore=tests/test_chapters.py -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$OUT/pytest.xml" -o junit_family=xunit2

step bench "$T_BENCH" "$PY" benchmarks/kernel.py --quick --out "$OUT/kernel.csv"

# End to end: s0/s1/s2 on a random-weight SmolLM2-shaped model (the real weights don't travel),
# rounds compared with the simulator, Triton vs torch backends compared token for token.
step e2e "$T_E2E" "$PY" scripts/e2e_random.py --device cuda --out "$OUT/e2e.json"

# Decode steps as CUDA graphs (graphs/cuda.py): greedy tokens with and without graphs, and the step
# at batch 1, 8, 16 and 32 both ways, taking turns.
step graphs "$T_GRAPHS" "$PY" scripts/graphs_check.py --device cuda --out "$OUT/graphs.json"

# Throughput against transformers on random-weight models of SmolLM2's shape and a 1B Llama shape.
step tput_smollm2 "$T_TPUT" "$PY" benchmarks/throughput.py --device cuda --model random-smollm2 --no-sweeps \
    --out "$OUT/tput_smollm2"
step tput_1b "$T_TPUT" "$PY" benchmarks/throughput.py --device cuda --model random-1b --no-sweeps \
    --out "$OUT/tput_1b"

echo "=== done in $((SECONDS - START))s; results in $OUT"
cat "$SUMMARY"
exit "$FAILED"
