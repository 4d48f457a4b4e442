"""Structured output's cost per step: the same requests with and without a JSON schema, side by side.

B requests (B = 1, 4, 16 by default) decode at once on SmolLM2-135M, greedy, each asking for a user
profile as JSON under one realistic schema (strings with ``maxLength``, an integer with bounds, an
enum, an array of at most three strings). The constrained runs end where the grammar ends (EOS);
a pilot constrained run gives each request's output length, and the unconstrained runs generate
exactly that many tokens (``ignore_eos``, ``max_tokens`` = that length), from the same prompts. So
both sides decode the same number of tokens in the same number of steps, with the same sequences
in each step, and differ only by the grammar. Each side has its own engine (two on the same
weights) and the two take turns step by step (the constrained one first in even repeats, the
unconstrained one in odd ones), so that a slow spell of a shared machine falls on both; the table
reports medians over the repeats.

Measured per decode step (the steps after the one that prefills every prompt; the median over a
run's steps, then over the repeats, because other processes share the cores): the whole step, the
difference between the two sides (the median over steps of step k's difference),
the engine's own parts (``engine.times``: schedule, model, sample, process) and, by wrapping them,
the three parts of the grammar's cost: bringing each sequence's matcher up to date
(``RequestConstraints.row``: consuming the last token), filling the allowed-token bitmask
(``GrammarState.fill_bitmask``) and the rest of ``apply_constraints`` (setting every masked logit
to -inf). The mask's cost per step is the sum of those parts' medians (``mask_ms``); their mean,
with the spells other processes cut into it, is ``mask_mean_ms``. Every constrained output is
checked against the schema (jsonschema).

And the one-time costs: llguidance's import, the tokenizer's llguidance view, ``GrammarCompiler.warm``
(the first mask), the first application of a mask to logits (``grammar.apply_bitmask``), then per
request: compiling the schema (a new schema each time) and building a matcher for an already
compiled one.

    python benchmarks/structured_output.py                 # SmolLM2-135M, B = 1, 4, 16 (5-8 minutes)
    python benchmarks/structured_output.py --quick         # the tiny random model (half a minute)

The dtype is what tinyserve's ``dtype="auto"`` picks (``--dtype`` to choose). It writes
``structured_output.csv`` (one ``step`` row per batch size, one ``once`` row per one-time cost) and
``structured_output.md`` (the table and its reading, for the README) to ``--out`` (default
``benchmarks/results``). The load average at start and end is recorded: the cores may be shared.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the Makefile does, before torch starts

import torch  # noqa: E402
from common import RESULTS_DIR, machine, patched, table  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.config import dtype_name  # noqa: E402
from tinyserve.guided_params import GuidedDecodingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "city", "occupation", "age", "role", "skills"],
    "additionalProperties": False,
}
SUBJECTS = [
    "Maria, a nurse from Lisbon", "Tom Baker, a plumber in London", "Dr. Aiko Tanaka, a researcher in Kyoto",
    "a software engineer from Berlin", "Omar Haddad, a baker in Marseille", "Lena Novak, a pilot from Prague",
    "a high-school teacher in Toronto", "Carlos Ruiz, a chef in Mexico City", "Priya Sharma, a lawyer in Mumbai",
    "an architect from Oslo", "Jonas Weber, a student in Vienna", "Fatima Zahra, a pharmacist in Rabat",
    "a journalist from Dublin", "Kenji Mori, a gardener in Osaka", "Sofia Rossi, a violinist in Milan",
    "a retired firefighter in Chicago",
]
# Room for the longest document the schema allows, even with every string at its maxLength in
# characters that take several tokens each: constrained outputs end where the grammar ends (EOS),
# not at this limit. One that did stop here would be incomplete, and count as not valid.
MAX_TOKENS = 512
# The grammar's parts, as the wrappers below label them.
PARTS = ("sync", "fill", "apply")


def prompts(n: int) -> list[str]:
    return [f"A user profile of {SUBJECTS[i % len(SUBJECTS)]}, as JSON:\n" for i in range(n)]


def guided(max_tokens: int = MAX_TOKENS, schema: dict = SCHEMA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(json=schema))


def unguided(length: int) -> SamplingParams:
    """Exactly ``length`` tokens, greedy, nothing constrained."""
    return SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)


class Timers:
    """Seconds per label, accumulated over the calls made while a block runs."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, obj, attr: str, label: str):
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[label] += time.perf_counter() - t

        return patched(obj, attr, timed)


