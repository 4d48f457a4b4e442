"""Checkers for chapter 08, the Triton paged-attention kernel.

- ``check_decode_kernel``: the reader's split-context decode kernel, through its launcher
  ``fn(q, k_cache, v_cache, block_tables, context_lens, scale, partition_blocks=...)``, on random
  decode batches (block sizes 1 to 16, 5 among them, which is not a power of two; GQA ratios 1 to
  4; head_dim 16, 24 and 32; contexts of one token and contexts that end mid-block; block tables
  out of order; NaN in every slot no sequence owns) at several partition sizes, against dense
  attention over each sequence's true K/V (``ch07_batches.dense_causal_attention``). A failure names the
  sequence and query head with the largest error, and runs the same batch again with one
  partition per context to say whether the walk or the reduction is wrong. The last case runs
  s0/s1/s2 through the real engine with ``TritonBackend(decode=fn)`` on the tiny model, against
  the package's kernel (``exercises.decode_engine``).

Without CUDA the kernels run in Triton's interpreter, on the CPU; with CUDA they compile and the
cases run on the GPU (``kernel_device``).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyserve.exercises.ch07_batches import dense_causal_attention
from tinyserve.exercises.verdict import checker, verdict


def kernel_device() -> str:
    """Where a Triton kernel the reader defined runs: on CUDA when it compiles, on the CPU when
    it is interpreted (no CUDA, or ``TRITON_INTERPRET=1``)."""
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@dataclass
class DecodeCase:
    """One decode batch: the launcher's arguments (on the kernel's device), the dense answer
    ``want [num_seqs, num_heads, head_dim]`` (float64, on the CPU) and a description."""

    args: tuple
    want: torch.Tensor
    shown: str
    group: int
    width: int  # blocks per row of the block table


def decode_case(lens: list[int], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                gen: torch.Generator, rng: random.Random, device: str = "cpu") -> DecodeCase:
    """A paged cache holding ``lens`` tokens' K/V in shuffled blocks (NaN in every other slot),
    one query per sequence, and dense attention over each sequence's own K/V."""
    needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(needed) + 2
    order = rng.sample(range(num_blocks), num_blocks)  # tables out of order, two blocks nobody owns
    tables = [order[sum(needed[:s]):sum(needed[:s + 1])] for s in range(len(lens))]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    want = []
    for s, (n, table) in enumerate(zip(lens, tables)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        want.append(dense_causal_attention(q[s:s + 1], k, v, scale)[0])
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    args = tuple(a.to(device) for a in (q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32)))
    shown = (f"context_lens={lens}, block_size={block_size}, {q.shape[1]} query heads on {num_kv_heads} KV "
             f"heads (G={group}), head_dim {head_dim}, tables {tables}")
    return DecodeCase(args + (scale,), torch.stack(want), shown, group, width)


# (context_lens, block_size, num_kv_heads, group, head_dim, partition_blocks): each fixed case
# aims at one part. One partition, no GQA; GQA with a partition per block (the short sequence's
# later partitions are empty); block size 5 and head_dim 24, neither a power of two; G=4 with
# one KV head and blocks of 16; blocks of one token.
FIXED = [
    ([7], 4, 1, 1, 16, 8),
    ([9, 3], 4, 2, 2, 16, 1),
    ([12, 1, 5], 5, 1, 3, 24, 2),
    ([40, 17], 16, 1, 4, 32, 1),
    ([6, 2], 1, 2, 2, 16, 4),
]


def random_spec(rng: random.Random) -> tuple:
    block_size = rng.choice([1, 4, 5, 8, 16])
    lens = [rng.randint(1, 45) for _ in range(rng.randint(1, 3))]
    if block_size > 1 and all(n % block_size == 0 for n in lens):
        lens[0] += 1  # at least one context ends mid-block
    return (lens, block_size, rng.choice([1, 2]), rng.choice([1, 2, 3, 4]), rng.choice([16, 24, 32]),
            rng.choice([1, 2, 3, 64]))


