"""The Worker: one device's share of the work. It owns the model and the CacheEngine.

Each round it first carries out the scheduler's cache orders (swap out, swap in, copy-on-write
copies), then runs the model on the packed batch and returns the logits of the rows to sample.
With tensor parallelism every rank runs a Worker over its shard; all of them receive the same
orders, because the block tables are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.model_runner import ModelInput, prepare_inputs
from tinyserve.models.loader import LoadedModel, load_model
from tinyserve.sequence import SequenceGroupMetadata

CPU_KV_BUDGET_GIB = 1.0  # on a machine without CUDA the "GPU" cache is ordinary memory
DEFAULT_SWAP_GIB = 1.0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use device='cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


class Worker:
    def __init__(self, model_config: ModelConfig, attention_backend: str = "auto", tp_rank: int = 0,
                 tp_size: int = 1, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 loaded: LoadedModel | None = None) -> None:
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        torch.manual_seed(model_config.seed)
        self.loaded = loaded or load_model(model_config.model, device=self.device, dtype=self.dtype,
                                           tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce,
                                           attention_backend=attention_backend)
        self.model = self.loaded.model
        if loaded is not None:
            self.model.set_attention_backend(attention_backend)
        cfg = self.loaded.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads // tp_size  # this rank's share
        self.cache_engine: CacheEngine | None = None
        self.block_size = 0

    @property
    def backend_name(self) -> str:
        return self.model.backend.name

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
        self.cache_engine = CacheEngine(cache_config, self.num_layers, self.num_kv_heads, self.head_dim,
                                        self.dtype, self.device)

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
        inputs = prepare_inputs(groups, self.block_size, self.device)
        return self.run(inputs)

    def run(self, inputs: ModelInput) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache_engine.gpu_cache, inputs.attn_metadata)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
