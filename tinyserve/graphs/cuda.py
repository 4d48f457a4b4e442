"""Decode steps captured as CUDA graphs and replayed, as vLLM v0.4's ``CUDAGraphRunner`` does.

A CUDA graph records every kernel launch of one forward pass, with the addresses it read and
wrote, and replays them all with one call: the CPU no longer launches hundreds of kernels one by
one while the GPU waits. A recording holds addresses, not values, so everything a step reads
lives in *static buffers* allocated once (token ids, positions, slots, block tables, context
lengths); each step copies its batch into their first rows, pads the rest (slot -1: nothing
stored; context length 1) and replays the graph of its padded size. The attention kernel must
take its work from those tensors alone, so the graph's metadata gives every row the largest
context a graph serves (``max_context_len``, v0.4's ``max_context_len_to_capture``) as the
host-side bound and the real lengths in ``context_lens``; the Triton backend's decode kernel
works that way. Longer contexts, larger batches and anything but a pure decode run eagerly.

``capture`` is the recording function, ``cuda_capture`` on a GPU; tests pass one that runs the
step eagerly over the same static buffers, which checks the buffers, the padding and which
graph a batch picks without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.graphs.sizes import graph_size
from tinyserve.model_runner import ModelInput

Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(pool=None) -> Capture:
    """A ``Capture`` that records ``fn`` into a ``torch.cuda.CUDAGraph`` (all graphs sharing
    ``pool``, as v0.4's do, so the sizes' activations reuse one allocation)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        fn()  # a warm-up run outside the graph: lazy initialisation and autotuning happen here
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


def graph_safe(backend) -> bool:
    """Whether a CUDA graph may record ``backend``: its decode and store take all their work
    from tensors (``graph_safe = True``, as the Triton backend declares), not from host lists
    that a recording would freeze."""
    return bool(getattr(backend, "graph_safe", False))


class CudaGraphs:
    """One captured decode step per capture size, over static buffers shared by all of them."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int],
                 block_size: int, max_context_len: int, capture: Capture | None = None) -> None:
        # >>> fold: ValueError: a backend that plans from host-side lengths
        if not graph_safe(model.backend):
            raise ValueError(f"CUDA graphs need an attention backend whose decode reads the lengths and block tables "
                             f"from their tensors (graph_safe = True, as 'triton'); "
                             f"{type(model.backend).__name__} plans from host-side lists")
        # <<<
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.block_size = block_size
        self.max_blocks = -(-max_context_len // block_size)
        self.max_context_len = self.max_blocks * block_size
        self.capture_fn = capture or cuda_capture()
        device, top = model.embed_tokens.device, max(sizes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def static_meta(self, size: int) -> AttentionMetadata:
        """The metadata a graph of ``size`` rows is recorded with: views of the static buffers."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 context_lens=self.context_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 query_lens=[1] * size, context_lens_list=[self.max_context_len] * size)

    def capture_all(self) -> None:
        """Record every size, largest first (its memory serves the smaller ones in a shared pool)."""
        for size in sorted(self.sizes, reverse=True):
            meta = self.static_meta(size)
            self.graphs[size] = self.capture_fn(
                lambda size=size, meta=meta: self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                                                        meta))

    def run(self, inputs: ModelInput) -> torch.Tensor | None:
        """Hidden states of the batch's rows from a replayed graph, or None when no graph takes
        the batch (it then runs eagerly)."""
        size = graph_size(inputs, self.sizes)
        meta = inputs.attn_metadata
        if size is None or meta.max_context_len > self.max_context_len:
            return None
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        # Padding rows: stored nowhere, attending to one cached token; their outputs are dropped.
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.block_tables[:size, width:] = 0
        self.block_tables[n:size] = 0
        self.context_lens[n:size] = 1
        replay, out = self.graphs[size]
        replay()
        return out[:n]
