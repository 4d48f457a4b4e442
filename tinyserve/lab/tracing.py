"""Tools for looking inside a running engine (chapter 09); the engine itself has no hooks for the book.

- ``TracingWorker``: a Worker that keeps, for every call, the cache orders it was given, the
  packed inputs it ran and the logits it returned.
- ``peek``: the engine's next round, scheduled on a deep copy of its scheduler, so looking at a
  round does not consume it.
- ``rename_requests``: the same records under other request ids.
- ``seed_llm_engine`` / ``seed_run``: the s0/s1/s2 walkthrough on the real engine, traced.
- ``sampling_probs``: the distribution the sampler draws from under a setting.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tinyserve.model_runner import ModelInput, prepare_inputs
from tinyserve.sampler import Sampler
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SamplingParams, SequenceGroupMetadata
from tinyserve.sim import RoundRecord
from tinyserve.worker import Worker


@dataclass
class WorkerCall:
    """One ``execute_model`` call: the cache orders, then what the model saw and returned."""

    blocks_to_swap_in: dict[int, int]
    blocks_to_swap_out: dict[int, int]
    blocks_to_copy: dict[int, list[int]]
    inputs: ModelInput | None = None
    logits: torch.Tensor | None = None  # float32 on the CPU, one row per sampled sequence


class TracingWorker(Worker):
    """A Worker that writes down every call. The engine calls the worker only for rounds that
    have work (``SchedulerOutputs.is_empty()`` is False), so ``calls[i]`` is the i-th such round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[WorkerCall] = []

    def execute_model(self, groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy):
        call = WorkerCall(dict(blocks_to_swap_in), dict(blocks_to_swap_out),
                          {src: list(dsts) for src, dsts in blocks_to_copy.items()})
        self.calls.append(call)
        logits = super().execute_model(groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy)
        if logits is not None:
            call.logits = logits.detach().float().cpu().clone()
        return logits

    def run(self, inputs: ModelInput) -> torch.Tensor:
        self.calls[-1].inputs = inputs
        return super().run(inputs)


def peek(engine) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs, ModelInput | None]:
    """The round ``engine.step()`` would run next: scheduled on a deep copy of the engine's
    scheduler (``schedule()`` allocates blocks and moves queues, so it cannot be undone) and
    packed by ``prepare_inputs``. The engine is left exactly as it was."""
    scheduler = copy.deepcopy(engine.scheduler)
    metas, out = scheduler.schedule()
    inputs = prepare_inputs(metas, engine.cache_config.block_size) if metas else None
    return metas, out, inputs


def sequence_names(metas: Sequence[SequenceGroupMetadata]) -> list[str]:
    """A name per packed sequence, in packing order: the request id, suffixed ``.i`` for the
    i-th sequence of a group that has several."""
    names = []
    for meta in metas:
        several = len(meta.seq_data) > 1
        names += [f"{meta.request_id}.{i}" if several else meta.request_id for i in range(len(meta.seq_data))]
    return names


def rename_requests(records: Sequence[RoundRecord], names: dict[str, str]) -> list[RoundRecord]:
    """Copies of ``records`` with request ids replaced through ``names`` (``LLM.generate`` calls
    its requests gen-0, gen-1, ...; the book calls them s0, s1, ...). Sample suffixes (".1")
    are kept; ids not in ``names`` stay as they are."""
    def one(key: str) -> str:
        if key in names:
            return names[key]
        base, _, index = key.rpartition(".")
        return f"{names[base]}.{index}" if base in names else key

    def ids(values: list[str]) -> list[str]:
        return [one(v) for v in values]

    def keyed(d: dict) -> dict:
        return {one(k): v for k, v in d.items()}

    return [replace(r, batch=ids(r.batch), preempted=ids(r.preempted), swapped_out=ids(r.swapped_out),
                    swapped_in=ids(r.swapped_in), finished=ids(r.finished), ignored=ids(r.ignored),
                    waiting=ids(r.waiting), running=ids(r.running), swapped=ids(r.swapped),
                    block_tables=keyed(r.block_tables), cpu_block_tables=keyed(r.cpu_block_tables),
                    chunk_sizes=keyed(r.chunk_sizes), tokens=keyed(r.tokens))
            for r in records]


