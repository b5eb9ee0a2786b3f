"""GroupNorm, as torch.nn.functional.group_norm: x [N, C, *spatial] in G groups of C / G
channels, each (sample, group) normalised over its C / G * spatial elements, then
y = x_hat * weight[c] + bias[c]. fp32 statistics and arithmetic, output in x's dtype.

A group may hold millions of elements, so no program holds one. x is walked as [N * C, S]
(S: the spatial size) in tiles of up to 4096 elements, each a few channel rows or a segment of
one, and every pass is a grid of such tiles (the whole GPU busy however few the groups):
- forward: per-tile mean and centred sum of squares, combined per group by Chan's formula
  (no cancellation under a large common offset), then the normalisation;
- backward: per-tile sums of dy (x - mean) and dy, combined per group into the two
  corrections of dx (and, over samples, into dweight and dbias), then dx.
The second pass of each visits the tiles in reverse order: the tiles the first pass read last
are then still in L2.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    cdiv,
    check_same_device,
    check_tensor,
    contiguous_or_none,
    fake_grad,
    kernel_op,
    new_output,
    next_pow2,
    or_empty,
)
from tigon.ops._internals import launch

TILE = 4096  # elements a program: as the GLU kernels' blocks (94-98% of copy bandwidth, H100)


@triton.jit
def _tile(pid, n_rows, n_cols, n_segs, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile pid of the [n_rows, n_cols] view: (rows int64 [BLOCK_R], columns [BLOCK_S], its mask,
    its segment index). Tiles run through memory in order: rows block-major, segments inside."""
    pid = pid.to(tl.int64)
    rows = (pid // n_segs) * BLOCK_R + tl.arange(0, BLOCK_R)
    seg = pid % n_segs
    cols = seg * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, mask, seg


@triton.jit
def group_norm_stats_kernel(
    X, DY, OUT_A, OUT_B, MEAN, n_rows, n_cols, n_segs, channels_per_group,
    BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per (channel row, segment): forward, the mean and the centred sum of squares of x;
    BACKWARD, sum(dy (x - mean)) and sum(dy) with the group's mean. Written at row * n_segs + seg."""
    rows, cols, mask, seg = _tile(tl.program_id(0), n_rows, n_cols, n_segs, BLOCK_R, BLOCK_S)
    row_mask = rows < n_rows
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    out = rows * n_segs + seg
    if BACKWARD:
        mean = tl.load(MEAN + rows // channels_per_group, mask=row_mask, other=0.0)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT_A + out, tl.sum(dy * (x - mean[:, None]), axis=1), mask=row_mask)
        tl.store(OUT_B + out, tl.sum(dy, axis=1), mask=row_mask)
    else:
        count = tl.minimum(n_cols - seg * BLOCK_S, BLOCK_S).to(tl.float32)
        seg_mean = tl.sum(x, axis=1) / count
        centred = tl.where(mask, x - seg_mean[:, None], 0.0)
        # Corrected two-pass: the centred values' own sum removes the rounding of the mean
        # (a large common offset), from the mean and from the sum of squares.
        correction = tl.sum(centred, axis=1) / count
        tl.store(OUT_A + out, seg_mean + correction, mask=row_mask)
        tl.store(OUT_B + out, tl.sum(centred * centred, axis=1) - count * correction * correction, mask=row_mask)


@triton.jit
def group_norm_combine_kernel(
    IN_A, IN_B, W, MEAN, RSTD, OUT_A, OUT_B, n_cols, n_segs, n_groups, channels_per_group, eps,
    BACKWARD: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program a (sample, group) q, over its K = C / G * n_segs partials (IN_* [q * K + k]).
    Forward: MEAN[q], RSTD[q] from the segments' means and centred sums of squares (Chan).
    BACKWARD: with g = weight[c] dy, OUT_A[q] = mean(g x_hat) and OUT_B[q] = mean(g)."""
    eps = tl.cast(eps, tl.float32)  # fp64 under Inductor: see rms_norm_forward_kernel
    q = tl.program_id(0).to(tl.int64)
    n_partials = channels_per_group * n_segs
    group_size = tl.cast(channels_per_group, tl.float32) * tl.cast(n_cols, tl.float32)
    base = q * n_partials
    if BACKWARD:
        acc_a = tl.zeros([BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, n_partials, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            kmask = k < n_partials
            a = tl.load(IN_A + base + k, mask=kmask, other=0.0)
            b = tl.load(IN_B + base + k, mask=kmask, other=0.0)
            if HAS_WEIGHT:
                w = tl.load(W + (q % n_groups) * channels_per_group + k // n_segs, mask=kmask, other=0.0)
                a = a * w.to(tl.float32)
                b = b * w.to(tl.float32)
            acc_a += a
            acc_b += b
        rstd = tl.load(RSTD + q)
        tl.store(OUT_A + q, tl.sum(acc_a, axis=0) * rstd / group_size)
        tl.store(OUT_B + q, tl.sum(acc_b, axis=0) / group_size)
    else:
        total = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, n_partials, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            kmask = k < n_partials
            count = tl.minimum(n_cols - (k % n_segs) * BLOCK_S, BLOCK_S).to(tl.float32)
            total += tl.where(kmask, count * tl.load(IN_A + base + k, mask=kmask, other=0.0), 0.0)
        mean = tl.sum(total, axis=0) / group_size
        m2 = tl.zeros([BLOCK_K], dtype=tl.float32)
        shift = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, n_partials, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            kmask = k < n_partials
            count = tl.minimum(n_cols - (k % n_segs) * BLOCK_S, BLOCK_S).to(tl.float32)
            delta = tl.where(kmask, tl.load(IN_A + base + k, mask=kmask, other=0.0) - mean, 0.0)
            m2 += tl.where(kmask, tl.load(IN_B + base + k, mask=kmask, other=0.0) + count * delta * delta, 0.0)
            shift += count * delta
        # As in the stats kernel: the weighted deltas' sum corrects the rounding of the mean.
        correction = tl.sum(shift, axis=0) / group_size
        m2_total = tl.maximum(tl.sum(m2, axis=0) - group_size * correction * correction, 0.0)
        tl.store(MEAN + q, mean + correction)
        tl.store(RSTD + q, tl.rsqrt(m2_total / group_size + eps))


@triton.jit
def group_norm_forward_kernel(
    X, Y, W, B, MEAN, RSTD, n_rows, n_cols, n_segs, n_tiles, n_channels, channels_per_group,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """y = (x - mean) rstd weight[c] + bias[c], tiles in reverse order (see the module docstring)."""
    rows, cols, mask, _ = _tile(n_tiles - 1 - tl.program_id(0), n_rows, n_cols, n_segs, BLOCK_R, BLOCK_S)
    row_mask = rows < n_rows
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    group = rows // channels_per_group
    scale = tl.load(RSTD + group, mask=row_mask, other=0.0)
    if HAS_WEIGHT:
        scale *= tl.load(W + rows % n_channels, mask=row_mask, other=0.0).to(tl.float32)
    y = (x - tl.load(MEAN + group, mask=row_mask, other=0.0)[:, None]) * scale[:, None]
    if HAS_BIAS:
        y += tl.load(B + rows % n_channels, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def group_norm_backward_kernel(
    DY, X, DX, W, MEAN, RSTD, C1, C2, n_rows, n_cols, n_segs, n_tiles, n_channels, channels_per_group,
    HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """dx = rstd (weight[c] dy - x_hat c1 - c2), c1 = mean(g x_hat), c2 = mean(g) over the group
    (g = weight[c] dy); tiles in reverse order."""
    rows, cols, mask, _ = _tile(n_tiles - 1 - tl.program_id(0), n_rows, n_cols, n_segs, BLOCK_R, BLOCK_S)
    row_mask = rows < n_rows
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    group = rows // channels_per_group
    mean = tl.load(MEAN + group, mask=row_mask, other=0.0)
    rstd = tl.load(RSTD + group, mask=row_mask, other=0.0)
    c1 = tl.load(C1 + group, mask=row_mask, other=0.0)
    c2 = tl.load(C2 + group, mask=row_mask, other=0.0)
    if HAS_WEIGHT:
        dy *= tl.load(W + rows % n_channels, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    x_hat = (x - mean[:, None]) * rstd[:, None]
    dx = rstd[:, None] * (dy - x_hat * c1[:, None] - c2[:, None])
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)


class _Tiles:
    """The tiling of x as [N * C, S] rows: BLOCK_R rows by BLOCK_S columns a tile."""

    def __init__(self, x):
        self.n_rows = x.shape[0] * x.shape[1]
        self.n_cols = math.prod(x.shape[2:])
        self.block_s = min(next_pow2(self.n_cols), TILE)
        self.block_r = TILE // self.block_s
        self.n_segs = cdiv(self.n_cols, self.block_s)
        self.n_tiles = cdiv(self.n_rows, self.block_r) * self.n_segs
        self.num_warps = max(2, min(16, TILE // 256))
        self.empty = self.n_rows == 0 or self.n_cols == 0


def _combine_block(n_partials: int) -> int:
    return max(16, min(1024, next_pow2(n_partials)))


def check_num_groups(num_groups) -> None:
    """``num_groups`` must be a positive int."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, torch.SymInt)):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")


def check_group_norm_args(x, num_groups, weight, bias):
    """x [N, C, *], C divisible by num_groups, weight and bias [C] or None, on one device;
    returns (weight, bias) as the kernels read them (unit stride)."""
    check_tensor("x", x, min_ndim=2)
    check_num_groups(num_groups)
    n_channels = x.shape[1]
    if n_channels % num_groups:
        raise ValueError(f"x has {n_channels} channels (dim 1), not divisible by num_groups={num_groups}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_tensor(name, p, ndim=1)
            if p.shape[0] != n_channels:
                raise ValueError(f"{name} has shape {tuple(p.shape)} but x has {n_channels} channels (dim 1)")
    check_same_device(x=x, weight=weight, bias=bias)
    return contiguous_or_none(weight), contiguous_or_none(bias)


def group_norm_forward(x, num_groups, weight, bias, eps):
    """x [N, C, *] -> (y like x (contiguous, x's dtype), mean fp32 [N, G], rstd fp32 [N, G])."""
    weight, bias = check_group_norm_args(x, num_groups, weight, bias)
    x = x.contiguous()
    t = _Tiles(x)
    n_channels = x.shape[1]
    cpg = n_channels // num_groups
    y = new_output(x.shape, x.dtype, x.device)
    mean = new_output((x.shape[0], num_groups), torch.float32, x.device)
    rstd = new_output((x.shape[0], num_groups), torch.float32, x.device)
    if t.empty:  # no elements, or empty groups: torch's statistics of those
        mean.zero_()
        rstd.fill_(float("nan"))
        return y, mean, rstd
    seg_mean = new_output((t.n_rows * t.n_segs,), torch.float32, x.device)
    seg_m2 = new_output((t.n_rows * t.n_segs,), torch.float32, x.device)
    tiles = {"BLOCK_R": t.block_r, "BLOCK_S": t.block_s, "num_warps": t.num_warps}
    launch(group_norm_stats_kernel, (t.n_tiles,),
        x, x, seg_mean, seg_m2, mean, t.n_rows, t.n_cols, t.n_segs, cpg, BACKWARD=False, **tiles)
    launch(group_norm_combine_kernel, (x.shape[0] * num_groups,),
        seg_mean, seg_m2, x, mean, rstd, seg_mean, seg_m2, t.n_cols, t.n_segs, num_groups, cpg, eps,
        BACKWARD=False, HAS_WEIGHT=False, BLOCK_S=t.block_s, BLOCK_K=_combine_block(cpg * t.n_segs), num_warps=4)
    launch(group_norm_forward_kernel, (t.n_tiles,),
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
        t.n_rows, t.n_cols, t.n_segs, t.n_tiles, n_channels, cpg,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **tiles)
    return y, mean, rstd


def group_norm_backward(dy, x, num_groups, weight, bias, mean, rstd, compute_dw, compute_db):
    """(dx like x (contiguous), dw, db) of group_norm_forward; dw / db None when not computed."""
    weight = contiguous_or_none(weight)
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    x, dy = x.contiguous(), dy.contiguous()
    t = _Tiles(x)
    n_samples, n_channels = x.shape[:2]
    cpg = n_channels // num_groups
    dx = new_output(x.shape, x.dtype, x.device)
    dw = db = None
    if t.empty:
        if compute_dw:
            dw = x.new_zeros(n_channels, dtype=weight.dtype)
        if compute_db:
            db = x.new_zeros(n_channels, dtype=bias.dtype)
        return dx, dw, db
    f32 = torch.float32
    sum_dy_xc = new_output((t.n_rows * t.n_segs,), f32, x.device)
    sum_dy = new_output((t.n_rows * t.n_segs,), f32, x.device)
    c1 = new_output((n_samples * num_groups,), f32, x.device)
    c2 = new_output((n_samples * num_groups,), f32, x.device)
    tiles = {"BLOCK_R": t.block_r, "BLOCK_S": t.block_s, "num_warps": t.num_warps}
    launch(group_norm_stats_kernel, (t.n_tiles,),
        x, dy, sum_dy_xc, sum_dy, mean, t.n_rows, t.n_cols, t.n_segs, cpg, BACKWARD=True, **tiles)
    launch(group_norm_combine_kernel, (n_samples * num_groups,),
        sum_dy_xc, sum_dy, weight if weight is not None else x, mean, rstd, c1, c2,
        t.n_cols, t.n_segs, num_groups, cpg, 0.0,
        BACKWARD=True, HAS_WEIGHT=weight is not None, BLOCK_S=t.block_s, BLOCK_K=_combine_block(cpg * t.n_segs),
        num_warps=4)
    launch(group_norm_backward_kernel, (t.n_tiles,),
        dy, x, dx, weight if weight is not None else x, mean, rstd, c1, c2,
        t.n_rows, t.n_cols, t.n_segs, t.n_tiles, n_channels, cpg,
        HAS_WEIGHT=weight is not None, **tiles)
    if compute_dw:  # dweight[c] = sum over samples of rstd * sum(dy (x - mean)) over the channel
        scaled = sum_dy_xc.view(n_samples * num_groups, -1) * rstd.view(-1, 1)
        dw = scaled.view(n_samples, n_channels, t.n_segs).sum((0, 2)).to(weight.dtype)
    if compute_db:
        db = sum_dy.view(n_samples, n_channels, t.n_segs).sum((0, 2)).to(bias.dtype)
    return dx, dw, db


# ---- custom ops: torch.ops.tigon.group_norm and its backward (see tigon.ops.rms_norm) ----


@kernel_op("tigon::group_norm", mutates_args=())
def group_norm_op(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(y like x (contiguous, x's dtype), mean fp32 [N, G], rstd fp32 [N, G]) of x [N, C, *]."""
    return group_norm_forward(x, num_groups, weight, bias, eps)


@group_norm_op.register_fake
def _(x, num_groups, weight, bias, eps):
    check_group_norm_args(x, num_groups, weight, bias)
    stats = (x.shape[0], num_groups)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(stats, dtype=torch.float32),
            x.new_empty(stats, dtype=torch.float32))


@kernel_op("tigon::group_norm_backward", mutates_args=())
def group_norm_backward_op(dy: Tensor, x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                           mean: Tensor, rstd: Tensor, compute_dw: bool, compute_db: bool
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x (contiguous), dw like weight, db like bias), each of the last two empty when
    not computed (bias is read for its dtype only)."""
    dx, dw, db = group_norm_backward(dy, x, num_groups, weight, bias, mean, rstd, compute_dw, compute_db)
    return dx, or_empty(dw, x), or_empty(db, x)


@group_norm_backward_op.register_fake
def _(dy, x, num_groups, weight, bias, mean, rstd, compute_dw, compute_db):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), fake_grad(weight, compute_dw, x),
            fake_grad(bias, compute_db, x))


def _setup_context(ctx, inputs, output):
    x, num_groups, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.num_groups = num_groups
    ctx.params = (weight, bias)  # parameters: kept, not saved (see the note in tigon.ops._common)
    ctx.needs_param_grads = (weight is not None and ctx.needs_input_grad[2],
                             bias is not None and ctx.needs_input_grad[3])


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None, None
    x, mean, rstd = ctx.saved_tensors
    weight, bias = ctx.params
    compute_dw, compute_db = ctx.needs_param_grads
    dx, dw, db = group_norm_backward_op(dy, x, ctx.num_groups, weight, bias, mean, rstd, compute_dw, compute_db)
    return dx, None, dw if compute_dw else None, db if compute_db else None, None


group_norm_op.register_autograd(_backward, setup_context=_setup_context)
