"""The checkers of chapter 08 accept a correct answer and reject plausible wrong ones."""

from __future__ import annotations

import math

import pytest

from tinyserve import exercises
from tinyserve.exercises import kernel as ex

# -- reference answers, written independently of the package ----------------------------------


def merge(o_a, lse_a, o_b, lse_b):
    top = max(lse_a, lse_b)
    w_a, w_b = math.exp(lse_a - top), math.exp(lse_b - top)
    return (w_a * o_a + w_b * o_b) / (w_a + w_b), top + math.log(w_a + w_b)


def merge_naive(o_a, lse_a, o_b, lse_b):
    # Right algebra, but exp(lse) overflows for large scores.
    w_a, w_b = math.exp(lse_a) if lse_a < 700 else math.inf, math.exp(lse_b) if lse_b < 700 else math.inf
    return (w_a * o_a + w_b * o_b) / (w_a + w_b), math.log(w_a + w_b)


def merge_average(o_a, lse_a, o_b, lse_b):
    top = max(lse_a, lse_b)
    return (o_a + o_b) / 2, top + math.log(math.exp(lse_a - top) + math.exp(lse_b - top))


def merge_forgets_lse(o_a, lse_a, o_b, lse_b):
    o, _ = merge(o_a, lse_a, o_b, lse_b)
    return o, max(lse_a, lse_b)


def num_splits(num_seqs, num_kv_heads, max_context_len, num_sms):
    programs, target = num_seqs * num_kv_heads, 2 * num_sms
    if programs >= target or max_context_len < 512:
        return 1
    return max(1, min(-(-target // programs), max_context_len // 256))


def num_splits_one_per_sm(num_seqs, num_kv_heads, max_context_len, num_sms):
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_context_len < 512:
        return 1
    return max(1, min(-(-num_sms // programs), max_context_len // 256))


def num_splits_ignores_min_partition(num_seqs, num_kv_heads, max_context_len, num_sms):
    programs = num_seqs * num_kv_heads
    return 1 if programs >= 2 * num_sms else -(-2 * num_sms // programs)


def layout(max_context_len, splits, tile):
    per = -(-max_context_len // splits)
    size = tile * -(-per // tile)
    return size, -(-max_context_len // size)


def layout_no_tile_rounding(max_context_len, splits, tile):
    size = -(-max_context_len // splits)
    return size, -(-max_context_len // size)


def layout_claims_every_split(max_context_len, splits, tile):
    size, _ = layout(max_context_len, splits, tile)
    return size, splits


def kv_head_of(head, num_heads, num_kv_heads):
    return divmod(head, num_heads // num_kv_heads)


def kv_head_of_interleaved(head, num_heads, num_kv_heads):
    return head % num_kv_heads, head // num_kv_heads


def kv_bytes(lens, num_kv_heads, head_dim, dtype_bytes):
    return 2 * sum(lens) * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_k_only(lens, num_kv_heads, head_dim, dtype_bytes):
    return sum(lens) * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_max_len(lens, num_kv_heads, head_dim, dtype_bytes):
    # Every sequence padded to the longest: what a dense, padded batch would read.
    return 2 * max(lens) * len(lens) * num_kv_heads * head_dim * dtype_bytes


CASES = [
    (ex.check_merge_partitions, merge, [merge_naive, merge_average, merge_forgets_lse]),
    (ex.check_num_splits, num_splits, [num_splits_one_per_sm, num_splits_ignores_min_partition]),
    (ex.check_partition_layout, layout, [layout_no_tile_rounding, layout_claims_every_split]),
    (ex.check_kv_head_of, kv_head_of, [kv_head_of_interleaved]),
    (ex.check_decode_kv_bytes, kv_bytes, [kv_bytes_k_only, kv_bytes_max_len]),
]


@pytest.mark.parametrize("checker,right,wrongs", CASES, ids=[c[0].__name__ for c in CASES])
def test_checker_accepts_right_and_rejects_wrong(checker, right, wrongs, capsys):
    assert checker(right) is True
    assert "✓" in capsys.readouterr().out
    for wrong in wrongs:
        assert checker(wrong) is False, wrong.__name__
        assert "✗" in capsys.readouterr().out


def test_checker_reports_an_exception_as_a_failure(capsys):
    def broken(*args):
        raise NotImplementedError

    assert ex.check_kv_head_of(broken) is False
    assert "raised NotImplementedError" in capsys.readouterr().out


def test_checkers_resolve_from_the_package():
    assert exercises.check_merge_partitions is ex.check_merge_partitions
    assert exercises.check_decode_kv_bytes is ex.check_decode_kv_bytes
