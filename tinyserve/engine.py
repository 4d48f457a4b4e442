"""The engine: the Scheduler and the Worker(s), stepped together.

``LLMEngine.step`` is one iteration of the serving loop: the scheduler picks the round, the
worker runs it, the sampler picks next tokens, the detokenizer turns them into text, and
finished sequences give their blocks back. Whoever wants to watch (the book's recorder, a
metrics exporter) registers a callback that hears what each step did (``add_callback``).
``LLM`` wraps the engine for offline batch generation, with vLLM's ``generate`` signature.
"""

from __future__ import annotations

import itertools
import reprlib
import time

import torch
from tqdm.auto import tqdm

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.detokenizer import detokenize_incrementally, find_stop_string
from tinyserve.models.loader import resolve_model_dir
from tinyserve.outputs import CompletionOutput, RequestOutput, StepCallback, StepEvent, StepTimes
from tinyserve.sampler import Sampler, SampleRequest
from tinyserve.sampling_params import SamplingParams
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus, check_token_ids
from tinyserve.worker import Worker


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, attention_backend: str = "auto",
                 gpu_memory_utilization: float = 0.9, swap_space_gib: float = 1.0, executor=None,
                 record_history: bool = False) -> None:
        self.model_config = model_config
        parallel_config = parallel_config or ParallelConfig()
        if executor is None:
            if parallel_config.tensor_parallel_size > 1:
                from tinyserve.parallel import TensorParallelExecutor

                executor = TensorParallelExecutor(model_config, parallel_config, attention_backend)
            else:
                executor = Worker(model_config, attention_backend=attention_backend)
        self.executor = executor
        self.tokenizer = executor.loaded.tokenizer
        hf = executor.loaded.hf_config
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and scheduler_config.max_model_len > limit:
            raise ValueError(f"max_model_len={scheduler_config.max_model_len} is longer than the model's "
                             f"max_position_embeddings={limit}")
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
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.sampler = Sampler(model_config.seed)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = hf.vocab_size
        self.times = StepTimes()
        # Running totals (constant memory) for the server's /metrics.
        self.num_preemptions_total = 0
        self.num_generation_tokens_total = 0
        self._callbacks: list[StepCallback] = []
        self._groups: dict[str, SequenceGroup] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._seq_ids = itertools.count()
        self.recorder = None
        if record_history:
            from tinyserve.recording import HistoryRecorder  # the book's records; a server never loads them

            self.recorder = HistoryRecorder()
            self.times.history = self.recorder.step_times  # the same list: engine.times.history keeps working
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
        for meta in metas:
            for seq in meta.seq_data.values():
                seq.num_computed_tokens += meta.token_chunk_size
                self.scheduler.mark_computed(seq)
        rows = [(meta, seq) for meta in metas if meta.do_sample for seq in meta.seq_data.values()]
        samples = self.sampler(logits, [self._sample_request(m, s) for m, s in rows]) if rows else []
        t3 = time.perf_counter()
        produced: list[tuple[SequenceGroup, Sequence, int]] = []
        for (meta, seq), tokens in zip(rows, samples):
            group = self._groups[meta.request_id]
            if seq.is_finished():
                continue  # its request failed on an earlier row of this step
            if isinstance(tokens, Exception):
                self._fail(group, f"sampling failed: {tokens}")
            else:
                produced += self._take_samples(group, seq, tokens)
        finished = [m.request_id for m in metas if self._groups[m.request_id].is_finished()]
        self.scheduler.free_finished_seq_groups()
        outputs = [self._output(self._groups[m.request_id]) for m in metas]
        outputs += [self._output(g) for g in out.ignored_seq_groups]
        for rid in finished + [g.request_id for g in out.ignored_seq_groups]:
            self._release(rid)
        times = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        self.times.add(times)
        self.num_preemptions_total += len(out.preempted)
        self.num_generation_tokens_total += len(produced)
        if self._callbacks:
            event = StepEvent(out, finished, produced, outputs, times)
            for callback in list(self._callbacks):
                callback(self, event)
        return outputs

    def _sample_request(self, meta: SequenceGroupMetadata, seq: Sequence) -> SampleRequest:
        params = meta.sampling_params
        first = meta.is_prompt and seq.get_output_len() == 0 and len(meta.seq_data) == 1
        return SampleRequest(params, num_samples=params.n if first else 1, generator=self._generators.get(seq.seq_id))

    def _take_samples(self, group: SequenceGroup, seq: Sequence,
                      tokens: list[int]) -> list[tuple[SequenceGroup, Sequence, int]]:
        """``seq`` takes the first token; each other one (n > 1 at a prompt) goes to a new fork."""
        seqs = [self._fork(group, seq, token) for token in tokens[1:]]  # forks copy seq before its token
        seq.append_token_id(tokens[0])
        seqs.insert(0, seq)
        try:
            for s in seqs:
                self._check_stop(group, s)
        except Exception as e:  # the tokenizer failed on this request's tokens: fail it alone
            self._fail(group, f"detokenization failed: {e!r}")
        return [(group, s, t) for s, t in zip(seqs, tokens)]

    def _fork(self, group: SequenceGroup, parent: Sequence, token: int) -> Sequence:
        """Parallel sampling: a child shares the parent's blocks (copy-on-write) and takes its own token."""
        child = parent.fork(next(self._seq_ids))
        group.add(child)
        self.scheduler.fork_seq(parent, child)
        seed = group.sampling_params.seed
        if seed is not None:
            self._generators[child.seq_id] = torch.Generator().manual_seed(seed + len(group.get_seqs()) - 1)
        child.append_token_id(token)
        return child

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        params = group.sampling_params
        last = seq.get_last_token_id()
        new_text = detokenize_incrementally(self.tokenizer, seq)
        cut = find_stop_string(seq.output_text, len(new_text), params.stop)
        if cut != -1:
            seq.output_text = seq.output_text[:cut]
            status = SequenceStatus.FINISHED_STOPPED
        elif (not params.ignore_eos and last == self.eos_token_id) or last in params.stop_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.scheduler_config.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        else:
            return
        seq.status = status
        self.scheduler.free_seq(seq)

    def _fail(self, group: SequenceGroup, message: str) -> None:
        """Finish a request whose own step failed, as aborted with the reason; the others go on."""
        group.error = f"request {group.request_id!r}: {message}"
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.finish_message = message
            self.scheduler.free_seq(seq)

    @staticmethod
    def _output(group: SequenceGroup) -> RequestOutput:
        completions = [CompletionOutput(i, s.output_text, list(s.output_token_ids), s.status.finish_reason)
                       for i, s in enumerate(group.get_seqs())]
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids), completions,
                             group.is_finished(), group.error)


