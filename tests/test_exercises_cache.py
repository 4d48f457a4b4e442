"""The checkers of chapters 06 and 07 accept a correct answer and reject plausible wrong ones."""

from __future__ import annotations

import pytest
import torch

from tinyserve.exercises import attention as ex_attn
from tinyserve.exercises import cache as ex_cache

# -- reference answers, written independently of the package ----------------------------------


def block_bytes(bs, layers, heads, head_dim, dtype_bytes):
    return 2 * layers * bs * heads * head_dim * dtype_bytes


def blocks_for_budget(total, free, util, act, block):
    return max(0, (int(total * util) - (total - free) - act) // block)


def swap_out(gpu, cpu, mapping):
    for (gk, gv), (ck, cv) in zip(gpu, cpu):
        for src, dst in mapping.items():
            ck[dst].copy_(gk[src])
            cv[dst].copy_(gv[src])


def swap_out_keys_only(gpu, cpu, mapping):
    for (gk, _), (ck, _) in zip(gpu, cpu):
        for src, dst in mapping.items():
            ck[dst].copy_(gk[src])


def swap_out_first_layer(gpu, cpu, mapping):
    swap_out(gpu[:1], cpu[:1], mapping)


def swap_out_backwards(gpu, cpu, mapping):
    swap_out(cpu, gpu, {d: s for s, d in mapping.items()})


def swap_out_same_numbers(gpu, cpu, mapping):
    swap_out(gpu, cpu, {s: s % cpu[0][0].shape[0] for s in mapping})


def split_x_offset(block, token, head, d, bs, heads, head_dim, x):
    # Nested loops in memory order: the count of elements before this one.
    offset = 0
    for b in range(block + 1):
        for h in range(heads):
            for c in range(head_dim // x):
                for t in range(bs):
                    for i in range(x):
                        if (b, h, c, t, i) == (block, head, d // x, token, d % x):
                            return offset
                        offset += 1
    raise AssertionError("unreachable")


def gather_kv(cache, table, n):
    bs = cache.shape[1]
    return torch.stack([cache[table[p // bs], p % bs] for p in range(n)])


def decode_attention(q, k_cache, v_cache, table, n, scale):
    k, v = gather_kv(k_cache, table, n), gather_kv(v_cache, table, n)
    group = q.shape[0] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        w = torch.softmax(k[:, h // group] @ q[h] * scale, dim=0)
        out[h] = w @ v[:, h // group]
    return out


def rotary(x, positions, theta):
    half = x.shape[-1] // 2
    out = x.clone()
    for i in range(half):
        angle = positions.double() * theta ** (-2 * i / x.shape[-1])
        c, s = angle.cos()[:, None].float(), angle.sin()[:, None].float()
        out[..., i] = x[..., i] * c - x[..., i + half] * s
        out[..., i + half] = x[..., i + half] * c + x[..., i] * s
    return out


def rotary_interleaved(x, positions, theta):  # GPT-J pairs (2i, 2i+1) instead of Llama's halves
    perm = torch.cat([torch.arange(0, x.shape[-1], 2), torch.arange(1, x.shape[-1], 2)])
    inverse = torch.argsort(perm)
    return rotary(x[..., perm], positions, theta)[..., inverse]


CASES = {
    ex_cache.check_block_bytes: (block_bytes, [
        lambda bs, L, H, D, b: bs * L * H * D * b,                  # forgot V
        lambda bs, L, H, D, b: 2 * L * H * D * b,                   # one token, not a block
    ]),
    ex_cache.check_blocks_for_budget: (blocks_for_budget, [
        lambda t, f, u, a, b: (int(t * u) - (t - f) - a) // b,      # negative when memory is short
        lambda t, f, u, a, b: max(0, (int(f * u) - a) // b),        # utilization of the free memory
        lambda t, f, u, a, b: max(0, (int(t * u) - (t - f)) // b),  # forgot the activations
    ]),
    ex_cache.check_swap_out: (swap_out, [swap_out_keys_only, swap_out_first_layer, swap_out_backwards,
                                         swap_out_same_numbers]),
    ex_cache.check_split_x_offset: (split_x_offset, [
        lambda b, t, h, d, bs, H, D, x: ((b * bs + t) * H + h) * D + d,                       # the plain layout
        lambda b, t, h, d, bs, H, D, x: (((b * H + h) * bs + t) * (D // x) + d // x) * x + d % x,  # token outside
    ]),
    ex_attn.check_gather_kv: (gather_kv, [
        lambda c, t, n: c.flatten(0, 1)[:n],                         # ignored the block table
        lambda c, t, n: c[t].flatten(0, 1)[: len(t) * c.shape[1]],   # did not stop at the context
    ]),
    ex_attn.check_decode_attention: (decode_attention, [
        lambda q, k, v, t, n, s: decode_attention(q, k, v, t, n, 1.0),                  # no scale
        lambda q, k, v, t, n, s: decode_attention(q, k, v, t, max(1, n - 1), s),         # missed its own token
        lambda q, k, v, t, n, s: decode_attention(q, k.repeat(1, 1, q.shape[0] // k.shape[2], 1),
                                                  v.repeat(1, 1, q.shape[0] // v.shape[2], 1), t, n, s),  # tiled heads
    ]),
    ex_attn.check_rotary: (rotary, [
        rotary_interleaved,
        lambda x, p, th: rotary(x, p + 1, th),                         # positions from 1
        lambda x, p, th: rotary(x, p, 10_000.0),                        # ignored theta
    ]),
    ex_attn.check_kv_head: (lambda h, H, K: h // (H // K), [
        lambda h, H, K: h % K,                                          # round-robin
        lambda h, H, K: min(h, K - 1),
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
    assert "✗" in capsys.readouterr().out


def test_every_checker_of_chapters_06_and_07_is_tested():
    names = {n for mod in (ex_cache, ex_attn) for n in dir(mod) if n.startswith("check_")}
    assert names == {c.__name__ for c in CASES}


@pytest.mark.parametrize("checker", list(CASES), ids=[c.__name__ for c in CASES])
def test_checker_reports_an_exception_instead_of_raising(checker, capsys):
    def broken(*args):
        raise ZeroDivisionError("oops")

    assert checker(broken) is False
    assert "raised ZeroDivisionError: oops" in capsys.readouterr().out


def test_failure_lines_summarize_tensors(capsys):
    ex_attn.check_gather_kv(lambda c, t, n: c.flatten(0, 1)[:n])
    out = capsys.readouterr().out
    assert "largest |difference|" in out and "tensor(" in out
    assert len(max(out.splitlines(), key=len)) < 200  # no tensor dumps


def test_checkers_are_reachable_from_the_package():
    import tinyserve.exercises as exercises

    assert exercises.check_swap_out is ex_cache.check_swap_out
    assert exercises.check_kv_head is ex_attn.check_kv_head
