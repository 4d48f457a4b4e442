"""The chapter-11 checkers accept correct answers (written here by hand, independently of the
package) and reject plausible wrong ones."""

from __future__ import annotations

from tinyserve.exercises import performance as ex


def static_efficiency(output_lens, batch_size):
    batches = [output_lens[i:i + batch_size] for i in range(0, len(output_lens), batch_size)]
    return sum(output_lens) / sum(len(b) * max(b) for b in batches)


def static_efficiency_whole_batch_padded(output_lens, batch_size):
    # Wrong: charges every batch as if it were full.
    batches = [output_lens[i:i + batch_size] for i in range(0, len(output_lens), batch_size)]
    return sum(output_lens) / sum(batch_size * max(b) for b in batches)


def kv_utilization(prompt_lens, output_lens, block_size, count_finishing_round=False):
    held = slots = 0
    for t in range(1, max(output_lens) + 1):
        for p, o in zip(prompt_lens, output_lens):
            if t < o or (count_finishing_round and t == o):
                n = p + t - 1
                held += n
                slots += -(-n // block_size) * block_size
    return held / slots


def decode_chunks(context_lens, block_size, budget, ceil_blocks=True):
    chunks = [[]]
    longest = 0
    for r in sorted(range(len(context_lens)), key=lambda r: context_lens[r]):
        width = -(-context_lens[r] // block_size) * block_size if ceil_blocks else context_lens[r]
        if chunks[-1] and (len(chunks[-1]) + 1) * max(width, longest) > budget:
            chunks.append([])
            longest = 0
        chunks[-1].append(r)
        longest = max(longest, width)
    return [sorted(c) for c in chunks]


def test_static_efficiency():
    assert ex.check_static_efficiency(static_efficiency)
    assert not ex.check_static_efficiency(static_efficiency_whole_batch_padded)


def test_kv_utilization():
    assert ex.check_kv_utilization(kv_utilization)
    assert not ex.check_kv_utilization(lambda p, o, bs: kv_utilization(p, o, bs, count_finishing_round=True))
    assert not ex.check_kv_utilization(lambda p, o, bs: 1.0)


def test_decode_chunks():
    assert ex.check_decode_chunks(decode_chunks)
    assert not ex.check_decode_chunks(lambda c, bs, b: decode_chunks(c, bs, b, ceil_blocks=False))
    assert not ex.check_decode_chunks(lambda c, bs, b: [list(range(len(c)))])


def test_a_crashing_answer_fails_cleanly(capsys):
    assert not ex.check_static_efficiency(lambda lens, bs: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
