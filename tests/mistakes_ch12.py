"""Deliberately wrong answers for chapter 12's structured-output exercise (``check_pack_bitmask``);
tests/exercise_mistakes.py merges ``MISTAKES`` with the other chapters'. Each is a plausible slip
in packing allowed tokens into int32 words (bit ``t % 32`` of word ``t // 32`` is token t)."""

from __future__ import annotations

import torch


def _pack(allowed: torch.Tensor, weights: torch.Tensor, num_words: int | None = None, pad: bool = False):
    rows, vocab = allowed.shape
    num_words = (vocab + 31) // 32 if num_words is None else num_words
    padded = torch.full((rows, num_words * 32), int(pad), dtype=torch.int64)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


LOW_FIRST = 2 ** torch.arange(32, dtype=torch.int64)


MISTAKES = {
    "check_pack_bitmask": [
        lambda allowed: _pack(allowed, LOW_FIRST.flip(0)),  # token 0 in bit 31: the word as written in binary
        lambda allowed: _pack(~allowed, LOW_FIRST),  # a set bit for a banned token
        lambda allowed: _pack(allowed, LOW_FIRST, num_words=allowed.shape[1] // 32 + 1),  # one word too many at 32k
        lambda allowed: _pack(allowed, LOW_FIRST, pad=True),  # the bits past the vocabulary set
    ],
}
