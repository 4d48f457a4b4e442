"""``TritonBackend(decode=)``: a decode launcher given in place of the package's kernel takes the
decode-kernel route, and only it; in the engine it yields the package kernel's tokens."""

from __future__ import annotations

import torch

from tinyserve.attention import reference
from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.triton_backend import TritonBackend
from tinyserve.block import slot_mapping
from tinyserve.exercises import decode_engine


def _batch(query_lens, context_lens, tables, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(16, 4, 2, 16, generator=gen), torch.randn(16, 4, 2, 16, generator=gen)
    q = torch.randn(sum(query_lens), 4, 16, generator=gen)
    slots = [s for ql, cl, t in zip(query_lens, context_lens, tables) for s in slot_mapping(t, cl - ql, cl, 4)]
    return q, k_cache, v_cache, AttentionMetadata.build(query_lens, context_lens, tables, slots)


def test_decode_batches_go_to_the_given_launcher_with_the_reference_signature():
    calls = []

    def decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        calls.append((block_tables.tolist(), context_lens.tolist(), scale))
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

    backend = TritonBackend(decode=decode)
    q, k, v, meta = _batch([1, 1], [6, 3], [[5, 2], [9]])
    out = backend.forward(q, k, v, meta, 0.25)
    assert calls == [([[5, 2], [9, 0]], [6, 3], 0.25)]
    torch.testing.assert_close(out, reference.paged_attention(q, k, v, meta, 0.25))
    assert backend.route_counts == {"decode-kernel": 1}

    q, k, v, meta = _batch([5], [5], [[3, 7]])  # a plain prefill stays the package's (SDPA)
    backend.forward(q, k, v, meta, 0.25)
    assert len(calls) == 1 and backend.route_counts["prefill-sdpa"] == 1


def test_without_a_launcher_the_package_kernel_decodes():
    assert TritonBackend().decode is None
    q, k, v, meta = _batch([1, 1], [6, 3], [[5, 2], [9]])
    torch.testing.assert_close(TritonBackend().forward(q, k, v, meta, 0.25),
                               reference.paged_attention(q, k, v, meta, 0.25))


def test_the_reference_as_launcher_gives_the_package_kernels_tokens_in_the_engine():
    package = decode_engine.run_seed_rounds("package's kernel")
    given = decode_engine.run_seed_rounds("reference", reference.paged_decode_attention)
    assert package.error is None and given.error is None
    assert given.tokens == package.tokens and len(given.tokens) == 3
    assert given.decode_calls == given.route_counts["decode-kernel"] > 0
