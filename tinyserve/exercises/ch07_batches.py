"""Chapter 07's test batches for the paged attention checker: packed batches over a paged cache
with each sequence's true K/V beside it, and the dense causal attention (float64, no cache) that
every backend must match. ``check_attention_backend`` (``ch07.py``) and chapter 08's decode
kernel checker grade against them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tinyserve.attention.metadata import AttentionMetadata


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
