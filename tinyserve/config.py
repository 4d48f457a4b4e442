"""The engine's settings, grouped the way vLLM v0.4 groups them.

Each config is a plain dataclass taken by keyword and checked on construction, so a bad value
fails where it was written rather than deep inside a scheduling round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

POLICIES = ("vllm", "orca", "v1")
PREEMPTION_MODES = ("swap", "recompute", None)
COMPAT_MODES = ("tinyserve", "vllm-0.4")


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

    ``policy="vllm"`` never mixes prefill and decode in a round; ``"orca"`` does; ``"v1"`` fills
    one token budget as vLLM V1 does (see ``tinyserve.v1_round``), chunking prompts unless
    ``enable_chunked_prefill=False`` (None, the default, means on for v1 and off otherwise, as
    in vLLM) and preempting by recompute. ``long_prefill_token_threshold`` (V1's setting; 0 means
    none) caps one prefill chunk under v1.
    ``preemption_mode=None`` follows vLLM's rule: recompute a group with one sequence, swap a
    group with several (their shared blocks would be expensive to rebuild).
    ``compat="vllm-0.4"`` makes the scheduler and block manager follow vLLM v0.4.0's runtime
    rules instead of tinyserve's (see the ``tinyserve.scheduler`` docstring for the list).
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 2048
    policy: str = "vllm"
    preemption_mode: str | None = None
    enable_chunked_prefill: bool | None = None
    compat: str = "tinyserve"
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_model_len", self.max_model_len)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = self.policy == "v1"
        if self.max_num_batched_tokens is None:
            # Like vLLM: without chunking a round must fit one full-length prompt; with chunking a
            # small budget keeps every round short, so decodes never wait long behind a prompt.
            self.max_num_batched_tokens = (max(512, self.max_num_seqs) if self.enable_chunked_prefill
                                           else max(self.max_model_len, 2048))
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_num_seqs "
                f"({self.max_num_seqs}): a decode round of max_num_seqs sequences would not fit the budget"
            )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer (0: no cap), "
                             f"got {self.long_prefill_token_threshold!r}")
        if self.policy == "v1":
            if self.preemption_mode == "swap":
                raise ValueError("policy='v1' preempts by recompute only, as vLLM V1 does: "
                                 "preemption_mode must be None or 'recompute'")
            self.preemption_mode = "recompute"
        if self.compat not in COMPAT_MODES:
            raise ValueError(f"compat must be one of {COMPAT_MODES}, got {self.compat!r}")
        if self.compat == "vllm-0.4" and (self.policy != "vllm" or self.enable_chunked_prefill):
            raise ValueError(f"compat='vllm-0.4' follows vLLM v0.4.0, which has neither the orca policy nor "
                             f"chunked prefill; got policy={self.policy!r}, "
                             f"enable_chunked_prefill={self.enable_chunked_prefill!r}")

    @property
    def prompt_limit(self) -> int:
        """The longest prompt that can ever run: it must fit the model and, unless it can be
        prefilled in chunks, one round's token budget."""
        if self.enable_chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)


# vLLM's spellings of a dtype, by the name tinyserve keeps ("auto": by device, see resolve_dtype).
DTYPE_NAMES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
               "float": "float32", "float32": "float32"}


def dtype_name(dtype) -> str:
    """The one name of ``dtype`` ("auto", "float32", "float16" or "bfloat16"), given a torch
    dtype, one of vLLM's strings, or None (= "auto")."""
    if dtype is None:
        return "auto"
    # A torch.dtype prints as "torch.float16"; config stays importable without torch.
    key = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    if isinstance(key, str) and key in DTYPE_NAMES:
        return DTYPE_NAMES[key]
    raise ValueError(f"dtype must be a torch dtype (float32, float16, bfloat16) or one of "
                     f"{sorted(DTYPE_NAMES)}, got {dtype!r}")


def resolve_device(device: str):
    """The torch.device for a device setting ("auto": CUDA when torch sees one)."""
    import torch

    device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use device='cpu' or 'auto'")
    return torch.device(device)


# CPU flags that mean bfloat16 matmuls run in hardware (AVX-512 BF16's dot products, AMX's tiles).
# Without them oneDNN converts bf16 to float32 on the fly: on an AVX2-only EPYC a batch-32 decode
# matmul ran about 5x slower in bf16 than in float32 (benchmarks/roofline.py measures both).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Names the dtype "auto" means on a CPU, overriding the flags (the tests set float32, where
# greedy outputs must match transformers token for token, on every machine).
CPU_DTYPE_ENV = "TINYSERVE_CPU_DTYPE"


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags as the kernel reports them (empty where there is no
    /proc/cpuinfo, as on macOS)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (see ``NATIVE_BF16_FLAGS``)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def resolve_dtype(dtype, device):
    """The torch dtype to run in: ``dtype`` itself, or for "auto" bfloat16 on CUDA (float16 where
    the GPU lacks bfloat16) and, on the CPU, bfloat16 where the CPU computes it natively (vLLM's
    CPU backend, added after v0.4.0, runs a bf16 checkpoint in bf16) and float32 where bf16 would
    be emulated, unless ``$TINYSERVE_CPU_DTYPE`` names one."""
    import torch

    name = dtype_name(dtype)
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return _cpu_auto_dtype()
    return getattr(torch, name)


def _cpu_auto_dtype():
    import torch

    override = os.environ.get(CPU_DTYPE_ENV)
    if override:
        name = DTYPE_NAMES.get(override)
        if name in (None, "auto"):
            raise ValueError(f"{CPU_DTYPE_ENV}={override!r}: expected float32, bfloat16 or float16")
        return getattr(torch, name)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@dataclass
class ModelConfig:
    """Which model to run, where, and in what precision.

    ``dtype`` takes a torch dtype or vLLM's strings and is kept by one name (``dtype_name``);
    ``max_model_len=None`` means the model's own limit (``max_position_embeddings``).
    """

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool | None = None  # None: graphs where they pay (worker.uses_graphs)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        self.dtype = dtype_name(self.dtype)
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True, False or None, got {self.enforce_eager!r}")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many worker processes share every layer, and how long the driver
    waits for a rank that has stopped answering (see ``parallel.liveness``).

    ``heartbeat_timeout_s``: a rank that sends no heartbeat for this long (stopped by ``SIGSTOP``
    or a debugger, frozen) fails the call with a ``WorkerError``. Ranks beat while they compute,
    so this does not limit how long a round may take. ``step_timeout_s`` and
    ``step_timeout_factor``: a round (``execute_model``) may take at most
    ``max(step_timeout_s, step_timeout_factor x the slowest round so far)``, which fails a rank
    that beats but is stuck. ``None`` turns a check off (both off, to hold a rank in a debugger:
    a round then waits up to the executor's 600 s hang guard). Start-up (weight loading) has its
    own, longer limit.
    """

    tensor_parallel_size: int = 1
    heartbeat_timeout_s: float | None = 5.0
    step_timeout_s: float | None = 30.0
    step_timeout_factor: float = 10.0

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("heartbeat_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
        factor = self.step_timeout_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor >= 1:
            raise ValueError(f"step_timeout_factor must be a number >= 1, got {factor!r}")
