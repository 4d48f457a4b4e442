"""Checkers for chapter 02: sequences, block tables, the slot mapping and the BlockAllocator.

``check_block_allocator`` grades the chapter's core component, the reader's BlockAllocator
(a FIFO free list and reference counts): call by call on scripts of allocate, fork-like
ref-count bumps and frees (double frees and empty pools included) against the package's
``tinyserve.block.BlockAllocator``, naming the first call whose result, ref count, free count
or free list differs; then inside the real scheduler (``BlockSpaceManager(allocator=...)`` in
``Scheduler(block_manager=...)``) on s0/s1/s2 and a small random workload that swaps, block
tables included. ``check_allocator`` grades a variant the same two ways, against a model of its
rule (the lowest free number first).

The machinery of exercise 1's checker (scripts of calls, the scheduler runs) is in
``ch02_allocator``, exercise 4's model of its rule in ``ch02_lowest_first``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import BlockAllocator, slot_mapping
from tinyserve.exercises.ch02_allocator import (
    allocator_difference,
    allocator_workloads,
    play_allocator,
    random_block_script,
    run_with_allocator,
)
from tinyserve.exercises.ch02_lowest_first import LowestFirstModelAllocator, lowest_first_script, play_lowest_first
from tinyserve.exercises.sched_runs import check_runs
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.sequence import Sequence

# Names other modules and the tests import from here (the checkers' machinery lives beside).
__all__ = ["allocator_difference", "allocator_workloads", "check_allocator", "check_block_allocator",
           "check_num_blocks", "check_slot_owner", "play_allocator", "run_with_allocator"]


@checker(chapter=2, answer="num_blocks")
def check_num_blocks(fn: Callable[[int, int], int], num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(num_tokens, block_size)``: how many blocks a sequence of that many tokens needs."""
    rng = random.Random(seed)
    cases = []
    for n, bs in [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (32, 16), (5, 1), (7, 8)]:
        cases.append(((n, bs), Sequence(0, None, [0] * n, bs).n_blocks))
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 4, 5, 8, 16, 32])
        n = rng.randint(0, 20) * bs if rng.random() < 0.4 else rng.randint(0, 500)
        cases.append(((n, bs), Sequence(0, None, [0] * n, bs).n_blocks))
    return run_cases("num_blocks", fn, cases)


# -- the slot mapping, backwards -----------------------------------------------------------------

def _slot_owners(block_tables: dict[str, list[int]], seq_lens: dict[str, int], block_size: int) -> dict[int, tuple]:
    """Every slot that holds a token, mapped to (sequence, position), from the package's slot_mapping."""
    owners = {}
    for name, table in block_tables.items():
        for pos, slot in enumerate(slot_mapping(table, 0, seq_lens[name], block_size)):
            owners[slot] = (name, pos)
    return owners


