"""Paged attention as one opaque op, so a compiled forward pass has no graph breaks.

A compiler traces the model's forward into a graph of tensor ops. Attention does not fit such a
graph: how much of the cache it reads, and through which block tables, changes every step, and
a backend plans it in Python from the step's ``AttentionMetadata``. vLLM V1's answer, kept here,
is to register attention as a custom op (``torch.library.custom_op``): the compiler sees a
single call with fixed input and output shapes and compiles everything around it, and the call
itself runs the ordinary backend. The step's metadata and backend do not go through the graph:
they are set for the duration of the step with ``step_context``, as V1's forward context does.
Nor do the caches: the op finds its layer's cache pair in the context by the layer's index.
Passed as arguments, caches the op writes to would be declared mutated, and the compiler,
which reasons about values rather than memory, would copy each whole cache to keep the
function pure (seconds per step). V1's ``unified_attention`` hides its cache the same way.

The op stores the new keys and values of the first ``num_tokens`` rows and attends them; rows
past ``num_tokens`` are padding (a batch padded to a captured size) and get zeros, with nothing
written to the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tinyserve.attention.backend import AttentionBackend
from tinyserve.attention.metadata import AttentionMetadata


@dataclass
class StepContext:
    backend: AttentionBackend
    meta: AttentionMetadata
    num_tokens: int  # real rows; the rest of the batch is padding
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # (k_cache, v_cache) per layer


_current: list[StepContext] = []


@contextmanager
def step_context(backend: AttentionBackend, meta: AttentionMetadata, num_tokens: int,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Make these what ``paged_attention`` uses while the block runs."""
    _current.append(StepContext(backend, meta, num_tokens, kv_caches))
    try:
        yield
    finally:
        _current.pop()


@torch.library.custom_op("tinyserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """Store ``k``/``v`` of the real rows into layer ``layer``'s cache and attend ``q`` to it,
    with the backend, metadata and caches of the current ``step_context``; padding rows of the
    output are zero."""
    if not _current:
        raise RuntimeError("paged_attention runs inside step_context(backend, meta, num_tokens, kv_caches)")
    ctx = _current[-1]
    n = ctx.num_tokens
    k_cache, v_cache = ctx.kv_caches[layer]
    out = torch.empty_like(q)  # a custom op's output may not alias its inputs
    if n:  # a batch of padding alone (compiling a size ahead of use) attends to nothing
        ctx.backend.store_kv(k[:n], v[:n], k_cache, v_cache, ctx.meta.slot_mapping)
        out[:n] = ctx.backend.forward(q[:n], k_cache, v_cache, ctx.meta, scale)
    out[n:] = 0
    return out


@paged_attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)
