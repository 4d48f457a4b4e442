"""Solutions to the exercises of chapter 12: prefix caching, chunked prefill, serving, structured output."""

from __future__ import annotations

import json

import torch


def cached_tokens(prompt, earlier, block_size):
    # The longest run of whole matching blocks against any earlier prompt, leaving the last token.
    best = 0
    for other in earlier:
        n = 0
        while n + block_size <= min(len(prompt), len(other)) and prompt[n:n + block_size] == other[n:n + block_size]:
            n += block_size
        best = max(best, n)
    return min(best, len(prompt) - 1)


def prefill_chunks(prompt_len, decode_left, budget):
    # In round k the decoders with more than k tokens left take one token each; the prompt gets the rest.
    chunks, done, k = [], 0, 0
    while done < prompt_len:
        decoding = sum(left > k for left in decode_left)
        chunks.append(min(prompt_len - done, budget - decoding))
        done += chunks[-1]
        k += 1
    return chunks


def stream_text(body):
    # Every data line but [DONE] is a JSON chunk; append each choice's piece to its text.
    texts = {}
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def pack_bitmask(allowed):
    # Pad the vocabulary to whole words, weigh bit k of each group of 32 by 2**k and add up (in
    # int64, where 2**31 fits); a word of 2**31 or more is the negative int32 with the same bits.
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed
    words = (padded.view(rows, -1, 32) * 2 ** torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
