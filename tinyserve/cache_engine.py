"""The CacheEngine owns the memory behind the paged KV cache.

The block manager only hands out block *numbers*; this module holds the tensors those numbers
index. Every layer has a key cache and a value cache of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` on the device (``gpu_cache``; on a machine
without CUDA, "GPU" memory is ordinary CPU memory) and a second, usually smaller pool of the same
layout in CPU memory (``cpu_cache``), the swap space that preempted sequences are parked in.

It carries out the three block movements the scheduler asks for each round: ``swap_out``
(device -> CPU), ``swap_in`` (CPU -> device) and ``copy`` (device -> device, for copy-on-write
after a fork). It also does the sizing arithmetic: how many bytes one block costs and how many
blocks a memory budget buys.
"""

from __future__ import annotations

import torch

from tinyserve.config import CacheConfig


def _as_index(blocks: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.int64, device=device)


class CacheEngine:
    """Device and CPU KV-cache pools for every layer, with swap and copy between blocks."""

    def __init__(
        self,
        cache_config: CacheConfig,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # >>> fold: validation: the pool must be sized
        if cache_config.num_gpu_blocks is None:
            raise ValueError(
                "cache_config.num_gpu_blocks is None: size the pool first "
                "(CacheEngine.num_blocks_for_budget or CacheEngine.profile_num_gpu_blocks)"
            )
        # <<<
        self.block_size = cache_config.block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_gpu_blocks = cache_config.num_gpu_blocks
        self.num_cpu_blocks = cache_config.num_cpu_blocks or 0

        # One tensor per pool, [layer, k/v, block, ...], so a swap or copy moves a block of
        # every layer with a single indexing call; the per-layer caches are views into it.
        # Zero-filled: a fresh cache should never leak NaN/garbage into a kernel that masks badly.
        self._gpu = torch.zeros(self._shape(self.num_gpu_blocks), dtype=dtype, device=self.device)
        # Pinned host memory lets device<->host copies run at full bus speed.
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._cpu = torch.zeros(self._shape(self.num_cpu_blocks), dtype=dtype, device="cpu", pin_memory=pin)
        self.gpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = [(c[0], c[1]) for c in self._gpu]
        self.cpu_cache: list[tuple[torch.Tensor, torch.Tensor]] = [(c[0], c[1]) for c in self._cpu]

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @staticmethod
    def _move(src_pool: torch.Tensor, dst_pool: torch.Tensor, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        # index_select makes a copy first, so overlapping sources and destinations are safe.
        blocks = src_pool.index_select(2, _as_index(src, src_pool.device))
        dst_pool.index_copy_(2, _as_index(dst, dst_pool.device), blocks.to(dst_pool.device))

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """Copy CPU blocks ``src`` into device blocks ``dst``, in every layer."""
        self._move(self._cpu, self._gpu, list(src_to_dst), list(src_to_dst.values()))

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """Copy device blocks ``src`` into CPU blocks ``dst``, in every layer."""
        self._move(self._gpu, self._cpu, list(src_to_dst), list(src_to_dst.values()))

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Copy each device block ``src`` into each of its ``dsts`` (copy-on-write), every layer."""
        pairs = [(src, dst) for src, dsts in src_to_dsts.items() for dst in dsts]
        self._move(self._gpu, self._gpu, [s for s, _ in pairs], [d for _, d in pairs])

    # ---- sizing ---------------------------------------------------------------------------

    @staticmethod
    def get_cache_block_size(
        block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one block: K and V, for every layer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks ``budget_bytes`` buys (0 for a budget below one block)."""
        per_block = CacheEngine.get_cache_block_size(block_size, num_layers, num_kv_heads, head_dim, dtype)
        return max(0, int(budget_bytes) // per_block)

    @staticmethod
    def num_cpu_blocks_for_swap(
        swap_space_gib: float, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """CPU swap blocks in ``swap_space_gib`` GiB (vLLM's ``swap_space`` knob, 4 GiB there)."""
        return CacheEngine.num_blocks_for_budget(
            int(swap_space_gib * 2**30), block_size, num_layers, num_kv_heads, head_dim, dtype
        )

    @staticmethod
    def profile_num_gpu_blocks(
        block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        gpu_memory_utilization: float = 0.9, activation_bytes: int = 0,
        device: torch.device | str | None = None,
    ) -> int:
        """Blocks that fit on a CUDA device once its weights are loaded.

        The budget is ``gpu_memory_utilization`` of the device's total memory, minus what is
        already in use (the model's weights, loaded before calling this, and anything else on
        the device, per ``torch.cuda.mem_get_info``), minus ``activation_bytes`` kept free for
        the forward pass's peak activations.
        """
        # >>> fold: validation: CUDA, a utilization in (0, 1]
        if not torch.cuda.is_available():
            raise RuntimeError(
                "profile_num_gpu_blocks needs CUDA; on the CPU pass num_gpu_blocks or use num_blocks_for_budget"
            )
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        # <<<
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - int(activation_bytes)
        return CacheEngine.num_blocks_for_budget(budget, block_size, num_layers, num_kv_heads, head_dim, dtype)

    @staticmethod
    def check_capacity(num_gpu_blocks: int, block_size: int, max_model_len: int) -> None:
        """Refuse a pool that cannot hold even one sequence of ``max_model_len`` tokens: every
        such request would wait forever."""
        tokens = num_gpu_blocks * block_size
        if tokens < max_model_len:
            # >>> fold: ValueError: not even one full-length sequence fits
            raise ValueError(
                f"The KV cache is too small: {num_gpu_blocks} blocks hold {tokens} tokens but "
                f"max_model_len is {max_model_len}, so not even one full-length sequence fits. "
                "Give the cache more blocks (num_gpu_blocks or memory) or lower max_model_len."
            )
            # <<<
