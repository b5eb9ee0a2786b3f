"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * (weight + offset), over the last dim.

Casting modes (``CASTING_MODES``), matching these torch references:
- ``"llama"``: normalise in fp32, cast to x's dtype, then multiply by the weight
  (output dtype = promote(x.dtype, weight.dtype)), as HF's ``LlamaRMSNorm``.
- ``"gemma"``: everything in fp32, ``offset`` usually 1.0 (Gemma's ``1 + w``), cast to
  x's dtype at the end, as HF's ``GemmaRMSNorm``.
- ``"none"``: no upcast, as Liger's casting mode "none": the eager expression
  ``(weight + offset) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))`` with every
  tensor op in its inputs' dtype. The kernel computes in fp32 and rounds where that expression
  rounds: x^2, the mean (fp32-accumulated, as torch's reductions), + eps, rsqrt, the product with
  x, weight + offset, and the output (dtype as "llama"). No HF model computes its norm this way
  (all upcast); it is for models trained with it. The backward is the gradient of that function
  at the forward's (rounded) rstd.

``weight=None`` (``elementwise_affine=False``): no scaling, output in x's dtype; offset must
be 0. The kernels also serve the fused residual-add variant (``fused_add_rms_norm.py``).

The backward writes dx into a new buffer, never over the incoming gradient dy: dy is autograd's,
not the caller's nor tigon's, and autograd may hand the same tensor to other nodes (a residual
add ``r + norm(x)`` gives one tensor to both summands; ``torch.autograd.grad(y, x, g)`` passes
the caller's ``g``), and nothing public tells whether it did. The entries' ``inplace`` option,
which wrote dx over dy, is deprecated and ignored (``warn_inplace_ignored``).
"""

from __future__ import annotations

import math
import warnings
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

CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}


def check_casting(casting) -> None:
    """``casting`` must name one of ``CASTING_MODES``."""
    if not isinstance(casting, str) or casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {', '.join(map(repr, CASTING_MODES))}, got {casting!r}")


@triton.jit
def rms_norm_weight(W, cols, n_cols, offset, CASTING: tl.constexpr):
    """weight + offset [BLOCK_N] in fp32; rounded to the weight's dtype in casting "none"."""
    # tl.cast(offset, fp32): see rms_norm_forward_kernel.
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    if CASTING == 2:
        w = w.to(W.dtype.element_ty).to(tl.float32)
    return w


@triton.jit
def rms_norm_forward_kernel(
    X, stride_x, R, stride_r, S, stride_s, Y, stride_y, W, RSTD,
    n_rows, n_cols, eps, offset,
    CASTING: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr = True,
):
    """BLOCK_M rows per program. With HAS_RESIDUAL, normalises s = x + r and stores s too.
    RSTD gets the rstd the output was formed with (fp32; in casting "none" a value of x's dtype)."""
    # Inductor passes Python floats as fp64 scalars (Triton's own launch: fp32); fp64 would
    # promote the whole block's math to fp64 (8x slower rms_norm backward on an H200).
    eps = tl.cast(eps, tl.float32)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the input dtype, as HF's `residual + hidden_states`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    if CASTING == 2:
        # Each step rounded to x's dtype, as the eager ops of the reference (see the docstring).
        dt = X.dtype.element_ty
        squares = (xf * xf).to(dt).to(tl.float32)
        mean_sq = (tl.sum(squares, axis=1) / n_cols).to(dt).to(tl.float32)
        rstd = tl.rsqrt((mean_sq + eps).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = xf * rstd[:, None]
    if CASTING != 1:  # "llama", "none": the normalised x is rounded to x's dtype
        y = y.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        y = y * rms_norm_weight(W, cols, n_cols, offset, CASTING)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(
    DY, stride_dy, X, stride_x, W, RSTD, DX, stride_dx, DS, stride_ds, DW_PARTIAL,
    n_rows, n_cols, offset,
    CASTING: tl.constexpr, HAS_DS: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr = True,
):
    """Persistent grid: each program walks row blocks pid, pid + G, ... and keeps its share
    of dW in fp32 registers, written once to DW_PARTIAL[pid] (summed on the host side), so
    the weight gradient needs no atomics. With HAS_DS the incoming gradient of the residual
    stream DS is added to dx."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = rms_norm_weight(W, cols, n_cols, offset, CASTING)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = x.to(tl.float32) * rstd[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        if HAS_DS:
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if CASTING != 1:  # the forward multiplied the weight by the rounded x_hat
                x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
            dw += tl.sum(dy * x_hat, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def rms_norm_forward(x2, weight, eps, offset, casting, residual2=None):
    """x2 [M, N] (unit last stride), weight [N] (contiguous) or None
    -> (y [M, N], rstd fp32 [M], s [M, N] or None)."""
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, _ = row_block_config(n_cols)
    out_dtype = _rms_norm_out_dtype(x2, weight, casting)
    y = new_output((n_rows, n_cols), out_dtype, x2.device)
    rstd = new_output((n_rows,), torch.float32, x2.device)
    s = new_output((n_rows, n_cols), x2.dtype, x2.device) if residual2 is not None else None
    if n_rows and n_cols:
        launch(rms_norm_forward_kernel, (cdiv(n_rows, block_m),),
            x2, x2.stride(0),
            residual2 if residual2 is not None else x2, residual2.stride(0) if residual2 is not None else 0,
            s if s is not None else x2, s.stride(0) if s is not None else 0,
            y, y.stride(0), weight if weight is not None else x2, rstd,
            n_rows, n_cols, eps, offset,
            CASTING=CASTING_MODES[casting], HAS_RESIDUAL=residual2 is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_WEIGHT=weight is not None, num_warps=num_warps,
        )
    return y, rstd, s


def rms_norm_backward(dy2, x2, weight, rstd, offset, casting, compute_dw, ds2=None):
    """Gradients of rms_norm_forward: (dx [M, N] in x's dtype, a new buffer; dw [N] or None).

    x2 is the normalised input (the sum s for the fused-add variant); ds2 [M, N] is the
    gradient arriving on s directly, added to dx.
    """
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, per_sm = row_block_config(n_cols, backward=True)
    dx = new_output((n_rows, n_cols), x2.dtype, x2.device)
    compute_dw = compute_dw and weight is not None
    n_programs = persistent_programs(x2.device, cdiv(n_rows, block_m), per_sm)
    dw_partial = new_output((n_programs, n_cols), torch.float32, x2.device) if compute_dw else None
    if n_rows and n_cols:
        launch(rms_norm_backward_kernel, (n_programs,),
            dy2, dy2.stride(0), x2, x2.stride(0), weight if weight is not None else x2, rstd, dx, dx.stride(0),
            ds2 if ds2 is not None else dy2, ds2.stride(0) if ds2 is not None else 0,
            dw_partial if compute_dw else rstd,
            n_rows, n_cols, offset,
            CASTING=CASTING_MODES[casting], HAS_DS=ds2 is not None, COMPUTE_DW=compute_dw,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_WEIGHT=weight is not None, num_warps=num_warps,
        )
    dw = None
    if compute_dw:
        dw = dw_partial.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
    return dx, dw


def check_norm_args(x, weight, casting, offset, **others):
    """Shared argument checks of the norm ops: x [..., N], weight [N] or None, floating, one
    device; returns the weight as the kernels read it (unit stride: a copy of an expanded one)."""
    check_casting(casting)
    check_tensor("x", x, min_ndim=1)
    if weight is None:
        if offset:
            raise ValueError(f"offset={offset} scales by (weight + offset), but weight is None "
                             "(no weight: offset must be 0)")
    else:
        check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(f"weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")
    for name, t in others.items():
        if t is not None:
            check_tensor(name, t)
            if t.shape != x.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but x has shape {tuple(x.shape)}")
            if t.dtype != x.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but x has dtype {x.dtype}")
    check_same_device(x=x, weight=weight, **others)
    return contiguous_or_none(weight)


def warn_inplace_ignored(inplace, what: str) -> None:
    """The norm entries' (functional, nn) deprecated ``inplace``: True warns that it is ignored."""
    if inplace:
        warnings.warn(
            f"{what}: inplace=True is deprecated and ignored. It let the backward write dx over the incoming "
            "gradient, which autograd may share with other nodes (a residual add hands one tensor to both "
            "summands) or which may be the caller's own grad_outputs, so it could corrupt other gradients; "
            "the backward now always writes a new buffer. Drop the argument.", FutureWarning, stacklevel=3)


# ---- custom ops: torch.ops.tigon.rms_norm and its backward ----
#
# Every op is a torch.library custom op (opaque to torch.compile: its fake implementation gives
# the outputs' shapes, Inductor schedules it as one call), with autograd registered on it; the
# eager path calls the same op. Outputs a caller may not need are returned as empty tensors
# (custom ops cannot return None).


def _rms_norm_out_dtype(x, weight, casting):
    scaled = weight is not None and casting != "gemma"
    return torch.promote_types(x.dtype, weight.dtype) if scaled else x.dtype


@kernel_op("tigon::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Optional[Tensor], eps: float, offset: float, casting: str) -> tuple[Tensor, Tensor]:
    """(y [..., N], rstd fp32 [rows]) of x [..., N]."""
    weight = check_norm_args(x, weight, casting, offset)
    y, rstd, _ = rms_norm_forward(as_rows(x), weight, eps, offset, casting)
    return y.view(x.shape[:-1] + y.shape[-1:]), rstd


@rms_norm_op.register_fake
def _(x, weight, eps, offset, casting):
    check_norm_args(x, weight, casting, offset)
    return x.new_empty(x.shape, dtype=_rms_norm_out_dtype(x, weight, casting)), \
        x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@kernel_op("tigon::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, offset: float, casting: str,
                         compute_dw: bool, ds: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dx like x, dw like weight or empty) for dy (and the residual stream's gradient ds, added
    to dx) of x [..., N] normalised with ``rstd``."""
    dx, dw = rms_norm_backward(as_rows(dy), as_rows(x), contiguous_or_none(weight), rstd, offset, casting, compute_dw,
                               ds2=None if ds is None else as_rows(ds))
    return dx.view(x.shape), or_empty(dw, x)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset, casting, compute_dw, ds):
    return torch.empty_like(x, memory_format=torch.contiguous_format), fake_grad(weight, compute_dw, x)


def rms_norm_gradients(ctx, dy, x, rstd, ds=None):
    """(dx, dw or None) of the norm saved in ctx (weight, offset, casting), for the backward of
    rms_norm and of the fused residual-add variant (x is then the sum)."""
    weight = ctx.weight
    compute_dw = weight is not None and ctx.needs_weight_grad
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd, ctx.offset, ctx.casting, compute_dw, ds)
    return dx, dw if compute_dw else None


def _setup_context(ctx, inputs, output):
    x, weight, _, offset, casting = inputs
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
    ctx.save_for_backward(x, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.weight = weight  # a parameter: kept, not saved (see the note in tigon.ops._common)
    ctx.offset, ctx.casting = offset, casting
    ctx.needs_weight_grad = ctx.needs_input_grad[1]


def _backward(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    dx, dw = rms_norm_gradients(ctx, dy, x, rstd)
    return dx, dw, None, None, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)

