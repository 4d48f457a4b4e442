"""The engine: the Scheduler and the Worker(s), stepped together.

``LLMEngine.step`` is one iteration of the serving loop: the scheduler picks the round, the
worker runs it (``execute``: the cache orders, then the model), the sampler picks next tokens
(whose log-probabilities are read from the model's logits, ``tinyserve/logprobs.py``), the
detokenizer turns them into text, and finished sequences give their blocks back. What a step
needs besides the scheduler, the executor and the sampler is a public method with a contract:
``sample_request``, ``take_prompt_logprobs``, ``fork``, ``check_stop``, ``fail``, ``output``,
``release`` and ``report_step`` (chapter 9's exercise writes ``step`` and ``execute`` from them).
Whoever wants to watch (the book's recorder, a metrics exporter) registers a callback that
hears what each step did (``add_callback``). ``LLM`` (``tinyserve/llm.py``) wraps the engine
for offline batch generation.
"""

from __future__ import annotations

import itertools
import time

import torch

from tinyserve import beam_search
from tinyserve.attention.backend import BackendSpec
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.constraints import RequestConstraints
from tinyserve.detokenizer import detokenize_incrementally, find_stop_string
from tinyserve.logprobs import prompt_logprob_dicts, sampled_logprobs
from tinyserve.model_runner import prompt_logprob_spans
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
from tinyserve.scheduler_outputs import SchedulerOutputs
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
    ``Sampler(model_config.seed)``; ``beam_select``, a function called like
    ``beam_search.select`` that decides which beams of a beam search go on (chapter 14).
    ``executor`` replaces the Worker itself.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, attention_backend: BackendSpec = "auto",
                 gpu_memory_utilization: float = 0.9, swap_space_gib: float = 1.0, executor=None,
                 record_history: bool = False, cache_engine=None, sampler=None, scheduler=None,
                 prepare_inputs=None, beam_select=None) -> None:
        self.model_config = model_config
        parallel_config = parallel_config or ParallelConfig()
        _check_hooks(executor, parallel_config, cache_engine=cache_engine, sampler=sampler, scheduler=scheduler,
                     prepare_inputs=prepare_inputs, beam_select=beam_select)
        if executor is None:
            executor = _make_executor(model_config, parallel_config, attention_backend, cache_engine, prepare_inputs,
                                      scheduler_config.max_num_seqs)
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
        self.beam_select = beam_select if beam_select is not None else beam_search.select
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = hf.vocab_size
        self.constraints = RequestConstraints(self.tokenizer, self.vocab_size, self.eos_token_id)
        self.times = StepTimes()
        # Running totals (constant memory) for the server's /metrics.
        self.num_preemptions_total = 0
        self.num_generation_tokens_total = 0
        self._callbacks: list[StepCallback] = []
        self._groups: dict[str, SequenceGroup] = {}
        # Each request's outputs in the kind it asked for.
        self._outputs = OutputBuilder(scheduler_config.compat, self.eos_token_id)
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
        if sampling_params.has_constraints:
            self.constraints.add(request_id, sampling_params)  # chapter 12: a bad grammar is refused here
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
            self.release(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- one iteration ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of the serving loop. Returns the outputs of the round's requests: each
        scheduled one and each the scheduler refused (ignored), in the kind each asked for."""
        t0 = time.perf_counter()
        metas, out = self.scheduler.schedule()
        t1 = time.perf_counter()
        logits = self.execute(metas, out)
        t2 = time.perf_counter()
        if logits is not None:
            logits = self.take_prompt_logprobs(metas, logits)  # before the computed tokens advance
        self.scheduler.update_num_computed_tokens(out)  # the K/V of every scheduled token is in the cache
        groups = [scheduled.seq_group for scheduled in out.scheduled_seq_groups]  # one per meta, in order
        rows = [(meta, group, seq) for meta, group in zip(metas, groups) if meta.do_sample
                for seq in meta.seq_data.values()]
        requests = [self.sample_request(meta, seq) for meta, _, seq in rows]
        samples = self.sampler(logits, requests) if rows else []
        logprobs = sampled_logprobs(logits, requests, samples) if rows else []
        t3 = time.perf_counter()
        produced: list[tuple[SequenceGroup, Sequence, int]] = []
        beams: dict[str, tuple[SequenceGroup, list]] = {}
        for (_, group, seq), tokens, row_logprobs in zip(rows, samples, logprobs):
            if seq.is_finished():
                continue  # its request failed on an earlier row of this step
            if isinstance(tokens, Exception):
                self.fail(group, f"sampling failed: {tokens}")
                continue
            # >>> fold: chapter 14: a beam search's rows are decided together, after the loop
            if group.sampling_params.use_beam_search:
                beams.setdefault(group.request_id, (group, []))[1].append((seq, tokens, row_logprobs))
                continue
            # <<<
            # The first token is the row's own; each other one (best_of > 1 at a prompt) starts a fork.
            seqs = [seq] + [self.fork(group, seq, t, lp) for t, lp in zip(tokens[1:], row_logprobs[1:])]
            seq.append_token_id(tokens[0], *row_logprobs[0])
            for s, token in zip(seqs, tokens):
                self.check_stop(group, s)
                produced.append((group, s, token))
        # >>> fold: chapter 14: beam search
        for group, beam_rows in beams.values():
            if not group.is_finished():
                produced += self.beam_step(group, beam_rows)
        # <<<
        finished = [g.request_id for g in groups if g.is_finished()]
        self.scheduler.free_finished_seq_groups()
        outputs = [o for o in map(self.output, groups + out.ignored_seq_groups) if o is not None]
        for rid in finished + [g.request_id for g in out.ignored_seq_groups]:
            self.release(rid)
        self.report_step(out, finished, produced, outputs, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
        return outputs

    def execute(self, metas: list[SequenceGroupMetadata], out: SchedulerOutputs) -> torch.Tensor | None:
        """The worker's half of a step: the round's cache orders, then the model (``Worker.execute_model``).

        Swap-out goes first, because the GPU blocks it empties may be handed out again this very
        round (as a swap-in or copy destination, or a new token's slot); swap-in next, because a
        copy may read a block just brought back; the copies last, before the model writes the
        new tokens into the fresh copies. Returns float32 logits, one row per sampled sequence
        in batch order (then the prompt rows ``prompt_logprobs`` asks for), or None when no
        group ran (a round of cache orders alone, or an empty one)."""
        if out.is_empty():
            return None
        return self.executor.execute_model(metas, out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy)

    # -- the step's tools: what a step needs besides the scheduler, the executor and the sampler --

    def sample_request(self, meta: SequenceGroupMetadata, seq: Sequence) -> SampleRequest:
        """What the sampler needs to draw ``seq``'s next token(s): its request's parameters, its
        own generator (requests with a ``seed``), its tokens for the penalties, and how many to
        draw: ``best_of`` for a prompt's first sample (one row, then forks), otherwise 1."""
        params = meta.sampling_params
        first = meta.is_prompt and seq.get_output_len() == 0 and len(meta.seq_data) == 1
        num_samples = params.num_samples if first else 1
        if params.use_beam_search:  # every beam proposes its 2W likeliest tokens (beam_search.candidates)
            num_samples = 2 * params.num_samples
        constraints = (self.constraints.row(meta.request_id, seq.seq_id, params, seq.output_token_ids)
                       if params.has_constraints else None)
        return SampleRequest(params, num_samples=num_samples,
                             generator=self._generators.get(seq.seq_id), prompt_token_ids=seq.prompt_token_ids,
                             output_token_ids=seq.output_token_ids, eos_token_id=self.eos_token_id,
                             constraints=constraints)

    def beam_step(self, group: SequenceGroup,
                  rows: list[tuple[Sequence, list[int], list[tuple[float, dict | None]]]]) -> list:
        """One step of a beam search (chapter 14, ``beam_search.py``), as v0.4's
        ``_process_sequence_group_outputs``: ``rows`` holds each running beam with the tokens it
        proposes and their logprobs. The best 2W continuations become children (a parent's last
        one continues the parent, the others fork it; a parent with none drops out), the stop
        checks run, and ``beam_search.select`` decides who goes on: the others are freed. Returns
        the (group, sequence, token) of the beams that took a token and stay."""
        params = group.sampling_params
        width = params.num_samples
        existing_finished = [s for s in group.get_seqs() if s.is_finished()]
        parents = [seq for seq, _, _ in rows]
        proposals = [dict(zip(tokens, entries)) for _, tokens, entries in rows]
        chosen = beam_search.candidates([p.cumulative_logprob for p in parents], [list(p) for p in proposals],
                                        [[lp for lp, _ in p.values()] for p in proposals], width)
        children: list[Sequence] = []
        for i, parent in enumerate(parents):
            mine = [c for c in chosen if c.parent == i]
            if not mine:  # no continuation among the best 2W: this beam drops out
                group.remove(parent.seq_id)
                self.scheduler.free_seq(parent)
                continue
            for c in mine[:-1]:
                # Forked in the block manager now, while the parent's blocks are whole (its own
                # stop check may free them); a child that is not kept is freed below.
                child = parent.fork(next(self._seq_ids))
                self.scheduler.fork_seq(parent, child)
                child.append_token_id(c.token, *proposals[i][c.token])
                children.append(child)
            parent.append_token_id(mine[-1].token, *proposals[i][mine[-1].token])
            children.append(parent)
        for seq in children:
            self.check_stop(group, seq)
        if group.error is not None:  # a stop check failed the request: free the children never added
            for seq in children:
                self.scheduler.free_seq(seq)
            return []
        max_len = max(group.prompt_len + params.max_tokens, self.scheduler_config.max_model_len)
        decided = self.beam_select(children, existing_finished, width, params.length_penalty,
                                     params.early_stopping, self.eos_token_id, max_len)
        for seq in decided.keep:
            if seq.seq_id not in group.seqs_dict:
                group.add(seq)
        for seq in decided.drop:
            if seq.seq_id in group.seqs_dict:  # a parent that does not go on
                group.remove(seq.seq_id)
            self.scheduler.free_seq(seq)
        for seq in decided.drop_finished:
            group.remove(seq.seq_id)
        return [(group, s, s.get_last_token_id()) for s in decided.keep]

    def take_prompt_logprobs(self, metas: list[SequenceGroupMetadata], logits: torch.Tensor) -> torch.Tensor:
        """Split the executor's logits: the rows after the sampled ones are prompt positions that
        requests with ``prompt_logprobs`` asked for; their logprobs go into those requests'
        outputs. Returns the sampled rows alone (all of ``logits`` when no request asked). Reads
        the round's positions from ``num_computed_tokens``: they must not have advanced yet.

        Positions already collected are skipped: a prompt preempted by recompute mid-prefill
        starts over from position 0 in chunks that need not line up with what was collected, so
        a chunk that ends past the collected end contributes its tail, one entirely collected
        contributes nothing (the same weights on the same tokens give the same logprobs)."""
        spans = prompt_logprob_spans(metas)
        if not spans:
            return logits
        num_sampled = sum(len(meta.seq_data) for meta in metas if meta.do_sample)
        rows = logits[num_sampled:]
        offset = 0
        for span in spans:
            group = self._groups[span.meta.request_id]
            collected = group.prompt_logprobs
            # collected[i] is prompt token i's entry, read at position i - 1: the next position
            # wanted is len(collected) - 1.
            wanted = len(collected) - 1 if collected is not None else span.stop
            if wanted < span.start:
                # A gap would misplace every later entry. None is possible today (requests with
                # prompt_logprobs take no prefix-cache hit); should one appear, the request fails
                # loudly rather than answer with prompt logprobs silently missing.
                self.fail(group, f"prompt logprobs are missing from position {wanted}: "
                                 f"this round starts at position {span.start}")
            elif wanted < span.stop:
                next_tokens = span.seq.prompt_token_ids[wanted + 1:span.stop + 1]
                collected += prompt_logprob_dicts(rows[offset + wanted - span.start:offset + span.stop - span.start],
                                                  next_tokens, span.meta.sampling_params.prompt_logprobs)
            offset += span.stop - span.start
        return logits[:num_sampled]

    def fork(self, group: SequenceGroup, parent: Sequence, token: int,
             logprob: tuple[float, dict | None] = (0.0, None)) -> Sequence:
        """A new sequence of ``group`` that copies ``parent`` as it is now, shares its blocks
        (copy-on-write: the block manager copies a shared block when one of them writes into it),
        and takes ``token`` (with its ``logprob``, as ``Sequence.append_token_id``). With a
        ``seed``, the i-th sequence of a group draws from its own generator, seeded ``seed + i``."""
        child = parent.fork(next(self._seq_ids))
        group.add(child)
        self.scheduler.fork_seq(parent, child)
        seed = group.sampling_params.seed
        if seed is not None:
            self._generators[child.seq_id] = torch.Generator().manual_seed(seed + len(group.get_seqs()) - 1)
        child.append_token_id(token, *logprob)
        return child

    def check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """After ``seq`` took a token: detokenize it into ``seq.output_text``, cut a completed stop
        string out of the text, and finish the sequence if it stops (``Scheduler.check_stop``:
        stop strings, EOS, stop token ids, ``max_tokens``, the model length), freeing its blocks.
        A tokenizer that fails on the request's tokens fails the request alone (``fail``). A
        sequence already finished is left as it is."""
        if seq.is_finished():
            return
        try:
            self._check_stop(group, seq)
        except Exception as e:  # the tokenizer failed on this request's tokens: fail it alone
            self.fail(group, f"detokenization failed: {e!r}")

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """The engine's half of the stop checks, the one that needs text; the scheduler checks the rest."""
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

    def fail(self, group: SequenceGroup, message: str) -> None:
        """Finish a request whose own part of the step failed: its unfinished sequences end as
        aborted and free their blocks, and its output carries ``message`` as its error. The other
        requests go on."""
        group.error = f"request {group.request_id!r}: {message}"
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.finish_message = message
            self.scheduler.free_seq(seq)

    def output(self, group: SequenceGroup) -> RequestOutput | None:
        """``group``'s RequestOutput as it stands, in the kind its request asked for (whole,
        delta or final only), or None when that kind has nothing to report now."""
        return self._outputs.build(group)

    def release(self, request_id: str) -> None:
        """Forget a request that is done (finished, ignored or aborted): its generators and what its
        outputs have reported. Its id may be used again afterwards. Its blocks are the scheduler's."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            for seq in group.get_seqs():
                self._generators.pop(seq.seq_id, None)
            self.constraints.forget(request_id, [seq.seq_id for seq in group.get_seqs()])
            self._outputs.forget(group)

    def report_step(self, out: SchedulerOutputs, finished: list[str],
                    produced: list[tuple[SequenceGroup, Sequence, int]], outputs: list[RequestOutput],
                    times: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)) -> None:
        """Tell the observers what a step did: the round, the ids of its requests that finished,
        every token sampled (group, sequence, token), the outputs returned, and the seconds spent
        scheduling, in the model, sampling and processing. Adds them to ``times`` and the
        running totals (preemptions, generated tokens), and calls every callback (the history)."""
        self.times.add(times)
        self.num_preemptions_total += len(out.preempted)
        self.num_generation_tokens_total += len(produced)
        # >>> fold: the callbacks of observers
        if self._callbacks:
            event = StepEvent(out, finished, produced, outputs, times)
            for callback in list(self._callbacks):
                callback(self, event)
        # <<<


def _make_executor(model_config: ModelConfig, parallel_config: ParallelConfig, attention_backend: BackendSpec,
                   cache_engine, prepare_inputs, max_num_seqs: int):
    """The Worker that runs the model (chapter 9), or one worker process per rank (chapter 10)."""
    # >>> chapter 10: tensor parallelism
    if parallel_config.tensor_parallel_size > 1:
        from tinyserve.parallel import TensorParallelExecutor

        return TensorParallelExecutor(model_config, parallel_config, attention_backend)
    # <<<
    return Worker(model_config, attention_backend=attention_backend, cache_engine=cache_engine,
                  prepare_inputs=prepare_inputs, max_num_seqs=max_num_seqs)


# What each replaceable part must be, for the error that refuses it.
_HOOK_KINDS = {
    "cache_engine": "a CacheEngine class or a factory taking its arguments",
    "prepare_inputs": "a function called as prepare_inputs(groups, block_size, device), like model_runner's",
    "sampler": "callable as sampler(logits, sample_requests), like Sampler",
    "beam_select": "a function called like beam_search.select(children, finished, width, length_penalty, "
                   "early_stopping, eos_token_id, max_len)",
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