@dataclass
class Run:
    """One run of a batch: each request's output (in request order) and each step's seconds."""

    guided: bool
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)  # per step: total, the engine's parts, the grammar's

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    def decode_steps(self) -> list[dict]:
        return [s for s in self.steps if s["decode"]]


class Side:
    """One batch of requests in one engine, stepped from outside (so that two can take turns)."""

    def __init__(self, llm, texts: list[str], params: list[SamplingParams], is_guided: bool, timers: Timers) -> None:
        self.engine = llm.engine
        self.run = Run(is_guided)
        self.timers = timers
        self.ids = [f"{'g' if is_guided else 'u'}{i}" for i in range(len(texts))]
        self.outputs: dict = {}
        self._event = None
        for rid, text, p in zip(self.ids, texts, params):
            self.engine.add_request(rid, text, p)
        self.engine.add_callback(self._on_step)

    def _on_step(self, _engine, event) -> None:
        self._event = event

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        """One engine step, timed whole and part by part."""
        self.timers.acc.clear()
        t = time.perf_counter()
        for out in self.engine.step():
            if out.finished:
                self.outputs[out.request_id] = out
        total = time.perf_counter() - t
        schedule, model, sample, process = self._event.times
        decode = all(not s.is_prompt for s in self._event.scheduler_outputs.scheduled_seq_groups)
        acc = dict(self.timers.acc)
        fill = acc.get("fill", 0.0)
        self.run.steps.append(dict(decode=decode, total=total, schedule=schedule, model=model, sample=sample,
                                   process=process, sync=acc.get("sync", 0.0), fill=fill,
                                   apply=acc.get("constraints", 0.0) - fill))

    def finish(self) -> Run:
        self.engine.remove_callback(self._on_step)
        for rid in self.ids:
            c = self.outputs[rid].outputs[0]
            self.run.token_ids.append(list(c.token_ids))
            self.run.texts.append(c.text)
            self.run.finish_reasons.append(c.finish_reason)
            self.run.errors.append(self.outputs[rid].error)
        return self.run


def run_sides(make_sides) -> list[Run]:
    """Step the sides ``make_sides(timers)`` returns in turn, one step each, until all are done: a
    slow spell of the machine then falls on the same steps of both. The grammar's parts are timed
    by wrapping them (``sync``: each matcher consuming the last token; ``fill``: the bitmasks;
    ``constraints``: the whole of ``apply_constraints``, fill included)."""
    from tinyserve import sampler
    from tinyserve.grammar import GrammarState

    timers = Timers()
    sides = make_sides(timers)
    with ExitStack() as stack:
        for side in sides:
            stack.enter_context(timers.wrap(side.engine.constraints, "row", "sync"))
        stack.enter_context(timers.wrap(GrammarState, "fill_bitmask", "fill"))
        stack.enter_context(timers.wrap(sampler, "apply_constraints", "constraints"))
        while not all(side.done for side in sides):
            for side in sides:
                if not side.done:
                    side.step()
    return [side.finish() for side in sides]


def per_step(run: Run) -> dict[str, float]:
    """The median over the run's decode steps of the total and each part (seconds): a step that lost
    its core to another process for a while counts once, not by how long it waited. Also the mean
    of the grammar's cost (spells included), and the decode steps and tokens."""
    steps = run.decode_steps()
    keys = ("total", "schedule", "model", "sample", "process") + PARTS
    stats = {k: statistics.median(s[k] for s in steps) for k in keys}
    stats["mask_mean"] = sum(s[p] for s in steps for p in PARTS) / len(steps)
    # Every token but the one each request's prefill step made.
    stats["decode_tokens"] = sum(run.lengths) - len(run.lengths)
    stats["decode_steps"] = len(steps)
    return stats


