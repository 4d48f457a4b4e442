"""A first Triton kernel, before the decode kernel: adding two matrices tile by tile.

It has the three things every kernel of chapter 8 is made of:

- **programs**: ``add_kernel`` is written for one program, which asks ``tl.program_id`` which
  tile of the output is its own; the launch ``add_kernel[grid](...)`` runs one per tile;
- **strides**: a program computes addresses as ``row * stride_row + col * stride_col`` from the
  tensors' strides, so a transposed or sliced view works as well as a contiguous tensor (the
  paged cache is read the same way, block by block);
- **masks**: tiles have power-of-two sides fixed at compile time, and the tiles on the right and
  bottom edges hang over the matrix; their loads and stores are masked, so they touch nothing
  outside it.
"""

from __future__ import annotations

import torch

from tinyserve.attention.triton_env import tl, triton


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_rows, n_cols,
               stride_xr, stride_xc, stride_yr, stride_yc, stride_or, stride_oc,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: the ``BLOCK_R x BLOCK_C`` tile ``(program_id(0), program_id(1))`` of
    ``out = x + y``, all three ``[n_rows, n_cols]`` with any strides."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]  # the tile's part inside the matrix
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    y = tl.load(y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yc, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: tuple[int, int] = (16, 16)) -> torch.Tensor:
    """``x + y`` for two ``[n_rows, n_cols]`` tensors of any strides, one program per tile of
    ``block`` (powers of two)."""
    n_rows, n_cols = x.shape
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n_rows, block[0]), triton.cdiv(n_cols, block[1]))
    add_kernel[grid](x, y, out, n_rows, n_cols, *x.stride(), *y.stride(), *out.stride(),
                     BLOCK_R=block[0], BLOCK_C=block[1])
    return out