def _run_launcher(fn, case: DecodeCase, partition_blocks: int):
    """The reader's output as float64 on the CPU, or the error text."""
    try:
        got = fn(*case.args, partition_blocks=partition_blocks)
    except NotImplementedError:
        return None, "raised NotImplementedError: not written yet"
    except Exception as e:  # the reader's kernel: any error is a failed case
        return None, f"raised {type(e).__name__}: {e}"
    if not isinstance(got, torch.Tensor) or got.shape != case.want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return None, f"returned {shape}, expected a tensor of shape {tuple(case.want.shape)}"
    return got.detach().double().cpu(), None


def _worst(got: torch.Tensor, case: DecodeCase) -> tuple[float, str]:
    """The largest error and where: "sequence 1, query head 3 (KV head 1): max |error| 0.42"."""
    err = (got - case.want).abs().nan_to_num(float("inf")).amax(dim=-1)  # [num_seqs, num_heads]
    s, h = divmod(int(err.argmax()), err.shape[1])
    bad = (err > 1e-4).nonzero().tolist()
    heads = sorted({hh for _, hh in bad})
    nan = (" (NaN: a slot the sequence does not own was read unmasked, or a 0 / 0)"
           if got.isnan().any() else "")
    return err.max().item(), (f"worst at sequence {s}, query head {h} (KV head {h // case.group}): max |error| "
                              f"{err[s, h].item():.3g}{nan}; wrong query heads {heads} of sequences "
                              f"{sorted({ss for ss, _ in bad})}")


def check_partitions(fn: Callable[..., torch.Tensor], specs: list[tuple], device: str) -> list[str]:
    """The kernel-level cases: one failure line per case, with where it is wrong and which part."""
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    failures = []
    for lens, block_size, num_kv_heads, group, head_dim, partition_blocks in specs:
        case = decode_case(lens, block_size, num_kv_heads, group, head_dim, gen, rng, device)
        where = f"{case.shown}, partition_blocks={partition_blocks}"
        got, problem = _run_launcher(fn, case, partition_blocks)
        if problem:
            failures.append(f"{where}: {problem}")
            continue
        if torch.allclose(got, case.want, atol=1e-5, rtol=1e-5):
            continue
        _, at = _worst(got, case)
        part = ""
        if math.ceil(case.width / partition_blocks) > 1:
            whole, problem = _run_launcher(fn, case, case.width)  # the same batch, one partition per context
            if whole is not None and torch.allclose(whole, case.want, atol=1e-5, rtol=1e-5):
                part = (" -- with one partition per context it is right, so the split is wrong: the partitions' "
                        "block ranges, an empty partition's (max, sum, acc), or the reduction's rescaling")
            else:
                part = " -- wrong with one partition per context too: the walk itself"
        elif partition_blocks >= case.width:
            part = (" -- one partition per context here, so the walk itself: the paging (table[b], row), the "
                    "masks, the online softmax or the KV head of each query head")
        failures.append(f"{where}: {at}{part}")
    return failures


@checker(chapter=8, answer="paged_decode")
def check_decode_kernel(fn: Callable[..., torch.Tensor], num_random: int = 4, seed: int = 0,
                        show: bool = False) -> bool:
    """``fn(q, k_cache, v_cache, block_tables, context_lens, scale, partition_blocks=...)`` ->
    ``[num_seqs, num_heads, head_dim]``, as ``reference.paged_decode_attention`` for every
    ``partition_blocks``: the fixed cases of ``FIXED``, then ``num_random`` random ones.

    The last case runs s0/s1/s2 through the engine on the tiny model with
    ``TritonBackend(decode=fn)`` and compares its greedy tokens with the package's kernel's
    (only when the other cases pass); ``show`` prints both runs."""
    from tinyserve.exercises import decode_engine

    rng = random.Random(seed)
    specs = FIXED + [random_spec(rng) for _ in range(num_random)]
    failures = check_partitions(fn, specs, kernel_device())
    if not failures:
        package = decode_engine.run_seed_rounds("package's kernel")
        yours = decode_engine.run_seed_rounds("your kernel", fn)
        if show:
            decode_engine.compare_runs(package, yours)
        if yours.error or yours.tokens != package.tokens:
            failures.append(f"in the engine (s0/s1/s2, blocks of 5, greedy): "
                            f"{yours.error or f'tokens {yours.tokens}, expected {package.tokens}'}")
    return verdict("decode_kernel", failures, len(specs) + 1)