def valid_outputs(texts: list[str], schema: dict = SCHEMA) -> int:
    """How many of ``texts`` parse as JSON and validate against ``schema``."""
    import jsonschema

    count = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        count += 1
    return count


def paired_difference(g: Run, u: Run, key: str) -> float:
    """The median over decode steps of the constrained step's ``key`` minus the unconstrained one's
    (step k of one against step k of the other: they took turns, with the same sequences)."""
    gs, us = g.decode_steps(), u.decode_steps()
    assert len(gs) == len(us), "both sides decode the same tokens in the same steps"
    return statistics.median(a[key] - b[key] for a, b in zip(gs, us))


def measure_batch(llms: tuple, batch: int, repeats: int, max_tokens: int = MAX_TOKENS,
                  log=print) -> tuple[dict, list[Run]]:
    """The ``step`` row of one batch size, and every run behind it (the pilot first, then each
    repeat's constrained and unconstrained runs in the order they took their turns).

    ``llms`` is two LLMs on the same weights, one for each side, so that their steps can take
    turns: the constrained side goes first in even repeats, the unconstrained one in odd ones."""
    guided_llm, free_llm = llms
    texts = prompts(batch)
    pilot = run_sides(lambda timers: [Side(guided_llm, texts, [guided(max_tokens) for _ in texts], True, timers)])[0]
    lengths = pilot.lengths
    runs = [pilot]
    pairs: list[tuple[dict, dict]] = []
    diffs: list[tuple[float, float]] = []
    for r in range(repeats):
        def make_sides(timers, first_guided=r % 2 == 0):
            sides = [Side(guided_llm, texts, [guided(max_tokens) for _ in texts], True, timers),
                     Side(free_llm, texts, [unguided(n) for n in lengths], False, timers)]
            return sides if first_guided else sides[::-1]

        done = run_sides(make_sides)
        runs += done
        g, u = (done[0], done[1]) if done[0].guided else (done[1], done[0])
        pairs.append((per_step(g), per_step(u)))
        diffs.append((paired_difference(g, u, "total"), paired_difference(g, u, "sample")))
        gs, us = pairs[-1]
        log(f"  B={batch} repeat {r + 1}/{repeats}: constrained {1000 * gs['total']:.2f} ms/step, "
            f"unconstrained {1000 * us['total']:.2f} ms/step, paired difference {1000 * diffs[-1][0]:+.2f} ms, "
            f"mask {1000 * sum(gs[p] for p in PARTS):.3f} ms/step (mean {1000 * gs['mask_mean']:.3f})")

    def med(side: int, key: str) -> float:
        return statistics.median(pair[side][key] for pair in pairs)

    guided_runs = [r for r in runs if r.guided]
    ms = {f"{name}_{k}_ms": round(1000 * med(side, k), 3) for side, name in ((1, "free"), (0, "guided"))
          for k in ("total", "model", "sample")}
    parts = {f"{p}_ms": round(1000 * med(0, p), 4) for p in PARTS}
    mask = sum(med(0, p) for p in PARTS)  # the parts' medians, added up
    step_diff = statistics.median(d for d, _ in diffs)
    tokens = pairs[0][0]["decode_tokens"]
    row = dict(
        kind="step", batch=batch, repeats=repeats, output_tokens=sum(lengths),
        min_len=min(lengths), max_len=max(lengths), decode_steps=int(pairs[0][0]["decode_steps"]),
        decode_tokens=int(tokens),
        # Every constrained run made the pilot's tokens, and every unconstrained one as many.
        same_lengths=all(r.lengths == lengths for r in runs),
        valid=sum(valid_outputs(r.texts) for r in guided_runs),
        constrained_outputs=sum(len(r.texts) for r in guided_runs),
        free_step_ms=ms["free_total_ms"], guided_step_ms=ms["guided_total_ms"],
        step_diff_ms=round(1000 * step_diff, 3), step_diff_pct=round(100 * step_diff / med(1, "total"), 2),
        sample_diff_ms=round(1000 * statistics.median(d for _, d in diffs), 3),
        **parts, mask_ms=round(1000 * mask, 4), mask_pct=round(100 * mask / med(0, "total"), 2),
        mask_mean_ms=round(1000 * med(0, "mask_mean"), 4),
        # The grammar's whole time over the tokens it constrained (the mean, spells included).
        mask_us_per_token=round(1e6 * med(0, "mask_mean") * pairs[0][0]["decode_steps"] / tokens, 2),
        free_model_ms=ms["free_model_ms"], guided_model_ms=ms["guided_model_ms"],
        free_sample_ms=ms["free_sample_ms"], guided_sample_ms=ms["guided_sample_ms"],
    )
    return row, runs


