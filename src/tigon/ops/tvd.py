"""Total variation distance between probability rows p and q [..., V]: 0.5 * sum_j |p_j - q_j|
(Liger's ``LigerTVDLoss`` semantics). Rows whose label equals ``ignore_index`` contribute
nothing, are not read and do not count: "batchmean" divides the sum by the number of kept rows,
"mean" by that times V, "sum" adds, "none" returns the pointwise 0.5 |p - q| (0 on ignored
rows) in the promoted dtype of p and q. All rows ignored gives a loss of 0 and zero gradients.
Gradients: d/dp = 0.5 sign(p - q) (0 where p == q, and where p - q is NaN, as torch's abs),
d/dq = -d/dp.

As ``kl_div``: a reduction forms the gradients in its one pass over p and q, divided by its
denominator (counted on the device: no host sync), and the backward scales them by grad_output
(``_gradient_scaling.scaled_gradient``); "none" has a backward kernel reading dy, p and q once.
The loss of a reduction is fp32.
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
    check_same_device,
    check_tensor,
    fake_grad,
    kernel_op,
    new_output,
    or_empty,
)
from tigon.ops.kl_div import check_reduction, launch_row_loss, row_loss_backward, setup_row_loss_context

REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2, "batchmean": 3}


@triton.jit
def tvd_kernel(
    P, stride_p, Q, stride_q, OUT, stride_out, GP, stride_gp, GQ, stride_gq, DY, stride_dy, LABELS, KEPT,
    n_rows, n_cols, ignore_index,
    REDUCTION: tl.constexpr, BACKWARD: tl.constexpr, HAS_LABELS: tl.constexpr, COMPUTE_GP: tl.constexpr,
    COMPUTE_GQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_M rows a program, in BLOCK_N chunks. A reduction: OUT[row] = the row's distance
    divided by the denominator (KEPT[0] kept rows, at least 1; times n_cols for "mean"), GP / GQ
    its gradients. "none": OUT = 0.5 |p - q|; with BACKWARD, GP / GQ = DY times its gradients.
    Ignored rows: zeros, p and q not read."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    keep = row_mask
    if HAS_LABELS:
        keep = keep & (tl.load(LABELS + rows, mask=row_mask, other=ignore_index) != ignore_index)
    scale = 1.0
    if REDUCTION != 0:
        if HAS_LABELS:
            kept = tl.maximum(tl.load(KEPT).to(tl.float32), 1.0)
        else:
            kept = tl.cast(n_rows, tl.float32)
        if REDUCTION == 2:
            scale = 1.0 / (kept * n_cols)
        elif REDUCTION == 3:
            scale = 1.0 / kept
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        col_mask = (cols < n_cols)[None, :]
        mask = row_mask[:, None] & col_mask
        read = keep[:, None] & col_mask
        p = tl.load(P + rows[:, None] * stride_p + cols[None, :], mask=read, other=0.0).to(tl.float32)
        q = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=read, other=0.0).to(tl.float32)
        diff = p - q
        # 0.5 sign(p - q), 0 where p == q or p - q is NaN (torch's abs backward)
        half_sign = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, 0.0))
        if BACKWARD:
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=read, other=0.0).to(tl.float32)
            g = dy * half_sign
        else:
            g = half_sign * scale
        if REDUCTION == 0 and not BACKWARD:
            tl.store(OUT + rows[:, None] * stride_out + cols[None, :], (0.5 * tl.abs(diff)).to(OUT.dtype.element_ty),
                     mask=mask)
        if REDUCTION != 0 or BACKWARD:
            if REDUCTION != 0:
                acc += 0.5 * tl.abs(diff)
            if COMPUTE_GP:
                tl.store(GP + rows[:, None] * stride_gp + cols[None, :], g.to(GP.dtype.element_ty), mask=mask)
            if COMPUTE_GQ:
                tl.store(GQ + rows[:, None] * stride_gq + cols[None, :], (-g).to(GQ.dtype.element_ty), mask=mask)
    if REDUCTION != 0:
        tl.store(OUT + rows, tl.sum(acc, axis=1) * scale, mask=row_mask)


def check_tvd_args(p, q, labels):
    """p and q [..., V] of one shape, floating; labels integer [...] (or flat [rows]) or None."""
    check_tensor("p", p, min_ndim=1)
    check_tensor("q", q, min_ndim=1)
    if q.shape != p.shape:
        raise ValueError(f"q has shape {tuple(q.shape)} but p has shape {tuple(p.shape)}: they must match")
    if labels is not None:
        check_tensor("labels", labels, floating=False)
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise TypeError(f"labels must hold integer labels, got dtype {labels.dtype}")
        rows = p.shape[:-1]
        n_rows = math.prod(rows)
        if labels.shape != rows and not (labels.ndim == 1 and labels.shape[0] == n_rows):
            raise ValueError(f"labels has shape {tuple(labels.shape)}; for p of shape {tuple(p.shape)} ([..., V]) it "
                             f"must be {tuple(rows)} or flat [{n_rows}]")
    check_same_device(p=p, q=q, labels=labels)


def _launch(p2, q2, out, gp, gq, dy2, labels, kept, ignore_index, reduction, backward):
    launch_row_loss(tvd_kernel, p2, q2, out, gp, gq, dy2,
                    (labels if labels is not None else p2, kept if kept is not None else p2), ignore_index,
                    REDUCTION=REDUCTION_CODES[reduction], BACKWARD=backward, HAS_LABELS=labels is not None,
                    COMPUTE_GP=gp is not None, COMPUTE_GQ=gq is not None)


def _labels(labels):
    """labels flat and contiguous (the kernel reads them by row index), or None."""
    return None if labels is None else labels.reshape(-1).contiguous()


# ---- custom ops: torch.ops.tigon.tvd and its backward ----


@kernel_op("tigon::tvd", mutates_args=())
def tvd_op(p: Tensor, q: Tensor, labels: Optional[Tensor], reduction: str, ignore_index: int,
           compute_grad_p: bool, compute_grad_q: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, grad_p, grad_q) of p and q [..., V]. loss: fp32 0-dim for a reduction, else
    [..., V] in their promoted dtype. For a reduction, the gradients asked for are formed here
    (for grad_output 1; not differentiable), else empty. ignore_index is checked by the caller."""
    check_reduction(reduction)
    check_tvd_args(p, q, labels)
    p2, q2, flat = as_rows(p), as_rows(q), _labels(labels)
    n_rows, n_cols = p2.shape
    if reduction == "none":
        out = new_output(p2.shape, torch.promote_types(p.dtype, q.dtype), p.device)
        _launch(p2, q2, out, None, None, None, flat, None, ignore_index, reduction, False)
        return out.view(p.shape), p.new_empty(0), q.new_empty(0)
    kept = None if flat is None else (flat != ignore_index).sum().reshape(1)  # on the device: no host sync
    gp = new_output(p2.shape, p.dtype, p.device) if compute_grad_p else None
    gq = new_output(q2.shape, q.dtype, q.device) if compute_grad_q else None
    rows = new_output((n_rows,), torch.float32, p.device) if n_cols else p2.new_zeros(n_rows, dtype=torch.float32)
    _launch(p2, q2, rows, gp, gq, None, flat, kept, ignore_index, reduction, False)
    return (rows.sum(), p.new_empty(0) if gp is None else gp.view(p.shape),
            q.new_empty(0) if gq is None else gq.view(q.shape))


