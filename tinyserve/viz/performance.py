"""Measuring tinyserve against transformers, and the drawings of chapter 11.

Three systems generate the same tokens for the same requests (greedy, ``ignore_eos``):

- ``tinyserve``: the engine of this book (continuous batching over a paged cache);
- ``generate``: transformers' ``model.generate`` on static, left-padded batches, where a batch
  runs until its longest request is done;
- ``generate_batch``: transformers' own continuous batching with a paged cache (the machinery
  behind ``model.generate_batch``, driven request by request so each can have its own length).

The benchmarks in ``benchmarks/`` run them side by side and commit CSVs to
``benchmarks/results/``; the chapter reads those CSVs and reruns a small version live. The KV
utilization and scheduler-overhead measurements need no model and live here too.
"""

from __future__ import annotations

import contextlib
import csv
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup
from tinyserve.sim import Request, simulate
from tinyserve.viz.figures import figure

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SYSTEMS = ("tinyserve", "tinyserve-orca", "generate", "generate_batch")
COLORS = {"tinyserve": "#4e79a7", "tinyserve-orca": "#76b7b2", "generate": "#f28e2b", "generate_batch": "#59a14f"}

# Prompts are cut from this text (written for the book), so every prompt is real English.
PASSAGE = """\
The harbour woke before the town did. Long before the bakers lit their ovens, the fishing boats
came back through the narrow gap in the sea wall, one after another, their lamps swinging, and
the gulls followed them in like a second, noisier fleet. On the quay an old woman sold coffee
from a cart with one squeaking wheel. She knew every captain by the way he tied his rope, and
she knew which of them would pay today and which would promise to pay tomorrow.
By seven the market stalls were up. There were crates of silver sardines, baskets of mussels
still closed tight against the air, a single enormous tuna laid out on ice like a sleeping
dog. Children ran between the tables, and the stall keepers shouted prices that fell as the
morning went on. A teacher walked her class along the water to count the boats and to learn
the names of the fish, and most of the children learned instead how far a gull can carry a
stolen piece of bread.
In the afternoon the wind turned. It came from the west, warm and full of salt, and the
shutters of the houses on the hill began to knock against their frames. The ferry to the
island was cancelled, and a group of travellers sat in the waiting room with their bags,
reading the same timetable again and again as if it might change its mind. A boy who worked at
the ticket office brought them tea and told them, with great seriousness, that the sea always
calms down by the evening, which was not true, but it made everyone feel better.
When the storm finally arrived it was shorter than anyone had feared. The rain hammered the
roofs for an hour, the streets turned into small rivers, and then the clouds tore open and the
whole bay was lit from below by a low orange sun. People came out onto their balconies to look.
Somebody played an accordion badly and nobody minded. The fishermen checked their boats, the
old woman folded her umbrella, and the town, which had been holding its breath all afternoon,
let it out again and went looking for dinner.
"""


# -- workloads -------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests as token ids, each with the exact number of tokens it must generate."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def load_tokenizer(model: str = "smollm2-135m"):
    from transformers import AutoTokenizer

    from tinyserve.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def make_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given token lengths, cut from ``PASSAGE`` at random offsets (wrapping)."""
    stream = tokenizer.encode(PASSAGE)
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        start = rng.randrange(len(stream))
        prompts.append([stream[(start + i) % len(stream)] for i in range(n)])
    return prompts


def mixed_workload(tokenizer, num_requests: int = 64, min_out: int = 8, max_out: int = 128,
                   min_prompt: int = 16, max_prompt: int = 256, seed: int = 0) -> Workload:
    """Output lengths drawn uniformly from ``[min_out, max_out]``; prompt lengths likewise."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(min_prompt, max_prompt) for _ in range(num_requests)]
    output_lens = [rng.randint(min_out, max_out) for _ in range(num_requests)]
    return Workload(f"mixed-{num_requests}x{min_out}..{max_out}", make_prompts(tokenizer, prompt_lens, seed),
                    output_lens)


