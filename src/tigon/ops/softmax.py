"""Softmax over the last dim: y = exp(x - max) / sum(exp(x - max)); dx = y * (dy - sum(dy * y)).

fp32 arithmetic, output in x's dtype. Rows up to ``FUSED_MAX_COLS`` wide are held in registers
(forward: one read of x, one write of y; several rows a program for short rows; persistent
backward); wider rows (vocabularies) take the looped kernels: an online max / sum pass, then a
pass writing y (the backward: sum(dy * y), then dx), the second pass mostly hitting L2. Softmax
over another dim is this op on a moved view (``tigon.functional.softmax``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    as_rows,
    cdiv,
    check_same_device,
    check_tensor,
    kernel_op,
    new_output,
    next_pow2,
    persistent_programs,
    row_block_config,
)
from tigon.ops._internals import launch
from tigon.ops._jit_math import online_lse_update, safe_max

# Widest row held in registers (one program of 32 warps a row at 32768, as Liger's single-block
# kernel); wider rows are looped in WIDE_BLOCK chunks. Not yet tuned on the GPU.
FUSED_MAX_COLS = 32768
WIDE_BLOCK = 8192


@triton.jit
def softmax_forward_kernel(X, stride_x, Y, stride_y, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M whole rows a program, in registers."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    m = safe_max(m)  # a row of only -inf: 0 / 0 = NaN, as torch
    e = tl.exp(x - m[:, None])
    s = tl.where(row_mask, tl.sum(e, axis=1), 1.0)  # rows past n_rows: no 0 / 0
    y = e / s[:, None]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def row_backward_loop(DY, stride_dy, Y, stride_y, DX, stride_dx, n_rows, n_cols, ROW_GRAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The persistent backward of a row op y = f(x) whose dx needs only y and dy (softmax,
    sparsemax): each program walks row blocks pid, pid + G, ..., whole rows in registers, and
    writes dx = ROW_GRAD(dy, y) (a @triton.jit function of [BLOCK_M, BLOCK_N] fp32 blocks,
    inlined; padding reads y = dy = 0)."""
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    for block in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = ROW_GRAD(dy, y)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def softmax_row_grad(dy, y):
    dot = tl.sum(y * dy, axis=1)
    return y * (dy - dot[:, None])


