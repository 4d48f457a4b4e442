"""Checkers for chapter 01: the KV cache, and why reserving it contiguously wastes memory.

The expected answers are computed here by other means than an answer would use: the cache
counted layer by layer and token by token, the real ``Sequence``'s block count, and a
slot-by-slot scan of the arena for the placement exercise.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.exercises.verdict import checker, run_cases
from tinyserve.sequence import Sequence

# (num_layers, num_kv_heads, head_dim): SmolLM2-135M, Llama-2-7B, Llama-3-8B
KNOWN_SHAPES = [(30, 3, 64), (32, 32, 128), (32, 8, 128)]


def _window_kv_bytes(seq_len: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                     num_window_layers: int, window: int) -> int:
    """Layer by layer, token by token: what each layer keeps, in bytes."""
    total = 0
    for layer in range(num_layers):
        windowed = layer < num_window_layers
        for position in range(seq_len):
            if windowed and position < seq_len - window:
                continue  # fell out of this layer's window: its key and value are dropped
            total += 2 * num_kv_heads * head_dim * dtype_bytes  # a key and a value per KV head
    return total


@checker(chapter=1, answer="window_kv_bytes")
def check_window_kv_bytes(fn: Callable[..., int], num_cases: int = 120, seed: int = 0) -> bool:
    """``fn(seq_len, num_layers, num_kv_heads, head_dim, dtype_bytes, num_window_layers, window)``:
    the bytes of KV cache one sequence of ``seq_len`` tokens holds in a model where
    ``num_window_layers`` of its layers use sliding-window attention (each keeps only the last
    ``window`` tokens' keys and values, as Mistral-7B's and half of Gemma-2's layers do) and the
    other layers keep every token."""
    rng = random.Random(seed)
    cases = []
    for layers, heads, dim in KNOWN_SHAPES:
        for window in (1, 64, 4096):
            args = (rng.randint(1, 200), layers, heads, dim, 2, rng.randint(0, layers), window)
            cases.append((args, _window_kv_bytes(*args)))
    while len(cases) < num_cases:
        layers = rng.randint(1, 12)
        window = rng.randint(1, 40)
        # Lengths on both sides of the window, and exactly at it.
        seq_len = rng.choice([rng.randint(1, window), window, rng.randint(window, 3 * window)])
        args = (seq_len, layers, rng.randint(1, 8), rng.choice([16, 64, 128]), rng.choice([1, 2, 4]),
                rng.randint(0, layers), window)
        cases.append((args, _window_kv_bytes(*args)))
    return run_cases("window_kv_bytes", fn, cases)


@checker(chapter=1, answer="reserved_waste")
def check_reserved_waste(fn: Callable[[list[int], int], int], num_cases: int = 100, seed: int = 0) -> bool:
    """``fn(seq_lens, max_model_len)``: slots reserved but holding no token, when every sequence
    reserves ``max_model_len`` contiguous slots."""
    rng = random.Random(seed)
    cases = [(([], 16), 0), (([16], 16), 0)]
    while len(cases) < num_cases:
        max_len = rng.choice([16, 64, 512, 2048])
        lens = [rng.randint(1, max_len) for _ in range(rng.randint(1, 12))]
        cases.append(((lens, max_len), len(lens) * max_len - sum(lens)))
    return run_cases("reserved_waste", fn, cases)


@checker(chapter=1, answer="paged_waste")
def check_paged_waste(fn: Callable[[list[int], int], int], num_cases: int = 150, seed: int = 0) -> bool:
    """``fn(seq_lens, block_size)``: slots allocated but holding no token under paging, when each
    sequence holds just enough blocks (only its last block can be partly empty)."""
    rng = random.Random(seed)
    cases = [(([], 16), 0), (([16], 16), 0), (([1], 16), 15), (([32, 33], 16), 15)]
    while len(cases) < num_cases:
        bs = rng.choice([1, 4, 8, 16, 32])
        # Half the lengths are exact multiples of the block size: a full last block wastes nothing.
        lens = [rng.randint(1, 12) * bs if rng.random() < 0.5 else rng.randint(1, 400)
                for _ in range(rng.randint(1, 10))]
        expected = sum(Sequence(0, None, [0] * n, bs).n_blocks * bs - n for n in lens)
        cases.append(((lens, bs), expected))
    return run_cases("paged_waste", fn, cases)


def _holes(runs: list[tuple[int, int]], arena_size: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of free slots, found slot by slot."""
    taken = [False] * arena_size
    for start, length in runs:
        for slot in range(start, start + length):
            taken[slot] = True
    holes, start = [], None
    for slot, used in enumerate(taken + [True]):
        if not used and start is None:
            start = slot
        elif used and start is not None:
            holes.append((start, slot - start))
            start = None
    return holes


def _best_fit(runs: list[tuple[int, int]], arena_size: int, length: int) -> int | None:
    fitting = [(size, start) for start, size in _holes(runs, arena_size) if size >= length]
    return min(fitting)[1] if fitting else None


def _arena(rng: random.Random) -> tuple[list[tuple[int, int]], int]:
    """Random non-overlapping runs in an arena, in no particular order."""
    size = rng.randint(4, 64)
    runs, pos = [], rng.randint(0, 3)
    while pos < size:
        length = rng.randint(1, max(1, size // 5))
        if pos + length > size:
            break
        runs.append((pos, length))
        pos += length + rng.choice([0, 0, 1, 2, 3, 5, 8])
    rng.shuffle(runs)
    return runs, size


@checker(chapter=1, answer="best_fit")
def check_best_fit(fn: Callable[[list[tuple[int, int]], int, int], int | None], num_cases: int = 200,
                   seed: int = 0) -> bool:
    """``fn(runs, arena_size, length)``: where a *best-fit* contiguous allocator places a run of
    ``length`` slots, given the ``(start, length)`` runs already reserved (in any order): the
    start of the smallest hole that is long enough, the leftmost of equally small ones; None if
    no hole is long enough, even when the free slots add up to enough."""
    rng = random.Random(seed)
    cases = [(([], 10, 10), 0), (([], 10, 11), None), (([(0, 4), (6, 4)], 10, 2), 4),
             (([(2, 3), (9, 1)], 10, 2), 0), (([(6, 4), (0, 4)], 10, 3), None), (([(0, 4)], 10, 6), 4)]
    while len(cases) < num_cases:
        runs, size = _arena(rng)
        length = rng.randint(1, max(1, size // 3))
        cases.append(((runs, size, length), _best_fit(runs, size, length)))
    return run_cases("best_fit", fn, cases)