def uniform_workload(tokenizer, num_requests: int = 32, output_len: int = 64, min_prompt: int = 16,
                     max_prompt: int = 256, seed: int = 0) -> Workload:
    """Every request generates ``output_len`` tokens (prompts still vary in length)."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(min_prompt, max_prompt) for _ in range(num_requests)]
    return Workload(f"uniform-{num_requests}x{output_len}", make_prompts(tokenizer, prompt_lens, seed),
                    [output_len] * num_requests)


# -- the three systems -----------------------------------------------------------------------------


@dataclass
class RunResult:
    system: str
    seconds: float
    outputs: list[list[int]]  # generated token ids per request, in request order

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def load_hf_model(model: str = "smollm2-135m", device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32):
    """The same weights as tinyserve's, as a transformers model (SDPA attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tinyserve.models.loader import resolve_model_dir

    hf_logging.disable_progress_bar()  # a loading bar per call clutters the benchmark's output
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dtype,
                                                attn_implementation="sdpa").to(device).eval()


def _greedy_config(max_new_tokens: int, pad_token_id: int):
    from transformers import GenerationConfig

    # No eos_token_id: like ignore_eos, every row runs to max_new_tokens and nothing is padded.
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                            eos_token_id=None, pad_token_id=pad_token_id)


class TinyserveSystem:
    """The engine's ``LLM.generate``. Each run also keeps where every step's time went
    (``last_steps``, see ``step_breakdown``); the timers cost microseconds a step."""

    def __init__(self, llm, name: str = "tinyserve") -> None:
        self.llm, self.name = llm, name
        self.last_steps: list[dict] = []

    def run(self, w: Workload) -> RunResult:
        import tinyserve.worker as worker

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
        from tinyserve.recording import HistoryRecorder

        recorder = HistoryRecorder()  # this run's steps only, whether or not the engine keeps a history
        self.llm.engine.add_callback(recorder)
        prepare: list[float] = []
        try:
            with _timing(worker, "prepare_inputs", prepare):
                start = time.perf_counter()
                outs = self.llm.generate(prompt_token_ids=w.prompts, sampling_params=params, use_tqdm=False)
                seconds = time.perf_counter() - start
        finally:
            self.llm.engine.remove_callback(recorder)
        self.last_steps = _split_steps(recorder.step_times, recorder.records, prepare)
        return RunResult(self.name, seconds, [list(o.outputs[0].token_ids) for o in outs])


class StaticGenerateSystem:
    """``model.generate`` on batches of ``batch_size`` requests in arrival order, left-padded.

    A batch generates as many tokens as its longest request wants; shorter rows keep computing
    and their surplus is thrown away, which is exactly the waste continuous batching removes.
    """

    name = "generate"

    def __init__(self, model, batch_size: int = 32, pad_token_id: int = 0) -> None:
        self.model, self.batch_size, self.pad_token_id = model, batch_size, pad_token_id

    @torch.inference_mode()
    def run(self, w: Workload) -> RunResult:
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for b in range(0, w.num_requests, self.batch_size):
            prompts, lens = w.prompts[b:b + self.batch_size], w.output_lens[b:b + self.batch_size]
            width = max(len(p) for p in prompts)
            device = self.model.device
            ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      generation_config=_greedy_config(max(lens), self.pad_token_id))
            outputs += [row[width:width + n].tolist() for row, n in zip(out, lens)]
        return RunResult(self.name, time.perf_counter() - start, outputs)