@tvd_op.register_fake
def _(p, q, labels, reduction, ignore_index, compute_grad_p, compute_grad_q):
    check_reduction(reduction)
    check_tvd_args(p, q, labels)
    if reduction == "none":
        return p.new_empty(p.shape, dtype=torch.promote_types(p.dtype, q.dtype)), p.new_empty(0), q.new_empty(0)
    return (p.new_empty((), dtype=torch.float32), fake_grad(p, compute_grad_p, p), fake_grad(q, compute_grad_q, q))


@kernel_op("tigon::tvd_backward", mutates_args=())
def tvd_backward_op(dy: Tensor, p: Tensor, q: Tensor, labels: Optional[Tensor], ignore_index: int,
                    compute_grad_p: bool, compute_grad_q: bool) -> tuple[Tensor, Tensor]:
    """(grad_p, grad_q) of tvd's reduction "none" for the incoming gradient dy [..., V]; each in
    its input's dtype (contiguous), or empty when not asked for."""
    check_tvd_args(p, q, labels)
    check_tensor("dy", dy, min_ndim=1)
    if dy.shape != p.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but p has shape {tuple(p.shape)}")
    p2, q2, dy2 = as_rows(p), as_rows(q), as_rows(dy)
    gp = new_output(p2.shape, p.dtype, p.device) if compute_grad_p else None
    gq = new_output(q2.shape, q.dtype, q.device) if compute_grad_q else None
    _launch(p2, q2, None, gp, gq, dy2, _labels(labels), None, ignore_index, "none", True)
    return (or_empty(None if gp is None else gp.view(p.shape), p),
            or_empty(None if gq is None else gq.view(q.shape), q))


@tvd_backward_op.register_fake
def _(dy, p, q, labels, ignore_index, compute_grad_p, compute_grad_q):
    check_tvd_args(p, q, labels)
    return fake_grad(p, compute_grad_p, p), fake_grad(q, compute_grad_q, q)


def _setup_context(ctx, inputs, output):
    p, q, labels, reduction, ignore_index, compute_gp, compute_gq = inputs
    setup_row_loss_context(ctx, output, reduction, (compute_gp, compute_gq), (p, q, labels), (ignore_index,))


def _backward(ctx, d_loss, _d_gp, _d_gq):
    return *row_loss_backward(ctx, d_loss, "tvd", tvd_backward_op), None, None, None, None, None


tvd_op.register_autograd(_backward, setup_context=_setup_context)
