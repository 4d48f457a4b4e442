""""Your engine so far": s0/s1/s2 through the reader's parts beside the package's own run.

Chapters 02–05 run the scheduler with no model (the simulator's scripted requests) and compare
the rounds: what each schedules, preempts, swaps out and in, finishes, leaves in each queue, and
the free GPU blocks (not block numbers: an allocator may hand out other blocks and be right).
Chapter 04 runs s0/s1/s2 twice, under the vLLM policy and under the orca policy, whose round is
that chapter's component (``orca_round``); chapters 02–12 run the vLLM policy only, and from
chapter 13 on the engine runs s0/s1/s2 under ``policy="v1"`` as well (chapter 13's ``v1_round``).
From chapter 06 the engine runs the prompts greedily on a model (SmolLM2 if installed, else the
tiny random Llama; with the tiny tokenizer the prompts are 9, 7 and 4 tokens, so the rounds are
not the story's, but both runs share them) and the tokens are compared as well as the rounds.

The reader's run is contained (``contain``): each round is bounded in time, anything it raises
is the verdict's problem line, and the report counts the calls each of the reader's parts served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tinyserve import presets
from tinyserve.sampling_params import SamplingParams
from tinyserve.sim import RoundRecord, make_record, simulate
from tinyserve.workspace import contain
from tinyserve.workspace.assemble import (
    ENGINE_PARTS,
    LATER_PARTS,
    PACKAGES,
    SCHEDULER_PARTS,
    YOURS,
    Report,
    build_engine,
    build_scheduler,
)
from tinyserve.workspace.contain import ComponentError, Tracker, contained
from tinyserve.workspace.store import COMPONENTS, saved_components

FACTS = ("phase", "batch", "preempted", "swapped_out", "swapped_in", "finished", "ignored", "waiting", "running",
         "swapped", "free_gpu_blocks")


@dataclass
class Verdict:
    """What ``your_engine_so_far`` found: ``ok`` and the one-line ``verdict``, the report of whose
    each part is, and both runs' rounds (and tokens, from chapter 06)."""

    chapter: int
    kind: str  # "rounds" | "tokens"
    ok: bool
    verdict: str
    report: Report
    yours: list[RoundRecord] = field(default_factory=list)
    packages: list[RoundRecord] = field(default_factory=list)
    your_tokens: dict[str, list[int]] = field(default_factory=dict)
    package_tokens: dict[str, list[int]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.verdict}\n{self.report}"


def _show(value) -> str:
    return ",".join(value) or "-" if isinstance(value, list) else str(value)


def round_difference(mine: list[RoundRecord], expected: list[RoundRecord]) -> str | None:
    """Where ``mine`` first departs from ``expected`` ("round 3: free_gpu_blocks 0 instead of 1"),
    or None if every round decided the same."""
    for a, b in zip(mine, expected):
        for name in FACTS:
            x, y = getattr(a, name), getattr(b, name)
            if x != y:
                return f"round {a.round}: {name} {_show(x)} instead of {_show(y)}"
    if len(mine) != len(expected):
        return f"{len(mine)} rounds instead of {len(expected)}"
    return None


def token_difference(mine: dict[str, list[int]], expected: dict[str, list[int]]) -> str | None:
    for rid, want in expected.items():
        got = mine.get(rid, [])
        for i, (x, y) in enumerate(zip(got, want)):
            if x != y:
                return f"{rid}'s token {i + 1}: {x} instead of {y}"
        if len(got) != len(want):
            return f"{rid}: {len(got)} tokens instead of {len(want)}"
    return None


def _simulate_into(scheduler, preset, records: list[RoundRecord]) -> None:
    """The simulator's rounds on ``scheduler``, appended to ``records`` as they happen, so that a
    run that raises (a reader's part may) still shows the rounds before it."""
    postprocess = scheduler.postprocess

    def recording_postprocess(out, next_token):  # simulate calls it once per round, after schedule
        finished = postprocess(out, next_token)
        records.append(make_record(len(records) + 1, scheduler, out, finished))
        return finished

    scheduler.postprocess = recording_postprocess
    simulate(preset.requests, preset.scheduler_config, preset.cache_config, scheduler=scheduler)


def _recorded_simulation(scheduler, preset) -> tuple[list[RoundRecord], str | None]:
    """The simulator's rounds on ``scheduler`` (the package's run), and the error if it raised."""
    records: list[RoundRecord] = []
    try:
        _simulate_into(scheduler, preset, records)
    except Exception as e:
        return records, f"{type(e).__name__}: {e}"
    return records, None


