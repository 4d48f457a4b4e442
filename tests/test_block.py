"""Physical blocks: the allocator's free list and ref counts, and the slot mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock, slot_for, slot_mapping


def test_physical_block_starts_free():
    b = PhysicalTokenBlock(Device.CPU, 7, 16)
    assert (b.device, b.block_number, b.block_size, b.ref_count) == (Device.CPU, 7, 16, 0)
    assert "CPU" in repr(b) and "7" in repr(b)


@pytest.mark.parametrize("device", list(Device))
def test_allocator_hands_out_every_block_once_then_raises_naming_the_device(device):
    alloc = BlockAllocator(device, block_size=4, num_blocks=5)
    assert alloc.get_num_free_blocks() == 5
    got = [alloc.allocate() for _ in range(5)]
    assert sorted(b.block_number for b in got) == list(range(5))
    assert all(b.ref_count == 1 and b.device == device and b.block_size == 4 for b in got)
    assert alloc.get_num_free_blocks() == 0
    with pytest.raises(OutOfBlocksError, match=device.name) as err:
        alloc.allocate()
    assert isinstance(err.value, RuntimeError)
    assert alloc.get_num_free_blocks() == 0


def test_an_empty_pool_is_allowed_but_yields_nothing():
    alloc = BlockAllocator(Device.CPU, 16, 0)
    assert alloc.get_num_free_blocks() == 0
    with pytest.raises(OutOfBlocksError, match="CPU"):
        alloc.allocate()


def test_free_returns_a_block_to_the_back_of_the_free_list():
    alloc = BlockAllocator(Device.GPU, 2, 3)
    a, b = alloc.allocate(), alloc.allocate()
    assert (a.block_number, b.block_number) == (0, 1)
    alloc.free(a)
    assert a.ref_count == 0 and alloc.get_num_free_blocks() == 2
    # FIFO: block 2 was free longer than block 0, so it comes out first.
    assert alloc.allocate().block_number == 2
    assert alloc.allocate().block_number == 0


def test_a_shared_block_is_freed_only_by_its_last_owner():
    alloc = BlockAllocator(Device.GPU, 2, 2)
    block = alloc.allocate()
    block.ref_count += 2  # two more tables hold it
    alloc.free(block)
    alloc.free(block)
    assert block.ref_count == 1 and alloc.get_num_free_blocks() == 1
    alloc.free(block)
    assert block.ref_count == 0 and alloc.get_num_free_blocks() == 2


def test_freeing_a_free_block_raises_value_error():
    alloc = BlockAllocator(Device.GPU, 2, 2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="already free"):
        alloc.free(block)
    with pytest.raises(ValueError):
        alloc.free(alloc.blocks[1])  # never allocated
    assert alloc.get_num_free_blocks() == 2  # the failed frees changed nothing


def test_freeing_a_block_of_the_other_device_raises():
    gpu, cpu = BlockAllocator(Device.GPU, 2, 2), BlockAllocator(Device.CPU, 2, 2)
    block = cpu.allocate()
    with pytest.raises(ValueError, match="CPU"):
        gpu.free(block)
    assert block.ref_count == 1 and gpu.get_num_free_blocks() == 2


@pytest.mark.parametrize(("block_size", "num_blocks"), [(0, 4), (-1, 4), (4, -1)])
def test_allocator_rejects_bad_sizes(block_size, num_blocks):
    with pytest.raises(ValueError):
        BlockAllocator(Device.GPU, block_size, num_blocks)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.booleans(), max_size=60), num_blocks=st.integers(0, 6))
def test_free_list_and_ref_counts_stay_consistent(ops, num_blocks):
    """Random allocate (True) / free (False) against a set of held block numbers."""
    alloc = BlockAllocator(Device.GPU, 1, num_blocks)
    held: list[PhysicalTokenBlock] = []
    for op in ops:
        if op:
            if len(held) == num_blocks:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate()
            else:
                held.append(alloc.allocate())
        elif held:
            alloc.free(held.pop(0))
        free_numbers = {b.block_number for b in alloc.free_blocks}
        held_numbers = {b.block_number for b in held}
        assert len(held_numbers) == len(held)
        assert free_numbers.isdisjoint(held_numbers)
        assert len(free_numbers) + len(held_numbers) == num_blocks == len(alloc.free_blocks) + len(held)
        assert all(b.ref_count == 1 for b in held) and all(b.ref_count == 0 for b in alloc.free_blocks)


# -- slot mapping -----------------------------------------------------------------------------


def test_slot_for_by_hand():
    # block_size 4; logical block 0 lives in physical block 2, logical block 1 in physical block 0.
    table = [2, 0]
    assert [slot_for(table, p, 4) for p in range(8)] == [8, 9, 10, 11, 0, 1, 2, 3]
    assert slot_mapping(table, 2, 6, 4) == [10, 11, 0, 1]
    assert slot_mapping(table, 3, 3, 4) == []
    with pytest.raises(IndexError, match="position 8"):
        slot_for(table, 8, 4)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 8), num_physical=st.integers(1, 12))
def test_slot_mapping_matches_a_flat_cache_reference(data, block_size, num_physical):
    """Write each position into a flat cache through a block table laid out by hand; the slot
    mapping must point at exactly the cell that holds that position."""
    table = data.draw(st.permutations(range(num_physical)))
    table = table[:data.draw(st.integers(1, num_physical))]
    length = data.draw(st.integers(0, len(table) * block_size))
    cache = [[None] * block_size for _ in range(num_physical)]
    for pos in range(length):
        cache[table[pos // block_size]][pos % block_size] = pos
    flat = [cell for block in cache for cell in block]
    start = data.draw(st.integers(0, length))
    slots = slot_mapping(table, start, length, block_size)
    assert [flat[s] for s in slots] == list(range(start, length))
    assert len(set(slots)) == len(slots)
