"""Solutions to the exercises of chapter 11, performance."""

from __future__ import annotations


def static_efficiency(output_lens, batch_size):
    # A batch computes (its size) x (its longest output) slots.
    batches = [output_lens[i:i + batch_size] for i in range(0, len(output_lens), batch_size)]
    return sum(output_lens) / sum(len(b) * max(b) for b in batches)


def kv_utilization(prompt_lens, output_lens, block_size):
    # After round t, a request still running (t < output_len) holds prompt + t - 1 tokens.
    held = slots = 0
    for t in range(1, max(output_lens) + 1):
        for p, o in zip(prompt_lens, output_lens):
            if t < o:
                n = p + t - 1
                held += n
                slots += -(-n // block_size) * block_size
    return held / slots


def decode_chunks(context_lens, block_size, budget):
    # Longest first: a sub-batch's first row is its widest and sets its width.
    chunks, width = [], 0
    for r in sorted(range(len(context_lens)), key=lambda r: -context_lens[r]):  # sorted() is stable
        if not chunks or (len(chunks[-1]) + 1) * width > budget:
            chunks.append([])
            width = -(-context_lens[r] // block_size) * block_size
        chunks[-1].append(r)
    return [sorted(c) for c in chunks]
