"""Chapter 02's exercise 4, an allocator that hands out the lowest free number: the rule kept as
plain data (``LowestFirstModel``), the same rule behind the allocator interface for the scheduler
runs (``LowestFirstModelAllocator``), and the scripts of calls its checker plays on both
(``lowest_first_script``, ``play_lowest_first``).

``tinyserve.exercises.ch02.check_allocator`` is the checker built on them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import Device, OutOfBlocksError, PhysicalTokenBlock


class LowestFirstModel:
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


class LowestFirstModelAllocator:
    """The model above behind the BlockAllocator interface, for the scheduler runs."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.model = LowestFirstModel(num_blocks)
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


def lowest_first_script(rng: random.Random) -> tuple[int, list[str]]:
    """A pool size and a short script of calls: allocate, share (a second owner, as fork does),
    free, and now and then a double free or an allocate on an empty pool."""
    num_blocks = rng.randint(1, 5)
    ops = [rng.choice(["allocate", "allocate", "allocate", "share", "free", "free"]) for _ in range(rng.randint(4, 10))]
    return num_blocks, ops


def play_lowest_first(make: Callable, num_blocks: int, ops: list[str], model: bool = False) -> list[str]:
    """Play a script; each call reports what it returned or raised, and the free count after."""
    pool = LowestFirstModel(num_blocks) if model else make(Device.GPU, 4, num_blocks)
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
