"""Solutions to the exercises of chapter 06, the CacheEngine."""

from __future__ import annotations

import torch

from tinyserve.cache_engine import CacheEngine


class PerLayerSwapCacheEngine(CacheEngine):
    """A CacheEngine whose swap-out moves the blocks layer by layer, with one ``index_copy_`` per
    layer and per K/V, through the per-layer views (the package moves every layer at once)."""

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        if not src_to_dst:
            return
        src = torch.tensor(list(src_to_dst), dtype=torch.int64)
        dst = torch.tensor(list(src_to_dst.values()), dtype=torch.int64)
        for gpu_pair, cpu_pair in zip(self.gpu_cache, self.cpu_cache):
            for gpu, cpu in zip(gpu_pair, cpu_pair):  # K, then V
                # index_select copies, so the destination never aliases the source.
                blocks = gpu.index_select(0, src.to(gpu.device))
                cpu.index_copy_(0, dst, blocks.to(cpu.device))


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
