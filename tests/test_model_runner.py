"""prepare_inputs packs a round into one batch: checked token by token against the definition.

The reference below walks every new token of every sequence in plain Python (position p of a
sequence lives at offset p % block_size of block table[p // block_size]); prepare_inputs must
produce the same ids, positions, slots, tables and sample rows with its whole-tensor arithmetic,
for prefills, prefill chunks that start after a computed prefix, and decodes, mixed in one batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.model_runner import prepare_inputs
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroupMetadata


def _random_round(rng: random.Random, block_size: int) -> list[SequenceGroupMetadata]:
    groups, next_block = [], 0
    for i in range(rng.randint(1, 8)):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        seq = Sequence(i, None, prompt, block_size)
        kind = rng.choice(["prefill", "chunk", "decode"])
        if kind == "decode":
            for _ in range(rng.randint(1, 5)):
                seq.append_token_id(rng.randrange(1000))
            seq.num_computed_tokens = seq.get_len() - 1
            chunk = 1
        elif kind == "chunk":
            seq.num_computed_tokens = rng.randrange(len(prompt))
            chunk = rng.randint(1, len(prompt) - seq.num_computed_tokens)
        else:
            chunk = len(prompt)
        end = seq.num_computed_tokens + chunk
        # Tables may hold more blocks than needed (allocated for the whole prompt), never fewer.
        n_blocks = -(-seq.get_len() // block_size) + rng.randint(0, 1)
        table = rng.sample(range(next_block, next_block + 3 * n_blocks), n_blocks)
        next_block += 3 * n_blocks
        groups.append(SequenceGroupMetadata(f"g{i}", kind != "decode", {i: seq}, SamplingParams(), {i: table},
                                            token_chunk_size=chunk, do_sample=end == seq.get_len()))
    return groups


def _reference(groups: list[SequenceGroupMetadata], block_size: int) -> dict:
    ids, positions, slots, qlens, clens, tables, sample = [], [], [], [], [], [], []
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            start = seq.num_computed_tokens
            end = start + meta.token_chunk_size
            table = meta.block_tables[seq_id]
            for p in range(start, end):
                ids.append(seq.get_token_ids()[p])
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            qlens.append(end - start)
            clens.append(end)
            tables.append(table)
            if meta.do_sample:
                sample.append(len(ids) - 1)
    width = max(len(t) for t in tables)
    return dict(ids=ids, positions=positions, slots=slots, qlens=qlens, clens=clens, sample=sample,
                tables=[t + [0] * (width - len(t)) for t in tables],
                starts=[sum(qlens[:i]) for i in range(len(qlens) + 1)])


@pytest.mark.parametrize("seed", range(20))
def test_packed_batch_matches_a_token_by_token_reference(seed: int):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    groups = _random_round(rng, block_size)
    got = prepare_inputs(groups, block_size)
    want = _reference(groups, block_size)
    meta = got.attn_metadata
    assert got.input_ids.tolist() == want["ids"]
    assert got.positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slots"]
    assert meta.block_tables.tolist() == want["tables"]
    assert meta.context_lens.tolist() == want["clens"] and meta.context_lens_list == want["clens"]
    assert meta.query_lens == want["qlens"]
    assert meta.query_start_loc.tolist() == want["starts"]
    assert got.sample_indices.tolist() == want["sample"]
    assert (meta.slot_mapping.dtype, meta.block_tables.dtype, meta.context_lens.dtype) == \
        (torch.int64, torch.int32, torch.int32)


def test_a_block_table_too_short_for_the_tokens_is_refused():
    seq = Sequence(0, None, list(range(20)), 4)
    meta = SequenceGroupMetadata("short", True, {0: seq}, SamplingParams(), {0: [3, 7]}, token_chunk_size=20)
    with pytest.raises(ValueError, match="block table"):
        prepare_inputs([meta], 4)


def test_a_chunk_past_the_sequence_end_is_refused():
    seq = Sequence(0, None, list(range(5)), 4)
    meta = SequenceGroupMetadata("long", True, {0: seq}, SamplingParams(), {0: [0, 1]}, token_chunk_size=6)
    with pytest.raises(ValueError, match="runs past"):
        prepare_inputs([meta], 4)
