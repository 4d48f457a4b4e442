"""Solutions to the exercises of chapter 06, the CacheEngine."""

from __future__ import annotations

import torch

from tinyserve.cache_engine import CacheEngine


class SwappingCacheEngine(CacheEngine):
    """The package's pools (``__init__``, section 6.1) with the three block movements written out
    layer by layer, through the per-layer views ``gpu_cache`` and ``cpu_cache``."""

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """Copy device block ``src`` into CPU block ``dst``, in every layer, K and V."""
        self._copy_blocks(self.gpu_cache, self.cpu_cache, list(src_to_dst), list(src_to_dst.values()))

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """Copy CPU block ``src`` into device block ``dst``, in every layer, K and V."""
        self._copy_blocks(self.cpu_cache, self.gpu_cache, list(src_to_dst), list(src_to_dst.values()))

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Copy each device block ``src`` into every block of its ``dsts`` (copy-on-write)."""
        # One source block may go to several destinations: repeat it once per destination.
        pairs = [(src, dst) for src, dsts in src_to_dsts.items() for dst in dsts]
        self._copy_blocks(self.gpu_cache, self.gpu_cache, [s for s, _ in pairs], [d for _, d in pairs])

    @staticmethod
    def _copy_blocks(src_pool, dst_pool, src: list[int], dst: list[int]) -> None:
        if not src:  # most rounds move nothing
            return
        for src_pair, dst_pair in zip(src_pool, dst_pool):
            for src_cache, dst_cache in zip(src_pair, dst_pair):  # K, then V
                # Each index lives where the tensor it indexes does (the GPU pool may be on CUDA).
                src_index = torch.tensor(src, dtype=torch.int64, device=src_cache.device)
                dst_index = torch.tensor(dst, dtype=torch.int64, device=dst_cache.device)
                # index_select gathers into a new tensor, so no write can clobber a block still
                # to be read; .to() carries it across the bus when the pools are on two devices.
                blocks = src_cache.index_select(0, src_index).to(dst_cache.device)
                dst_cache.index_copy_(0, dst_index, blocks)


def max_seqs_in_budget(budget_bytes, seq_len, block_size, num_layers, num_kv_heads, head_dim, dtype_bytes):
    # Whole blocks only, for the pool and for each sequence: its last block is paid in full.
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    blocks_per_seq = -(-seq_len // block_size)
    return (budget_bytes // block_bytes) // blocks_per_seq


def split_x_position(offset, block_size, num_kv_heads, head_dim, x):
    # Peel the indices off the offset from the fastest-moving one (the last of the shape) outwards.
    rest, within = divmod(offset, x)
    rest, token = divmod(rest, block_size)
    rest, piece = divmod(rest, head_dim // x)
    block, head = divmod(rest, num_kv_heads)
    return block, token, head, piece * x + within