@checker(chapter=2, answer="slot_owner")
def check_slot_owner(fn: Callable[[dict[str, list[int]], dict[str, int], int, int], tuple | None],
                     num_cases: int = 300, seed: int = 0) -> bool:
    """``fn(block_tables, seq_lens, slot, block_size)``: whose token's K/V is in cache slot
    ``slot``, as ``(sequence name, position)``, or None when no token is there (a free block,
    or the empty tail of a sequence's last block). No two sequences share a block."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 4, 5, 8, 16])
        pool = rng.randint(3, 24)
        numbers = rng.sample(range(pool), pool)  # blocks in a scattered order, never in sequence
        tables, lens = {}, {}
        for name in ("s0", "s1", "s2")[:rng.randint(1, 3)]:
            k = min(len(numbers), rng.randint(1, 4))
            if k == 0:
                break
            tables[name], numbers = numbers[:k], numbers[k:]
            lens[name] = rng.randint((k - 1) * bs + 1, k * bs)
        owners = _slot_owners(tables, lens, bs)
        # Half the probes hit a token; the others a free block or an unfilled tail.
        slot = rng.choice(list(owners)) if rng.random() < 0.5 else rng.randrange(pool * bs)
        cases.append(((tables, lens, slot, bs), owners.get(slot)))
    return run_cases("slot_owner", fn, cases,
                     same=lambda got, want: (got is None and want is None)
                     or (got is not None and want is not None and tuple(got) == want))


# -- the BlockAllocator, the chapter's component -------------------------------------------------


@checker(chapter=2, answer="FreeListAllocator")
def check_block_allocator(cls: Callable, num_cases: int = 120, seed: int = 0) -> bool:
    """``cls(device, block_size, num_blocks)``: the chapter's BlockAllocator. ``blocks`` holds
    every block by number; ``free_blocks`` is the free list, a FIFO queue (a fresh pool's holds
    0, 1, 2, ... in order); ``allocate()`` takes the block at its front, gives it one owner
    (ref_count 1) and returns it, or raises ``OutOfBlocksError`` when none is free;
    ``free(block)`` drops one owner and puts the block at the back of the free list when none is
    left, and raises ValueError on a block that is already free; ``get_num_free_blocks()``.
    Graded call by call against ``tinyserve.block.BlockAllocator``, then as the allocator of the
    real scheduler on s0/s1/s2 and a random workload that swaps, block tables included."""
    rng = random.Random(seed)
    scripts = [(2, ["allocate", "allocate", "allocate"]),  # an empty pool
               (0, ["allocate"]),  # a pool of no blocks at all
               (3, ["allocate", "free", "double free"]),  # a double free
               (3, ["allocate", "allocate", "share", "free", "free", "free"]),  # two owners, then none
               (4, ["allocate", "allocate", "allocate", "free", "free", "allocate", "allocate", "allocate"])]  # FIFO
    while len(scripts) < num_cases:
        scripts.append(random_block_script(rng))
    failures = []
    for num_blocks, ops in scripts:
        difference = allocator_difference(cls, num_blocks, ops)
        if difference:
            failures.append(difference)
    name = getattr(cls, "__name__", "BlockAllocator")
    script_ok = verdict(f"{name}, call by call beside the package's BlockAllocator", failures, len(scripts))
    engine_ok = check_runs(f"{name} in the scheduler", allocator_workloads(),
                           lambda *w: run_with_allocator(cls, *w), lambda *w: run_with_allocator(BlockAllocator, *w),
                           tables=True)
    return script_ok and engine_ok


# -- a variant: the lowest number first ---------------------------------------------------------

@checker(chapter=2, answer="LowestFirstAllocator")
def check_allocator(cls: Callable, num_cases: int = 60, seed: int = 0) -> bool:
    """``cls(device, block_size, num_blocks)``: a BlockAllocator whose ``allocate`` always hands
    out the free block with the lowest number (ref count 1), raises ``OutOfBlocksError`` when
    none is free; ``free(block)`` drops one owner and returns the block when none is left, and
    raises ValueError on a block that is already free; ``get_num_free_blocks()``; ``num_blocks``.
    Graded on scripts of calls, then driving the real scheduler on s0/s1/s2 and a random workload."""
    rng = random.Random(seed)
    scripts = [(2, ["allocate", "free", "free"]),  # a double free
               (1, ["allocate", "allocate", "free", "allocate"]),  # an empty pool
               (3, ["allocate", "allocate", "share", "free", "allocate", "free", "allocate"]),  # two owners
               (4, ["allocate", "allocate", "allocate", "free", "free", "allocate", "allocate"])]  # holes refill low
    while len(scripts) < num_cases:
        scripts.append(lowest_first_script(rng))
    cases = []
    for num_blocks, ops in scripts:
        cases.append(((num_blocks, ops), play_lowest_first(None, num_blocks, ops, model=True)))
    script_ok = run_cases("LowestFirstAllocator, scripted calls", lambda n, ops: play_lowest_first(cls, n, ops), cases,
                          describe=lambda args: f"{args[0]} blocks, calls {args[1]}")
    engine_ok = check_runs("LowestFirstAllocator in the scheduler", allocator_workloads(),
                           lambda *w: run_with_allocator(cls, *w),
                           lambda *w: run_with_allocator(LowestFirstModelAllocator, *w),
                           tables=True)
    return script_ok and engine_ok
