"""Scheduler overhead: one ``schedule()`` with 256 running sequences, against one decode step.

The scheduler is pure Python and runs on the CPU between model steps, so its time is time the
accelerator (here: the same CPU) does no model work. This measures

- the median time of one ``schedule()`` while 256 sequences decode together, with a cache of
  10 000 blocks (no model involved);
- one decode step of the default model at batch 256 (prompts of 64 tokens), split into
  scheduling, input preparation, the forward pass and sampling;

and prints the scheduler's share of a step.

    python benchmarks/scheduler_overhead.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# As the Makefile does: OpenMP threads that busy-wait make torch many times slower whenever
# another process shares the cores. Set before torch starts its threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common import RESULTS_DIR, machine, table  # noqa: E402

from tinyserve.lab import perf  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 16, fewer rounds (a smoke test)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    num_seqs = 16 if args.quick else 256
    print(f"machine: {machine()}")

    sched = perf.time_schedule(num_seqs=num_seqs, num_blocks=10_000, rounds=20 if args.quick else 300)
    sched_ms = 1000 * statistics.median(sched)
    print(f"schedule() with {num_seqs} running sequences, 10 000 blocks: median {sched_ms:.2f} ms "
          f"over {len(sched)} rounds (p90 {1000 * sorted(sched)[int(0.9 * len(sched))]:.2f} ms)")

    from tinyserve import LLM

    llm = LLM(model=args.model, device=args.device, max_num_seqs=num_seqs, swap_space=0.0)
    steps = perf.time_decode_step(llm, num_seqs=num_seqs, prompt_len=64, rounds=2 if args.quick else 4)
    step = {k: statistics.median(r[k] for r in steps) for k in steps[0]}
    total = sum(step.values())
    print(f"one decode step of {args.model} at batch {num_seqs} (median of {len(steps)}):")
    print(table([dict(part=k, ms=1000 * v, share=v / total) for k, v in step.items()] +
                [dict(part="total", ms=1000 * total, share=1.0)], ["part", "ms", "share"],
                {"ms": ".2f", "share": ".1%"}))
    share = sched_ms / 1000 / (total - step["schedule"] + sched_ms / 1000)
    print(f"schedule() with 10 000 blocks is {share:.1%} of a batch-{num_seqs} decode step")
    rows = [dict(num_seqs=num_seqs, num_blocks=10_000, schedule_ms=round(sched_ms, 4),
                 engine_schedule_ms=round(1000 * step["schedule"], 4), prepare_ms=round(1000 * step["prepare"], 3),
                 model_ms=round(1000 * step["model"], 3), sample_ms=round(1000 * step["sample"], 3),
                 schedule_share=round(share, 5), machine=machine())]
    print(f"wrote {perf.write_results('scheduler_overhead', rows, args.out)}")


if __name__ == "__main__":
    main()
