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
from dataclasses import dataclass

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.exercises.engine_runs import run_engine
from tinyserve.exercises.verdict import checker, run_cases, verdict


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [n_q, H, D]``, the last ``n_q`` positions of a context ``k, v [n, Hkv, D]``; query head
    ``h`` reads KV head ``h // (H // Hkv)``. In float64, one head at a time."""
    n_q, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(n_q):
            seen = n - n_q + i + 1  # its own position and every earlier one
            weights = torch.softmax(kh[:seen] @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ vh[:seen]
    return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


@dataclass
class Batch:
    """A packed batch over a paged cache: per sequence its true K/V (context, not cached) and its
    queries; ``k_cache``/``v_cache`` hold every token but the new ones, which ``store_kv`` writes."""

    name: str
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    qs: list[torch.Tensor]
    scale: float

    def kind(self, i: int) -> str:
        n_q, n = self.meta.query_lens[i], self.meta.context_lens_list[i]
        return "prefill" if n_q == n else "decode" if n_q == 1 else "prefix"

    def describe_seq(self, i: int) -> str:
        n_q, n = self.meta.query_lens[i], self.meta.context_lens_list[i]
        what = {"prefill": f"a prefill of {n} tokens", "decode": f"a decode at context {n}",
                "prefix": f"a prefill of {n_q} tokens over {n - n_q} cached"}[self.kind(i)]
        return f"sequence {i} ({what}, block table {self.tables[i]})"

    def __str__(self) -> str:
        return (f"{self.name}: query_lens={self.meta.query_lens}, context_lens={self.meta.context_lens_list}, "
                f"block_size={self.k_cache.shape[1]}, {_count(self.qs[0].shape[1], 'query head')} / "
                f"{_count(self.k_cache.shape[2], 'KV head')}, {str(self.k_cache.dtype).removeprefix('torch.')}")


def make_batch(name: str, seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int,
               head_dim: int, gen: torch.Generator, rng: random.Random, spare: int = 2,
               dtype: torch.dtype = torch.float32) -> Batch:
    """``seqs`` is ``(context_len, new_tokens)`` per sequence; blocks are handed out in random order
    from a pool with ``spare`` blocks nobody owns, and every slot no sequence has filled is NaN."""
    needed = [-(-c // block_size) for c, _ in seqs]
    num_blocks = sum(needed) + spare
    order = rng.sample(range(num_blocks), num_blocks)
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    ks, vs, qs, slots = [], [], [], []
    for (context, new), table in zip(seqs, tables):
        k = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(context - new):  # the cached prefix is already in place
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(new, num_kv_heads * group, head_dim, generator=gen).to(dtype))
    meta = AttentionMetadata.build([n for _, n in seqs], [c for c, _ in seqs], tables, slots)
    return Batch(name, k_cache, v_cache, meta, tables, ks, vs, qs, head_dim**-0.5)


def fixed_batches(gen: torch.Generator, rng: random.Random) -> list[Batch]:
    return [
        make_batch("one prefill", [(5, 5)], 4, 2, 1, 8, gen, rng),
        make_batch("one decode", [(6, 1)], 4, 2, 1, 8, gen, rng),
        make_batch("a prefill over a cached prefix", [(9, 3)], 4, 1, 1, 8, gen, rng),
        make_batch("a mixed batch with GQA", [(7, 7), (11, 1), (9, 3)], 4, 2, 3, 16, gen, rng),
        make_batch("blocks of one token", [(4, 4), (5, 1)], 1, 1, 2, 4, gen, rng),
        make_batch("bfloat16", [(6, 6), (9, 1)], 4, 2, 2, 16, gen, rng, dtype=torch.bfloat16),
    ]


def random_batch(index: int, gen: torch.Generator, rng: random.Random) -> Batch:
    seqs = []
    for _ in range(rng.randint(1, 4)):
        context = rng.randint(1, 20)
        kind = rng.choice(["prefill", "decode", "prefix"])
        new = context if kind == "prefill" else 1 if kind == "decode" else rng.randint(1, context)
        seqs.append((context, new))
    return make_batch(f"random batch {index}", seqs, rng.choice([1, 2, 4, 8]), rng.choice([1, 2]),
                      rng.choice([1, 2, 3]), rng.choice([4, 8, 16]), gen, rng, spare=rng.randint(1, 4))


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
