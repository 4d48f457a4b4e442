"""The configs: their defaults, their derived values, and a clear error for every bad field."""

from __future__ import annotations

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, resolve_device, resolve_dtype


def test_cache_config_defaults_follow_the_design():
    c = CacheConfig()
    assert (c.block_size, c.num_gpu_blocks, c.num_cpu_blocks, c.watermark) == (16, None, None, 0.01)
    assert c.enable_prefix_caching is False


def test_cache_config_accepts_zero_cpu_blocks():
    # No swap space is a legal setup (recompute-only); no GPU blocks is not.
    assert CacheConfig(num_gpu_blocks=1, num_cpu_blocks=0).num_cpu_blocks == 0


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 0), ("block_size", -4), ("block_size", 2.0), ("block_size", True),
    ("num_gpu_blocks", 0), ("num_gpu_blocks", -1), ("num_gpu_blocks", 3.5),
    ("num_cpu_blocks", -1), ("num_cpu_blocks", 1.5),
    ("watermark", -0.01), ("watermark", 1.0), ("watermark", 2),
])
def test_cache_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_scheduler_config_defaults_and_derived_token_budget():
    s = SchedulerConfig()
    assert (s.max_num_seqs, s.max_model_len, s.policy, s.preemption_mode) == (256, 2048, "vllm", None)
    # A round must hold at least one full-length prompt.
    assert s.max_num_batched_tokens == 2048
    assert SchedulerConfig(max_model_len=4096).max_num_batched_tokens == 4096
    assert SchedulerConfig(max_model_len=100).max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=8).max_num_batched_tokens == 300


@pytest.mark.parametrize("policy", ["vllm", "orca"])
@pytest.mark.parametrize("mode", ["swap", "recompute", None])
def test_scheduler_config_accepts_every_policy_and_preemption_mode(policy, mode):
    s = SchedulerConfig(policy=policy, preemption_mode=mode)
    assert (s.policy, s.preemption_mode) == (policy, mode)


@pytest.mark.parametrize("mode", ["recompute", None])
def test_v1_preempts_by_recompute_and_chunks_by_default(mode):
    s = SchedulerConfig(policy="v1", preemption_mode=mode)
    assert (s.preemption_mode, s.enable_chunked_prefill) == ("recompute", True)
    assert SchedulerConfig(policy="v1", enable_chunked_prefill=False).enable_chunked_prefill is False
    assert SchedulerConfig(policy="vllm").enable_chunked_prefill is False


def test_v1_refuses_swap_and_a_negative_threshold():
    with pytest.raises(ValueError, match="recompute only"):
        SchedulerConfig(policy="v1", preemption_mode="swap")
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(policy="v1", long_prefill_token_threshold=-1)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": -3}, "max_num_seqs"),
    ({"max_num_seqs": 2.0}, "max_num_seqs"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
    ({"policy": "fifo"}, "policy"),
    ({"policy": None}, "policy"),
    ({"preemption_mode": "evict"}, "preemption_mode"),
    # A decode round of max_num_seqs sequences must fit the token budget.
    ({"max_num_batched_tokens": 8, "max_num_seqs": 9}, "max_num_batched_tokens"),
])
def test_scheduler_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_prompt_limit_is_the_token_budget_unless_prompts_can_be_chunked():
    assert SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4, max_model_len=64).prompt_limit == 10
    assert SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=64).prompt_limit == 64
    chunked = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4, max_model_len=64, enable_chunked_prefill=True)
    assert chunked.prompt_limit == 64


def test_model_config():
    m = ModelConfig()
    assert (m.model, m.device, m.dtype, m.seed, m.max_model_len) == ("smollm2-135m", "auto", "auto", 0, None)
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert ModelConfig(device=device).device == device
    assert ModelConfig(max_model_len=64).max_model_len == 64


@pytest.mark.parametrize(("dtype", "name"), [
    (None, "auto"), ("auto", "auto"), ("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
    ("float", "float32"), ("float32", "float32"),
    (torch.float16, "float16"), (torch.half, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
    (torch.float, "float32"),
])
def test_model_config_takes_torch_dtypes_and_vllm_dtype_strings(dtype, name):
    assert ModelConfig(dtype=dtype).dtype == name
    # Resolved once, by one rule: a name to its torch dtype, "auto" to float32 on the CPU.
    expected = torch.float32 if name == "auto" else getattr(torch, name)
    assert resolve_dtype(ModelConfig(dtype=dtype).dtype, "cpu") is expected


@pytest.mark.parametrize(("field", "value"), [("device", "tpu"), ("device", "gpu"), ("dtype", "int8"),
                                              ("dtype", "fp16"), ("dtype", torch.float64), ("dtype", torch.int8),
                                              ("dtype", 16), ("max_model_len", 0), ("max_model_len", -1),
                                              ("max_model_len", 1.5), ("seed", "0")])
def test_model_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_device_resolution_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="cuda"):
        resolve_device("cuda")


def test_parallel_config():
    assert ParallelConfig().tensor_parallel_size == 1
    assert ParallelConfig(tensor_parallel_size=2).tensor_parallel_size == 2
    for bad in (0, -1, 1.0):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ParallelConfig(tensor_parallel_size=bad)


def test_chunked_prefill_defaults_to_a_small_round_budget():
    assert SchedulerConfig(max_model_len=8192, enable_chunked_prefill=True).max_num_batched_tokens == 512
    assert SchedulerConfig(max_num_seqs=600, enable_chunked_prefill=True).max_num_batched_tokens == 600
