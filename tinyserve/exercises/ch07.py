"""Checkers for chapter 07, a Llama model on a paged cache.

- ``check_paged_attention``: the reader's attention backend (``store_kv`` and ``forward``, the
  protocol of ``attention/backend.py``). Its writes are compared slot by slot with the slot
  mapping; its outputs with dense causal attention written out here over the true K/V of each
  sequence (no cache involved), on batches that mix prefills, decodes and prefills over a cached
  prefix, with shuffled block tables and NaN in every slot no sequence owns. The last case runs
  the tiny model with ``attention_backend=<the reader's object>`` in the real engine, against
  the package's ``"torch"`` backend.
- ``check_rotary_interleaved``: rotary embeddings with GPT-J's pairing of channels, against the
  rotation written as a product of complex numbers.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.exercises.engine_runs import run_engine, same_tokens
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


def _batch(rng: random.Random, gen: torch.Generator):
    """A random packed batch over a paged cache: per sequence its true K/V, its queries, its
    blocks; the cache already holds every token but the new ones, which ``store_kv`` must write."""
    block_size = rng.choice([1, 2, 4, 8])
    num_kv_heads, group, head_dim = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([4, 8, 16])
    seqs = []
    for _ in range(rng.randint(1, 4)):
        context = rng.randint(1, 20)
        kind = rng.choice(["prefill", "decode", "prefix"])
        new = context if kind == "prefill" else 1 if kind == "decode" else rng.randint(1, context)
        seqs.append((context, new))
    needed = [-(-c // block_size) for c, _ in seqs]
    num_blocks = sum(needed) + rng.randint(1, 4)
    order = rng.sample(range(num_blocks), num_blocks)
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    ks, vs, qs, slots = [], [], [], []
    for (context, new), table in zip(seqs, tables):
        k = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        for p in range(context - new):  # the cached prefix is already in place
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(new, num_kv_heads * group, head_dim, generator=gen))
    meta = AttentionMetadata.build([n for _, n in seqs], [c for c, _ in seqs], tables, slots)
    return k_cache, v_cache, meta, ks, vs, qs, head_dim**-0.5


def _same_cache(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def _attention_cases(backend, num_cases: int, seed: int) -> list[str]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    failures = []
    for _ in range(num_cases):
        k_cache, v_cache, meta, ks, vs, qs, scale = _batch(rng, gen)
        shown = (f"query_lens={meta.query_lens}, context_lens={meta.context_lens_list}, "
                 f"block_size={k_cache.shape[1]}, heads {qs[0].shape[1]}/{k_cache.shape[2]}")
        new_k = torch.cat([k[k.shape[0] - q.shape[0]:] for k, q in zip(ks, qs)])
        new_v = torch.cat([v[v.shape[0] - q.shape[0]:] for v, q in zip(vs, qs)])
        # Two padding tokens (slot -1) that must be stored nowhere.
        pad = torch.full((2, *new_k.shape[1:]), 1e4)
        slots = torch.cat([meta.slot_mapping, torch.tensor([-1, -1])])
        want_k, want_v = k_cache.clone(), v_cache.clone()
        flat_k, flat_v = want_k.view(-1, *want_k.shape[2:]), want_v.view(-1, *want_v.shape[2:])
        for t, slot in enumerate(meta.slot_mapping.tolist()):
            flat_k[slot], flat_v[slot] = new_k[t], new_v[t]
        try:
            backend.store_kv(torch.cat([new_k, pad]), torch.cat([new_v, pad]), k_cache, v_cache, slots)
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"store_kv ({shown}) raised {type(e).__name__}: {e}")
            continue
        if not (_same_cache(k_cache, want_k) and _same_cache(v_cache, want_v)):
            failures.append(f"store_kv ({shown}): the caches differ from the slot mapping's writes")
            continue
        want = torch.cat([dense_causal_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
        try:
            got = backend.forward(torch.cat(qs), k_cache, v_cache, meta, scale)
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"forward ({shown}) raised {type(e).__name__}: {e}")
            continue
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)):
            detail = (f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                      if isinstance(got, torch.Tensor) and got.shape != want.shape else
                      f"largest |difference| {(got.double() - want).abs().nan_to_num(float('inf')).max().item():.3g}"
                      if isinstance(got, torch.Tensor) else f"returned {type(got).__name__}")
            failures.append(f"forward ({shown}): {detail}")
    return failures


@checker(chapter=7, answer="BlockwiseAttention")
def check_paged_attention(cls: type, num_cases: int = 40, seed: int = 0) -> bool:
    """``cls()`` is an attention backend: ``store_kv(key, value, k_cache, v_cache, slot_mapping)``
    writes each token to its slot (slot -1: nowhere), and ``forward(q, k_cache, v_cache, meta,
    scale)`` attends each sequence's queries, the last ``query_lens[i]`` positions of its
    context, to the context read back through its block table, causally, with GQA.

    The last case runs the tiny model in the real engine with ``attention_backend=cls()`` and
    compares its greedy tokens with the package's torch backend (only when the other cases pass)."""
    try:
        backend = cls()
    except Exception as e:  # the reader's code
        return verdict("paged_attention", [f"{cls.__name__}() raised {type(e).__name__}: {e}"], 1)
    failures = _attention_cases(backend, num_cases, seed)
    if not failures:
        package = run_engine("torch backend", block_size=2)
        yours = run_engine("your backend", block_size=2, attention_backend=backend)
        if not same_tokens(yours, package):
            failures.append(f"in the engine: {yours.error or 'other tokens than the torch backend'}")
    return verdict("paged_attention", failures, num_cases + 1)


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