def _list_of(items, kind) -> bool:
    """True for None, or a list (or tuple) whose items are all ``kind``."""
    return items is None or (isinstance(items, (list, tuple)) and all(isinstance(i, kind) for i in items))


class LLM:
    """Offline generation with the engine, as ``vllm.LLM`` offers it."""

    def __init__(self, model: str = "smollm2-135m", *, device: str = "auto", dtype: str | torch.dtype = "auto",
                 block_size: int = 16, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 watermark: float = 0.01, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, policy: str = "vllm", preemption_mode: str | None = None,
                 attention_backend: str = "auto", tensor_parallel_size: int = 1, seed: int = 0,
                 enable_prefix_caching: bool = False, enable_chunked_prefill: bool = False,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 1.0, record_history: bool = False,
                 compat: str = "tinyserve") -> None:
        from transformers import AutoConfig

        model_config = ModelConfig(model=model, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len)
        cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                   num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                                   enable_prefix_caching=enable_prefix_caching)
        if max_model_len is None:  # the model's own limit, read from its config without loading weights
            hf_config = AutoConfig.from_pretrained(str(resolve_model_dir(model)), local_files_only=True)
            max_model_len = hf_config.max_position_embeddings
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len, policy=policy,
                                           preemption_mode=preemption_mode,
                                           enable_chunked_prefill=enable_chunked_prefill, compat=compat)
        self.engine = LLMEngine(model_config, cache_config, scheduler_config,
                                ParallelConfig(tensor_parallel_size=tensor_parallel_size),
                                attention_backend=attention_backend, gpu_memory_utilization=gpu_memory_utilization,
                                swap_space_gib=swap_space, record_history=record_history)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the prompts' order."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate needs prompts or prompt_token_ids")
        if not _list_of(prompts, str):
            raise ValueError(f"prompts must be a string or a list of strings, got {reprlib.repr(prompts)}")
        if not _list_of(prompt_token_ids, (list, tuple)):
            raise ValueError("prompt_token_ids must be a list with one list of token ids per prompt "
                             f"(for one prompt: [ids]), got {reprlib.repr(prompt_token_ids)}")
        n = len(prompts) if prompts is not None else len(prompt_token_ids)
        if n == 0:
            raise ValueError("generate got an empty list of prompts")
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != n:
            raise ValueError(f"{n} prompts but {len(prompt_token_ids)} prompt_token_ids")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{n} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for i in range(n):
                rid = f"gen-{next(self._counter)}"
                self.engine.add_request(rid, prompts[i] if prompts is not None else None, params[i],
                                        prompt_token_ids[i] if prompt_token_ids is not None else None)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a bad prompt leaves no half-batch behind
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else n > 16)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
