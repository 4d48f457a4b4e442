"""Three systems that generate the same tokens for the same requests (greedy, ``ignore_eos``).

- ``TinyserveSystem``: the engine of this book (continuous batching over a paged cache);
- ``StaticGenerateSystem``: transformers' ``model.generate`` on static, left-padded batches,
  where a batch runs until its longest request is done;
- ``GenerateBatchSystem``: transformers' own continuous batching with a paged cache (the
  machinery behind ``model.generate_batch``, driven request by request so each can have its
  own length).

``compare`` runs them side by side; ``benchmarks/throughput.py`` and chapter 11 use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyserve.lab.perf.steps import split_steps, timing
from tinyserve.lab.perf.workloads import Workload
from tinyserve.sequence import SamplingParams


@dataclass
class RunResult:
    system: str
    seconds: float
    outputs: list[list[int]]  # generated token ids per request, in request order
    # The work the run did, where the system can say (None: it can't, as for generate_batch):
    forwards: int | None = None  # model forward passes
    prefill_forwards: int | None = None  # passes that ran prompts and no decoding sequence
    decode_rows: int | None = None  # sequence rows computed by decoding passes, wasted ones included

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
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
        from tinyserve.recording import HistoryRecorder

        recorder = HistoryRecorder()  # this run's steps only, whether or not the engine keeps a history
        self.llm.engine.add_callback(recorder)
        prepare: list[float] = []
        try:
            with timing(self.llm.engine.executor, "prepare_inputs", prepare):
                start = time.perf_counter()
                outs = self.llm.generate(prompt_token_ids=w.prompts, sampling_params=params, use_tqdm=False)
                seconds = time.perf_counter() - start
        finally:
            self.llm.engine.remove_callback(recorder)
        self.last_steps = split_steps(recorder.step_times, recorder.records, prepare)
        ran = [s for s in self.last_steps if s["batch_size"]]
        return RunResult(self.name, seconds, [list(o.outputs[0].token_ids) for o in outs], forwards=len(ran),
                         prefill_forwards=sum(s["phase"] == "prefill" for s in ran),
                         decode_rows=sum(s["decode_rows"] for s in ran))


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
        forwards = batches = rows = 0
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
            # One prefill pass, then a decoding pass per further token of the longest request,
            # each over every row of the batch, finished or not.
            batches, forwards, rows = batches + 1, forwards + max(lens), rows + len(lens) * (max(lens) - 1)
        return RunResult(self.name, time.perf_counter() - start, outputs, forwards=forwards,
                         prefill_forwards=batches, decode_rows=rows)


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
        calls: list[int] = []  # one entry per forward pass the manager makes (its passes mix phases)
        hook = self.model.register_forward_pre_hook(lambda *_: calls.append(1))
        with hook, self.model.continuous_batching_context_manager(
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
        return RunResult(self.name, seconds, [done[i] for i in ids], forwards=len(calls))


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


def step_breakdown(llm, w: Workload) -> list[dict]:
    """Run ``w`` on tinyserve and split every step's time into scheduling, input preparation,
    the model's forward pass, sampling, and processing the outputs (stop checks, bookkeeping).

    The engine times four phases itself (``engine.times``); input preparation is inside its
    "model" phase, so ``prepare_inputs`` is timed on its own and subtracted from it.
    """
    system = TinyserveSystem(llm)
    system.run(w)
    return system.last_steps