# -- what the sampler draws from --------------------------------------------------------------------

DEFAULT_SAMPLING_SETTINGS = (
    ("greedy (temperature 0)", SamplingParams(temperature=0.0)),
    ("temperature 0.6", SamplingParams(temperature=0.6)),
    ("temperature 1.0", SamplingParams(temperature=1.0)),
    ("temperature 1.0, top-k 4", SamplingParams(temperature=1.0, top_k=4)),
    ("temperature 1.0, top-p 0.6", SamplingParams(temperature=1.0, top_p=0.6)),
)


def sampling_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for one row (one-hot on the argmax when greedy)."""
    row = logits_row.float().reshape(1, -1)
    if params.greedy:
        return torch.nn.functional.one_hot(row.argmax(dim=-1), row.shape[-1]).float()[0]
    return Sampler._probs(row, [params])[0]


# -- the s0/s1/s2 walkthrough on the real engine ------------------------------------------------------

@dataclass
class SeedRun:
    """The s0/s1/s2 walkthrough on the real engine, with the rounds the book looks at."""

    engine: object  # LLMEngine, finished
    prefill: tuple[list[SequenceGroupMetadata], ModelInput]  # round 1, as peeked before it ran
    decode: tuple[list[SequenceGroupMetadata], ModelInput]  # round 3, as peeked before it ran


_SEED_RUNS: dict[tuple[int, str], SeedRun] = {}


@functools.lru_cache(maxsize=1)
def _default_loaded():
    from tinyserve.models.loader import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


def seed_llm_engine(loaded, preemption_mode: str | None = "auto", max_tokens: int = 8,
                    prompt_token_ids: dict[str, list[int]] | None = None, policy: str = "vllm"):
    """An LLMEngine on ``presets.seed_rounds`` with s0, s1, s2 added (greedy), built around a
    fresh TracingWorker over ``loaded`` (a LoadedModel, shared so the weights load once).
    ``prompt_token_ids`` replaces the tokenized prompts (a model with another tokenizer needs
    it to get the story's 5, 5 and 3 tokens). ``policy`` and ``preemption_mode`` are the
    preset's ("auto": swap, or recompute under v1)."""
    from tinyserve import presets
    from tinyserve.config import ModelConfig
    from tinyserve.engine import LLMEngine

    preset = presets.seed_rounds(preemption_mode, policy=policy, max_tokens=max_tokens)
    weight = next(loaded.model.parameters())
    model_config = ModelConfig(model=str(loaded.path), device=weight.device.type,
                               dtype=str(weight.dtype).removeprefix("torch."))
    engine = LLMEngine(model_config, preset.cache_config, preset.scheduler_config,
                       executor=TracingWorker(model_config, loaded=loaded), record_history=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for rid, prompt in preset.prompts.items():
        engine.add_request(rid, prompt, params, (prompt_token_ids or {}).get(rid))
    return engine


def seed_run(loaded=None, prompt_token_ids: dict[str, list[int]] | None = None) -> SeedRun:
    """Run (once per model, then cached) s0/s1/s2 to the end, peeking at rounds 1 and 3."""
    loaded = loaded or _default_loaded()
    key = (id(loaded), repr(prompt_token_ids))
    if key not in _SEED_RUNS:
        engine = seed_llm_engine(loaded, prompt_token_ids=prompt_token_ids)
        metas1, _, prefill = peek(engine)
        engine.step()
        engine.step()
        metas3, _, decode = peek(engine)
        while engine.has_unfinished_requests():
            engine.step()
        _SEED_RUNS[key] = SeedRun(engine, (metas1, prefill), (metas3, decode))
    return _SEED_RUNS[key]
