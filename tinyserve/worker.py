"""The Worker: one device's share of the work. It owns the model and the CacheEngine.

Each round it first carries out the scheduler's cache orders (swap out, swap in, copy-on-write
copies), then runs the model on the packed batch and returns the logits of the rows to sample.
With tensor parallelism every rank runs a Worker over its shard; all of them receive the same
orders, because the block tables are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyserve import model_runner
from tinyserve.attention.backend import BackendSpec, backend_label
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, dtype_name, resolve_device
from tinyserve.graphs.compiled import CompiledDecode
from tinyserve.graphs.cuda import CudaGraphs, graph_safe
from tinyserve.graphs.sizes import capture_sizes
from tinyserve.model_runner import ModelInput
from tinyserve.models.loader import LoadedModel, load_model
from tinyserve.models.packed_linear import pack_linears
from tinyserve.sequence import SequenceGroupMetadata

CPU_KV_BUDGET_GIB = 1.0  # on a machine without CUDA the "GPU" cache is ordinary memory
DEFAULT_SWAP_GIB = 1.0


class Worker:
    """The model and its KV cache on one device.

    ``attention_backend`` is a name ("auto", "torch", "torch-batched", "triton") or a backend
    object (see ``attention.backend`` for the two methods it needs). ``loaded`` reuses a model
    already loaded (its backend is switched to ``attention_backend``); otherwise the loader
    loads ``model_config.model``, resolving device and dtype. Either way the Worker runs where
    the model's weights are and in their dtype. ``cache_engine`` is the class that holds the KV
    cache (default ``CacheEngine``; another class with its constructor, ``gpu_cache`` and
    ``swap_in``/``swap_out``/``copy`` can stand in, e.g. a reader's own). ``prepare_inputs`` is
    the function that packs a round's groups into the model's inputs, called as
    ``prepare_inputs(groups, block_size, device)`` and returning a ``ModelInput`` (default
    ``model_runner.prepare_inputs``).
    """

    def __init__(self, model_config: ModelConfig, attention_backend: BackendSpec = "auto", tp_rank: int = 0,
                 tp_size: int = 1, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 loaded: LoadedModel | None = None, cache_engine: type[CacheEngine] | None = None,
                 prepare_inputs: Callable[..., ModelInput] | None = None, max_num_seqs: int = 256) -> None:
        torch.manual_seed(model_config.seed)
        if loaded is None:
            loaded = load_model(model_config.model, device=model_config.device, dtype=model_config.dtype,
                                tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce,
                                attention_backend=attention_backend)
        self.loaded = loaded
        self.model = loaded.model
        self.device, self.dtype = self.model.embed_tokens.device, self.model.embed_tokens.dtype
        _check_settings(model_config, self.device, self.dtype)
        self.model.set_attention_backend(attention_backend)
        self.num_layers = self.model.num_layers
        self.head_dim = self.model.head_dim
        self.num_kv_heads = self.model.num_kv_heads  # this rank's share
        self.cache_engine_class = cache_engine or CacheEngine
        self.prepare_inputs = prepare_inputs or model_runner.prepare_inputs
        self.cache_engine: CacheEngine | None = None
        self.block_size = 0
        # >>> chapter 11: compiled decode steps
        self.max_num_seqs = max_num_seqs
        self.max_model_len = model_config.max_model_len or self.model.config.max_position_embeddings
        self.use_graphs = uses_graphs(model_config.enforce_eager, self.device, tp_size)
        if self.use_graphs and self.device.type == "cuda" and not graph_safe(self.model.backend):
            if model_config.enforce_eager is False:
                raise ValueError(f"enforce_eager=False on CUDA needs the 'triton' attention backend, not "
                                 f"{self.backend_name!r}")
            self.use_graphs = False
        # <<<
        self.decode_graphs: CompiledDecode | CudaGraphs | None = None  # built with the cache (chapter 11)

    @property
    def backend_name(self) -> str:
        return backend_label(self.model.backend)

    def _block_args(self, block_size: int) -> tuple:
        return block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype

    def determine_num_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9,
                             swap_space_gib: float = DEFAULT_SWAP_GIB) -> tuple[int, int]:
        """How many device and CPU blocks this worker can hold."""
        if self.device.type == "cuda":
            # Keep room for the forward pass: a generous guess at the peak activations.
            num_gpu = CacheEngine.profile_num_gpu_blocks(*self._block_args(block_size),
                                                         gpu_memory_utilization=gpu_memory_utilization,
                                                         activation_bytes=2 * 2**30, device=self.device)
        else:
            num_gpu = CacheEngine.num_blocks_for_budget(int(CPU_KV_BUDGET_GIB * 2**30), *self._block_args(block_size))
        num_cpu = CacheEngine.num_cpu_blocks_for_swap(swap_space_gib, *self._block_args(block_size))
        return num_gpu, num_cpu

    def init_cache(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.cache_engine = self.cache_engine_class(cache_config, self.num_layers, self.num_kv_heads, self.head_dim,
                                                    self.dtype, self.device)
        # >>> chapter 11: compiled decode steps
        if self.use_graphs:
            self.decode_graphs = self.build_decode_graphs()
        # <<<

    def warm_up_graphs(self) -> None:
        """Build every size's graph now (compile on the CPU; CUDA graphs are captured with the
        cache already), so that no request waits for one."""
        if isinstance(self.decode_graphs, CompiledDecode):
            self.decode_graphs.compile_all()

    def build_decode_graphs(self) -> CompiledDecode | CudaGraphs:
        """The padded decode graphs over this worker's cache (chapter 11): captured CUDA graphs
        on a GPU, ``torch.compile``'d graphs on the CPU, with the linears' weights packed once
        for oneDNN where the CPU supports it."""
        sizes = capture_sizes(self.max_num_seqs)
        caches = self.cache_engine.gpu_cache
        if self.device.type == "cuda":
            graphs = CudaGraphs(self.model, caches, sizes, self.block_size, self.max_model_len)
            graphs.capture_all()
            return graphs
        pack_linears(self.model)
        return CompiledDecode(self.model, caches, sizes)

    @torch.inference_mode()
    def execute_model(self, groups: list[SequenceGroupMetadata], blocks_to_swap_in: dict[int, int],
                      blocks_to_swap_out: dict[int, int], blocks_to_copy: dict[int, list[int]]) -> torch.Tensor | None:
        """Apply the round's cache operations, then run the model.

        Swap-out goes first: the blocks it frees may be handed to another sequence this very
        round (a copy-on-write destination, a new slot) and must be saved before anything
        writes to them. Returns float32 logits for the sampled rows, or None for an empty batch.
        """
        assert self.cache_engine is not None, "init_cache must run before execute_model"
        self.cache_engine.swap_out(blocks_to_swap_out)
        self.cache_engine.swap_in(blocks_to_swap_in)
        self.cache_engine.copy(blocks_to_copy)
        if not groups:
            return None
        inputs = self.prepare_inputs(groups, self.block_size, self.device)
        return self.run(inputs)

    def run(self, inputs: ModelInput) -> torch.Tensor:
        # A pure decode batch runs on its padded size's graph when there is one (chapter 11).
        hidden = None if self.decode_graphs is None else self.decode_graphs.run(inputs)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache_engine.gpu_cache, inputs.attn_metadata)
        # The LM head runs on the sampled rows only, unless a request asks for prompt logprobs:
        # then its prompt rows follow them (model_runner.prompt_logprob_spans).
        rows = inputs.sample_indices if inputs.logit_indices is None else inputs.logit_indices
        return self.model.compute_logits(hidden.index_select(0, rows))


def uses_graphs(enforce_eager: bool | None, device: torch.device, tp_size: int = 1) -> bool:
    """Whether decode steps run as graphs. ``enforce_eager=None`` chooses what pays on the device:
    graphs on a GPU (as vLLM), eager on the CPU, where compiling a size costs seconds that
    the engine's short runs do not win back (chapter 11 measures both)."""
    check_graph_settings(enforce_eager, tp_size)
    if enforce_eager is None:
        return device.type == "cuda" and tp_size == 1
    return not enforce_eager


def check_graph_settings(enforce_eager: bool | None, tp_size: int) -> None:
    """Refuse graphs that cannot be built, before any weights load."""
    if enforce_eager is False and tp_size > 1:
        raise ValueError("enforce_eager=False is not supported with tensor_parallel_size > 1: the ranks' "
                         "all-reduces would sit inside the graph")


def _check_settings(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an explicit device or dtype that the loaded model does not have."""
    if model_config.device != "auto" and resolve_device(model_config.device).type != device.type:
        raise ValueError(f"model_config.device={model_config.device!r} but the loaded model is on {device}")
    if model_config.dtype != "auto" and model_config.dtype != dtype_name(dtype):
        raise ValueError(f"model_config.dtype={model_config.dtype!r} but the loaded model is in {dtype}")
