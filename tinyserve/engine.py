"""The engine: the Scheduler and the Worker(s), stepped together.

``LLMEngine.step`` is one iteration of the serving loop: the scheduler picks the round, the
worker runs it, the sampler picks next tokens, and finished sequences give their blocks back.
``LLM`` wraps the engine for offline batch generation, with vLLM's ``generate`` signature.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.models.loader import resolve_model_dir
from tinyserve.sampler import Sampler, SampleRequest
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus
from tinyserve.sim import RoundRecord, make_record, seq_key
from tinyserve.worker import Worker


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "ignored" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # why an ignored request was not run


@dataclass
class StepTimes:
    """Where one step's time went (seconds), for the performance chapter."""

    schedule: float = 0.0
    model: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    history: list[tuple[float, float, float, float]] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, attention_backend: str = "auto",
                 gpu_memory_utilization: float = 0.9, swap_space_gib: float = 1.0, executor=None) -> None:
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
        self.history: list[RoundRecord] = []
        self.times = StepTimes()
        self._groups: dict[str, SequenceGroup] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._seq_ids = itertools.count()

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise TypeError(f"request {request_id!r}: prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
        vocab = self.executor.loaded.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: prompt token ids must be in [0, {vocab})")
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
            group = self._groups.pop(rid, None)
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
        produced: dict[str, str] = {}
        for (meta, seq), tokens in zip(rows, samples):
            group = self._groups[meta.request_id]
            children = [self._fork(group, seq, token) for token in tokens[1:]]
            seq.append_token_id(tokens[0])
            self._check_stop(group, seq)
            for s, token in zip([seq, *children], tokens):
                produced[seq_key(group, s)] = self.tokenizer.decode([token])
        finished = [m.request_id for m in metas if self._groups[m.request_id].is_finished()]
        self.scheduler.free_finished_seq_groups()
        outputs = [self._output(self._groups[m.request_id]) for m in metas]
        outputs += [self._output(g) for g in out.ignored_seq_groups]
        for rid in finished + [g.request_id for g in out.ignored_seq_groups]:
            group = self._groups.pop(rid)
            for seq in group.get_seqs():
                self._generators.pop(seq.seq_id, None)
        self.history.append(make_record(len(self.history) + 1, self.scheduler, out, finished, produced))
        t4 = time.perf_counter()
        self.times.schedule += t1 - t0
        self.times.model += t2 - t1
        self.times.sample += t3 - t2
        self.times.process += t4 - t3
        self.times.history.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        return outputs

    def _sample_request(self, meta: SequenceGroupMetadata, seq: Sequence) -> SampleRequest:
        params = meta.sampling_params
        first = meta.is_prompt and seq.get_output_len() == 0 and len(meta.seq_data) == 1
        return SampleRequest(params, num_samples=params.n if first else 1, generator=self._generators.get(seq.seq_id))

    def _fork(self, group: SequenceGroup, parent: Sequence, token: int) -> Sequence:
        """Parallel sampling: a child shares the parent's blocks (copy-on-write) and takes its own token."""
        child = parent.fork(next(self._seq_ids))
        group.add(child)
        self.scheduler.fork_seq(parent, child)
        seed = group.sampling_params.seed
        if seed is not None:
            self._generators[child.seq_id] = torch.Generator().manual_seed(seed + len(group.get_seqs()) - 1)
        child.append_token_id(token)
        self._check_stop(group, child)
        return child

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        params = group.sampling_params
        last = seq.get_last_token_id()
        seq.output_text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        status = None
        for stop in params.stop:
            cut = seq.output_text.find(stop)
            if cut != -1:
                seq.output_text = seq.output_text[:cut]
                status = SequenceStatus.FINISHED_STOPPED
                break
        if status is None:
            if (not params.ignore_eos and last == self.eos_token_id) or last in params.stop_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.scheduler_config.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            seq.status = status
            self.scheduler.free_seq(seq)

    @staticmethod
    def _output(group: SequenceGroup) -> RequestOutput:
        completions = [CompletionOutput(i, s.output_text, list(s.output_token_ids), s.status.finish_reason)
                       for i, s in enumerate(group.get_seqs())]
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids), completions,
                             group.is_finished(), group.error)


class LLM:
    """Offline generation with the engine, as ``vllm.LLM`` offers it."""

    def __init__(self, model: str = "smollm2-135m", *, device: str = "auto", dtype: str | None = None,
                 block_size: int = 16, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 watermark: float = 0.01, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, policy: str = "vllm", preemption_mode: str | None = None,
                 attention_backend: str = "auto", tensor_parallel_size: int = 1, seed: int = 0,
                 enable_prefix_caching: bool = False, enable_chunked_prefill: bool = False,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 1.0) -> None:
        model_config = ModelConfig(model=model, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len)
        parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
        cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                   num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                                   enable_prefix_caching=enable_prefix_caching)
        executor = None
        if tensor_parallel_size == 1:
            executor = Worker(model_config, attention_backend=attention_backend)
            limit = executor.loaded.hf_config.max_position_embeddings
        else:
            from transformers import AutoConfig

            limit = AutoConfig.from_pretrained(resolve_model_dir(model)).max_position_embeddings
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len or limit, policy=policy,
                                           preemption_mode=preemption_mode,
                                           enable_chunked_prefill=enable_chunked_prefill)
        self.engine = LLMEngine(model_config, cache_config, scheduler_config, parallel_config,
                                attention_backend=attention_backend, gpu_memory_utilization=gpu_memory_utilization,
                                swap_space_gib=swap_space, executor=executor)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the prompts' order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate needs prompts or prompt_token_ids")
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
