"""Chapter 06's worked example of the three block movements: a CacheEngine whose blocks carry
their own names, so that after a ``swap_out``, ``swap_in`` or ``copy`` a printout says which block
each block's bytes came from.

Every element of GPU block ``b`` in layer ``l`` holds ``1000 * l + b`` in the key cache and minus
that in the value cache; CPU block ``c`` holds ``1000 * l + 500 + c`` (and minus it). A block's
first element names it, and ``labels`` reads them back as ``G3`` or ``C1``; a block whose elements
disagree (half copied) reads as ``??``, and one whose number belongs to another layer, or whose
sign says it came from the other half (K into V), is shown with that layer or ``k``/``v``.
"""

from __future__ import annotations

import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig

CPU_BASE = 500  # CPU block numbers start here, so a number says which pool a block came from


def numbered_engine(engine_class=CacheEngine, *, num_layers: int = 2, num_gpu_blocks: int = 6,
                    num_cpu_blocks: int = 4, block_size: int = 2, num_kv_heads: int = 1, head_dim: int = 2,
                    dtype: torch.dtype = torch.float32, device: str = "cpu") -> CacheEngine:
    """An ``engine_class`` (the package's CacheEngine by default) whose blocks hold their names."""
    engine = engine_class(CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                      num_cpu_blocks=num_cpu_blocks),
                          num_layers, num_kv_heads, head_dim, dtype, device)
    for base, pool in ((0, engine.gpu_cache), (CPU_BASE, engine.cpu_cache)):
        for layer, (k, v) in enumerate(pool):
            names = torch.arange(k.shape[0], dtype=torch.float32) + 1000 * layer + base
            k.copy_(names.view(-1, 1, 1, 1).expand(k.shape))
            v.copy_(-names.view(-1, 1, 1, 1).expand(v.shape))
    return engine


def _label(block: torch.Tensor, layer: int, half: str) -> str:
    first = block.flatten()[0].item()
    if not bool((block == first).all()):
        return "??"
    sign = "k" if first > 0 else "v" if first < 0 else ""
    number = int(abs(first))
    from_layer, number = divmod(number, 1000)
    name = f"C{number - CPU_BASE}" if number >= CPU_BASE else f"G{number}"
    # Bytes from the wrong half or the wrong layer say so; the right ones are just the name.
    if sign and sign != half:
        name += sign.upper()
    if from_layer != layer:
        name += f"@{from_layer}"
    return name


def labels(pool) -> list[list[list[str]]]:
    """``[layer][0 for K, 1 for V][block]``: where each block's bytes came from."""
    return [[[_label(cache[b], layer, half) for b in range(cache.shape[0])] for half, cache in zip("kv", pair)]
            for layer, pair in enumerate(pool)]


def show_pools(engine: CacheEngine, title: str = "") -> None:
    """Print both pools, one line per pool and layer: whose bytes each block holds, K then V."""
    if title:
        print(title)
    for name, pool in (("GPU", engine.gpu_cache), ("CPU", engine.cpu_cache)):
        for layer, (keys, values) in enumerate(labels(pool)):
            print(f"  {name} layer {layer}   K: " + " ".join(f"{x:>3}" for x in keys)
                  + "   V: " + " ".join(f"{x:>3}" for x in values))