class GenerateBatchSystem:
    """transformers' continuous batching (``generate_batch``'s manager) with a paged cache.

    ``generate_batch`` gives every request the same ``max_new_tokens``; the manager it wraps
    takes one per request, so that is what runs here. The manager (cache allocation, thread
    start) is set up before the clock starts, as tinyserve's engine is. Its other limits: at most
    ``max_requests_per_batch`` requests and ``max_batch_tokens`` tokens a round, pages of 16.
    """

    name = "generate_batch"

    def __init__(self, model, max_requests_per_batch: int = 32, max_batch_tokens: int = 2048,
                 page_size: int = 16, num_blocks: int = 1024, pad_token_id: int = 0) -> None:
        self.model = model
        self.cb_kwargs = dict(max_requests_per_batch=max_requests_per_batch, max_batch_tokens=max_batch_tokens,
                              page_size=page_size, num_blocks=num_blocks, allow_block_sharing=False)
        self.pad_token_id = pad_token_id

    def run(self, w: Workload) -> RunResult:
        from transformers import ContinuousBatchingConfig

        gen = _greedy_config(max(w.output_lens), self.pad_token_id)
        gen.eos_token_id = -1  # the manager's own spelling of "no end-of-sequence token"
        kwargs = dict(self.cb_kwargs)
        # No more blocks than the batch can fill: the cache is allocated up front, and a tiny
        # model's KV is so small that a memory budget in blocks can run to gigabytes.
        longest = max(len(p) + n for p, n in zip(w.prompts, w.output_lens))
        kwargs["num_blocks"] = min(kwargs["num_blocks"],
                                   kwargs["max_requests_per_batch"] * -(-longest // kwargs["page_size"]) + 1)
        with self.model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**kwargs),
                warmup=False) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                   for i, (p, n) in enumerate(zip(w.prompts, w.output_lens))]
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error:
                        raise RuntimeError(f"generate_batch failed on {result.request_id}: {result.error}")
                    done[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("generate_batch's generation thread stopped")
            seconds = time.perf_counter() - start
        return RunResult(self.name, seconds, [done[i] for i in ids])


def agreement(a: RunResult, b: RunResult) -> float:
    """Share of requests whose generated tokens are identical in the two runs."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs)) / max(len(a.outputs), 1)


def compare(systems: list, workload: Workload, repeats: int = 1,
            log: Callable[[str], None] | None = None) -> dict[str, list[RunResult]]:
    """Run every system ``repeats`` times, interleaved (A B C A B C ...), so that a slow spell of
    a shared machine hits all of them alike. Returns every run, per system."""
    runs: dict[str, list[RunResult]] = {s.name: [] for s in systems}
    for r in range(repeats):
        for s in systems:
            res = s.run(workload)
            if res.tokens != workload.output_tokens:
                raise RuntimeError(f"{s.name} generated {res.tokens} tokens, expected {workload.output_tokens}")
            runs[s.name].append(res)
            if log:
                log(f"  [{workload.name} {r + 1}/{repeats}] {s.name:<15} {res.seconds:7.2f} s  "
                    f"{res.tokens_per_s:7.1f} tok/s")
    return runs


def median_rate(results: list[RunResult]) -> float:
    return statistics.median(r.tokens_per_s for r in results)


# -- where tinyserve's step time goes ---------------------------------------------------------------


@contextlib.contextmanager
def _timing(module, name: str, sink: list[float]) -> Iterator[None]:
    """Temporarily wrap ``module.name`` so every call's duration is appended to ``sink``."""
    original = getattr(module, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


STEP_PARTS = ("schedule", "prepare", "model", "sample", "process")


def _split_steps(times: list[tuple], records: list, prepare: list[float]) -> list[dict]:
    rows = []
    timed = iter(prepare)
    for (sched, model, sample, process), rec in zip(times, records):
        prep = next(timed, 0.0) if rec.batch else 0.0
        rows.append(dict(step=len(rows) + 1, phase=rec.phase, batch_size=len(rec.batch),
                         num_tokens=rec.num_batched_tokens, schedule=sched, prepare=prep, model=model - prep,
                         sample=sample, process=process))
    return rows


def step_breakdown(llm, w: Workload) -> list[dict]:
    """Run ``w`` on tinyserve and split every step's time into scheduling, input preparation,
    the model's forward pass, sampling, and processing the outputs (stop checks, bookkeeping).

    The engine times four phases itself (``engine.times``); input preparation is inside its
    "model" phase, so ``prepare_inputs`` is timed on its own and subtracted from it.
    """
    system = TinyserveSystem(llm)
    system.run(w)
    return system.last_steps


def time_decode_step(llm, num_seqs: int = 256, prompt_len: int = 64, rounds: int = 3) -> list[dict]:
    """One decode step of the real model at batch ``num_seqs``, split as ``step_breakdown`` does.

    The prompts are not run through the model (at batch 256 that would take minutes on a CPU):
    a scheduler of its own admits them and marks them computed, so the cache holds zeros where
    their K/V would be. A decode step costs the same either way; only the tokens differ.
    """
    import tinyserve.worker as worker
    from tinyserve.sampler import SampleRequest

    engine = llm.engine
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=num_seqs * prompt_len, max_num_seqs=num_seqs,
                                          max_model_len=engine.scheduler_config.max_model_len),
                          engine.cache_config)
    for i in range(num_seqs):
        seq = Sequence(i, None, [1000 + i] * prompt_len, engine.cache_config.block_size)
        scheduler.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(temperature=0.0, max_tokens=10**6), 0.0))
    greedy = SampleRequest(SamplingParams(temperature=0.0))
    rows = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        metas, out = scheduler.schedule()
        t1 = time.perf_counter()
        prepare: list[float] = []
        if r > 0:  # round 0 is the prefill: skipped, see above
            with _timing(worker, "prepare_inputs", prepare):
                logits = engine.executor.execute_model(metas, {}, {}, {})
        t2 = time.perf_counter()
        tokens = engine.sampler(logits, [greedy] * len(metas)) if r > 0 else [[7]] * len(metas)
        t3 = time.perf_counter()
        for group, chunk, tok in zip(out.scheduled_seq_groups, out.token_chunk_sizes, tokens):
            for seq in group.get_seqs():
                seq.num_computed_tokens += chunk
                scheduler.mark_computed(seq)
                seq.append_token_id(tok[0])
        if r > 0:
            if len(metas) != num_seqs or out.phase != "decode":
                raise RuntimeError(f"expected a decode round of {num_seqs}, got {out.phase} of {len(metas)}")
            rows.append(dict(schedule=t1 - t0, prepare=prepare[0], model=t2 - t1 - prepare[0], sample=t3 - t2))
    return rows


