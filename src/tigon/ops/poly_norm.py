"""PolyNorm (Zhuo et al., PolyCom): y = w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b over the
last dim, norm(u) = u / sqrt(mean(u^2) + eps).

x [..., N]; weight [3] (w0 for the cube); bias one element. fp32 arithmetic, output in x's
dtype. The per-row 1 / sqrt(mean(u^2) + eps) of x^3, x^2, x are kept (fp32 [rows, 3]) for the
backward; the weight and bias gradients are per-program fp32 partial sums, summed on the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    as_rows,
    cdiv,
    check_same_device,
    check_tensor,
    contiguous_or_none,
    fake_grad,
    kernel_op,
    new_output,
    or_empty,
    persistent_programs,
    row_block_config,
)
from tigon.ops._internals import launch


@triton.jit
def poly_norm_forward_kernel(
    X, stride_x, Y, stride_y, W, B, RSTD, n_rows, n_cols, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_M rows a program; RSTD [rows, 3] gets the rstd of x^3, x^2, x."""
    eps = tl.cast(eps, tl.float32)  # fp64 under Inductor: see rms_norm_forward_kernel
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = x * x
    x3 = x2 * x
    r1 = tl.rsqrt(tl.sum(x2, axis=1) / n_cols + eps)
    r2 = tl.rsqrt(tl.sum(x2 * x2, axis=1) / n_cols + eps)
    r3 = tl.rsqrt(tl.sum(x3 * x3, axis=1) / n_cols + eps)
    tl.store(RSTD + rows * 3, r3, mask=row_mask)
    tl.store(RSTD + rows * 3 + 1, r2, mask=row_mask)
    tl.store(RSTD + rows * 3 + 2, r1, mask=row_mask)
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    b = tl.load(B).to(tl.float32)
    y = x3 * (w0 * r3)[:, None] + x2 * (w1 * r2)[:, None] + x * (w2 * r1)[:, None] + b
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def poly_norm_backward_kernel(
    DY, stride_dy, X, stride_x, W, RSTD, DX, stride_dx, DW_PARTIAL, n_rows, n_cols,
    COMPUTE_DW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Persistent grid. With n_p = x^p r_p and m_p = mean(dy n_p) over the row:
    dx = sum_p w_p p x^(p-1) r_p (dy - n_p m_p); dw_p = sum dy n_p; db = sum dy. Each program
    writes its fp32 partial (dw0, dw1, dw2, db) to DW_PARTIAL[pid]."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    dw0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    dw1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    db = tl.zeros([BLOCK_M], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r3 = tl.load(RSTD + rows * 3, mask=row_mask, other=0.0)
        r2 = tl.load(RSTD + rows * 3 + 1, mask=row_mask, other=0.0)
        r1 = tl.load(RSTD + rows * 3 + 2, mask=row_mask, other=0.0)
        x2 = x * x
        # Row sums of dy x^p: m_p = r_p s_p / N.
        s3 = tl.sum(dy * x2 * x, axis=1)
        s2 = tl.sum(dy * x2, axis=1)
        s1 = tl.sum(dy * x, axis=1)
        c3 = r3 * r3 * r3 * s3 / n_cols
        c2 = r2 * r2 * r2 * s2 / n_cols
        c1 = r1 * r1 * r1 * s1 / n_cols
        # Term p: w_p p x^(p-1) (r_p dy - r_p^3 s_p x^p / N), grouped by the power of x.
        dx = (3.0 * w0) * x2 * (r3[:, None] * dy - c3[:, None] * x2 * x) \
            + (2.0 * w1) * x * (r2[:, None] * dy - c2[:, None] * x2) \
            + w2 * (r1[:, None] * dy - c1[:, None] * x)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw0 += r3 * s3
            dw1 += r2 * s2
            dw2 += r1 * s1
            db += tl.sum(dy, axis=1)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * 4, tl.sum(dw0, axis=0))
        tl.store(DW_PARTIAL + pid * 4 + 1, tl.sum(dw1, axis=0))
        tl.store(DW_PARTIAL + pid * 4 + 2, tl.sum(dw2, axis=0))
        tl.store(DW_PARTIAL + pid * 4 + 3, tl.sum(db, axis=0))