def _drive(engine, preset, done: dict[str, list[int]], tracker: Tracker | None = None,
           max_rounds: int | None = None) -> None:
    """Add the preset's prompts and step the engine until they finish, each request's tokens into
    ``done``; with a tracker each step is a round of its bound, and at most ``max_rounds``."""
    params = SamplingParams(temperature=0.0, max_tokens=preset.max_tokens, ignore_eos=True)
    for rid, prompt in preset.prompts.items():
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        if max_rounds is not None and steps >= max_rounds:
            raise ComponentError(f"your run did not finish within {max_rounds} rounds: requests that never "
                                 "finish?")
        if tracker is not None:
            tracker.begin_round()
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)


def _engine_run(engine, preset) -> tuple[dict[str, list[int]], list[RoundRecord], str | None]:
    """The package's engine run: each request's tokens, the rounds, and the error if it raised."""
    done: dict[str, list[int]] = {}
    try:
        _drive(engine, preset, done)
    except Exception as e:
        return done, engine.history, f"{type(e).__name__}: {e}"
    return done, engine.history, None


# The reader's engine run stops after this many times the package's rounds (and 20 more).
ROUND_LIMIT_FACTOR = 4


def readers_engine_run(model, preset, chapter: int, package_rounds: int
                       ) -> tuple[dict[str, list[int]], list[RoundRecord], Report, str | None]:
    """The engine on the reader's parts of chapters up to ``chapter``, built and run contained
    (``contain.STEP_TIMEOUT_S`` a step): each request's tokens, the rounds, the measured report,
    and the problem line of whatever stopped the run (None if nothing did)."""
    tracker = Tracker(contain.STEP_TIMEOUT_S)
    tracker.rounds_by_schedule = False  # the steps below start the rounds
    done: dict[str, list[int]] = {}
    built: list = []

    def run() -> None:
        engine, _ = build_engine(model, preset=preset, chapter=chapter, tracker=tracker)
        built.append(engine)
        _drive(engine, preset, done, tracker, ROUND_LIMIT_FACTOR * package_rounds + 20)

    _, error = contained(tracker, run)
    rounds: list[RoundRecord] = []
    if built:
        try:
            rounds = list(built[0].history)
        except Exception:  # a reader's engine without the recorder: no rounds to show
            pass
    report = tracker.report if tracker.report is not None else _report_after_failure(chapter, ENGINE_PARTS)
    report.measured = True
    return done, rounds, report, error


def readers_scheduler_run(preset, chapter: int) -> tuple[list[RoundRecord], Report, str | None]:
    """The simulator on the reader's scheduler parts, built and run contained
    (``contain.ROUND_TIMEOUT_S`` a round): the rounds, the measured report, and the problem line."""
    tracker = Tracker(contain.ROUND_TIMEOUT_S)
    records: list[RoundRecord] = []

    def run() -> None:
        scheduler, _ = build_scheduler(preset, chapter=chapter, tracker=tracker)
        _simulate_into(scheduler, preset, records)

    _, error = contained(tracker, run)
    report = tracker.report if tracker.report is not None else _report_after_failure(chapter, SCHEDULER_PARTS)
    report.measured = True
    return records, report, error


def _report_after_failure(chapter: int, names: tuple[str, ...]) -> Report:
    saved = set(saved_components())
    return Report({name: YOURS if name in saved and COMPONENTS[name].chapter <= chapter else PACKAGES
                   for name in names if name not in LATER_PARTS or COMPONENTS[name].chapter <= chapter})


# Chapters whose verdict also runs s0/s1/s2 under policy="orca": chapter 04's orca_round is the
# round of that policy only, so the vLLM run alone would never call it.
ORCA_CHAPTERS = (4,)
# From chapter 13 the verdict also runs s0/s1/s2 under policy="v1" (which preempts by recompute
# only), the round of chapter 13's v1_round.
V1_FROM = 13


def _policies(chapter: int) -> tuple[str, ...]:
    if chapter in ORCA_CHAPTERS:
        return ("vllm", "orca")
    return ("vllm", "v1") if chapter >= V1_FROM else ("vllm",)


