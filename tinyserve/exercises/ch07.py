"""Checkers for chapter 07, a Llama model on a paged cache.

- ``check_attention_backend``: the chapter's core component, the reader's paged attention backend
  (``store_kv`` and ``forward``, the protocol of ``attention/backend.py``). Its writes are compared
  slot by slot with the slot mapping; its outputs with dense causal attention written out here in
  float64 over the true K/V of each sequence (no cache involved), on fixed batches (one prefill,
  one decode, a prefill over a cached prefix, a mixed GQA batch, half precision) and random ones
  that mix all three kinds, with block sizes 1 to 8, GQA groups 1 to 3, block tables out of order
  and NaN in every slot no sequence owns. ``forward`` always runs on a correctly filled cache, so
  each method is judged on its own. A failure names the method, the batch, the sequence (prefill,
  decode or prefix), the query head and the largest error. Then the tiny model runs s0/s1/s2 in
  the real engine with ``attention_backend=<the reader's object>``, against the package's
  ``"torch"`` backend, and the first token that differs is named.
- ``check_rotary_interleaved``: rotary embeddings with GPT-J's pairing of channels, against the
  rotation written as a product of complex numbers.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.exercises.ch07_batches import (
    Batch,
    dense_causal_attention,  # noqa: F401 (importable from here, as before)
    fixed_batches,
    random_batch,
)
from tinyserve.exercises.engine_runs import run_engine
from tinyserve.exercises.verdict import checker, run_cases, verdict


class NotWritten(Exception):
    """The reader's method still raises NotImplementedError."""


