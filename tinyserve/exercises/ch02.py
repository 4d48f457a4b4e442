"""Checkers for chapter 02: sequences, block tables, the slot mapping and the BlockAllocator.

``check_block_allocator`` grades the chapter's core component, the reader's BlockAllocator
(a FIFO free list and reference counts): call by call on scripts of allocate, fork-like
ref-count bumps and frees (double frees and empty pools included) against the package's
``tinyserve.block.BlockAllocator``, naming the first call whose result, ref count, free count
or free list differs; then inside the real scheduler (``BlockSpaceManager(allocator=...)`` in
``Scheduler(block_manager=...)``) on s0/s1/s2 and a small random workload that swaps, block
tables included. ``check_allocator`` grades a variant the same two ways, against a model of its
rule (the lowest free number first).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock, slot_mapping
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, scheduler_run, seed_workloads
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.sequence import Sequence
from tinyserve.sim import Request, RoundRecord


def _raised(e: Exception) -> str:
    return f"raised {type(e).__name__}" + (f": {e}" if str(e) else "")


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

def _block_script(rng: random.Random) -> tuple[int, list[str]]:
    """A pool size and a script: mostly allocations and frees, some second owners (as a fork
    makes), and now and then a double free or an allocation from an empty pool."""
    num_blocks = rng.randint(1, 6)
    ops = rng.choices(["allocate", "share", "free", "double free"], weights=[5, 2, 4, 1], k=rng.randint(4, 16))
    return num_blocks, ops


def _free_list(pool) -> str:
    try:
        return str([b.block_number for b in pool.free_blocks])
    except Exception as e:  # the reader's class may lack the attribute, or hold something else there
        return f"unreadable ({type(e).__name__}: {e})"


def play_allocator(make: Callable, num_blocks: int, ops: list[str], block_size: int = 4) -> list[tuple[str, str]]:
    """Play a script on ``make(Device.GPU, block_size, num_blocks)``: one ``(call, what it did)``
    per call, what it did being the result (or the exception), the block's ref count, the free
    count and the free list after it. A ``share`` gives the newest owned block a second owner,
    as ``BlockSpaceManager.fork`` does; ``free`` frees the oldest owned block, ``double free``
    a block that is already free. A step with no block to act on is skipped."""
    try:
        pool = make(Device.GPU, block_size, num_blocks)
    except Exception as e:  # the reader's constructor
        return [(f"{getattr(make, '__name__', 'cls')}(Device.GPU, {block_size}, {num_blocks})",
                 _raised(e))]
    held: list = []  # every block handed out so far, once each, oldest first
    steps = []
    for op in ops:
        owned = [b for b in held if getattr(b, "ref_count", 0) > 0]
        if op == "allocate":
            call = "allocate()"
        elif op == "share":
            if not owned:
                continue
            block = owned[-1]
            call = f"block {block.block_number}.ref_count += 1 (a second owner, as fork makes)"
        else:
            candidates = owned if op == "free" else [b for b in held if getattr(b, "ref_count", 1) == 0]
            if not candidates:
                continue
            block = candidates[0]
            call = f"free(block {block.block_number})" + (" again" if op == "double free" else "")
        try:
            if op == "allocate":
                block = pool.allocate()
                if not isinstance(block, PhysicalTokenBlock):
                    steps.append((call, f"returned {block!r}, not a PhysicalTokenBlock"))
                    break
                if all(block is not b for b in held):
                    held.append(block)
                result = f"block {block.block_number}, ref_count {block.ref_count}"
            elif op == "share":
                block.ref_count += 1
                result = f"ref_count {block.ref_count}"
            else:
                pool.free(block)
                result = f"ref_count {block.ref_count}"
        except OutOfBlocksError:
            result = "OutOfBlocksError"
        except ValueError:
            result = "ValueError"
        except Exception as e:  # the reader's code: any other error is what it did
            result = _raised(e)
        try:
            free = pool.get_num_free_blocks()
        except Exception as e:
            free = f"get_num_free_blocks() raised {type(e).__name__}"
        steps.append((call, f"{result}; {free} free, free list {_free_list(pool)}"))
    return steps


def allocator_difference(cls: Callable, num_blocks: int, ops: list[str]) -> str | None:
    """Where ``cls`` first departs from the package's BlockAllocator on a script, or None."""
    mine, want = play_allocator(cls, num_blocks, ops), play_allocator(BlockAllocator, num_blocks, ops)
    if mine and mine[0][0].startswith(getattr(cls, "__name__", "cls") + "("):  # the constructor raised
        return f"{mine[0][0]} {mine[0][1]}"
    for k, ((call, got), (want_call, expected)) in enumerate(zip(mine, want)):
        if call != want_call or got != expected:
            calls = [c for c, _ in mine[:k]]
            where = (f"a pool of {num_blocks} blocks, after {'..., ' if k > 4 else ''}{'; '.join(calls[-4:])}"
                     if k else f"a fresh pool of {num_blocks} blocks")
            if call != want_call:  # an earlier call left another block to act on
                return f"{where}: the next call is {call} instead of {want_call} ({got})"
            return f"{where}: {call} -> {got}, expected {expected}"
    if len(mine) != len(want):
        return f"a pool of {num_blocks} blocks, calls {ops}: {len(mine)} steps instead of {len(want)}"
    return None


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
        scripts.append(_block_script(rng))
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