def _seed(preemption_mode: str | None, policy: str) -> presets.Preset:
    preset = presets.seed_rounds(None if policy == "v1" else preemption_mode, policy=policy)
    if policy == "v1":  # without prefix caching, so that chapter 03's block manager takes part too
        preset.cache_config = dataclasses.replace(preset.cache_config, enable_prefix_caching=False)
    return preset


def _scheduler_runs(preset, chapter: int) -> tuple[list[RoundRecord], list[RoundRecord], Report, str | None]:
    """The package's rounds and the reader's on ``preset``, the report, and the reader's problem."""
    package, _ = _recorded_simulation(build_scheduler(preset, chapter=0)[0], preset)
    mine, report, error = readers_scheduler_run(preset, chapter)
    return package, mine, report, error


def _problems(mine: list[RoundRecord], package: list[RoundRecord], error: str | None,
              my_tokens: dict[str, list[int]] | None = None,
              package_tokens: dict[str, list[int]] | None = None) -> list[str]:
    """The first difference of rounds (and tokens, if given), and the reader's problem line, if any."""
    problems = [p for p in (round_difference(mine, package),
                            token_difference(my_tokens, package_tokens) if package_tokens is not None else None) if p]
    if error:
        # What the error cut short is not a difference of its own.
        problems = [p for p in problems if mine and not p.endswith(f"rounds instead of {len(package)}")
                    and " tokens instead of " not in p]
        problems.append(error)
    return problems


def your_engine_so_far(chapter: int, *, model=None, preemption_mode: str = "swap", quiet: bool = False) -> Verdict:
    """Run s0/s1/s2 (``presets.seed_rounds(preemption_mode)``) through the reader's parts of
    chapters up to ``chapter`` and through the package's, print the verdict ("same rounds",
    "same tokens", or the first difference, or what stopped the reader's run) and which parts
    were the reader's with the calls each served, and return it.

    Chapters 02–05: the scheduler without a model. Chapter 04 runs s0/s1/s2 under
    ``policy="vllm"`` and again under ``policy="orca"``, whose round is the chapter's
    ``orca_round`` (the verdict's rounds are the orca run's, or the first run that differs).
    From 06: the engine on ``model`` (see ``build_engine``), comparing tokens and rounds. From
    13 the engine runs s0/s1/s2 under ``policy="v1"`` too (preempting by recompute, the only mode
    of v1), whose round is the chapter's ``v1_round``."""
    kind = "rounds" if chapter <= 5 else "tokens"
    policies = _policies(chapter)
    runs = []  # (policy, package's rounds, reader's rounds, problems, reader's tokens, package's tokens)
    reports = []
    for policy in policies:
        preset = _seed(preemption_mode, policy)
        if kind == "rounds":
            package, mine, report, error = _scheduler_runs(preset, chapter)
            reports.append(report)
            runs.append((policy, package, mine, _problems(mine, package, error), {}, {}))
            continue
        engine, _ = build_engine(model, preset=preset, chapter=0)
        package_tokens, package, _ = _engine_run(engine, preset)
        my_tokens, mine, report, error = readers_engine_run(model, preset, chapter, len(package))
        reports.append(report)
        runs.append((policy, package, mine, _problems(mine, package, error, my_tokens, package_tokens),
                     my_tokens, package_tokens))
    report = Report.combined(reports)
    failed = [run for run in runs if run[3]]
    _, package, mine, _, my_tokens, package_tokens = failed[0] if failed else runs[-1]
    if len(runs) == 1:
        problems = runs[0][3]
    else:  # each run's problems, named by its policy
        problems = [f"policy={policy!r}: {p}" for policy, _, _, found, _, _ in runs for p in found]
    rounds = "; ".join(f"policy={run[0]!r}: {len(run[1])} rounds" for run in runs)
    same = f"same {kind} ({len(package)} rounds)" if len(runs) == 1 else f"same {kind} ({rounds})"
    ok = not problems
    text = same if ok else "; ".join(problems)
    verdict = Verdict(chapter, kind, ok, text, report, mine, package, my_tokens, package_tokens)
    if not quiet:
        where = "without a model" if kind == "rounds" else "on the model, greedy"
        under = f", under {' and '.join(f'policy={p!r}' for p in policies)}" if len(policies) > 1 else ""
        mode = f"preemption_mode={preemption_mode!r}" + (" (policy='v1' recomputes)" if "v1" in policies else "")
        print(f"Your engine so far (chapter {chapter:02d}): s0/s1/s2{under}, {mode}, {where}")
        print(verdict)
    return verdict
