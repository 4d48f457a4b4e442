"""The CPU-tuned backend (``attention/batched.py``) against the short reference (``reference.py``).

The batches are those of the reference's own tests (shuffled blocks, NaN in every slot no
sequence owns); the reference is itself checked against dense softmax attention there. Small
gather budgets force the decode rows into many sub-batches, so the cutting is exercised too.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_reference import make_batch

from tinyserve.attention import batched, reference
from tinyserve.attention.backend import get_backend
from tinyserve.attention.metadata import AttentionMetadata

CASES = {
    # name: (query_lens, context_lens)
    "decode": ([1] * 6, [3, 17, 9, 30, 1, 12]),
    "prefill": ([7, 1, 19, 4], [7, 1, 19, 4]),
    "prefix": ([3, 8, 17, 9], [11, 16, 40, 9]),
    "mixed": ([1, 12, 1, 5, 1], [30, 12, 3, 21, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("budget", [batched.GATHER_BUDGET, 1])  # 1: every decode row on its own
def test_batched_equals_reference(case, block_size, group, budget):
    query_lens, context_lens = CASES[case]
    q, kc, vc, meta, _ = make_batch(query_lens, context_lens, block_size, 32, group, seed=len(case))
    want = reference.paged_attention(q, kc, vc, meta, 0.17)
    got = batched.paged_attention(q, kc, vc, meta, 0.17, budget)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(batched.BatchedTorchBackend(budget).forward(q, kc, vc, meta, 0.17), want,
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_agrees_with_reference(dtype):
    q, kc, vc, meta, _ = make_batch([5, 1, 4], [5, 40, 17], 16, 64, 3, seed=5, dtype=dtype)
    got = batched.paged_attention(q, kc, vc, meta, 0.125)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.float(), reference.paged_attention(q, kc, vc, meta, 0.125).float(),
                               atol=tol, rtol=tol)


def test_decode_without_host_lengths_equals_reference():
    # Gathers the full width of the (padded) block tables: no device-to-host copy of the lengths.
    q, kc, vc, meta, _ = make_batch([1, 1, 1], [3, 50, 17], 4, 64, 2, seed=6)
    wide = torch.cat([meta.block_tables, torch.zeros(3, 4, dtype=torch.int32)], dim=1)
    torch.testing.assert_close(batched.paged_decode_attention(q, kc, vc, wide, meta.context_lens, 0.125),
                               reference.paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens,
                                                                0.125), atol=2e-6, rtol=2e-6)


def test_decode_sub_batches():
    lens = [30, 1, 12, 3, 17]
    # Each sub-batch holds rows of similar length (sorted), within the budget unless alone.
    chunks = batched.decode_sub_batches(list(range(5)), lens, block_size=4, row_values=2, budget=70)
    assert sorted(r for c in chunks for r in c) == list(range(5))
    for c in chunks:
        width = max(-(-lens[r] // 4) * 4 for r in c)
        assert len(c) == 1 or len(c) * width * 2 <= 70
    assert chunks == [[1, 3], [2], [4], [0]]
    assert batched.decode_sub_batches([0, 1], [5, 6], 4, 1, budget=1 << 20) == [[0, 1]]


def test_plan_is_kept_per_batch_and_per_setting():
    # One plan per batch, reused by every layer; another batch, cache shape or budget is a new key.
    backend = batched.BatchedTorchBackend(gather_budget=3 * 4 * 2 * 32)
    q, kc, vc, meta, _ = make_batch([1] * 6, CASES["decode"][1], 4, 32, 2, seed=9)
    for _ in range(2):  # two layers
        backend.forward(q, kc, vc, meta, 0.2)
    assert len(meta.per_batch) == 1
    (plan,) = meta.per_batch.values()
    assert len(plan) > 2  # the small budget cut the decode batch
    backend.gather_budget = batched.GATHER_BUDGET
    out = backend.forward(q, kc, vc, meta, 0.2)
    assert len(meta.per_batch) == 2 and len(meta.per_batch[max(meta.per_batch)]) == 1
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, meta, 0.2), atol=2e-6, rtol=2e-6)
    other = AttentionMetadata.build(meta.query_lens, meta.context_lens_list,
                                    [row[: -(-n // 4)] for row, n in zip(meta.block_tables.tolist(),
                                                                          meta.context_lens_list)], [])
    assert other.per_batch == {}  # a new batch starts without a plan


def test_names_resolve_to_the_two_torch_backends():
    assert isinstance(get_backend("torch"), reference.TorchBackend)
    assert isinstance(get_backend("torch-batched"), batched.BatchedTorchBackend)
    assert isinstance(get_backend("auto", "cpu"), batched.BatchedTorchBackend)


@pytest.mark.parametrize("seed", range(4))
def test_any_cut_of_the_decode_rows_attends_the_same(seed):
    """``split`` only decides which decode rows share a gather; a random partition, in a random
    order, must give the reference's attention (chapter 11's exercise 3 relies on it)."""
    import random

    rng = random.Random(seed)

    def random_cut(rows, context_lens, block_size, row_values, budget):
        rows = rng.sample(rows, len(rows))
        cuts = sorted(rng.sample(range(1, len(rows)), rng.randint(0, len(rows) - 1)))
        return [sorted(rows[a:b]) for a, b in zip([0, *cuts], [*cuts, len(rows)])]

    query_lens, context_lens = CASES["mixed" if seed % 2 else "decode"]
    q, kc, vc, meta, _ = make_batch(query_lens, context_lens, 4, 32, 2, seed=seed)
    got = batched.BatchedTorchBackend(split=random_cut).forward(q, kc, vc, meta, 0.2)
    torch.testing.assert_close(got, reference.paged_attention(q, kc, vc, meta, 0.2), atol=2e-6, rtol=2e-6)


def test_store_kv_filters_a_slot_mapping_once_and_follows_every_new_one():
    """The batched backend works out a slot mapping's padding filter once and reuses it for the
    other layers; a new mapping, or the same tensor changed in place, is filtered again. Checked
    against reference.store_kv on fresh caches at every call."""
    backend = batched.BatchedTorchBackend()
    gen = torch.Generator().manual_seed(0)
    shape = (6, 4, 2, 8)  # blocks, block size, KV heads, head dim

    def same_as_reference(slot_mapping):
        key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
        ours = torch.zeros(shape), torch.zeros(shape)
        ref = torch.zeros(shape), torch.zeros(shape)
        backend.store_kv(key, value, *ours, slot_mapping)
        reference.store_kv(key, value, *ref, slot_mapping)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])

    first = torch.tensor([3, -1, 7, 8, -1])
    same_as_reference(first)
    same_as_reference(first)  # the next layer: the memo
    same_as_reference(torch.tensor([0, 1, 2, 20, 23]))  # the next step: no padding at all
    reused = torch.tensor([5, 6, -1, 9, 10])
    same_as_reference(reused)
    reused[2] = 11  # the same tensor changed in place: filtered again, the padding is gone
    same_as_reference(reused)