def _same_cache(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per slot: True where ``got`` holds what ``want`` does (NaN where NaN)."""
    same = (got.isnan() == want.isnan()) & (got.nan_to_num() == want.nan_to_num())
    return same.flatten(2).all(dim=2).flatten()


def _check_store(backend, b: Batch) -> str | None:
    """Run ``store_kv`` on the batch's new tokens plus two padding tokens (slot -1); what is wrong, or None."""
    new_k = torch.cat([k[k.shape[0] - q.shape[0]:] for k, q in zip(b.ks, b.qs)])
    new_v = torch.cat([v[v.shape[0] - q.shape[0]:] for v, q in zip(b.vs, b.qs)])
    pad = torch.full((2, *new_k.shape[1:]), 1e4, dtype=new_k.dtype)
    slots = torch.cat([b.meta.slot_mapping, torch.tensor([-1, -1])])
    want_k, want_v = b.k_cache.clone(), b.v_cache.clone()
    flat_k, flat_v = want_k.view(-1, *want_k.shape[2:]), want_v.view(-1, *want_v.shape[2:])
    for t, slot in enumerate(b.meta.slot_mapping.tolist()):
        flat_k[slot], flat_v[slot] = new_k[t], new_v[t]
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    try:
        backend.store_kv(torch.cat([new_k, pad]), torch.cat([new_v, pad]), k_cache, v_cache, slots)
    except NotImplementedError:
        raise NotWritten("store_kv") from None
    except Exception as e:  # the reader's code: any error is a failed case
        return f"store_kv ({b}) raised {type(e).__name__}: {e}"
    bs = b.k_cache.shape[1]
    owner = {}  # slot -> (token, sequence, position)
    t = 0
    for i, (n_q, n) in enumerate(zip(b.meta.query_lens, b.meta.context_lens_list)):
        for p in range(n - n_q, n):
            owner[b.meta.slot_mapping[t].item()] = (t, i, p)
            t += 1
    for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        wrong = (~_same_cache(got, want)).nonzero().flatten().tolist()
        if wrong:
            s = wrong[0]
            where = f"slot {s} (block {s // bs}, offset {s % bs})"
            if s in owner:
                t, i, p = owner[s]
                padding = bool((got.view(-1, *got.shape[2:])[s] == 1e4).all())
                found = "a padding token's K/V (slot -1 is stored nowhere)" if padding else "something else"
                return (f"store_kv ({b}): {name} {where} should hold token {t} (sequence {i}, position {p}), "
                        f"slot_mapping[{t}] = {s}; it holds {found}")
            return (f"store_kv ({b}): {name} {where} changed, but no token maps to it "
                    f"(slot -1 is a padding token, stored nowhere)")
    return None


def _check_forward(backend, b: Batch) -> tuple[str | None, set[str]]:
    """Run ``forward`` over a correctly filled cache; what is wrong (or None) and the kinds of
    sequence it got wrong."""
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    t = 0
    for k, v, q in zip(b.ks, b.vs, b.qs):
        for j in range(k.shape[0] - q.shape[0], k.shape[0]):
            slot = b.meta.slot_mapping[t].item()
            flat_k[slot], flat_v[slot] = k[j], v[j]
            t += 1
    q = torch.cat(b.qs)
    try:
        got = backend.forward(q, k_cache, v_cache, b.meta, b.scale)
    except NotImplementedError:
        raise NotWritten("forward") from None
    except Exception as e:  # the reader's code: any error is a failed case
        return f"forward ({b}) raised {type(e).__name__}: {e}", set()
    if not isinstance(got, torch.Tensor):
        return f"forward ({b}) returned {type(got).__name__}, expected a tensor", set()
    if got.shape != q.shape:
        return f"forward ({b}) returned shape {tuple(got.shape)}, expected {tuple(q.shape)} (= q's)", set()
    if got.dtype != q.dtype:
        return f"forward ({b}) returned {got.dtype} for {q.dtype} queries: return q's dtype", set()
    half = q.dtype in (torch.float16, torch.bfloat16)
    atol = 5e-2 if half else 1e-5
    worst, kinds, start = None, set(), 0
    group = q.shape[1] // k_cache.shape[2]
    for i, (qi, k, v) in enumerate(zip(b.qs, b.ks, b.vs)):
        want = dense_causal_attention(qi, k, v, b.scale)
        err = (got[start:start + len(qi)].double() - want).abs().nan_to_num(float("inf"))
        start += len(qi)
        bad = err > atol + (0 if half else 1e-5) * want.abs()
        if bad.any():
            kinds.add(b.kind(i))
            per_head = err.amax(dim=(0, 2))
            h = int(per_head.argmax())
            row = int(err[:, h].amax(dim=1).argmax())
            if worst is None or per_head[h] > worst[0]:
                worst = (per_head[h].item(), i, h, row)
    if worst is None:
        return None, set()
    e, i, h, row = worst
    n_q, n = b.meta.query_lens[i], b.meta.context_lens_list[i]
    size = "NaN or inf (a slot the sequence does not own was read?)" if e == float("inf") else f"{e:.3g}"
    return (f"forward ({b}): {b.describe_seq(i)}, query head {h} (KV head {h // group}), query {row} "
            f"(position {n - n_q + row}): largest |error| {size}"), kinds


def _first_token_difference(yours, package) -> str:
    for rid, want in package.tokens.items():
        got = yours.tokens.get(rid, [])
        for j, (a, w) in enumerate(zip(got, want)):
            if a != w:
                return f"{rid}'s token {j} is {a}, the torch backend's is {w}"
        if len(got) != len(want):
            return f"{rid} has {len(got)} tokens, the torch backend's run {len(want)}"
    return "the same tokens"


@checker(chapter=7, answer="PagedAttentionBackend")
def check_attention_backend(backend, num_cases: int = 40, seed: int = 0) -> bool:
    """``backend`` (a class, instantiated with no arguments, or an object) is an attention backend:
    ``store_kv(key, value, k_cache, v_cache, slot_mapping)`` writes each token's K/V to its slot
    (slot -1: nowhere), and ``forward(q, k_cache, v_cache, meta, scale)`` attends each sequence's
    queries, the last ``query_lens[i]`` positions of its context, to the context read back through
    its block table, causally, with grouped-query heads, returning q's shape and dtype.

    Six fixed batches and ``num_cases`` random ones, each method judged on its own; then, when
    both pass, the tiny model runs s0/s1/s2 in the real engine with the backend and its greedy
    tokens must be the package's torch backend's."""
    name = "attention_backend"
    if isinstance(backend, type):
        try:
            backend = backend()
        except Exception as e:  # the reader's code
            return verdict(name, [f"{backend.__name__}() raised {type(e).__name__}: {e}"], 1)
    missing = [m for m in ("store_kv", "forward") if not callable(getattr(backend, m, None))]
    if missing:
        return verdict(name, [f"the backend has no {' and no '.join(missing)} method"], 1)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    batches = fixed_batches(gen, rng) + [random_batch(j, gen, rng) for j in range(num_cases)]
    failures, wrong_kinds, store_failed, forward_failed = [], {}, 0, 0
    for b in batches:
        try:
            store = _check_store(backend, b)
            forward, kinds = _check_forward(backend, b)
        except NotWritten as e:
            print(f"✗ {name}: {e} is not written yet (it raises NotImplementedError)")
            return False
        store_failed += store is not None
        forward_failed += forward is not None
        failures += [f for f in (store, forward) if f]
        for kind in kinds:
            wrong_kinds[kind] = wrong_kinds.get(kind, 0) + 1
    num = len(batches) + 1
    if failures:
        verdict(name, failures, num)
        parts = [f"store_kv wrong in {store_failed} of {len(batches)} batches"] if store_failed else []
        if forward_failed:
            label = {"prefill": "prefills", "decode": "decodes", "prefix": "prefills over a cached prefix"}
            wrong = ", ".join(f"{label[k]} in {n}" for k, n in sorted(wrong_kinds.items()))
            right = [label[k] for k in label if k not in wrong_kinds]
            parts.append(f"forward wrong in {forward_failed} of {len(batches)} batches"
                         + (f" (wrong on {wrong}" + (f"; right on every one of the {' and '.join(right)}"
                                                     if right else "") + ")" if wrong else ""))
        print("    " + "; ".join(parts) + ". (The engine run waits until these pass.)")
        return False
    package = run_engine("torch backend", block_size=2)
    yours = run_engine("your backend", block_size=2, attention_backend=backend)
    if yours.error or yours.tokens != package.tokens:
        why = yours.error or _first_token_difference(yours, package)
        return verdict(name, [f"in the engine (tiny model, s0/s1/s2 greedy, blocks of 2): {why}"], num)
    return verdict(name, [], num)


# -- rotary, GPT-J style ----------------------------------------------------------------------------

def rotary_interleaved_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Channels (2i, 2i+1) as the real and imaginary parts of one complex number, turned by
    ``position * theta ** (-2i / head_dim)``."""
    head_dim = x.shape[-1]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], head_dim // 2, 2).contiguous())
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    turn = torch.polar(torch.ones(len(positions), head_dim // 2, dtype=torch.float64),
                       positions.double()[:, None] * freqs[None, :])
    return torch.view_as_real(pairs * turn[:, None, :]).reshape(x.shape).to(x.dtype)


@checker(chapter=7, answer="rotary_interleaved")
def check_rotary_interleaved(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                             num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(x, positions, theta)`` rotates ``x [num_tokens, num_heads, head_dim]`` as GPT-J does:
    channel ``2i`` pairs with channel ``2i + 1`` (not with ``i + head_dim / 2`` as in Llama), and
    pair ``i`` turns by ``position * theta ** (-2i / head_dim)``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(num_cases):
        head_dim = rng.choice([4, 8, 16, 64])
        theta = rng.choice([10_000.0, 500_000.0, 500.0])
        positions = torch.tensor([rng.randint(0, 2047) for _ in range(rng.randint(1, 6))])
        x = torch.randn(len(positions), rng.randint(1, 4), head_dim, generator=gen)
        cases.append(((x, positions, theta), rotary_interleaved_reference(x, positions, theta)))

    # float32 angles of positions in the thousands carry errors near 1e-4 rad, whichever way
    # they are computed; a wrong pairing or frequency is off by O(1).
    def close(got, want) -> bool:
        return got.shape == want.shape and bool(torch.allclose(got.double(), want.double(), atol=2e-3, rtol=0))

    return run_cases("rotary_interleaved", fn, cases, same=close,
                     describe=lambda a: f"x{tuple(a[0].shape)}, positions={a[1].tolist()}, theta={a[2]}")
