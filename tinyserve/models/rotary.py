"""Rotary position embeddings (RoPE), as Llama-family models use them.

In a packed batch, the row a token occupies says nothing about where it stands in its sequence,
so positions are an explicit input. Llama encodes them by rotating queries and keys: channel pair
``(i, i + head_dim/2)`` turns by ``position * inv_freq[i]``. This module reads a model's rope
settings (either transformers generation), computes the rotation speeds (with Llama 3.1's and
linear context scaling), and applies the rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_settings(config) -> tuple[float, dict]:
    """``(rope_theta, scaling)`` from a config of either transformers generation.

    transformers 4 keeps ``config.rope_theta`` and an optional ``config.rope_scaling`` dict;
    transformers 5 folds both into ``config.rope_parameters``. The scaling type is under
    ``rope_type`` (or the older ``type``).
    """
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    params.setdefault("rope_type", params.get("type", "default"))
    return float(theta), params


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Rotation speed of each of the ``head_dim / 2`` channel pairs, after any context scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":  # position interpolation: positions are squeezed by ``factor``
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: slow (long-wavelength) pairs are interpolated by ``factor``, fast pairs are
        # kept, and the band in between blends the two smoothly.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        blend = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return blend * inv_freq + (1 - blend) * inv_freq / factor
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear and llama3 are)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up by position id."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> None:
        super().__init__()
        freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(head_dim, theta, scaling)[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + head_dim/2)`` of ``x [T, heads, head_dim]`` (HF's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
