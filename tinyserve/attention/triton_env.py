"""Compiled or interpreted: what every Triton kernel module imports before it defines a kernel.

On a machine with CUDA, ``@triton.jit`` kernels compile. Without CUDA they run through Triton's
interpreter, which executes each program in Python over NumPy: slow, but the very code that
compiles on a GPU, so the tests on a CPU check the kernels against the PyTorch reference.

Triton makes that choice when ``@triton.jit`` runs, by reading ``TRITON_INTERPRET`` at that
moment. So this module sets the variable (only when there is no CUDA, and never over an explicit
choice such as ``TRITON_INTERPRET=1`` on a GPU machine to step through a kernel) before any kernel
module defines its kernels; they all import it first.

One thing the variable cannot reach: triton's standard library (``tl.max``, ``tl.sum``,
``tl.zeros``, ...) is itself made of ``@triton.jit`` functions, decorated when triton is first
imported. When that happened before the variable was set (``import transformers`` imports triton
through ``torch._dynamo``), they stay compiled-mode functions, which an interpreted kernel cannot
call. So the kernels use only triton's builtins (``tl.full``, ``tl.reduce``, ...), which the
interpreter replaces whatever the import order, and reduce with ``max_along``/``sum_along``
below. The same kernels then give the same results whichever module was imported first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the TRITON_INTERPRET decision above)
import triton.language as tl  # noqa: E402

__all__ = ["is_interpreted", "max_along", "next_pow2", "sum_along", "tl", "triton"]


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` runs through the interpreter: a compiled kernel is a JITFunction, an
    interpreted one wraps the plain Python function instead. This reads what really happened,
    not what was asked for."""
    return not isinstance(kernel, triton.runtime.JITFunction)


# The two combine functions are the ones tl.max/tl.sum use. The interpreter recognises them and
# reduces with NumPy in one call (any other combine function runs element by element in Python).
@triton.jit
def max_along(x, axis: tl.constexpr):
    """``tl.max(x, axis)``, callable from kernels compiled or interpreted alike."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def sum_along(x, axis: tl.constexpr):
    """``tl.sum(x, axis)``, callable from kernels compiled or interpreted alike."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


def next_pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``at_least`` (tiles have power-of-two sides)."""
    return max(at_least, triton.next_power_of_2(n))
