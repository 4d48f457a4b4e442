"""Side-by-side runs of the real scheduler, for chapters 02–05's exercises whose answer is a
scheduler component (an allocator, a block manager, an admission rule, a victim policy).

``scheduler_run`` plugs the reader's component in through the Scheduler's documented
constructor arguments and drives it with the simulator; ``show_runs`` prints the runs one under
the other; ``first_difference`` names the first round where two runs part, the one-line answer a
checker reports, and ``check_runs`` grades a component that way on several workloads.
"""

from __future__ import annotations

from collections.abc import Callable

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.verdict import run_cases
from tinyserve.scheduler import Scheduler
from tinyserve.sim import Request, RoundRecord, format_rounds, simulate
from tinyserve.workspace.so_far import round_difference

SAME = "the same rounds"


def scheduler_run(requests: list[Request], scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                  block_manager=None, choose_victim: Callable | None = None,
                  can_admit: Callable | None = None) -> list[RoundRecord]:
    """The simulator's rounds on a Scheduler built with these components (None: the package's)."""
    scheduler = Scheduler(scheduler_config, cache_config, block_manager=block_manager,
                          choose_victim=choose_victim, can_admit=can_admit)
    return simulate(requests, scheduler_config, cache_config, scheduler=scheduler)


def run_with_manager(cls: type, requests: list[Request], scheduler_config: SchedulerConfig,
                     cache_config: CacheConfig) -> list[RoundRecord]:
    """The simulator's rounds with the scheduler's block manager an instance of ``cls`` (a
    BlockSpaceManager subclass), built on the cache config's sizes."""
    manager = cls(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
                  cache_config.watermark)
    return scheduler_run(requests, scheduler_config, cache_config, block_manager=manager)


def _round_facts(r: RoundRecord, tables: bool) -> list[tuple[str, object]]:
    facts = [("batch", ",".join(r.batch) or "-"), ("preempted", ",".join(r.preempted) or "-"),
             ("swapped in", ",".join(r.swapped_in) or "-"), ("ignored", ",".join(r.ignored) or "-"),
             ("free", r.free_gpu_blocks)]
    if tables:
        facts += [(f"{rid}'s table", t) for rid, t in sorted({**r.block_tables, **r.cpu_block_tables}.items())]
    return facts


def first_difference(mine: list[RoundRecord], expected: list[RoundRecord], tables: bool = False) -> str:
    """``SAME``, or where ``mine`` first departs from ``expected`` (short enough for a verdict)."""
    for a, b in zip(mine, expected):
        for (name, x), (_, y) in zip(_round_facts(a, tables), _round_facts(b, tables)):
            if x != y:
                return f"round {a.round}: {name} {x} instead of {y}"
        if len(_round_facts(a, tables)) != len(_round_facts(b, tables)):
            return f"round {a.round}: other block tables"
    if len(mine) != len(expected):
        return f"{len(mine)} rounds instead of {len(expected)}"
    return SAME


# What the round checkers of chapters 04 and 05 compare beyond round_difference's facts: what
# each member brought, the batch's tokens and both pools' tables.
ROUND_FACTS = ("chunk_sizes", "num_batched_tokens", "block_tables", "cpu_block_tables", "free_cpu_blocks")


def round_run_difference(mine: list[RoundRecord], error: str | None, expected: list[RoundRecord]) -> str | None:
    """The first round and fact in which the reader's run ``mine`` (cut short by ``error``, if
    any) departs from ``expected``, or None."""
    for a, b in zip(mine, expected):
        problem = round_difference([a], [b])
        for name in ROUND_FACTS:
            if problem is None and getattr(a, name) != getattr(b, name):
                problem = f"round {a.round}: {name} {getattr(a, name)} instead of {getattr(b, name)}"
        if problem:
            return problem
    if error:
        return f"round {len(mine) + 1} raised {error}"
    if len(mine) != len(expected):
        return f"{len(mine)} rounds instead of {len(expected)}"
    return None


def format_block_tables(records: list[RoundRecord]) -> str:
    """One line per round: every block table (a * marks one in CPU swap space) and the free count."""
    lines = []
    for r in records:
        cells = [f"{rid}={t}" for rid, t in sorted(r.block_tables.items())]
        cells += [f"{rid}=*{t}" for rid, t in sorted(r.cpu_block_tables.items())]
        lines.append(f"round {r.round:>2}  {' '.join(cells) or '-':<44} free {r.free_gpu_blocks}")
    return "\n".join(lines)


def show_runs(runs: dict[str, list[RoundRecord]], tables: bool = False) -> None:
    """Print each run's rounds (or its block tables), one run under the other, then how the later
    runs compare with the first."""
    for label, records in runs.items():
        print(f"-- {label}")
        print(format_block_tables(records) if tables else format_rounds(records))
    (first_label, first), *others = runs.items()
    for label, records in others:
        print(f"{label}, against {first_label}: {first_difference(records, first, tables)}")


SimWorkload = tuple[str, list[Request], SchedulerConfig, CacheConfig]  # (label, requests, configs)


def seed_workloads() -> list[SimWorkload]:
    """s0/s1/s2 under swap and under recompute preemption: every chapter 02-05 checker's first runs."""
    runs = []
    for mode in ("swap", "recompute"):
        seed = presets.seed_rounds(mode)
        runs.append((f"s0/s1/s2, preemption_mode={mode!r}", seed.requests, seed.scheduler_config, seed.cache_config))
    return runs


def check_runs(name: str, workloads: list[SimWorkload], reader: Callable[..., list[RoundRecord]],
               expected: Callable[..., list[RoundRecord]], tables: bool = False) -> bool:
    """Run every workload with the reader's component (``reader(requests, sc, cc)``) and with the
    expected behaviour, and grade through ``run_cases``: a workload fails at its first different
    round (or if the reader's component raises inside the scheduler)."""
    wanted = {label: expected(reqs, sc, cc) for label, reqs, sc, cc in workloads}
    cases = [((label, reqs, sc, cc), SAME) for label, reqs, sc, cc in workloads]
    return run_cases(name, lambda label, reqs, sc, cc: first_difference(reader(reqs, sc, cc), wanted[label], tables),
                     cases, describe=lambda args: args[0])