def one_time_costs(llm, repeats: int) -> list[dict]:
    """The ``once`` rows: what structured output pays once per process and once per request (ms)."""
    import importlib

    grammars = llm.engine.constraints.grammars
    t = time.perf_counter()
    importlib.import_module("llguidance")
    costs = [("import_llguidance", time.perf_counter() - t)]
    t = time.perf_counter()
    grammars.ll_tokenizer  # noqa: B018  (built on first use)
    costs.append(("tokenizer_build", time.perf_counter() - t))
    t = time.perf_counter()
    grammars.warm()
    costs.append(("warm_first_mask", time.perf_counter() - t))
    from tinyserve.grammar import allocate_bitmask, apply_bitmask

    state = grammars.matcher(GuidedDecodingParams(json=SCHEMA))
    bitmask = allocate_bitmask(1, llm.engine.vocab_size)
    state.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, llm.engine.vocab_size)
    t = time.perf_counter()
    apply_bitmask(logits, bitmask)
    costs.append(("first_apply", time.perf_counter() - t))
    compile_s, matcher_s = [], []
    for i in range(repeats):
        # A new schema each time (its title differs), so the compiler's cache never answers.
        params = GuidedDecodingParams(json=dict(SCHEMA, title=f"profile {i}"))
        t = time.perf_counter()
        grammars.compile(params)
        compile_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammars.matcher(params)
        matcher_s.append(time.perf_counter() - t)
    costs += [("compile_per_request", statistics.median(compile_s)),
              ("matcher_per_request", statistics.median(matcher_s))]
    return [dict(kind="once", name=name, ms=round(1000 * s, 3), repeats=repeats if name.endswith("request") else 1)
            for name, s in costs]


STEP_COLUMNS = ["batch", "output_tokens", "decode_steps", "free_step_ms", "guided_step_ms", "step_diff_ms",
                "sample_diff_ms", "sync_ms", "fill_ms", "apply_ms", "mask_ms", "mask_mean_ms", "mask_pct", "valid"]