def check_poly_norm_args(x, weight, bias):
    """x [..., N], weight [3], bias one element ([1] or []), on one device; returns (weight,
    bias) as the kernels read them (unit stride)."""
    check_tensor("x", x, min_ndim=1)
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != 3:
        raise ValueError(f"weight must have shape [3] (the weights of x^3, x^2, x), got {tuple(weight.shape)}")
    check_tensor("bias", bias)
    if bias.ndim > 1 or bias.numel() != 1:
        raise ValueError(f"bias must be a one-element tensor (shape [1] or []), got shape {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    return contiguous_or_none(weight), contiguous_or_none(bias)


def poly_norm_forward(x, weight, bias, eps):
    """x [..., N] -> (y [..., N] contiguous in x's dtype, rstd fp32 [rows, 3])."""
    weight, bias = check_poly_norm_args(x, weight, bias)
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, _ = row_block_config(n_cols)
    y = new_output((n_rows, n_cols), x.dtype, x.device)
    rstd = new_output((n_rows, 3), torch.float32, x.device)
    if n_rows and n_cols:
        launch(poly_norm_forward_kernel, (cdiv(n_rows, block_m),),
            x2, x2.stride(0), y, y.stride(0), weight, bias, rstd, n_rows, n_cols, eps,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y.view(x.shape), rstd


def poly_norm_backward(dy, x, weight, bias, rstd, compute_dw):
    """(dx like x, dw like weight, db like bias) of poly_norm_forward; dw, db None when not
    computed."""
    weight = contiguous_or_none(weight)
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, per_sm = row_block_config(n_cols, backward=True)
    dx = new_output((n_rows, n_cols), x.dtype, x.device)
    n_programs = persistent_programs(x.device, cdiv(n_rows, block_m), per_sm)
    partial = new_output((n_programs, 4), torch.float32, x.device) if compute_dw else None
    if n_rows and n_cols:
        launch(poly_norm_backward_kernel, (n_programs,),
            dy2, dy2.stride(0), x2, x2.stride(0), weight, rstd, dx, dx.stride(0),
            partial if partial is not None else rstd, n_rows, n_cols,
            COMPUTE_DW=compute_dw, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    elif partial is not None:
        partial.zero_()
    dw = db = None
    if partial is not None:
        total = partial.sum(0)
        # Copies (copy=True): views of one buffer would alias each other, which custom ops refuse.
        dw = total[:3].to(weight.dtype, copy=True)
        db = total[3].reshape(bias.shape).to(bias.dtype, copy=True)
    return dx.view(x.shape), dw, db


# ---- custom ops: torch.ops.tigon.poly_norm and its backward (see tigon.ops.rms_norm) ----


@kernel_op("tigon::poly_norm", mutates_args=())
def poly_norm_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y [..., N] in x's dtype, rstd fp32 [rows, 3]) of x [..., N]."""
    return poly_norm_forward(x, weight, bias, eps)


@poly_norm_op.register_fake
def _(x, weight, bias, eps):
    check_poly_norm_args(x, weight, bias)
    return x.new_empty(x.shape), x.new_empty((math.prod(x.shape[:-1]), 3), dtype=torch.float32)


@kernel_op("tigon::poly_norm_backward", mutates_args=())
def poly_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, rstd: Tensor, compute_dw: bool
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dw like weight, db like bias); the last two empty unless compute_dw."""
    dx, dw, db = poly_norm_backward(dy, x, weight, bias, rstd, compute_dw)
    return dx, or_empty(dw, x), or_empty(db, x)


@poly_norm_backward_op.register_fake
def _(dy, x, weight, bias, rstd, compute_dw):
    return x.new_empty(x.shape), fake_grad(weight, compute_dw, x), fake_grad(bias, compute_dw, x)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.params = (weight, bias)  # parameters: kept, not saved (see the note in tigon.ops._common)
    # One kernel pass gives both (four partial sums a program): computed when either is needed.
    ctx.needs_param_grads = (ctx.needs_input_grad[1], ctx.needs_input_grad[2])


def _backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None, None
    x, rstd = ctx.saved_tensors
    weight, bias = ctx.params
    needs_dw, needs_db = ctx.needs_param_grads
    dx, dw, db = poly_norm_backward_op(dy, x, weight, bias, rstd, needs_dw or needs_db)
    return dx, dw if needs_dw else None, db if needs_db else None, None


poly_norm_op.register_autograd(_backward, setup_context=_setup_context)