# -- KV cache utilization (no model) ----------------------------------------------------------------


def kv_utilization(prompt_lens: list[int], output_lens: list[int], block_size: int = 16,
                   max_num_seqs: int = 32, max_model_len: int = 2048,
                   max_num_batched_tokens: int = 2048) -> dict[str, float]:
    """Share of allocated KV slots that hold a token, averaged over every round of a workload.

    The real scheduler runs the workload (``sim.simulate``) with room for every request it
    admits. In each round a running request holds the tokens it has computed (the sum of its
    chunks) in ``len(block_table) * block_size`` slots. The same rounds are then charged as if
    every running request had reserved a contiguous region of ``max_model_len`` slots, or of
    ``prompt + max_tokens`` slots (its worst case, known up front), as systems before paging did.
    """
    reqs = [Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
    blocks_per_req = -(-(max(prompt_lens) + max(output_lens)) // block_size)
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=max_num_seqs * blocks_per_req + 1, num_cpu_blocks=0)
    sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
    want = {r.request_id: r.prompt_len + r.output_len for r in reqs}
    computed: dict[str, int] = {}
    held = paged = to_max = to_need = 0
    for rec in simulate(reqs, sched, cache):
        if rec.preempted:
            raise RuntimeError("the utilization measurement assumes a cache with room for every request")
        for rid, chunk in rec.chunk_sizes.items():
            computed[rid] = computed.get(rid, 0) + chunk
        for rid, table in rec.block_tables.items():
            held += computed[rid]
            paged += len(table) * block_size
            to_max += max_model_len
            to_need += want[rid]
    return {"paged": held / paged, "reserve_max_model_len": held / to_max, "reserve_prompt_plus_max_tokens":
            held / to_need}


# -- scheduler overhead (no model) ------------------------------------------------------------------


def time_schedule(num_seqs: int = 256, num_blocks: int = 10_000, block_size: int = 16, prompt_len: int = 100,
                  rounds: int = 200, policy: str = "vllm") -> list[float]:
    """Seconds per ``schedule()`` call while ``num_seqs`` sequences decode together.

    Every sequence is admitted and prefilled first (untimed); then each timed round schedules all
    of them for one decode step, and each gets a token, as the engine would do after sampling.
    """
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0)
    config = SchedulerConfig(max_num_batched_tokens=max(num_seqs * prompt_len, 2048), max_num_seqs=num_seqs,
                             max_model_len=2048, policy=policy)
    scheduler = Scheduler(config, cache)
    for i in range(num_seqs):
        seq = Sequence(i, None, [1000 + i] * prompt_len, block_size)
        scheduler.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(max_tokens=10**6), 0.0))
    times = []
    for r in range(rounds + 1):
        t = time.perf_counter()
        metas, out = scheduler.schedule()
        dt = time.perf_counter() - t
        if r > 0:  # round 0 is the prefill
            times.append(dt)
        for group, chunk in zip(out.scheduled_seq_groups, out.token_chunk_sizes):
            for seq in group.get_seqs():
                seq.num_computed_tokens += chunk
                scheduler.mark_computed(seq)
                seq.append_token_id(7)
    if len(out.scheduled_seq_groups) != num_seqs:
        raise RuntimeError(f"only {len(out.scheduled_seq_groups)} of {num_seqs} sequences were scheduled")
    return times