class _LowestFirstModel:
    """The rule, kept as plain data: which numbers are free, and each block's owners."""

    def __init__(self, num_blocks: int) -> None:
        self.free = set(range(num_blocks))
        self.owners = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocksError("empty")
        number = min(self.free)
        self.free.remove(number)
        self.owners[number] = 1
        return number

    def release(self, number: int) -> None:
        if self.owners[number] == 0:
            raise ValueError("double free")
        self.owners[number] -= 1
        if self.owners[number] == 0:
            self.free.add(number)


class _ModelAllocator:
    """The model above behind the BlockAllocator interface, for the scheduler runs."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.model = _LowestFirstModel(num_blocks)
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]

    def allocate(self) -> PhysicalTokenBlock:
        block = self.blocks[self.model.allocate()]
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        self.model.owners[block.block_number] = block.ref_count  # forks raise ref_count directly
        self.model.release(block.block_number)
        block.ref_count -= 1

    def get_num_free_blocks(self) -> int:
        return len(self.model.free)


def _script(rng: random.Random) -> tuple[int, list[str]]:
    """A pool size and a short script of calls: allocate, share (a second owner, as fork does),
    free, and now and then a double free or an allocate on an empty pool."""
    num_blocks = rng.randint(1, 5)
    ops = [rng.choice(["allocate", "allocate", "allocate", "share", "free", "free"]) for _ in range(rng.randint(4, 10))]
    return num_blocks, ops


def _run_script(make: Callable, num_blocks: int, ops: list[str], model: bool = False) -> list[str]:
    """Play a script; each call reports what it returned or raised, and the free count after."""
    pool = _LowestFirstModel(num_blocks) if model else make(Device.GPU, 4, num_blocks)
    held: list = []  # handed-out blocks (numbers for the model), oldest first; some freed since
    refs: list[int] = []  # owners the script believes each handed-out block has
    trace = []
    for op in ops:
        if op == "share":
            if any(refs):
                i = max(i for i, r in enumerate(refs) if r)
                refs[i] += 1
                if model:
                    pool.owners[held[i]] += 1
                else:
                    held[i].ref_count += 1
            continue
        try:
            if op == "allocate":
                got = pool.allocate()
                number = got if model else got.block_number
                if not model and (got.ref_count != 1 or got.device != Device.GPU):
                    trace.append(f"allocate -> block {number} with ref_count={got.ref_count}")
                    continue
                held.append(got)
                refs.append(1)
                result = f"allocate -> {number}"
            else:
                # Free the oldest block still owned, or, when none is, the first one again.
                i = next((i for i, r in enumerate(refs) if r), 0)
                if not held:
                    continue
                block = held[i]
                number = block if model else block.block_number
                pool.release(block) if model else pool.free(block)
                refs[i] = max(0, refs[i] - 1)
                result = f"free {number}"
        except OutOfBlocksError:
            result = f"{op} -> OutOfBlocksError"
        except ValueError:
            result = f"{op} -> ValueError"
        free = len(pool.free) if model else pool.get_num_free_blocks()
        trace.append(f"{result} (free={free})")
    return trace


def allocator_workloads() -> list[SimWorkload]:
    """s0/s1/s2 both ways, and a small random workload that swaps (so CPU blocks move too)."""
    runs = seed_workloads()
    rng = random.Random(7)
    requests = [Request(f"r{i}", rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 6)) for i in range(8)]
    runs.append(("8 random requests, 7 GPU blocks of 3",
                 requests, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=18,
                                           preemption_mode="swap"),
                 CacheConfig(block_size=3, num_gpu_blocks=7, num_cpu_blocks=8, watermark=0.0)))
    return runs


def run_with_allocator(make: Callable, requests: list[Request], scheduler_config: SchedulerConfig,
                       cache_config: CacheConfig) -> list[RoundRecord]:
    """The simulator's rounds, with the scheduler's block manager built on allocator ``make``."""
    manager = BlockSpaceManager(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
                                cache_config.watermark, allocator=make)
    return scheduler_run(requests, scheduler_config, cache_config, block_manager=manager)


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
        scripts.append(_script(rng))
    cases = []
    for num_blocks, ops in scripts:
        cases.append(((num_blocks, ops), _run_script(None, num_blocks, ops, model=True)))
    script_ok = run_cases("LowestFirstAllocator, scripted calls", lambda n, ops: _run_script(cls, n, ops), cases,
                          describe=lambda args: f"{args[0]} blocks, calls {args[1]}")
    engine_ok = check_runs("LowestFirstAllocator in the scheduler", allocator_workloads(),
                           lambda *w: run_with_allocator(cls, *w), lambda *w: run_with_allocator(_ModelAllocator, *w),
                           tables=True)
    return script_ok and engine_ok
