"""``LLM``: offline batch generation with the engine, with vLLM's ``generate`` signature.

``LLM(...)`` takes every setting as a keyword (see ``DESIGN.md``'s public API), groups them into
the engine's configs, and builds an ``LLMEngine``. ``generate`` adds the prompts as requests,
steps the engine until all of them finish, and returns their outputs in the prompts' order.
"""

from __future__ import annotations

import itertools
import reprlib
import time

import torch
from tqdm.auto import tqdm

from tinyserve.attention.backend import BackendSpec, check_backend
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.models.loader import max_model_len_for
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import check_graph_settings


def _list_of(items, kind) -> bool:
    """True for None, or a list (or tuple) whose items are all ``kind``."""
    return items is None or (isinstance(items, (list, tuple)) and all(isinstance(i, kind) for i in items))


class LLM:
    """Offline generation with the engine, as ``vllm.LLM`` offers it.

    ``max_model_len=None`` is the model's own limit (read from its config, not its weights).
    ``enable_prefix_caching`` and ``enable_chunked_prefill`` left None are on under
    ``policy="v1"`` and off otherwise, as vLLM V1 and v0.4 default them.
    ``attention_backend`` is a name ("auto", "torch", "torch-batched", "triton") or a backend
    object (two methods, see ``tinyserve.attention.backend``) that then runs in every attention
    layer of the real engine. ``scheduler`` (a Scheduler class or factory), ``cache_engine`` (a
    CacheEngine class or factory), ``prepare_inputs`` (a function like
    ``model_runner.prepare_inputs``), ``sampler`` (an object called like ``Sampler``) and
    ``beam_select`` (a function called like ``beam_search.select``) replace those parts of the
    engine (see ``LLMEngine``). ``enforce_eager`` (vLLM's name): True runs every step eagerly,
    False runs decode steps as padded graphs (CUDA graphs on a GPU, ``torch.compile`` on the CPU,
    chapter 11), None chooses graphs on a GPU and eager on the CPU.
    """

    def __init__(self, model: str = "smollm2-135m", *, device: str = "auto", dtype: str | torch.dtype = "auto",
                 block_size: int = 16, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 watermark: float = 0.01, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, policy: str = "vllm", preemption_mode: str | None = None,
                 attention_backend: BackendSpec = "auto", tensor_parallel_size: int = 1, seed: int = 0,
                 enable_prefix_caching: bool | None = None, enable_chunked_prefill: bool | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 1.0, record_history: bool = False,
                 compat: str = "tinyserve", cache_engine=None, sampler=None, scheduler=None,
                 prepare_inputs=None, beam_select=None, enforce_eager: bool | None = None) -> None:
        model_config = ModelConfig(model=model, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                   enforce_eager=enforce_eager)
        check_graph_settings(enforce_eager, tensor_parallel_size)
        check_backend(attention_backend)  # refused before any weights are read
        cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                   num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                                   enable_prefix_caching=(policy == "v1" if enable_prefix_caching is None
                                                          else enable_prefix_caching))
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len_for(model_config), policy=policy,
                                           preemption_mode=preemption_mode,
                                           enable_chunked_prefill=enable_chunked_prefill, compat=compat)
        self.engine = LLMEngine(model_config, cache_config, scheduler_config,
                                ParallelConfig(tensor_parallel_size=tensor_parallel_size),
                                attention_backend=attention_backend, gpu_memory_utilization=gpu_memory_utilization,
                                swap_space_gib=swap_space, record_history=record_history,
                                cache_engine=cache_engine, sampler=sampler, scheduler=scheduler,
                                prepare_inputs=prepare_inputs, beam_select=beam_select)
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the prompts' order."""
        prompts, prompt_token_ids, params = _generate_args(prompts, sampling_params, prompt_token_ids)
        n = len(params)
        ids = []
        try:
            for i in range(n):
                rid = f"gen-{next(self._counter)}"
                self.engine.add_request(rid, prompts[i] if prompts is not None else None, params[i],
                                        prompt_token_ids[i] if prompt_token_ids is not None else None)
                ids.append(rid)
        # >>> fold: all or nothing: a bad prompt leaves no half-batch behind
        except Exception:
            self.engine.abort_request(ids)
            raise
        # <<<
        return self._run(ids, use_tqdm if use_tqdm is not None else n > 16)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        # As vLLM's: throughput so far, input and output tokens per second, and no ETA (which,
        # extrapolated from the first request to finish, says minutes for a batch of seconds).
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        start, tokens_in, tokens_out = time.perf_counter(), 0, 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        tokens_in += len(out.prompt_token_ids)
                        tokens_out += sum(len(o.token_ids) for o in out.outputs)
                        seconds = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"input {tokens_in / seconds:.1f} tok/s, output "
                                            f"{tokens_out / seconds:.1f} tok/s", refresh=False)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _generate_args(prompts, sampling_params, prompt_token_ids) -> tuple[list | None, list | None, list]:
    """``generate``'s arguments checked, and as lists: the prompts (or None), the token ids (or
    None) and one SamplingParams per prompt. A ValueError names what is wrong."""
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
    if any(isinstance(p, SamplingParams) and p.output_kind == "delta" for p in params):
        raise ValueError("output_kind='delta' is for callers of LLMEngine.step, who add the pieces up; "
                         "generate returns each request's whole output")
    return prompts, prompt_token_ids, params
