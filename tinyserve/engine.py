"""The engine: the Scheduler and the Worker(s), stepped together.

``LLMEngine.step`` is one iteration of the serving loop: the scheduler picks the round, the
worker runs it, the sampler picks next tokens (whose log-probabilities are read from the
model's logits, ``tinyserve/logprobs.py``), the detokenizer turns them into text, and
finished sequences give their blocks back. Whoever wants to watch (the book's recorder, a
metrics exporter) registers a callback that hears what each step did (``add_callback``).
``LLM`` (``tinyserve/llm.py``) wraps the engine for offline batch generation.
"""

from __future__ import annotations

import itertools
import time

import torch

from tinyserve.attention.backend import BackendSpec
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.detokenizer import detokenize_incrementally, find_stop_string
from tinyserve.logprobs import prompt_logprob_dicts, sampled_logprobs
from tinyserve.model_runner import PromptSpan, prompt_logprob_spans
from tinyserve.models.loader import check_max_model_len
from tinyserve.outputs import (
    OutputBuilder,
    RequestOutput,
    StepCallback,
    StepEvent,
    StepTimes,
)
from tinyserve.sampler import Sampler, SampleRequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus, check_token_ids
from tinyserve.worker import Worker


class LLMEngine:
    """The serving loop over one Worker (or a tensor-parallel executor of several).

    Parts can be swapped for one's own through the constructor: ``scheduler``, the class (or
    factory) called as ``scheduler(scheduler_config, cache_config)`` once the cache is sized,
    default ``Scheduler``; ``cache_engine``, the class (or factory with its constructor's
    arguments) the Worker builds its KV cache with, default ``CacheEngine``; ``prepare_inputs``,
    the function the Worker packs a round's inputs with (see ``Worker``); and ``sampler``, an
    object called as ``sampler(logits, sample_requests)`` like ``Sampler``, default
    ``Sampler(model_config.seed)``. ``executor`` replaces the Worker itself.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, attention_backend: BackendSpec = "auto",
                 gpu_memory_utilization: float = 0.9, swap_space_gib: float = 1.0, executor=None,
                 record_history: bool = False, cache_engine=None, sampler=None, scheduler=None,
                 prepare_inputs=None) -> None:
        self.model_config = model_config
        parallel_config = parallel_config or ParallelConfig()
        _check_hooks(executor, parallel_config, cache_engine=cache_engine, sampler=sampler, scheduler=scheduler,
                     prepare_inputs=prepare_inputs)
        if executor is None:
            executor = _make_executor(model_config, parallel_config, attention_backend, cache_engine, prepare_inputs)
        self.executor = executor
        self.tokenizer = executor.loaded.tokenizer
        hf = executor.loaded.hf_config
        check_max_model_len(scheduler_config.max_model_len, hf)
        if cache_config.num_gpu_blocks is None or cache_config.num_cpu_blocks is None:
            num_gpu, num_cpu = executor.determine_num_blocks(cache_config.block_size, gpu_memory_utilization,
                                                             swap_space_gib)
            cache_config.num_gpu_blocks = cache_config.num_gpu_blocks or num_gpu
            if cache_config.num_cpu_blocks is None:
                cache_config.num_cpu_blocks = num_cpu
        CacheEngine.check_capacity(cache_config.num_gpu_blocks, cache_config.block_size, scheduler_config.max_model_len)
        executor.init_cache(cache_config)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.scheduler = (scheduler or Scheduler)(scheduler_config, cache_config)
        self.sampler = sampler if sampler is not None else Sampler(model_config.seed)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = hf.vocab_size
        self.times = StepTimes()
        # Running totals (constant memory) for the server's /metrics.
        self.num_preemptions_total = 0
        self.num_generation_tokens_total = 0
        self._callbacks: list[StepCallback] = []
        self._groups: dict[str, SequenceGroup] = {}
        self._outputs = OutputBuilder(scheduler_config.compat)  # each request's outputs in the kind it asked for
        self._generators: dict[int, torch.Generator] = {}
        self._seq_ids = itertools.count()
        self.recorder = None
        if record_history:
            from tinyserve.recording import HistoryRecorder  # the book's records; a server never loads them

            self.recorder = HistoryRecorder()
            self.times.history = self.recorder.step_times  # one list: times.history is the recorder's
            self.add_callback(self.recorder)

    # -- observers -------------------------------------------------------------------------

    def add_callback(self, callback: StepCallback) -> None:
        """Call ``callback(engine, event)`` after every step, with a StepEvent of what it did."""
        self._callbacks.append(callback)

    def remove_callback(self, callback: StepCallback) -> None:
        self._callbacks.remove(callback)

    @property
    def history(self) -> list:
        """One ``sim.RoundRecord`` per step, kept only by an engine built with record_history=True."""
        if self.recorder is None:
            raise RuntimeError("engine.history is kept only when the engine is built with record_history=True "
                               "(or attach a recording.HistoryRecorder with add_callback)")
        return self.recorder.records

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params.verify()  # again: a field may have been changed since construction
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"request {request_id!r}: prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = check_token_ids("prompt_token_ids", prompt_token_ids, self.vocab_size)
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
        check_token_ids("stop_token_ids", sampling_params.stop_token_ids, self.vocab_size)
        seq = Sequence(next(self._seq_ids), prompt, prompt_token_ids, self.cache_config.block_size)
        if sampling_params.seed is not None:
            self._generators[seq.seq_id] = torch.Generator().manual_seed(sampling_params.seed)
        group = SequenceGroup(request_id, [seq], sampling_params, arrival_time or time.monotonic())
        if sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # no position predicts the first prompt token
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.scheduler.abort_seq_group(ids)
        for rid in ids:
            self._release(rid)

    def _release(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is not None:
            for seq in group.get_seqs():
                self._generators.pop(seq.seq_id, None)
            self._outputs.forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- one iteration ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        metas, out = self.scheduler.schedule()
        t1 = time.perf_counter()
        logits = None
        if not out.is_empty():
            logits = self.executor.execute_model(metas, out.blocks_to_swap_in, out.blocks_to_swap_out,
                                                 out.blocks_to_copy)
        t2 = time.perf_counter()
        spans = prompt_logprob_spans(metas) if logits is not None else []  # before the computed tokens advance
        self.scheduler.update_num_computed_tokens(out)  # the K/V of every scheduled token is in the cache
        rows = [(meta, seq) for meta in metas if meta.do_sample for seq in meta.seq_data.values()]
        requests = [self._sample_request(m, s) for m, s in rows]
        # The logits hold the sampled rows first, then the prompt rows asked for by prompt_logprobs.
        samples = self.sampler(logits[:len(rows)] if spans else logits, requests) if rows else []
        logprobs = sampled_logprobs(logits, requests, samples) if rows else []
        if spans:
            self._take_prompt_logprobs(spans, logits[len(rows):])
        t3 = time.perf_counter()
        produced: list[tuple[SequenceGroup, Sequence, int]] = []
        for (meta, seq), tokens, row_logprobs in zip(rows, samples, logprobs):
            group = self._groups[meta.request_id]
            if seq.is_finished():
                continue  # its request failed on an earlier row of this step
            if isinstance(tokens, Exception):
                self._fail(group, f"sampling failed: {tokens}")
            else:
                produced += self._take_samples(group, seq, tokens, row_logprobs)
        finished = [m.request_id for m in metas if self._groups[m.request_id].is_finished()]
        self.scheduler.free_finished_seq_groups()
        groups = [self._groups[m.request_id] for m in metas] + out.ignored_seq_groups
        outputs = [o for o in map(self._outputs.build, groups) if o is not None]
        for rid in finished + [g.request_id for g in out.ignored_seq_groups]:
            self._release(rid)
        times = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        self.times.add(times)
        self.num_preemptions_total += len(out.preempted)
        self.num_generation_tokens_total += len(produced)
        # >>> fold: the callbacks of observers
        if self._callbacks:
            event = StepEvent(out, finished, produced, outputs, times)
            for callback in list(self._callbacks):
                callback(self, event)
        # <<<
        return outputs

    def _sample_request(self, meta: SequenceGroupMetadata, seq: Sequence) -> SampleRequest:
        params = meta.sampling_params
        first = meta.is_prompt and seq.get_output_len() == 0 and len(meta.seq_data) == 1
        return SampleRequest(params, num_samples=params.num_samples if first else 1,
                             generator=self._generators.get(seq.seq_id), prompt_token_ids=seq.prompt_token_ids,
                             output_token_ids=seq.output_token_ids, eos_token_id=self.eos_token_id)

    # -- log-probabilities (chapter 9's sampling features) -----------------------------------

    def _take_prompt_logprobs(self, spans: list[PromptSpan], logits: torch.Tensor) -> None:
        """Append the dicts of this round's prompt positions to their requests' prompt_logprobs."""
        offset = 0
        for span in spans:
            num = span.stop - span.start
            collected = self._groups[span.meta.request_id].prompt_logprobs
            # In order, chunk after chunk; a recomputed prompt repeats positions already collected.
            if collected is not None and len(collected) == span.start + 1:
                next_tokens = span.seq.prompt_token_ids[span.start + 1:span.stop + 1]
                collected += prompt_logprob_dicts(logits[offset:offset + num], next_tokens,
                                                  span.meta.sampling_params.prompt_logprobs)
            offset += num

    def _take_samples(self, group: SequenceGroup, seq: Sequence, tokens: list[int],
                      logprobs: list[tuple[float, dict | None]]) -> list[tuple[SequenceGroup, Sequence, int]]:
        """``seq`` takes the first token; each other one (best_of > 1 at a prompt) goes to a new fork."""
        # Forks copy seq before its token.
        seqs = [self._fork(group, seq, token, lp) for token, lp in zip(tokens[1:], logprobs[1:])]
        seq.append_token_id(tokens[0], *logprobs[0])
        seqs.insert(0, seq)
        try:
            for s in seqs:
                self._check_stop(group, s)
        except Exception as e:  # the tokenizer failed on this request's tokens: fail it alone
            self._fail(group, f"detokenization failed: {e!r}")
        return [(group, s, t) for s, t in zip(seqs, tokens)]

    def _fork(self, group: SequenceGroup, parent: Sequence, token: int,
              logprob: tuple[float, dict | None] = (0.0, None)) -> Sequence:
        """Parallel sampling: a child shares the parent's blocks (copy-on-write) and takes its own token."""
        child = parent.fork(next(self._seq_ids))
        group.add(child)
        self.scheduler.fork_seq(parent, child)
        seed = group.sampling_params.seed
        if seed is not None:
            self._generators[child.seq_id] = torch.Generator().manual_seed(seed + len(group.get_seqs()) - 1)
        child.append_token_id(token, *logprob)
        return child

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """The engine's half of the stop checks, the one that needs text: detokenize the new token
        and look for a stop string. The scheduler checks the rest (EOS, stop token ids, lengths)
        and frees the blocks of a sequence that finished."""
        new_text = detokenize_incrementally(self.tokenizer, seq)
        params = group.sampling_params
        cut = -1
        if seq.get_output_len() >= params.min_tokens:  # as in v0.4, no stop string counts before min_tokens
            cut = find_stop_string(seq.output_text, len(new_text), params.stop)
        if cut != -1:
            if params.include_stop_str_in_output:  # keep the stop string (the first to complete), cut what follows
                cut += min(len(s) for s in params.stop if seq.output_text.startswith(s, cut))
            seq.output_text = seq.output_text[:cut]
        self.scheduler.check_stop(group, seq, self.eos_token_id, stop_string_found=cut != -1)

    def _fail(self, group: SequenceGroup, message: str) -> None:
        """Finish a request whose own step failed, as aborted with the reason; the others go on."""
        group.error = f"request {group.request_id!r}: {message}"
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.finish_message = message
            self.scheduler.free_seq(seq)


