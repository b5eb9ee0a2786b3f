"""LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * weight + bias.

Statistics and arithmetic in fp32, output in x's dtype (as torch's LayerNorm on CUDA).
weight and bias are each optional; their gradients are reduced in fp32 without atomics.
"""

from __future__ import annotations

import math
from typing import Optional

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
def layer_norm_forward_kernel(
    X, stride_x, Y, stride_y, W, B, MEAN, RSTD,
    n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars (Triton's own launch: fp32); fp64 would
    # promote the whole block's math to fp64 (see rms_norm_forward_kernel).
    eps = tl.cast(eps, tl.float32)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    # Two-pass variance (centre first): no cancellation when |mean| >> std.
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_backward_kernel(
    DY, stride_dy, X, stride_x, W, MEAN, RSTD, DX, stride_dx, DW_PARTIAL, DB_PARTIAL,
    n_rows, n_cols,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Persistent grid as in the RMSNorm backward: per-program fp32 partial sums of dW, dB."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        mean_g = tl.sum(g, axis=1) / n_cols
        mean_gx = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - mean_g[:, None] - x_hat * mean_gx[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += tl.sum(dy * x_hat, axis=0)
        if COMPUTE_DB:
            db += tl.sum(dy, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=col_mask)


def check_layer_norm_args(x, weight, bias):
    """x [..., N], weight and bias [N] or None, on one device; returns (weight, bias) as the
    kernels read them (unit stride: a copy of an expanded one)."""
    check_tensor("x", x, min_ndim=1)
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_tensor(name, p, ndim=1)
            if p.shape[0] != n:
                raise ValueError(f"{name} has shape {tuple(p.shape)} but x's last dim is {n}")
    check_same_device(x=x, weight=weight, bias=bias)
    return contiguous_or_none(weight), contiguous_or_none(bias)


def layer_norm_forward(x, weight, bias, eps):
    """x [..., N] -> (y [..., N] contiguous in x's dtype, mean, rstd fp32 [rows])."""
    weight, bias = check_layer_norm_args(x, weight, bias)
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, _ = row_block_config(n_cols)
    y = new_output((n_rows, n_cols), x.dtype, x.device)
    mean = new_output((n_rows,), torch.float32, x.device)
    rstd = new_output((n_rows,), torch.float32, x.device)
    if n_rows and n_cols:
        launch(layer_norm_forward_kernel, (cdiv(n_rows, block_m),),
            x2, x2.stride(0), y, y.stride(0),
            weight if weight is not None else x2, bias if bias is not None else x2, mean, rstd,
            n_rows, n_cols, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y.view(x.shape), mean, rstd


def layer_norm_backward(dy, x, weight, bias, mean, rstd, compute_dw, compute_db):
    """(dx like x, dw, db) of layer_norm_forward; dw / db None when not computed."""
    x2, dy2 = as_rows(x), as_rows(dy)
    weight = contiguous_or_none(weight)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, per_sm = row_block_config(n_cols, backward=True)
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    dx = new_output((n_rows, n_cols), x2.dtype, x2.device)
    n_programs = persistent_programs(x2.device, cdiv(n_rows, block_m), per_sm)
    dw_partial = new_output((n_programs, n_cols), torch.float32, x2.device) if compute_dw else None
    db_partial = new_output((n_programs, n_cols), torch.float32, x2.device) if compute_db else None
    if n_rows and n_cols:
        launch(layer_norm_backward_kernel, (n_programs,),
            dy2, dy2.stride(0), x2, x2.stride(0), weight if weight is not None else x2,
            mean, rstd, dx, dx.stride(0),
            dw_partial if compute_dw else mean, db_partial if compute_db else mean,
            n_rows, n_cols,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    dw = db = None
    if compute_dw:
        dw = dw_partial.sum(0).to(weight.dtype) if n_rows else x2.new_zeros(n_cols, dtype=weight.dtype)
    if compute_db:
        db = db_partial.sum(0).to(bias.dtype) if n_rows else x2.new_zeros(n_cols, dtype=bias.dtype)
    return dx.view(x.shape), dw, db


# ---- custom ops: torch.ops.tigon.layer_norm and its backward (see tigon.ops.rms_norm) ----


@kernel_op("tigon::layer_norm", mutates_args=())
def layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(y [..., N], mean fp32 [rows], rstd fp32 [rows]) of x [..., N]."""
    return layer_norm_forward(x, weight, bias, eps)


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    check_layer_norm_args(x, weight, bias)
    n_rows = math.prod(x.shape[:-1])
    return (x.new_empty(x.shape), x.new_empty(n_rows, dtype=torch.float32),
            x.new_empty(n_rows, dtype=torch.float32))


@kernel_op("tigon::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                           rstd: Tensor, compute_dw: bool, compute_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dw like weight, db like bias), each of the last two empty when not computed
    (bias is read for its dtype only)."""
    dx, dw, db = layer_norm_backward(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)
    return dx, or_empty(dw, x), or_empty(db, x)


@layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd, compute_dw, compute_db):
    return (x.new_empty(x.shape), fake_grad(weight, compute_dw, x), fake_grad(bias, compute_db, x))


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.params = (weight, bias)  # parameters: kept, not saved (see the note in tigon.ops._common)
    ctx.needs_param_grads = (weight is not None and ctx.needs_input_grad[1],
                             bias is not None and ctx.needs_input_grad[2])


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None
    x, mean, rstd = ctx.saved_tensors
    weight, bias = ctx.params
    compute_dw, compute_db = ctx.needs_param_grads
    dx, dw, db = layer_norm_backward_op(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)
    return dx, dw if compute_dw else None, db if compute_db else None, None


layer_norm_op.register_autograd(_backward, setup_context=_setup_context)
