"""A gradient formed in the forward pass, scaled by grad_output in the backward: per row or by
one scalar, in place when autograd frees the graph after that backward (no copy), into a new
buffer when the graph is retained. Shared by the cross-entropy family, JSD, KL, TVD and the
chunked losses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._common import cdiv, next_pow2, traced
from tigon.ops._internals import graph_retained, interpreter_enabled, launch


@triton.jit
def scale_row_block(X, Y, scale, cols, n_cols):
    mask = cols < n_cols
    x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + cols, (x * scale).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def scale_rows_kernel(X, stride_x, Y, stride_y, SCALE, stride_scale, n_cols, IN_PLACE: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Y[row] = X[row] * SCALE[row * stride_scale] (stride 0: one scalar). In place (Y is X), a
    row whose scale is exactly 1 is left untouched without reading it: the common
    grad_output = 1 costs a launch, not a pass over X."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    if IN_PLACE:
        if scale != 1.0:
            for start in range(0, n_cols, BLOCK):
                scale_row_block(X + row * stride_x, X + row * stride_x, scale, start + offs, n_cols)
    else:
        for start in range(0, n_cols, BLOCK):
            scale_row_block(X + row * stride_x, Y + row * stride_y, scale, start + offs, n_cols)


@triton.jit
def scale_kernel(X, Y, SCALE, n_elements, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """Y = X * SCALE[0] over contiguous X and Y; in place, nothing is read when SCALE is 1."""
    scale = tl.load(SCALE).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if IN_PLACE:
        if scale != 1.0:
            scale_row_block(X, X, scale, offs, n_elements)
    else:
        scale_row_block(X, Y, scale, offs, n_elements)


def scale_rows(x2, scale, out=None):
    """x2 [M, N] (unit last stride) * scale (a one-element tensor, or [M] per row), into ``out``
    (a new [M, N] buffer, or x2 itself: in place). Returns out."""
    out = x2 if out is None else out
    if not x2.numel():
        return out
    in_place = out is x2
    if scale.numel() == 1 and x2.is_contiguous() and out.is_contiguous():
        block = 4096
        launch(scale_kernel, (cdiv(x2.numel(), block),), x2, out, scale.reshape(1), x2.numel(),
               IN_PLACE=in_place, BLOCK=block, num_warps=8)
        return out
    stride = 0 if scale.numel() == 1 else scale.stride(0)
    block = min(4096, next_pow2(x2.shape[1]))
    launch(scale_rows_kernel, (x2.shape[0],), x2, x2.stride(0), out, out.stride(0), scale.reshape(-1), stride,
           x2.shape[1], IN_PLACE=in_place, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


# The dtypes the scale kernels take; anything else (float64, ...) is scaled by torch.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scaled_gradient(grad, scale, retained=None):
    """A gradient formed in the forward pass, times grad_output ``scale`` (one element or one per
    row of a 2-D grad), for a backward; scale's value is never read on the host (that would stall
    it until the device has run the whole forward). Eager: over ``grad`` itself when the graph is
    freed after this backward (no copy; autograd may adopt the buffer as .grad), else into a new
    buffer, so that ``grad`` is still exact for the next backward over the retained graph;
    ``retained``: whether it is (None: ask autograd). A contiguous grad of a kernel dtype on a
    device tigon's kernels run on goes through the scale kernels, which in place leave grad
    unread when the scale is exactly 1 (what loss.backward() gives): a launch, no pass over it.
    Traced (see ``traced``), strided, float64 or elsewhere: torch's multiply, in the wider of
    grad's dtype and fp32, rounded to grad's dtype."""
    factor = scale.reshape(-1, *(1,) * (grad.ndim - 1)) if grad.ndim else scale.reshape(())
    if traced(grad, scale):
        return (grad.to(torch.promote_types(grad.dtype, torch.float32)) * factor).to(grad.dtype)
    in_place = not (graph_retained() if retained is None else retained)
    if (grad.dtype in KERNEL_DTYPES and grad.is_contiguous() and (scale.numel() == 1 or grad.ndim == 2)
            and (grad.is_cuda or (grad.device.type == "cpu" and interpreter_enabled()))):
        return scale_rows(grad, scale, out=grad if in_place else torch.empty_like(grad))
    return grad.mul_(factor) if in_place else (grad * factor).to(grad.dtype)
