"""The checkers of chapters 01-03 accept a correct answer and reject plausible wrong ones."""

from __future__ import annotations

import pytest

from tinyserve.block_manager import AllocStatus
from tinyserve.exercises import memory as ex

# -- reference answers, written independently of the package ----------------------------------


def kv_bytes(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def reserved_waste(lens, max_len):
    return sum(max_len - n for n in lens)


def paged_waste(lens, bs):
    return sum((bs - n % bs) % bs for n in lens)


def first_fit(runs, size, length):
    taken = [False] * size
    for start, n in runs:
        taken[start:start + n] = [True] * n
    for start in range(size - length + 1):
        if not any(taken[start:start + length]):
            return start
    return None


def best_fit(runs, size, length):
    holes, pos = [], 0
    for start, n in sorted(runs) + [(size, 0)]:
        if start - pos >= length:
            holes.append((start - pos, pos))
        pos = start + n
    return min(holes)[1] if holes else None


def first_fit_between_runs_only(runs, size, length):
    pos = 0
    for start, n in sorted(runs):
        if start - pos >= length:
            return pos
        pos = start + n
    return None if runs else (0 if length <= size else None)


def num_blocks(n, bs):
    return (n + bs - 1) // bs


def logical_blocks(tokens, bs):
    return [tokens[i:i + bs] for i in range(0, len(tokens), bs)]


def slots(table, start, end, bs):
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


def can_allocate(required, free, total, watermark):
    keep = int(watermark * total)
    if total - required < keep:
        return "NEVER"
    return AllocStatus.OK if free - required >= keep else "later"


def append_slot(table, ref_counts, seq_len, bs, free_list):
    table = list(table)
    if len(table) * bs < seq_len:
        return table + [free_list[0]], None
    last = table[-1]
    if ref_counts[last] == 1:
        return table, None
    table[-1] = free_list[0]
    return table, (last, free_list[0])


def swap_out_mapping(tables, cpu_free):
    out, free = {}, iter(cpu_free)
    for table in tables:
        for b in table:
            if b not in out:
                out[b] = next(free)
    return out


def can_swap_in(group_blocks, num_seqs, free, total, watermark):
    keep = 0 if free == total else int(watermark * total)
    return free - group_blocks - num_seqs >= keep


CASES = {
    ex.check_kv_bytes_per_token: (kv_bytes, [
        lambda L, H, D, b: L * H * D * b,                  # forgot that there is a K and a V
        lambda L, H, D, b: 2 * L * H * D,                  # forgot the dtype
    ]),
    ex.check_reserved_waste: (reserved_waste, [
        lambda lens, M: M * len(lens) - sum(lens) + len(lens),   # off by one per sequence
        lambda lens, M: sum(M - n for n in lens if n < M // 2),  # forgot the long ones
    ]),
    ex.check_paged_waste: (paged_waste, [
        lambda lens, bs: sum(bs - n % bs for n in lens),   # a full last block "wastes" bs
        lambda lens, bs: sum(n % bs for n in lens),        # counted the used part
    ]),
    ex.check_first_fit: (first_fit, [best_fit, first_fit_between_runs_only]),
    ex.check_num_blocks: (num_blocks, [
        lambda n, bs: n // bs + 1,                         # one too many at exact multiples
        lambda n, bs: n // bs,                             # drops the partial block
        lambda n, bs: max(1, num_blocks(n, bs)),           # an empty sequence needs no block
    ]),
    ex.check_logical_blocks: (logical_blocks, [
        lambda t, bs: [t[i:i + bs] for i in range(0, len(t) - 1, bs)],  # drops a last lone token
        lambda t, bs: [t[i:i + bs + 1] for i in range(0, len(t), bs)],  # blocks overlap
    ]),
    ex.check_slot_mapping: (slots, [
        lambda bt, s, e, bs: [bt[p // bs] + p % bs for p in range(s, e)],      # forgot * block_size
        lambda bt, s, e, bs: [bt[p // bs] * bs + p % bs for p in range(s + 1, e + 1) if p // bs < len(bt)],
        lambda bt, s, e, bs: list(range(s, e)),                                 # contiguous thinking
    ]),
    ex.check_can_allocate: (can_allocate, [
        lambda r, f, t, w: "NEVER" if r > t else "OK" if f >= r else "LATER",                   # no watermark
        lambda r, f, t, w: "NEVER" if t - r < int(w * t) else "OK" if f - r > int(w * t) else "LATER",  # > not >=
        lambda r, f, t, w: "NEVER" if t - r < w * t else "OK" if f - r >= w * t else "LATER",   # no int()
        lambda r, f, t, w: "OK" if f - r >= int(w * t) else "LATER",                            # never NEVER
    ]),
    ex.check_append_slot: (append_slot, [
        lambda t, rc, n, bs, fl: ((list(t) + [fl[0]], None) if len(t) * bs < n else (list(t), None)),  # no CoW
        lambda t, rc, n, bs, fl: append_slot(t, rc, n + 1, bs, fl),                # off by one on the length
        lambda t, rc, n, bs, fl: append_slot(t, rc, n, bs, fl[::-1]),              # takes from the wrong end
    ]),
    ex.check_swap_out_mapping: (swap_out_mapping, [
        lambda tables, free: dict(zip([b for t in tables for b in t], free)),      # moves shared blocks twice
        lambda tables, free: {b: b for t in tables for b in t},                    # keeps the numbers
    ]),
    ex.check_can_swap_in: (can_swap_in, [
        lambda b, s, f, t, w: f - b >= int(w * t),                                 # no room to grow
        lambda b, s, f, t, w: f - b - s >= 0,                                      # no watermark
        lambda b, s, f, t, w: f - b - s >= int(w * t),                             # reserve on an empty GPU
    ]),
}


@pytest.mark.parametrize("checker", list(CASES), ids=[c.__name__ for c in CASES])
def test_checker_accepts_a_correct_answer(checker, capsys):
    correct, _ = CASES[checker]
    assert checker(correct) is True
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("checker,wrong", [(c, w) for c, (_, ws) in CASES.items() for w in ws],
                         ids=[f"{c.__name__}-{i}" for c, (_, ws) in CASES.items() for i in range(len(ws))])
def test_checker_rejects_a_wrong_answer(checker, wrong, capsys):
    assert checker(wrong) is False
    out = capsys.readouterr().out
    assert "✗" in out and "expected" in out or "raised" in out


def test_every_memory_checker_is_tested():
    names = {n for n in dir(ex) if n.startswith("check_")}
    assert names == {c.__name__ for c in CASES}


def test_checker_reports_an_exception_instead_of_raising(capsys):
    def broken(n, bs):
        raise ZeroDivisionError("oops")

    assert ex.check_num_blocks(broken) is False
    assert "raised ZeroDivisionError: oops" in capsys.readouterr().out


def test_checkers_are_reachable_from_the_package():
    import tinyserve.exercises as exercises

    assert exercises.check_slot_mapping is ex.check_slot_mapping
