"""KL divergence with ``torch.nn.functional.kl_div``'s semantics: input holds log-probabilities
x, target t probabilities (or log-probabilities with ``log_target``), pointwise
    log_target=False:  t (log t - x), 0 where t == 0 (torch's xlogy(t, t) - t x)
    log_target=True:   exp(t) (t - x)
reduced by "sum", "mean" (over every element), "batchmean" (sum / input.shape[0]) or "none".
Gradients: d/dx = -t (-exp(t)); d/dt = log t + 1 - x (NaN where t == 0, as torch's) or
exp(t) (t - x + 1).

A reduction forms the gradients in the forward pass, in the same pass that sums the loss: one
read of x and t, one write of each gradient asked for ([..., V] in its input's dtype, divided by
the reduction's denominator), kept for the backward, which scales them by grad_output
(``_gradient_scaling.scaled_gradient``: in place when autograd frees the graph after that backward,
a new tensor when it is retained or traced). "none" writes the pointwise loss (the promoted
dtype of x and t, as torch) and its backward reads dy, t (and x for t's gradient) once.
The loss of a reduction is fp32.
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
    fake_grad,
    kernel_op,
    new_output,
    next_pow2,
    or_empty,
)
from tigon.ops._gradient_scaling import scaled_gradient
from tigon.ops._internals import launch

REDUCTIONS = ("none", "sum", "mean", "batchmean")
REDUCED, POINTWISE, POINTWISE_BACKWARD = 0, 1, 2

# Elements a program handles per loop step: several rows a program for short rows, a loop over
# the row in chunks of this for long ones (vocabularies). 2048 at 8 warps keeps a program at ~50
# registers a thread (sm_90 ptxas), so ~5 programs stream on an SM; 4096 needs ~100 (2 an SM),
# and 2-D tiles of short rows cost more (a 64-bit pointer an element). Not yet tuned on the GPU.
BLOCK_ELEMENTS = 2048


@triton.jit
def kl_div_kernel(
    X, stride_x, T, stride_t, OUT, stride_out, GX, stride_gx, GT, stride_gt, DY, stride_dy,
    n_rows, n_cols, denom,
    LOG_TARGET: tl.constexpr, MODE: tl.constexpr, COMPUTE_GX: tl.constexpr, COMPUTE_GT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_M rows a program, in BLOCK_N chunks. MODE 0 (a reduction): OUT[row] = the row's sum
    of the pointwise loss, GX / GT = its gradients / denom. MODE 1: OUT = the pointwise loss.
    MODE 2 (the backward of MODE 1): GX = DY * d/dx, GT = DY * d/dt."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    offs = tl.arange(0, BLOCK_N)
    scale = 1.0 / tl.cast(denom, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        t = tl.load(T + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if (MODE != 2) | COMPUTE_GT:
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            p = tl.exp(t)
            loss = p * (t - x)
            dx = -p
            dt = loss + p
        else:
            log_t = tl.log(tl.where(t == 0.0, 1.0, t))  # xlogy: t log t = 0 at t == 0 (NaN for t < 0)
            loss = t * log_t - t * x
            dx = -t
            # torch's: xlogy(t != 0, t) + t / t - x (NaN at t == 0, and for t < 0 like the loss)
            dt = tl.where(t == 0.0, float("nan"), log_t + 1.0) - x
        if MODE == 0:
            acc += tl.where(mask, loss, 0.0)
            if COMPUTE_GX:
                tl.store(GX + rows[:, None] * stride_gx + cols[None, :], (dx * scale).to(GX.dtype.element_ty),
                         mask=mask)
            if COMPUTE_GT:
                tl.store(GT + rows[:, None] * stride_gt + cols[None, :], (dt * scale).to(GT.dtype.element_ty),
                         mask=mask)
        elif MODE == 1:
            tl.store(OUT + rows[:, None] * stride_out + cols[None, :], loss.to(OUT.dtype.element_ty), mask=mask)
        else:
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if COMPUTE_GX:
                tl.store(GX + rows[:, None] * stride_gx + cols[None, :], (dy * dx).to(GX.dtype.element_ty),
                         mask=mask)
            if COMPUTE_GT:
                tl.store(GT + rows[:, None] * stride_gt + cols[None, :], (dy * dt).to(GT.dtype.element_ty),
                         mask=mask)
    if MODE == 0:
        tl.store(OUT + rows, tl.sum(acc, axis=1), mask=row_mask)


def loss_launch_config(n_rows, n_cols):
    """(grid, BLOCK_M, BLOCK_N, num_warps) of a row loss streaming BLOCK_ELEMENTS a step."""
    block_n = min(BLOCK_ELEMENTS, next_pow2(n_cols))
    block_m = max(1, min(64, BLOCK_ELEMENTS // block_n))
    num_warps = 8 if block_m * block_n >= 2048 else 4
    return (cdiv(n_rows, block_m),), block_m, block_n, num_warps


def _rows_arg(t, placeholder):
    """(t, its row stride), or (placeholder, 0) for a None t (its kernel flag keeps it unread);
    a 1-D t (per-row sums, indexed by row alone) passes stride 0."""
    if t is None:
        return placeholder, 0
    return t, t.stride(0) if t.ndim == 2 else 0


def launch_row_loss(kernel, a2, b2, out, ga, gb, dy2, pointers, scalar, **constexprs):
    """Launches a row loss of two inputs a2, b2 [rows, V] (kl_div_kernel, tvd_kernel), whose
    arguments are A, B, OUT, GA, GB, DY (each followed by its row stride), ``pointers``, n_rows,
    n_cols, ``scalar``, then ``constexprs`` and BLOCK_M, BLOCK_N. out, ga, gb and dy2 may be
    None: the one placeholder ``b2`` goes in their place. Nothing runs without elements."""
    n_rows, n_cols = b2.shape
    if not (n_rows and n_cols):
        return
    grid, block_m, block_n, num_warps = loss_launch_config(n_rows, n_cols)
    launch(kernel, grid,
           a2, a2.stride(0), b2, b2.stride(0),
           *_rows_arg(out, b2), *_rows_arg(ga, b2), *_rows_arg(gb, b2), *_rows_arg(dy2, b2), *pointers,
           n_rows, n_cols, scalar,
           **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def _launch(x2, t2, out, gx, gt, dy2, denom, log_target, mode):
    launch_row_loss(kl_div_kernel, x2, t2, out, gx, gt, dy2, (), denom,
                    LOG_TARGET=log_target, MODE=mode, COMPUTE_GX=gx is not None, COMPUTE_GT=gt is not None)


def check_reduction(reduction) -> None:
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")


def check_kl_div_options(reduction, log_target) -> None:
    """The plain arguments, before the op call (its schema's errors would be vaguer)."""
    check_reduction(reduction)
    if not isinstance(log_target, bool):
        raise TypeError(f"log_target must be a bool, got {log_target!r}")


def check_kl_div_args(x, t):
    """input and target [..., V] of one shape, floating, on one device."""
    check_tensor("input", x, min_ndim=1)
    check_tensor("target", t, min_ndim=1)
    if t.shape != x.shape:
        raise ValueError(f"target has shape {tuple(t.shape)} but input has shape {tuple(x.shape)}: they must match "
                         "(expand one explicitly to broadcast)")
    check_same_device(input=x, target=t)


def reduction_denominator(x, reduction):
    """What the summed loss is divided by: torch's (batchmean: input.shape[0]; mean: numel)."""
    if reduction == "batchmean":
        return x.shape[0]
    if reduction == "mean":
        return math.prod(x.shape)
    return 1


def _pointwise_dtype(x, t):
    return torch.promote_types(x.dtype, t.dtype)


# ---- custom ops: torch.ops.tigon.kl_div and its backward ----


@kernel_op("tigon::kl_div", mutates_args=())
def kl_div_op(input: Tensor, target: Tensor, reduction: str, log_target: bool, compute_grad_input: bool,
              compute_grad_target: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, grad_input, grad_target) of input and target [..., V]. loss: fp32 0-dim for a
    reduction, else [..., V] in their promoted dtype. For a reduction, the gradients asked for
    are formed here (for grad_output 1; not differentiable), else empty."""
    check_reduction(reduction)
    check_kl_div_args(input, target)
    x2, t2 = as_rows(input), as_rows(target)
    if reduction == "none":
        out = new_output(t2.shape, _pointwise_dtype(input, target), input.device)
        _launch(x2, t2, out, None, None, None, 1, log_target, POINTWISE)
        return out.view(input.shape), input.new_empty(0), target.new_empty(0)
    gx = new_output(x2.shape, input.dtype, input.device) if compute_grad_input else None
    gt = new_output(t2.shape, target.dtype, target.device) if compute_grad_target else None
    denom = reduction_denominator(input, reduction)
    n_rows, n_cols = t2.shape
    rows = new_output((n_rows,), torch.float32, input.device) if n_cols else t2.new_zeros(n_rows, dtype=torch.float32)
    _launch(x2, t2, rows, gx, gt, None, torch.sym_max(denom, 1), log_target, REDUCED)
    loss = rows.sum() / denom  # 0 / 0 = NaN for an empty mean, as torch
    return (loss, input.new_empty(0) if gx is None else gx.view(input.shape),
            target.new_empty(0) if gt is None else gt.view(target.shape))


@kl_div_op.register_fake
def _(input, target, reduction, log_target, compute_grad_input, compute_grad_target):
    check_reduction(reduction)
    check_kl_div_args(input, target)
    if reduction == "none":
        return input.new_empty(input.shape, dtype=_pointwise_dtype(input, target)), input.new_empty(0), \
            target.new_empty(0)
    return (input.new_empty((), dtype=torch.float32), fake_grad(input, compute_grad_input, input),
            fake_grad(target, compute_grad_target, target))


@kernel_op("tigon::kl_div_backward", mutates_args=())
def kl_div_backward_op(dy: Tensor, input: Tensor, target: Tensor, log_target: bool, compute_grad_input: bool,
                       compute_grad_target: bool) -> tuple[Tensor, Tensor]:
    """(grad_input, grad_target) of kl_div's reduction "none" for the incoming gradient dy
    [..., V]; each in its input's dtype (contiguous), or empty when not asked for."""
    _check_backward_args(dy, input, target)
    x2, t2, dy2 = as_rows(input), as_rows(target), as_rows(dy)
    gx = new_output(x2.shape, input.dtype, input.device) if compute_grad_input else None
    gt = new_output(t2.shape, target.dtype, target.device) if compute_grad_target else None
    _launch(x2, t2, None, gx, gt, dy2, 1, log_target, POINTWISE_BACKWARD)
    return (or_empty(None if gx is None else gx.view(input.shape), input),
            or_empty(None if gt is None else gt.view(target.shape), target))


@kl_div_backward_op.register_fake
def _(dy, input, target, log_target, compute_grad_input, compute_grad_target):
    _check_backward_args(dy, input, target)
    return fake_grad(input, compute_grad_input, input), fake_grad(target, compute_grad_target, target)


def _check_backward_args(dy, x, t):
    check_kl_div_args(x, t)
    check_tensor("dy", dy, min_ndim=1)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but input has shape {tuple(x.shape)}")
    check_same_device(input=x, dy=dy)


def setup_row_loss_context(ctx, output, reduction, computed, saved, options):
    """setup_context of a row loss of two inputs (kl_div, tvd) whose op returns (loss, grad_a,
    grad_b): a reduction keeps the gradients its forward formed (``computed`` says which), "none"
    saves ``saved`` and keeps ``options`` for its backward op."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.pointwise = reduction == "none"
    ctx.needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    if ctx.pointwise:
        ctx.options = options
        ctx.save_for_backward(*saved)
    else:
        ctx.computed = computed
        ctx.save_for_backward(output[1], output[2])


def row_loss_backward(ctx, d_loss, name, backward_op):
    """(grad_a, grad_b) of a row loss set up by ``setup_row_loss_context``, None where not asked
    for. "none": backward_op(d_loss, *saved, *options, need_a, need_b); a reduction: the saved
    gradients times d_loss (``scaled_gradient``)."""
    need_a, need_b = ctx.needs
    if d_loss is None or not (need_a or need_b):
        return None, None
    if ctx.pointwise:
        ga, gb = backward_op(d_loss, *ctx.saved_tensors, *ctx.options, need_a, need_b)
    else:
        if (need_a and not ctx.computed[0]) or (need_b and not ctx.computed[1]):
            raise RuntimeError(f"{name} ran without the gradient now asked for (grad mode was off, or the functional "
                               "entry was bypassed)")
        saved_a, saved_b = ctx.saved_tensors
        scale = d_loss.reshape(1).to(torch.float32)
        ga = scaled_gradient(saved_a, scale) if need_a else None
        gb = scaled_gradient(saved_b, scale) if need_b else None
    return (ga if need_a else None), (gb if need_b else None)


def _setup_context(ctx, inputs, output):
    x, t, reduction, log_target, compute_gx, compute_gt = inputs
    setup_row_loss_context(ctx, output, reduction, (compute_gx, compute_gt), (x, t), (log_target,))


def _backward(ctx, d_loss, _d_gx, _d_gt):
    return *row_loss_backward(ctx, d_loss, "kl_div", kl_div_backward_op), None, None, None, None


kl_div_op.register_autograd(_backward, setup_context=_setup_context)
