"""How chapter 02's exercise 1, the reader's ``BlockAllocator``, is played: scripts of calls on a
pool, played on the reader's class and on the package's ``tinyserve.block.BlockAllocator`` side by
side (``play_allocator``, ``allocator_difference``), and the scheduler runs that use an allocator
(``allocator_workloads``, ``run_with_allocator``, which exercise 4's checker shares).

``tinyserve.exercises.ch02.check_block_allocator`` is the checker built on them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, scheduler_run, seed_workloads
from tinyserve.sim import Request, RoundRecord


def _raised(e: Exception) -> str:
    return f"raised {type(e).__name__}" + (f": {e}" if str(e) else "")



def random_block_script(rng: random.Random) -> tuple[int, list[str]]:
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
            free = f"{pool.get_num_free_blocks()} free"
        except Exception as e:
            free = f"get_num_free_blocks() raised {type(e).__name__}"
        steps.append((call, f"{result}; {free}, free list {_free_list(pool)}"))
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

