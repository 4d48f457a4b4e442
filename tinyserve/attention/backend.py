"""Attention backends: what one is, the built-in ones by name, and how an engine gets one.

A backend does two jobs in every attention layer of the model:

- ``store_kv(key, value, k_cache, v_cache, slot_mapping)`` writes this step's keys and values,
  ``[num_tokens, num_kv_heads, head_dim]``, into the layer's paged cache, token ``t`` to flat
  slot ``slot_mapping[t]`` (``block * block_size + offset``; a negative slot is a padding token
  stored nowhere). It works in place and returns nothing.
- ``forward(q, k_cache, v_cache, meta, scale)`` attends a packed batch of queries
  ``q [num_tokens, num_heads, head_dim]`` to their contexts, read back from the cache through
  ``meta``'s block tables (an ``AttentionMetadata``: sequence ``i`` owns query rows
  ``query_start_loc[i]:query_start_loc[i+1]``, the last ``query_lens[i]`` positions of a causal
  context of ``context_lens_list[i]`` tokens, all already stored). It returns
  ``[num_tokens, num_heads, head_dim]`` in q's dtype.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, and ``num_heads`` is a
multiple of ``num_kv_heads`` (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
An optional ``name`` attribute labels the backend in logs (``Worker.backend_name``).

That is the whole protocol, so ``attention_backend=`` (of ``LLM``, ``LLMEngine``, ``Worker``,
``LlamaForCausalLM`` and the loader) takes a backend *object* as well as a name: any object with
those two methods runs inside the real engine, e.g. a reader's own paged attention. The names:

- ``"torch"``: ``reference.py``, the short PyTorch version to read, one sequence at a time.
- ``"torch-batched"``: ``batched.py``, the same math tuned for the CPU (padded sub-batches,
  one gather per sub-batch, a plan shared by every layer).
- ``"triton"``: ``triton_backend.py``, the Triton kernels (interpreted on a machine without
  CUDA), with explicit, recorded fallbacks for the batches they do not cover.
- ``"auto"``: triton on CUDA, torch-batched on the CPU.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from tinyserve.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "torch-batched", "triton")


@runtime_checkable
class AttentionBackend(Protocol):
    """What the model calls in each attention layer (see the module docstring)."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


BackendSpec = str | AttentionBackend  # a name from BACKEND_NAMES, or an object


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The built-in backend a name means on ``device``. ``"auto"`` picks triton on CUDA
    (compiled kernels) and torch-batched on the CPU (the interpreter is far too slow to serve with)."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch-batched"
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES} or an object with store_kv and "
                         f"forward methods, got {name!r}")
    return name


def check_backend(spec: BackendSpec) -> BackendSpec:
    """``spec`` itself if it names a backend or implements the protocol; ValueError otherwise."""
    if isinstance(spec, str):
        resolve_backend_name(spec, "cpu")
        return spec
    missing = [m for m in ("store_kv", "forward") if not callable(getattr(spec, m, None))]
    if missing:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES} or an object with store_kv and "
                         f"forward methods; {type(spec).__name__} lacks {', '.join(missing)}")
    return spec


def backend_label(backend: AttentionBackend) -> str:
    """A backend's ``name``, or its class name when it has none."""
    return getattr(backend, "name", None) or type(backend).__name__


def get_backend(spec: BackendSpec, device: torch.device | str = "cpu") -> AttentionBackend:
    """A backend object for ``spec``: an object is used as it is, a name builds a fresh built-in."""
    if not isinstance(check_backend(spec), str):
        return spec
    name = resolve_backend_name(spec, device)
    if name == "triton":
        # Imported only when asked for: defining the kernels decides on TRITON_INTERPRET.
        from tinyserve.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch-batched":
        from tinyserve.attention.batched import BatchedTorchBackend

        return BatchedTorchBackend()
    from tinyserve.attention.reference import TorchBackend

    return TorchBackend()
