"""From scheduled groups to model inputs: the packed batch.

Every sequence of a round contributes its new tokens back to back, with no padding: a prefill
brings its whole uncomputed prompt (or one chunk of it), a decode brings one token. Alongside
the token ids go their positions, the cache slot each new K/V is written to, and, per
sequence, its block table and context length so attention can read the past back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.sequence import Sequence, SequenceGroupMetadata


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the packed batch whose logits are sampled
    sample_seqs: list[tuple[SequenceGroupMetadata, Sequence]]  # who each sampled row belongs to


def prepare_inputs(groups: list[SequenceGroupMetadata], block_size: int,
                   device: torch.device | str = "cpu") -> ModelInput:
    """Pack the round's groups into one batch (host lists first, one transfer per tensor)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    sample_indices: list[int] = []
    sample_seqs: list[tuple[SequenceGroupMetadata, Sequence]] = []
    # Python loops over sequences and blocks, never over tokens (a prompt may bring thousands).
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            table = meta.block_tables[seq_id]
            start = seq.num_computed_tokens
            end = start + meta.token_chunk_size
            if end > seq.get_len():
                raise ValueError(f"request {meta.request_id!r}: chunk of {meta.token_chunk_size} tokens from "
                                 f"position {start} runs past the sequence's {seq.get_len()} tokens")
            if -(-end // block_size) > len(table):  # a clear error, not an IndexError below
                raise ValueError(f"request {meta.request_id!r}: block table of {len(table)} blocks cannot hold "
                                 f"{end} tokens at block_size {block_size}")
            if end - start == 1:
                input_ids.append(seq.get_last_token_id() if end == seq.get_len() else seq.get_token_ids()[start])
            else:
                input_ids.extend(seq.get_token_ids()[start:end])
            positions.extend(range(start, end))
            _add_slots(slots, table, start, end, block_size)
            query_lens.append(end - start)
            context_lens.append(end)
            tables.append(table)
            if meta.do_sample:
                sample_indices.append(len(input_ids) - 1)
                sample_seqs.append((meta, seq))
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=AttentionMetadata.build(query_lens, context_lens, tables, slots, device=device),
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        sample_seqs=sample_seqs,
    )


def _add_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the cache slots of positions ``start..end-1``: a run of consecutive slots per
    block touched, so a long prefill costs one step per block rather than one per token (and a
    decode, one). Position p lives at offset ``p % block_size`` of block ``table[p // block_size]``."""
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        n = min(block_size - offset, end - p)
        base = table[block] * block_size + offset
        slots.extend(range(base, base + n))
        p += n
