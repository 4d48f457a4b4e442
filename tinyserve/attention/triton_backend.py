"""The Triton attention backend (``"triton"``): the kernels where they apply, and said so where not.

The Triton kernels of this package cover two things: storing K/V (every batch) and decode
attention (a batch in which every sequence brings one new token). Every other kind of batch runs
on a PyTorch path, chosen by ``TritonBackend.route`` and recorded:

==================  ===============================================  ==============================
route               batches                                          why not a Triton kernel
==================  ===============================================  ==============================
``decode-kernel``   every sequence brings one new token              (it is the Triton kernel)
``prefill-sdpa``    plain prefills: each context is exactly the new  a prefill kernel is flash
                    tokens                                           attention, which torch's fused
                                                                     SDPA already is
``torch-batched``   anything else: a prefill over a cached prefix,   a decode-style kernel would
                    a later chunk of a chunked prefill, prefills     re-read the prefix once per
                    mixed with decodes (the orca policy)             query; none is written here
==================  ===============================================  ==============================

``route_counts`` counts the attention calls (one per layer) per route, and the first call of each
PyTorch route logs at INFO level (logger ``tinyserve.attention``), so a run on the Triton backend
says which of its work was not Triton. All three routes read the context back from the paged
cache through the block tables, and the tests hold each to ``reference.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tinyserve.attention import batched
from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.triton_paged import paged_decode_attention, store_kv

logger = logging.getLogger("tinyserve.attention")

ROUTES = {
    "decode-kernel": "the Triton paged decode kernel",
    "prefill-sdpa": "plain prefill: torch SDPA over the new tokens read back from the cache "
                    "(no Triton prefill kernel)",
    "torch-batched": "cached prefix, chunked or mixed batch: the torch-batched backend "
                     "(no Triton kernel for it)",
}


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for a batch of plain prefills (every context is exactly the new tokens).

    The new tokens' K/V are read back from the cache through the block tables, the same source
    of truth as the decode kernel's, and each sequence goes to torch's fused SDPA.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    # (sequence, position) of every packed token, built on the host from host lists: no sync.
    seq_idx = [i for i, n in enumerate(meta.query_lens) for _ in range(n)]
    pos = [p for n in meta.query_lens for p in range(n)]
    seq_t = torch.tensor(seq_idx, dtype=torch.long, device=q.device)
    pos_t = torch.tensor(pos, dtype=torch.long, device=q.device)
    slots = meta.block_tables.long()[seq_t, pos_t // block_size] * block_size + pos_t % block_size
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].to(q.dtype)

    out = torch.empty_like(q)
    start = 0
    for n in meta.query_lens:
        rows = slice(start, start + n)
        # [n, H, D] -> [1, H, n, D]; K/V heads are repeated per query head for portability
        # (SDPA's enable_gqa needs torch >= 2.5).
        qs = q[rows].transpose(0, 1)[None]
        ks = k[rows].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vs = v[rows].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1)
        start += n
    return out


class TritonBackend:
    """Triton kernels for the K/V store and for decode; PyTorch, on record, for the rest
    (see the module docstring for which batches take which route and why)."""

    name = "triton"
    # Its decode kernel and store take all their work from tensors (lengths, tables, slots), so a
    # CUDA graph may record them once and replay them on new values (graphs/cuda.py).
    graph_safe = True

    def __init__(self, decode: Callable[..., torch.Tensor] | None = None) -> None:
        """``decode``, if given, replaces the package's kernel on the ``decode-kernel`` route: a
        launcher with the signature of ``reference.paged_decode_attention``, ``(q, k_cache,
        v_cache, block_tables, context_lens, scale) -> out`` (chapter 8's exercise plugs a
        reader's kernel in here). Stores and prefills stay the package's."""
        self.route_counts: Counter[str] = Counter()
        self._fallback = batched.BatchedTorchBackend()
        self.decode = decode

    @staticmethod
    def route(meta: AttentionMetadata) -> str:
        """Which path ``forward`` takes for this batch: a key of ``ROUTES``."""
        if meta.is_decode:
            return "decode-kernel"
        # >>> chapter 12: prefix caching
        if meta.has_prefix:  # a cached prefix or an earlier chunk: attention must read the cache
            return "torch-batched"
        # <<<
        return "prefill-sdpa"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        route = self.route(meta)
        if route != "decode-kernel" and route not in self.route_counts:
            logger.info("triton backend: %s", ROUTES[route])
        self.route_counts[route] += 1
        if route == "decode-kernel":
            # >>> fold: a decode launcher given in place of the package's kernel
            if self.decode is not None:
                return self.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
            # <<<
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          scale, max_context_len=meta.max_context_len)
        if route == "prefill-sdpa":
            return prefill_attention(q, k_cache, v_cache, meta, scale)
        return self._fallback.forward(q, k_cache, v_cache, meta, scale)
