"""The engine's settings, grouped the way vLLM v0.4 groups them.

Each config is a plain dataclass taken by keyword and checked on construction, so a bad value
fails where it was written rather than deep inside a scheduling round.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("vllm", "orca")
PREEMPTION_MODES = ("swap", "recompute", None)


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class CacheConfig:
    """How the KV cache is cut into blocks and how many blocks each device holds.

    ``None`` block counts are filled in by the engine from the memory it finds
    (see ``cache_engine.num_blocks_for_budget``). ``watermark`` is the share of GPU blocks
    kept free at admission so running sequences can still grow without immediate preemption.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    watermark: float = 0.01
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("num_gpu_blocks", self.num_gpu_blocks, allow_none=True)
        if self.num_cpu_blocks is not None and (
            not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0
        ):
            raise ValueError(f"num_cpu_blocks must be a non-negative integer, got {self.num_cpu_blocks!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")


@dataclass
class SchedulerConfig:
    """Budgets of one scheduling round and the policy that fills it.

    ``policy="vllm"`` never mixes prefill and decode in a round; ``"orca"`` does.
    ``preemption_mode=None`` follows vLLM's rule: recompute a group with one sequence, swap a
    group with several (their shared blocks would be expensive to rebuild).
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 2048
    policy: str = "vllm"
    preemption_mode: str | None = None
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is None:
            # Like vLLM: without chunking a round must fit one full-length prompt; with chunking a
            # small budget keeps every round short, so decodes never wait long behind a prompt.
            self.max_num_batched_tokens = (max(512, self.max_num_seqs) if self.enable_chunked_prefill
                                           else max(self.max_model_len, 2048))
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_num_seqs "
                f"({self.max_num_seqs}): a decode round of max_num_seqs sequences would not fit the budget"
            )

    @property
    def prompt_limit(self) -> int:
        """The longest prompt that can ever run: it must fit the model and, unless it can be
        prefilled in chunks, one round's token budget."""
        if self.enable_chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)


@dataclass
class ModelConfig:
    """Which model to run, where, and in what precision."""

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA (float16 if no bf16)
    seed: int = 0
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many worker processes share every layer."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
