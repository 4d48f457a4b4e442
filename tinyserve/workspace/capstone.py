"""The capstone of chapter 09: the reader's engine serves the real model, beside the package's.

``capstone()`` builds the engine from every part the reader has saved (allocator, block manager,
the scheduler's rounds, cache engine, attention, input builder, sampler, and the serving loop's
step itself, ``engine_step``; the package's for the parts not written) and runs SmolLM2 greedily
on three workloads, each beside the package's own engine: s0/s1/s2 with swapping (the story's
preemption), six prompts on a cache too small for them (preempted and recomputed) and s0/s1/s2
under the Orca policy. It prints the tokens side by side with a verdict per request, whose each
part was and how many calls each of the reader's served ("your orca_round ran 16 rounds"), and
returns a ``Capstone``. The reader's runs are contained (``contain``): a step is bounded in
time, and whatever the reader's code raises is a problem of the report, never an exception out
of ``capstone()``. With ``$TINYSERVE_CAPSTONE_RESULT`` set it also writes the result there as
JSON: the book's tests run chapter 09 with the solutions saved as the reader's answers and check it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sim import Request
from tinyserve.workspace.assemble import Report, build_engine
from tinyserve.workspace.so_far import _engine_run, readers_engine_run, round_difference

RESULT_ENV = "TINYSERVE_CAPSTONE_RESULT"
# The capstone closes chapter 09: it runs the parts of chapters up to 09 (none of its workloads
# uses policy="v1", and chapter 13's v1_round would only add a name to its report).
CHAPTER = 9

# Six prompts whose prompts and outputs need about twice the 12 blocks of 4 tokens the cache
# holds: the newest requests are preempted and recomputed before all of them finish.
CROWD_PROMPTS = {
    "c0": "The capital of France is",
    "c1": "Once upon a time, there was a",
    "c2": "In 1969, the first person to walk on the",
    "c3": "The best way to learn to cook is",
    "c4": "My favourite colour is",
    "c5": "Water boils at a temperature of",
}


def crowd(max_tokens: int = 12) -> presets.Preset:
    """The preempting workload: six prompts, 12 GPU blocks of 4 tokens, recompute."""
    return presets.Preset(
        scheduler_config=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=6, max_model_len=40,
                                         preemption_mode="recompute"),
        cache_config=CacheConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=8, watermark=0.0),
        # The simulator's view only (the engine runs the prompts): the lengths are the words'.
        requests=[Request(rid, len(p.split()), max_tokens) for rid, p in CROWD_PROMPTS.items()],
        prompts=dict(CROWD_PROMPTS),
        max_tokens=max_tokens,
    )


def workloads() -> dict[str, presets.Preset]:
    return {"s0/s1/s2, swap": presets.seed_rounds("swap"),
            "six prompts, 12 blocks, recompute": crowd(),
            "s0/s1/s2, Orca": presets.seed_rounds("swap", policy="orca")}


@dataclass
class Row:
    """One request of one workload: both engines' tokens, and the text of the reader's."""

    workload: str
    request_id: str
    yours: list[int]
    packages: list[int]
    text: str

    @property
    def same(self) -> bool:
        return self.yours == self.packages


@dataclass
class Capstone:
    ok: bool
    report: Report
    rows: list[Row] = field(default_factory=list)
    preemptions: dict[str, int] = field(default_factory=dict)  # per workload, in the reader's run
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The result as JSON: ``yours`` are the reader's parts built in, ``calls`` what each of
        them served, ``served`` those that served any."""
        return {"ok": self.ok, "yours": self.report.yours(), "report": dict(self.report),
                "calls": {name: self.report.calls.get(name, 0) for name in self.report.yours()},
                "served": self.report.served(), "said": self.report.said(),
                "notes": self.report.notes, "preemptions": self.preemptions, "problems": self.problems,
                "rows": [asdict(r) | {"same": r.same} for r in self.rows]}


def _table(rows: list[Row]) -> str:
    lines = [f"{'request':8} {'same':5} {'your tokens':44} text"]
    for r in rows:
        tokens = " ".join(map(str, r.yours))
        lines.append(f"{r.request_id:8} {'✓' if r.same else '✗':5} {tokens[:44]:44} {r.text!r}")
        if not r.same:
            lines.append(f"{'':8} {'':5} package's: {' '.join(map(str, r.packages))}")
    return "\n".join(lines)


def capstone(model=None, *, quiet: bool = False) -> Capstone:
    """Run the workloads through the reader's engine and the package's (see the module's
    docstring); ``model`` as ``build_engine`` takes it (default SmolLM2, else the tiny Llama)."""
    rows: list[Row] = []
    problems: list[str] = []
    preemptions: dict[str, int] = {}
    reports: list[Report] = []
    for name, preset in workloads().items():
        package_engine, _ = build_engine(model, preset=preset, chapter=0)
        expected, package_rounds, _ = _engine_run(package_engine, preset)
        got, rounds, report, error = readers_engine_run(model, preset, CHAPTER, len(package_rounds))
        reports.append(report)
        if error:
            problems.append(f"{name}: {error}")
        difference = round_difference(rounds, package_rounds)
        if difference and not error:
            problems.append(f"{name}: {difference}")
        preemptions[name] = sum(len(r.preempted) for r in rounds)
        tokenizer = package_engine.tokenizer
        for rid, want in expected.items():
            mine = got.get(rid, [])
            rows.append(Row(name, rid, mine, want, tokenizer.decode(mine)))
    report = Report.combined(reports)
    ok = not problems and all(r.same for r in rows)
    result = Capstone(ok, report, rows, preemptions, problems)
    if not quiet:
        print(report)
        for name in workloads():
            n = preemptions[name]
            print(f"\n{name} ({n} preemption{'' if n == 1 else 's'} in your run):")
            print(_table([r for r in rows if r.workload == name]))
        same = sum(r.same for r in rows)
        verdict = "identical to the package's" if ok else "not identical"
        print(f"\n{'✓' if ok else '✗'} {same} of {len(rows)} requests' tokens {verdict}")
        for p in problems:
            print(f"  {p}")
    path = os.environ.get(RESULT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1)
    return result
