"""Choosing an attention backend by name.

A backend does two things per layer: store the new tokens' K/V into the paged cache through the
slot mapping, and compute attention for a packed batch by reading K/V back through the block
tables. ``"torch"`` is the readable reference; ``"triton"`` runs GPU kernels (interpreted on a
machine without CUDA).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tinyserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """``"auto"`` picks triton on CUDA (compiled kernels) and torch on the CPU (the
    interpreter is far too slow to serve with)."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
    return name


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    name = resolve_backend_name(name, device)
    if name == "triton":
        # Imported lazily: it decides on TRITON_INTERPRET before its kernels are defined.
        from tinyserve.attention.triton_paged import TritonBackend

        return TritonBackend()
    from tinyserve.attention.reference import TorchBackend

    return TorchBackend()
