"""Which batch sizes get a graph, which graph a batch uses, and which batches use one at all.

vLLM v0.4 captures decode batches of 1, 2 and 4 sequences, then every multiple of 8 up to
``max_num_seqs`` rounded up to a multiple of 8 (``_BATCH_SIZES_TO_CAPTURE``, at most 256); V1's
``CompilationConfig`` keeps the same list as its default capture sizes. A batch runs on the
graph of the smallest size that holds it, its extra rows padding; a larger batch, and any batch
that is not a pure decode, runs eagerly.
"""

from __future__ import annotations

import torch

from tinyserve.model_runner import ModelInput

ALIGNMENT = 8  # sizes past 4 are multiples of this
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph when at most ``max_num_seqs`` sequences run at once."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    # v0.4's _get_graph_batch_size: 1 and 2 as they are, 3 up to 4, then up to a multiple of 8.
    if max_num_seqs <= 2:
        top = max_num_seqs
    elif max_num_seqs <= 4:
        top = 4
    else:
        top = -(-max_num_seqs // ALIGNMENT) * ALIGNMENT
    return [s for s in [1, 2, 4] + list(range(ALIGNMENT, MAX_CAPTURE_SIZE + 1, ALIGNMENT)) if s <= top]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The size of the graph a batch of ``num_seqs`` runs on, or None when no graph holds it."""
    return next((s for s in sizes if s >= num_seqs), None) if num_seqs > 0 else None


def graph_size(inputs: ModelInput, sizes: list[int]) -> int | None:
    """The graph size this batch runs on, or None to run it eagerly: a graph records a pure
    decode step (one new token per sequence), every row sampled, nothing else asked of it."""
    meta = inputs.attn_metadata
    if not meta.is_decode or inputs.logit_indices is not None:
        return None
    return padded_size(meta.num_seqs, sizes)


def pad(values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """``values`` followed by ``fill`` up to ``size`` rows."""
    out = values.new_full((size, *values.shape[1:]), fill)
    out[: values.shape[0]] = values
    return out