def markdown(steps: list[dict], once: list[dict], meta: dict) -> str:
    """The results as the README quotes them: one table, the one-time costs and a reading."""
    costs = {r["name"]: r["ms"] for r in once}
    lines = ["# Structured output: the mask's cost per step", "",
             f"Measured by `benchmarks/structured_output.py` on {meta['model']} ({meta['dtype']}), greedy: "
             f"B requests decoding together, each a JSON document under one schema (strings with maxLength, "
             f"a bounded integer, an enum, an array of at most 3 strings), against the same requests "
             f"unconstrained and forced to the same lengths in a second engine, the two taking turns step by "
             f"step; {meta['repeats']} repeats, medians. Machine: {meta['machine']}; load average "
             f"{meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end.", "",
             "| B | tokens | unconstrained ms/step | constrained ms/step | step by step difference | "
             "mask ms/step (sync + fill + apply) | mask % of step | valid |",
             "|---|---|---|---|---|---|---|---|"]
    for r in steps:
        lines.append(f"| {r['batch']} | {r['output_tokens']} | {r['free_step_ms']:.1f} | {r['guided_step_ms']:.1f} | "
                     f"{r['step_diff_ms']:+.2f} ms ({r['step_diff_pct']:+.1f}%) | "
                     f"{r['mask_ms']:.2f} ({r['sync_ms']:.2f} + {r['fill_ms']:.2f} + {r['apply_ms']:.2f}) | "
                     f"{r['mask_pct']:.1f}% | {r['valid']}/{r['constrained_outputs']} |")
    big = max(steps, key=lambda r: r["batch"])
    lines += ["", f"One-time costs: importing llguidance {costs['import_llguidance']:.0f} ms, "
              f"the tokenizer's llguidance view {costs['tokenizer_build']:.0f} ms, `GrammarCompiler.warm` (the "
              f"first mask) {costs['warm_first_mask']:.0f} ms, the first application of a mask to logits "
              f"{costs['first_apply']:.1f} ms; per request, compiling this schema "
              f"{costs['compile_per_request']:.1f} ms and a matcher for a compiled one "
              f"{costs['matcher_per_request']:.2f} ms.", "",
              f"Reading: at B={big['batch']} the grammar costs {big['mask_ms']:.2f} ms per decode step "
              f"({big['mask_pct']:.1f}% of a {big['guided_step_ms']:.1f} ms step, "
              f"{big['mask_us_per_token']:.0f} µs per token): {big['sync_ms']:.2f} ms bringing the matchers "
              f"up to date, {big['fill_ms']:.2f} ms filling the bitmasks, {big['apply_ms']:.2f} ms applying them "
              f"to the logits (the mean, with the spells the machine's other work cut into it: "
              f"{big['mask_mean_ms']:.2f} ms). Seen from outside, the constrained step differs from the "
              f"unconstrained one by {big['step_diff_ms']:+.2f} ms ({big['step_diff_pct']:+.1f}%; the median "
              f"of step by step differences), its sampling phase by {big['sample_diff_ms']:+.2f} ms (the "
              f"mask, plus a copy of the logits and a check that each row keeps a token). "
              f"{sum(r['valid'] for r in steps)} of {sum(r['constrained_outputs'] for r in steps)} constrained "
              f"outputs validate against the schema."]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny random model, B = 1 and 3, 2 repeats")
    ap.add_argument("--model", default=None, help="smollm2-135m (default) or a local Hugging Face directory")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 16 (--quick: 1 3)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 2)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    batches = args.batches or ([1, 3] if args.quick else [1, 4, 16])
    repeats = args.repeats or (2 if args.quick else 5)
    tmp = None
    model = args.model
    if model is None and args.quick:
        from tinyserve.models.tiny import make_tiny_model_dir

        tmp = Path(tempfile.mkdtemp(prefix="tinyserve-tiny-"))
        model = str(make_tiny_model_dir(tmp))
    try:
        return run(args, model or "smollm2-135m", batches, repeats)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, model: str, batches: list[int], repeats: int) -> dict:
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    print(f"machine: {machine()}; load average {load_start:.2f}")
    # One engine per side, on the same weights, so that their steps can take turns.
    llms = tuple(LLM(model=model, device="cpu", dtype=args.dtype, max_num_seqs=max(batches), swap_space=0.0)
                 for _ in range(2))
    llm = llms[0]
    dtype = dtype_name(llm.engine.executor.dtype)
    print(f"model: {args.model or model} in {dtype}")
    once = one_time_costs(llm, repeats=3 if args.quick else 10)
    print(table(once, ["name", "ms"]))
    steps, runs = [], {}
    for batch in batches:
        row, runs[batch] = measure_batch(llms, batch, repeats, args.max_tokens)
        steps.append(row)
    load_end = os.getloadavg()[0]
    print()
    print(table(steps, STEP_COLUMNS))
    meta = dict(machine=machine(), model="SmolLM2-135M" if model == "smollm2-135m" else Path(model).name,
                dtype=dtype, repeats=repeats, load_start=load_start, load_end=load_end)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "structured_output.csv", [dict(r, dtype=dtype, load_start=load_start, load_end=load_end)
                                                   for r in steps + once])
    md = markdown(steps, once, meta)
    (args.out / "structured_output.md").write_text(md)
    print()
    print(md)
    print(f"wrote {args.out / 'structured_output.csv'} and .md ({time.perf_counter() - started:.0f} s)")
    return dict(steps=steps, once=once, runs=runs, meta=meta)


if __name__ == "__main__":
    main()
