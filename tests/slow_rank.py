"""An attention backend that makes one tensor-parallel rank slow, for the tests of slow and stuck ranks.

Every rank unpickles its own copy of a backend object, importing the module its class lives in,
so the class has a module of its own that imports next to nothing (not a test module). It sleeps
the way a long torch op computes: without the GIL, so the rank's heartbeat goes on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.reference import TorchBackend


class SleepyBackend(TorchBackend):
    """The reference backend, except that on rank ``rank`` the first round of ``n`` tokens sleeps
    ``sleeps[n]`` seconds (once, in its first attention layer; every layer shares the backend)."""

    name = "torch-sleepy"

    def __init__(self, rank: int, sleeps: dict[int, float]) -> None:
        self.rank, self.sleeps = rank, dict(sleeps)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == self.rank:
            time.sleep(self.sleeps.pop(q.shape[0], 0.0))
        return super().forward(q, k_cache, v_cache, meta, scale)