# -- reading the committed results ------------------------------------------------------------------


def read_results(name: str, results_dir: str | Path | None = None) -> list[dict]:
    """Rows of ``benchmarks/results/<name>.csv``, with numbers converted."""
    path = Path(results_dir or RESULTS_DIR) / f"{name}.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, v in row.items():
            with contextlib.suppress(ValueError, TypeError):
                row[k] = float(v) if any(c in v for c in ".eE") else int(v)
    return rows


def write_results(name: str, rows: list[dict], results_dir: str | Path | None = None) -> Path:
    path = Path(results_dir or RESULTS_DIR) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


# -- drawings ---------------------------------------------------------------------------------------


def _plt():
    import matplotlib.pyplot as plt

    return plt


def draw_headline(rows: list[dict], ax=None):
    """Bars of tokens/s per system for each headline workload, labelled with tinyserve's ratio."""
    plt = _plt()
    rows = [r for r in rows if r["experiment"] == "headline"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        rates = [next((r["tokens_per_s"] for r in rows if r["workload"] == w and r["system"] == system), 0)
                 for w in workloads]
        offset = (j - (len(systems) - 1) / 2) * width
        bars = ax.bar(np.arange(len(workloads)) + offset, rates, width, label=system, color=COLORS[system])
        for bar, w in zip(bars, workloads):
            ours = next(r["tokens_per_s"] for r in rows if r["workload"] == w and r["system"] == "tinyserve")
            if not system.startswith("tinyserve") and bar.get_height():
                ax.annotate(f"{ours / bar.get_height():.2f}×", (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(workloads)), workloads)
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(0, 1.3 * max(r["tokens_per_s"] for r in rows))
    ax.set_title("throughput (numbers: tinyserve, default policy, ÷ that system)")
    ax.legend(fontsize=8, ncol=len(systems), loc="upper center")
    return ax.figure


def draw_sweep(rows: list[dict], experiment: str, x: str, xlabel: str, ax=None):
    """tokens/s of each system against one workload parameter."""
    plt = _plt()
    rows = [r for r in rows if r["experiment"] == experiment]
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.4))
    for system in SYSTEMS:
        pts = sorted((r[x], r["tokens_per_s"]) for r in rows if r["system"] == system)
        if pts:
            ax.plot(*zip(*pts), "o-", label=system, color=COLORS[system])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return ax.figure