def _make_executor(model_config: ModelConfig, parallel_config: ParallelConfig, attention_backend: BackendSpec,
                   cache_engine, prepare_inputs):
    """The Worker that runs the model (chapter 9), or one worker process per rank (chapter 10)."""
    # >>> chapter 10: tensor parallelism
    if parallel_config.tensor_parallel_size > 1:
        from tinyserve.parallel import TensorParallelExecutor

        return TensorParallelExecutor(model_config, parallel_config, attention_backend)
    # <<<
    return Worker(model_config, attention_backend=attention_backend, cache_engine=cache_engine,
                  prepare_inputs=prepare_inputs)


# What each replaceable part must be, for the error that refuses it.
_HOOK_KINDS = {
    "cache_engine": "a CacheEngine class or a factory taking its arguments",
    "prepare_inputs": "a function called as prepare_inputs(groups, block_size, device), like model_runner's",
    "sampler": "callable as sampler(logits, sample_requests), like Sampler",
    "scheduler": "a Scheduler class or a factory called as scheduler(scheduler_config, cache_config)",
}
_WORKER_PARTS = ("cache_engine", "prepare_inputs")  # given to the Worker the engine builds


def _check_hooks(executor, parallel_config: ParallelConfig, **parts) -> None:
    """Refuse a replacement part that is not callable, or that the engine could not pass on."""
    for name, part in parts.items():
        if part is None:
            continue
        if not callable(part):
            raise ValueError(f"{name} must be {_HOOK_KINDS[name]}; got {part!r}")
        if name not in _WORKER_PARTS:
            continue
        if executor is not None:
            raise ValueError(f"{name} is given to the Worker the engine builds; with executor=..., "
                             f"pass it to that Worker instead (Worker(..., {name}=...))")
        if parallel_config.tensor_parallel_size > 1:
            raise ValueError(f"{name} works with tensor_parallel_size=1 only: the ranks build their workers "
                             "in their own processes")
