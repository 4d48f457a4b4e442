"""CacheEngine: pool shapes, swap and copy between blocks, and the sizing arithmetic."""

from __future__ import annotations

import pytest
import torch

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4


def make_engine(num_gpu=10, num_cpu=6, dtype=torch.float32, seed=0):
    engine = CacheEngine(CacheConfig(block_size=BLOCK, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu),
                         LAYERS, KV_HEADS, HEAD_DIM, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for k, v in engine.gpu_cache + engine.cpu_cache:
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return engine


def snapshot(cache):
    return [(k.clone(), v.clone()) for k, v in cache]


def test_pool_shapes_and_views():
    engine = CacheEngine(CacheConfig(block_size=16, num_gpu_blocks=7, num_cpu_blocks=3),
                         num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, device="cpu")
    assert len(engine.gpu_cache) == len(engine.cpu_cache) == 2
    for (k, v), blocks in [(engine.gpu_cache[1], 7), (engine.cpu_cache[0], 3)]:
        assert k.shape == v.shape == (blocks, 16, 3, 64)
        assert k.dtype == torch.bfloat16 and k.is_contiguous()
        assert bool((k == 0).all())  # fresh pools hold zeros, never garbage
    # Writing through one layer's view leaves the other layers and the V cache alone.
    engine.gpu_cache[0][0].fill_(1.0)
    assert bool((engine.gpu_cache[1][0] == 0).all()) and bool((engine.gpu_cache[0][1] == 0).all())


def test_missing_block_count_is_an_error():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        CacheEngine(CacheConfig(block_size=16), 2, 2, 8, torch.float32, "cpu")


def test_swap_out_then_in_restores_bit_for_bit():
    engine = make_engine()
    before = snapshot(engine.gpu_cache)
    gpu_blocks = [7, 2, 9, 0]
    engine.swap_out({g: c for g, c in zip(gpu_blocks, [3, 0, 5, 1])})
    for k, v in engine.gpu_cache:  # the device blocks get reused by someone else meanwhile
        k[gpu_blocks] = float("nan")
        v[gpu_blocks] = -1.0
    # Swapped back in to different device blocks, as after a real preemption.
    new_blocks = [1, 4, 8, 6]
    engine.swap_in({c: g for c, g in zip([3, 0, 5, 1], new_blocks)})
    for (k, v), (k0, v0) in zip(engine.gpu_cache, before):
        assert torch.equal(k[new_blocks], k0[gpu_blocks])
        assert torch.equal(v[new_blocks], v0[gpu_blocks])


def test_swap_touches_only_mapped_blocks():
    engine = make_engine(seed=1)
    gpu_before, cpu_before = snapshot(engine.gpu_cache), snapshot(engine.cpu_cache)
    engine.swap_out({5: 2})
    engine.swap_in({4: 3})
    for layer in range(LAYERS):
        for which in range(2):
            gpu, cpu = engine.gpu_cache[layer][which], engine.cpu_cache[layer][which]
            gpu0, cpu0 = gpu_before[layer][which], cpu_before[layer][which]
            assert torch.equal(cpu[2], gpu0[5]) and torch.equal(gpu[3], cpu0[4])
            for b in range(engine.num_cpu_blocks):
                if b != 2:
                    assert torch.equal(cpu[b], cpu0[b])
            for b in range(engine.num_gpu_blocks):
                if b != 3:
                    assert torch.equal(gpu[b], gpu0[b])


def test_copy_duplicates_blocks_for_copy_on_write():
    engine = make_engine(seed=2)
    before = snapshot(engine.gpu_cache)
    engine.copy({1: [4, 6], 3: [0]})
    for (k, v), (k0, v0) in zip(engine.gpu_cache, before):
        for src, dst in [(1, 4), (1, 6), (3, 0)]:
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        for b in [1, 2, 3, 5, 7, 8, 9]:
            assert torch.equal(k[b], k0[b]) and torch.equal(v[b], v0[b])


def test_empty_mappings_are_no_ops():
    engine = make_engine(seed=3)
    before = snapshot(engine.gpu_cache)
    engine.swap_in({})
    engine.swap_out({})
    engine.copy({})
    for (k, v), (k0, v0) in zip(engine.gpu_cache, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_no_swap_space():
    engine = CacheEngine(CacheConfig(block_size=BLOCK, num_gpu_blocks=4, num_cpu_blocks=0),
                         LAYERS, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    assert engine.cpu_cache[0][0].shape[0] == 0


def test_block_size_smollm2():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims. A float32 block of 16 tokens stores
    # 16 tokens x 30 layers x (K + V) x 3 heads x 64 dims x 4 bytes.
    assert CacheEngine.get_cache_block_size(16, 30, 3, 64, torch.float32) == 16 * 30 * 2 * 3 * 64 * 4
    assert CacheEngine.get_cache_block_size(16, 30, 3, 64, torch.float32) == 720 * 1024
    assert CacheEngine.get_cache_block_size(16, 30, 3, 64, torch.bfloat16) == 360 * 1024
    # 1 GiB buys 1456 blocks (1456.35...), i.e. 23296 tokens of context.
    assert CacheEngine.num_blocks_for_budget(2**30, 16, 30, 3, 64, torch.float32) == 1456
    assert CacheEngine.num_cpu_blocks_for_swap(4, 16, 30, 3, 64, torch.float32) == 4 * 1456 + 1
    assert CacheEngine.num_cpu_blocks_for_swap(0.5, 16, 30, 3, 64, torch.bfloat16) == 1456
    assert CacheEngine.num_blocks_for_budget(720 * 1024 - 1, 16, 30, 3, 64, torch.float32) == 0
    assert CacheEngine.num_blocks_for_budget(-5, 16, 30, 3, 64, torch.float32) == 0


def test_allocated_pool_matches_block_size_arithmetic():
    engine = make_engine(num_gpu=10, num_cpu=6)
    per_block = CacheEngine.get_cache_block_size(BLOCK, LAYERS, KV_HEADS, HEAD_DIM, torch.float32)
    gpu_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.gpu_cache)
    assert gpu_bytes == 10 * per_block


def test_too_small_cache_is_a_clear_error():
    CacheEngine.check_capacity(num_gpu_blocks=128, block_size=16, max_model_len=2048)  # exactly fits
    with pytest.raises(ValueError, match="127 blocks hold 2032 tokens but max_model_len is 2048"):
        CacheEngine.check_capacity(num_gpu_blocks=127, block_size=16, max_model_len=2048)


def test_profile_needs_cuda():
    if torch.cuda.is_available():
        n = CacheEngine.profile_num_gpu_blocks(16, 30, 3, 64, torch.float16, gpu_memory_utilization=0.5)
        free, total = torch.cuda.mem_get_info()
        assert 0 <= n <= total // CacheEngine.get_cache_block_size(16, 30, 3, 64, torch.float16)
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            CacheEngine.profile_num_gpu_blocks(16, 30, 3, 64, torch.float32)


def test_the_worker_saves_a_swapped_out_block_before_the_model_writes_into_it():
    # Round 3 of the walkthrough, played by Worker.execute_model on a real CacheEngine whose blocks
    # hold one number each: s2's GPU block 2 goes to CPU block 0, and s1's new token (301) is
    # written into block 2 in the same round. The old contents (102) must reach the CPU first.
    from tinyserve.exercises.ch09 import worker_order_reference

    gpu, cpu = worker_order_reference([100, 101, 102, 103], [200, 201], {2: 0}, {}, {}, {3: 300, 2: 301})
    assert cpu == [102, 201] and gpu == [100, 101, 301, 300]
