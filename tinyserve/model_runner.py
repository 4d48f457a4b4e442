"""From scheduled groups to model inputs: the packed batch.

Every sequence of a round contributes its new tokens back to back, with no padding: a prefill
brings its whole uncomputed prompt (or one chunk of it), a decode brings one token. Alongside
the token ids go their positions, the cache slot each new K/V is written to, and, per
sequence, its block table and context length so attention can read the past back.

Only the rows that are sampled go through the LM head, except for a request that asks for
``prompt_logprobs``: its prompt positions get logits too (``prompt_logprob_spans``), appended
after the sampled rows.
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
    # Rows that go through the LM head: sample_indices, then the prompt_logprob_spans' rows.
    logit_indices: torch.Tensor | None = None


@dataclass
class PromptSpan:
    """Prompt positions ``start..stop-1`` of ``seq`` whose logits give its prompt logprobs: the
    logits at position p are the model's prediction of prompt token p + 1."""

    meta: SequenceGroupMetadata
    seq: Sequence
    start: int
    stop: int


def prompt_logprob_spans(groups: list[SequenceGroupMetadata]) -> list[PromptSpan]:
    """The prompt positions of this round whose logits a request's ``prompt_logprobs`` needs,
    in batch order (read before the round's computed tokens advance)."""
    spans = []
    for meta in groups:
        if meta.sampling_params.prompt_logprobs is None or not meta.is_prompt:
            continue
        for seq in meta.seq_data.values():
            start = seq.num_computed_tokens
            stop = min(start + meta.token_chunk_size, seq.get_prompt_len() - 1)  # the last predicts no prompt token
            if stop > start:
                spans.append(PromptSpan(meta, seq, start, stop))
    return spans


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
    prompt_rows: list[int] = []
    spans = {id(span.seq): span for span in prompt_logprob_spans(groups)}
    # Python loops over sequences and blocks, never over tokens (a prompt may bring thousands).
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            table = meta.block_tables[seq_id]
            start = seq.num_computed_tokens
            end = start + meta.token_chunk_size
            # >>> fold: validation: the chunk fits the sequence and its table
            if end > seq.get_len():
                raise ValueError(f"request {meta.request_id!r}: chunk of {meta.token_chunk_size} tokens from "
                                 f"position {start} runs past the sequence's {seq.get_len()} tokens")
            if -(-end // block_size) > len(table):  # a clear error, not an IndexError below
                raise ValueError(f"request {meta.request_id!r}: block table of {len(table)} blocks cannot hold "
                                 f"{end} tokens at block_size {block_size}")
            # <<<
            if end - start == 1:
                input_ids.append(seq.get_last_token_id() if end == seq.get_len() else seq.get_token_ids()[start])
            else:
                input_ids.extend(seq.get_token_ids()[start:end])
            span = spans.get(id(seq))
            if span is not None:  # this chunk's rows begin at len(input_ids) - (end - start)
                first = len(input_ids) - (end - start)
                prompt_rows.extend(range(first + span.start - start, first + span.stop - start))
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
        logit_indices=torch.tensor(sample_indices + prompt_rows, dtype=torch.long, device=device)
        if prompt_rows else None,
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