def draw_sweeps(rows: list[dict]):
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    req = [r for r in rows if r["experiment"] == "requests"]
    spr = [r for r in rows if r["experiment"] == "spread"]
    draw_sweep(rows, "requests", "num_requests", "number of requests (output lengths drawn at random)", a)
    a.set_title(f"more requests than one batch of {req[0]['batch']}")
    draw_sweep(rows, "spread", "spread", f"output-length spread, max - min ({spr[0]['num_requests']} requests)", b)
    b.set_title("the same mean output length, spread wider")
    fig.tight_layout()
    return fig


def draw_kv_utilization(rows: list[dict], ax=None):
    """Share of allocated KV slots holding a token, per scheme."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    labels = [r["scheme"] for r in rows]
    values = [100 * r["utilization"] for r in rows]
    colors = ["#4e79a7" if r["scheme"].startswith("paged") else "#bab0ac" for r in rows]
    bars = ax.barh(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.1f}%", (v, bar.get_y() + bar.get_height() / 2), va="center", xytext=(3, 0),
                    textcoords="offset points", fontsize=8)
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
    ax.set_xlabel("allocated KV slots that hold a token (%)")
    return ax.figure


def draw_step_breakdown(rows: list[dict]):
    """Left: every step's time (log scale) and batch size. Right: where an average prefill round
    and an average decode round spend their time, part by part (log scale)."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1.6, 1]})
    steps = np.array([r["step"] for r in rows])
    total = np.array([1000 * sum(r[p] for p in STEP_PARTS) for r in rows])
    phases = {"prefill": "#f28e2b", "decode": "#4e79a7", "mixed": "#b07aa1"}
    for phase, color in phases.items():
        pick = np.array([r["phase"] == phase for r in rows])
        if pick.any():
            a.scatter(steps[pick], total[pick], s=8, color=color, label=f"{phase} round")
    a.set_yscale("log")
    a.set_xlabel("engine step")
    a.set_ylabel("step time (ms)")
    twin = a.twinx()
    twin.plot(steps, [r["batch_size"] for r in rows], color="#bab0ac", lw=1, label="sequences in the batch")
    twin.set_ylabel("sequences in the batch")
    a.legend(fontsize=8, loc="upper right")
    twin.legend(fontsize=8, loc="lower left")
    present = [ph for ph in phases if any(r["phase"] == ph for r in rows)]
    height = 0.8 / len(present)
    for j, phase in enumerate(present):
        mine = [r for r in rows if r["phase"] == phase]
        ms = [1000 * sum(r[p] for r in mine) / len(mine) for p in STEP_PARTS]
        b.barh(np.arange(len(STEP_PARTS)) + (j - (len(present) - 1) / 2) * height, ms, height,
               color=phases[phase], label=f"{phase} ({len(mine)} rounds)")
    b.set_yticks(np.arange(len(STEP_PARTS)), STEP_PARTS)
    b.invert_yaxis()
    b.set_xscale("log")
    b.set_xlabel("mean ms per round (log scale)")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def step_shares(rows: list[dict]) -> dict[str, float]:
    total = sum(r[p] for r in rows for p in STEP_PARTS)
    return {p: sum(r[p] for r in rows) / total for p in STEP_PARTS}


@figure("11_throughput")
def throughput_figure():
    return draw_headline(read_results("throughput"))


@figure("11_sweeps")
def sweeps_figure():
    return draw_sweeps(read_results("throughput"))


@figure("11_kv_utilization")
def kv_utilization_figure():
    return draw_kv_utilization(read_results("memory"))


@figure("11_step_breakdown")
def step_breakdown_figure():
    return draw_step_breakdown(read_results("step_times"))
