"""The workloads ``check_engine_step`` runs a reader's engine on, and what it compares after each step.

Each workload is a few requests on the tiny random Llama under configs that make a step do one
thing the serving loop must get right: swap a request out and back in (the story's s0/s1/s2),
recompute a preempted one, fork samples that share blocks (``n=2, best_of=3``), stop on a stop
string (one that occurs in the package's own text), and abort a request in the middle of a
chunked-prefill run beside a prompt the scheduler refuses. ``play`` runs one on an engine class
and takes a ``Snapshot`` after every step; ``difference`` says how two snapshots differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from tinyserve import presets
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.exercises.engine_runs import PROMPTS, tiny
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker

GREEDY = dict(temperature=0.0, ignore_eos=True)


@dataclass
class Workload:
    name: str
    configs: Callable[[], tuple[CacheConfig, SchedulerConfig]]  # fresh each time: the engine sizes them
    requests: Callable[[], list[tuple[str, list[int], SamplingParams]]]
    aborts: dict[int, list[str]] = field(default_factory=dict)  # before step k (1-based): abort these


def _ids(rid: str, length: int | None = None) -> list[int]:
    ids = tiny().tokenizer.encode(PROMPTS[rid])
    return ids[:length] if length else ids


def _seed(mode: str) -> Workload:
    def configs():
        preset = presets.seed_rounds(mode, max_tokens=8)
        return preset.cache_config, preset.scheduler_config
    # The story's prompt lengths (5, 5 and 3 tokens), so that the rounds are the story's.
    return Workload(f"s0/s1/s2 with {'swapping' if mode == 'swap' else 'recompute'}", configs,
                    lambda: [(rid, _ids(rid, n), SamplingParams(max_tokens=8, **GREEDY))
                             for rid, n in presets.SEED_PROMPT_LENS.items()])


def _roomy(chunked: bool = False) -> tuple[CacheConfig, SchedulerConfig]:
    return (CacheConfig(block_size=4, num_gpu_blocks=48, num_cpu_blocks=4, watermark=0.0),
            SchedulerConfig(max_num_batched_tokens=6 if chunked else 64, max_num_seqs=4, max_model_len=32,
                            enable_chunked_prefill=chunked))


def _samples() -> list:
    return [("pair", _ids("s2"), SamplingParams(n=2, best_of=3, temperature=1.0, seed=1, max_tokens=6,
                                                 ignore_eos=True)),
            ("s0", _ids("s0"), SamplingParams(max_tokens=6, **GREEDY)),
            ("twins", _ids("s1"), SamplingParams(n=2, temperature=0.8, max_tokens=5, ignore_eos=True))]


@functools.cache
def stop_strings() -> tuple[str, str]:
    """Two stop strings, each from the middle of a text the package's engine generates greedily
    for s1 and s2 (so that the requests do stop on them)."""
    steps, _ = play(Workload("plain", _roomy, lambda: [(rid, _ids(rid), SamplingParams(max_tokens=14, **GREEDY))
                                                        for rid in ("s1", "s2")]), None)
    texts = {o.request_id: o.outputs[0].text for s in steps for o in s.raw if o.finished}
    return tuple(texts[rid][len(texts[rid]) // 2:len(texts[rid]) // 2 + 3] for rid in ("s1", "s2"))


def _stops() -> list:
    one, two = stop_strings()
    return [("s1", _ids("s1"), SamplingParams(max_tokens=14, stop=[one], **GREEDY)),
            ("s2", _ids("s2"), SamplingParams(max_tokens=14, stop=[two], include_stop_str_in_output=True, **GREEDY)),
            ("s0", _ids("s0"), SamplingParams(max_tokens=6, **GREEDY))]


def _aborted() -> list:
    plain = SamplingParams(max_tokens=8, **GREEDY)
    return [(rid, _ids(rid), plain) for rid in PROMPTS] + [("long", list(range(3, 43)), plain)]


WORKLOADS = [
    _seed("swap"),
    _seed("recompute"),
    Workload("n=2 and best_of=3 samples (forks, copy-on-write)", _roomy, _samples),
    Workload("stop strings", _roomy, _stops),
    Workload("chunked prefill, a refused prompt and an abort", lambda: _roomy(chunked=True), _aborted,
             aborts={4: ["s1"]}),
]


# -- playing a workload ------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What one step left behind, in the terms the reader's step is judged on."""

    outputs: list[tuple]  # per output: (request_id, finished, has error, [(index, token ids, text, reason)])
    queues: dict[str, list[str]]
    free_blocks: tuple[int, int]
    heard: tuple | None  # (finished ids, [(request_id, seq_id, token)], preemptions) or None: not told
    raw: list = field(default_factory=list, repr=False)