@triton.jit
def softmax_backward_kernel(DY, stride_dy, Y, stride_y, DX, stride_dx, n_rows, n_cols,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Persistent grid over row blocks (``row_backward_loop``): dx = y * (dy - sum(dy * y))."""
    row_backward_loop(DY, stride_dy, Y, stride_y, DX, stride_dx, n_rows, n_cols, softmax_row_grad, BLOCK_M, BLOCK_N)


@triton.jit
def softmax_forward_wide_kernel(X, stride_x, Y, stride_y, n_cols, BLOCK: tl.constexpr):
    """One row a program, in BLOCK chunks: online max and sum, then y (chunks in reverse order,
    the ones read last first, most likely still in L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"), eviction_policy="evict_last")
        x = x.to(tl.float32)
        m, s = online_lse_update(m, s, x, tl.max(x, axis=0))  # leading -inf chunks: no NaN
    inv_s = 1.0 / s
    n_blocks = tl.cdiv(n_cols, BLOCK)
    for i in range(n_blocks):
        cols = (n_blocks - 1 - i) * BLOCK + offs
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf"), eviction_policy="evict_first").to(tl.float32)
        tl.store(y_row + cols, (tl.exp(x - m) * inv_s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def softmax_backward_wide_kernel(DY, stride_dy, Y, stride_y, DX, stride_dx, n_cols, BLOCK: tl.constexpr):
    """One row a program, in BLOCK chunks: sum(dy * y), then dx (chunks in reverse order)."""
    row = tl.program_id(0).to(tl.int64)
    y_row = Y + row * stride_y
    dy_row = DY + row * stride_dy
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    for i in range(n_blocks):
        cols = (n_blocks - 1 - i) * BLOCK + offs
        mask = cols < n_cols
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(DX + row * stride_dx + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=mask)


def _wide_launch(n_cols):
    block = min(WIDE_BLOCK, next_pow2(n_cols))
    return block, max(4, min(16, block // 1024))


def softmax_forward(x2):
    """x2 [M, N] (unit last stride) -> y [M, N] contiguous, x2's dtype."""
    n_rows, n_cols = x2.shape
    y = new_output((n_rows, n_cols), x2.dtype, x2.device)
    if n_rows and n_cols:
        if n_cols <= FUSED_MAX_COLS:
            block_m, block_n, num_warps, _ = row_block_config(n_cols)
            launch(softmax_forward_kernel, (cdiv(n_rows, block_m),), x2, x2.stride(0), y, y.stride(0), n_rows, n_cols,
                   BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
        else:
            block, num_warps = _wide_launch(n_cols)
            launch(softmax_forward_wide_kernel, (n_rows,), x2, x2.stride(0), y, y.stride(0), n_cols,
                   BLOCK=block, num_warps=num_warps)
    return y


def softmax_backward(dy2, y2):
    """dy2, y2 [M, N] (unit last stride) -> dx [M, N] contiguous, y2's dtype."""
    n_rows, n_cols = y2.shape
    dx = new_output((n_rows, n_cols), y2.dtype, y2.device)
    if n_rows and n_cols:
        if n_cols <= FUSED_MAX_COLS:
            block_m, block_n, num_warps, per_sm = row_block_config(n_cols, backward=True)
            programs = persistent_programs(y2.device, cdiv(n_rows, block_m), per_sm)
            launch(softmax_backward_kernel, (programs,), dy2, dy2.stride(0), y2, y2.stride(0), dx, dx.stride(0),
                   n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
        else:
            block, num_warps = _wide_launch(n_cols)
            launch(softmax_backward_wide_kernel, (n_rows,), dy2, dy2.stride(0), y2, y2.stride(0), dx, dx.stride(0),
                   n_cols, BLOCK=block, num_warps=num_warps)
    return dx


def check_row_op_backward_args(dy, y):
    """dy and y [..., N] of one shape, floating, on one device (the backward ops of softmax and
    sparsemax)."""
    check_tensor("dy", dy, min_ndim=1)
    check_tensor("y", y, min_ndim=1)
    if dy.shape != y.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but y has shape {tuple(y.shape)}")
    check_same_device(dy=dy, y=y)


# ---- custom ops: torch.ops.tigon.softmax and its backward ----


@kernel_op("tigon::softmax", mutates_args=())
def softmax_op(x: Tensor) -> Tensor:
    """softmax of x [..., N] over the last dim: [..., N] contiguous, x's dtype."""
    check_tensor("x", x, min_ndim=1)
    return softmax_forward(as_rows(x)).view(x.shape)


@softmax_op.register_fake
def _(x):
    check_tensor("x", x, min_ndim=1)
    return x.new_empty(x.shape)


@kernel_op("tigon::softmax_backward", mutates_args=())
def softmax_backward_op(dy: Tensor, y: Tensor) -> Tensor:
    """dx [..., N] (contiguous, y's dtype) of y = softmax(x) for the incoming gradient dy."""
    check_row_op_backward_args(dy, y)
    return softmax_backward(as_rows(dy), as_rows(y)).view(y.shape)


@softmax_backward_op.register_fake
def _(dy, y):
    check_row_op_backward_args(dy, y)
    return y.new_empty(y.shape)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)


def register_output_autograd(op, backward_op) -> None:
    """Autograd of a row op y = op(x) whose dx = backward_op(dy, y) needs only its output
    (softmax, sparsemax)."""

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return backward_op(dy, y)

    op.register_autograd(backward, setup_context=_save_output)


register_output_autograd(softmax_op, softmax_backward_op)


def check_dim(dim, x) -> int:
    """``dim`` an int naming a dim of x (negative counts from the end); returns it in [0, ndim)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if isinstance(x, torch.Tensor) and x.ndim and not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.ndim if isinstance(x, torch.Tensor) and x.ndim else dim


def over_dim(op, x, dim):
    """op (a last-dim row op) applied over ``dim`` of x: on a view with dim moved last, the
    result moved back (a view; the op copies the moved input into rows)."""
    dim = check_dim(dim, x)
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or dim == x.ndim - 1:
        return op(x)
    return op(x.movedim(dim, -1)).movedim(-1, dim)
