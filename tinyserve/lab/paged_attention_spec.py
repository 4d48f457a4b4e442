"""Chapter 07's small demonstrations of what an attention backend must do, read off the package's
reference (``attention/reference.py``) by calling it, never by listing it.

- ``cache_picture``: a paged cache whose head has one channel, drawn as blocks × offsets, so a
  ``store_kv`` call can be seen landing in its slots.
- ``seen_positions``: which context positions each query of a packed batch attends to, found by
  running ``causal_attention`` with zero queries (every visible position gets the same weight) and
  one-hot values (output channel ``p`` is the weight of position ``p``).
- ``kv_head_of``: which KV head each query head reads, found the same way with values that are
  their KV head's number.
"""

from __future__ import annotations

import torch

from tinyserve.attention.reference import causal_attention


def cache_picture(k_cache: torch.Tensor, label=str) -> str:
    """``k_cache [num_blocks, block_size, 1, 1]`` as one line per block, its first slot's number in
    front: each slot's value through ``label`` (a token, say), ``·`` for an empty one (0 or NaN)."""
    num_blocks, block_size = k_cache.shape[:2]
    width = 6
    lines = ["                 offset" + "".join(f"{o:>{width}}" for o in range(block_size))]
    for b in range(num_blocks):
        values = [k_cache[b, o, 0, 0].item() for o in range(block_size)]
        cells = "".join(f"{'·' if x != x or x == 0 else label(x):>{width}}" for x in values)
        lines.append(f"block {b:>2} (slots {b * block_size:>2}+)" + cells)
    return "\n".join(lines)


def seen_positions(query_len: int, context_len: int) -> list[list[int]]:
    """The context positions each of a sequence's ``query_len`` queries attends to, as the
    package's ``causal_attention`` decides it."""
    q = torch.zeros(query_len, 1, 1)
    k = torch.zeros(context_len, 1, 1)
    v = torch.eye(context_len)[:, None, :]  # position p's value is the one-hot vector e_p
    weights = causal_attention(q, k, v, scale=1.0)[:, 0, :]  # [query_len, context_len]
    return [[p for p in range(context_len) if weights[i, p] > 0] for i in range(query_len)]


def seen_picture(query_len: int, context_len: int) -> str:
    """``seen_positions`` drawn as one row per query: ``■`` seen, ``·`` masked."""
    rows = seen_positions(query_len, context_len)
    lines = ["                  position " + " ".join(f"{p:>2}" for p in range(context_len))]
    for i, seen in enumerate(rows):
        pos = context_len - query_len + i
        lines.append(f"  query {i} (position {pos:>2}) " + " ".join(f"{'■' if p in seen else '·':>2}"
                                                              for p in range(context_len)))
    return "\n".join(lines)


def kv_head_of(num_heads: int, num_kv_heads: int) -> list[int]:
    """The KV head each query head reads in the package's ``causal_attention``."""
    q = torch.zeros(1, num_heads, 1)
    k = torch.zeros(1, num_kv_heads, 1)
    v = torch.arange(num_kv_heads, dtype=torch.float32)[None, :, None]  # KV head j's value is j
    return [int(round(x)) for x in causal_attention(q, k, v, scale=1.0)[0, :, 0].tolist()]