def build(workload: Workload, factory):
    from tinyserve.engine import LLMEngine

    cache_config, scheduler_config = workload.configs()
    model_config = ModelConfig(model="in-memory")
    worker = Worker(model_config, attention_backend="torch", loaded=tiny())
    return (factory or LLMEngine)(model_config, cache_config, scheduler_config, executor=worker)


def _snapshot(engine, outputs, heard) -> Snapshot:
    shown = [(o.request_id, o.finished, o.error is not None,
              [(c.index, tuple(c.token_ids), c.text, c.finish_reason) for c in o.outputs]) for o in outputs]
    sched = engine.scheduler
    queues = {name: [g.request_id for g in getattr(sched, name)] for name in ("waiting", "running", "swapped")}
    bm = sched.block_manager
    return Snapshot(shown, queues, (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()), heard, outputs)


def play(workload: Workload, factory, limit: int = 200) -> tuple[list[Snapshot], str | None]:
    """Run ``workload`` on an engine made by ``factory`` (an engine class; None: the package's),
    at most ``limit`` steps; the snapshots, and the error that ended the run early (or None)."""
    snapshots: list[Snapshot] = []
    try:
        engine = build(workload, factory)
        told: list = []
        engine.add_callback(lambda eng, event: told.append(
            (list(event.finished), [(g.request_id, s.seq_id, t) for g, s, t in event.produced],
             list(event.scheduler_outputs.preempted))))
        for rid, ids, params in workload.requests():
            engine.add_request(rid, None, params, prompt_token_ids=ids)
        while engine.has_unfinished_requests() and len(snapshots) < limit:
            for rid in workload.aborts.get(len(snapshots) + 1, []):
                engine.abort_request(rid)
            told.clear()
            outputs = engine.step()
            snapshots.append(_snapshot(engine, outputs, told[0] if told else None))
    except Exception as e:  # the reader's code: report where it raised
        return snapshots, f"raised {type(e).__name__}: {e}"
    return snapshots, None


def difference(mine: Snapshot, want: Snapshot) -> str | None:
    """How ``mine`` differs from ``want``, first in the outputs, then the queues, the free blocks
    and what the observers heard; None when they agree."""
    ids, expected_ids = [o[0] for o in mine.outputs], [o[0] for o in want.outputs]
    if ids != expected_ids:
        why = ""
        missing = [o for o in want.outputs if o[0] not in ids]
        extra = [rid for rid in ids if rid not in expected_ids]
        if missing and any(c[3] == "ignored" for c in missing[0][3]):
            why = f": {missing[0][0]!r} was refused by the scheduler this round (out.ignored_seq_groups)"
        elif missing:
            why = f": {missing[0][0]!r} is missing"
        elif extra:
            why = f": {extra[0]!r} is not in this round (neither scheduled nor refused by the scheduler)"
        return f"returned outputs for {ids}, expected {expected_ids}{why}"
    for (rid, finished, error, comps), (_, want_finished, want_error, want_comps) in zip(mine.outputs, want.outputs):
        if len(comps) != len(want_comps):
            return f"{rid}'s output has {len(comps)} completions, expected {len(want_comps)}"
        for (i, tokens, text, reason), (_, want_tokens, want_text, want_reason) in zip(comps, want_comps):
            if tokens != want_tokens:
                return f"{rid} completion {i}: token ids {list(tokens)}, expected {list(want_tokens)}"
            if text != want_text:
                return f"{rid} completion {i}: text {text!r}, expected {want_text!r}"
            if reason != want_reason:
                return f"{rid} completion {i}: finish_reason {reason!r}, expected {want_reason!r}"
        if (finished, error) != (want_finished, want_error):
            return f"{rid}: finished={finished}, error={error}; expected finished={want_finished}, error={want_error}"
    for name, queue in mine.queues.items():
        if queue != want.queues[name]:
            return f"the scheduler's {name} queue holds {queue}, expected {want.queues[name]}"
    if mine.free_blocks != want.free_blocks:
        return f"(free GPU, CPU blocks) = {mine.free_blocks}, expected {want.free_blocks}"
    if mine.heard is None:
        return "the observers heard nothing of this step: report_step was not called"
    for what, got, expected in zip(("finished requests", "sampled tokens (request, seq id, token)", "preempted"),
                                   mine.heard, want.heard):
        if got != expected:
            return f"told the observers the {what} {got}, expected {expected}"
    return None
