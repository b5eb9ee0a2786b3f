"""GroupNorm, as torch.nn.functional.group_norm: x [N, C, *spatial] in G groups of C / G
channels, each (sample, group) normalised over its C / G * spatial elements, then
y = x_hat * weight[c] + bias[c]. fp32 statistics and arithmetic, output in x's dtype.

x is viewed as [N * C, S] (S: the spatial size); a group is C / G contiguous rows of it. Three
launch plans (``group_norm_config``), all bandwidth-bound:
- "one_tile": the padded group fits one program's registers (<= GROUP_TILE_MAX elements): one
  program a group reads it once, computes its statistics (exact two-pass, in registers) and
  writes y; the backward likewise reads x and dy once for the two sums and dx.
- "group": larger groups, at least an SM's worth of them: one program a group walks its tiles
  twice, back to back, the second pass in reverse order, so that what the first pass read last
  is still in L2 (a group of 16 x 128 x 128 bf16 is 512 KiB; ~132 of them are in flight).
- "tiles": a few large groups (fewer than the SMs): every pass is a grid of <= 4096-element
  tiles (the whole GPU busy however few the groups):
  - forward: per-tile mean and centred sum of squares, combined per group by Chan's formula
    (no cancellation under a large common offset), then the normalisation;
  - backward: per-tile sums of dy (x - mean) and dy, combined per group into the two
    corrections of dx (and, over samples, into dweight and dbias), then dx.
  The second pass of each visits the tiles in reverse order, for L2 as above.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

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
    persistent_programs,
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


@triton.jit
def _group_tile(t, n_col_blocks, channels_per_group, n_cols, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile t of a group seen as [channels_per_group, n_cols] (column blocks fastest): its rows
    (channels in the group, int64 [BLOCK_R]), offsets from the group's start, and mask."""
    rows = ((t // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (t % n_col_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (rows < channels_per_group)[:, None] & (cols < n_cols)[None, :]
    return rows, rows[:, None] * n_cols + cols[None, :], mask


@triton.jit
def _group_channel_param(P, channel0, rows, channels_per_group, HAS: tl.constexpr, other: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """P[channel0 + rows] in fp32 ([BLOCK_R]), or ``other`` everywhere without P."""
    if HAS:
        return tl.load(P + channel0 + rows, mask=rows < channels_per_group, other=0.0).to(tl.float32)
    return tl.full([BLOCK_R], other, tl.float32)


@triton.jit
def _group_norm_forward_group(
    q, X, Y, W, B, MEAN, RSTD, n_groups, channels_per_group, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """(Sample, group) q: its channels_per_group x n_cols elements, contiguous in x. ONE_TILE: the
    group is one [BLOCK_R, BLOCK_S] tile held in registers, read once (exact two-pass
    statistics). Else two passes over its tiles: the sums of x - K and (x - K)^2, K the first
    tile's mean (within a few standard deviations of the group's mean: no cancellation under a
    large common offset), then y, tiles in reverse order (L2)."""
    group_size = tl.cast(channels_per_group, tl.float32) * tl.cast(n_cols, tl.float32)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_S)
    n_tiles = tl.cdiv(channels_per_group, BLOCK_R) * n_col_blocks
    start = q * channels_per_group * n_cols
    channel0 = (q % n_groups) * channels_per_group
    rows, offsets, mask = _group_tile(0, n_col_blocks, channels_per_group, n_cols, BLOCK_R, BLOCK_S)
    x = tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32)
    if ONE_TILE:
        mean = tl.sum(x) / group_size
        xc = tl.where(mask, x - mean, 0.0)  # y is written from xc: x is dead from here on
        # Corrected two-pass: the centred values' own sum removes the rounding of the mean.
        correction = tl.sum(xc) / group_size
        var = tl.sum(xc * xc) / group_size - correction * correction
        mean += correction
    else:
        count = tl.cast(tl.minimum(channels_per_group, BLOCK_R) * tl.minimum(n_cols, BLOCK_S), tl.float32)
        shift = tl.sum(x) / count
        d = tl.where(mask, x - shift, 0.0)
        acc = d
        acc_sq = d * d
        for t in range(1, n_tiles):
            rows, offsets, mask = _group_tile(t, n_col_blocks, channels_per_group, n_cols, BLOCK_R, BLOCK_S)
            d = tl.where(mask, tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32) - shift, 0.0)
            acc += d
            acc_sq += d * d
        centred_mean = tl.sum(acc) / group_size
        var = tl.sum(acc_sq) / group_size - centred_mean * centred_mean
        mean = shift + centred_mean
    # Clamped rounding below 0; a NaN (from an inf: inf - inf) stays NaN, as torch's group.
    rstd = tl.rsqrt(tl.where(var < 0.0, 0.0, var) + eps)
    tl.store(MEAN + q, mean)
    tl.store(RSTD + q, rstd)
    if ONE_TILE:
        scale = rstd * _group_channel_param(W, channel0, rows, channels_per_group, HAS_WEIGHT, 1.0, BLOCK_R)
        bias = _group_channel_param(B, channel0, rows, channels_per_group, HAS_BIAS, 0.0, BLOCK_R)
        y = (xc - correction) * scale[:, None] + bias[:, None]
        tl.store(Y + start + offsets, y.to(Y.dtype.element_ty), mask=mask)
    else:
        for j in range(n_tiles):
            rows, offsets, mask = _group_tile(n_tiles - 1 - j, n_col_blocks, channels_per_group, n_cols,
                                              BLOCK_R, BLOCK_S)
            x = tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32)
            scale = rstd * _group_channel_param(W, channel0, rows, channels_per_group, HAS_WEIGHT, 1.0, BLOCK_R)
            bias = _group_channel_param(B, channel0, rows, channels_per_group, HAS_BIAS, 0.0, BLOCK_R)
            y = (x - mean) * scale[:, None] + bias[:, None]
            tl.store(Y + start + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def group_norm_group_forward_kernel(
    X, Y, W, B, MEAN, RSTD, n_groups, n_tasks, channels_per_group, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_TILE: tl.constexpr, LOOP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program p normalises (sample, group) p, or with LOOP the ones q = p, p + P, ... < n_tasks
    (N * G). (Not looping is the default: in a loop the compiler keeps the first tile's int64
    offsets live across groups, +26 registers.)"""
    eps = tl.cast(eps, tl.float32)  # fp64 under Inductor: see rms_norm_forward_kernel
    if LOOP:
        for q in range(tl.program_id(0).to(tl.int64), n_tasks, tl.num_programs(0)):
            _group_norm_forward_group(q, X, Y, W, B, MEAN, RSTD, n_groups, channels_per_group, n_cols, eps,
                                      HAS_WEIGHT, HAS_BIAS, ONE_TILE, BLOCK_R, BLOCK_S)
    else:
        _group_norm_forward_group(tl.program_id(0).to(tl.int64), X, Y, W, B, MEAN, RSTD, n_groups, channels_per_group,
                                  n_cols, eps, HAS_WEIGHT, HAS_BIAS, ONE_TILE, BLOCK_R, BLOCK_S)


@triton.jit
def _group_norm_backward_group(
    q, DY, X, DX, W, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, n_groups, channels_per_group, n_cols,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """(Sample, group) q: the per-channel sums rstd sum(dy (x - mean)) and sum(dy) (to
    DW_PARTIAL / DB_PARTIAL [N * C], summed over samples afterwards), c1 = mean(g x_hat) and
    c2 = mean(g) over the group (g = weight[c] dy), then dx = rstd (g - x_hat c1 - c2).
    ONE_TILE: x and dy read once; else the sums channel block by channel block, then dx with
    the tiles in reverse order."""
    group_size = tl.cast(channels_per_group, tl.float32) * tl.cast(n_cols, tl.float32)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_S)
    n_row_blocks = tl.cdiv(channels_per_group, BLOCK_R)
    start = q * channels_per_group * n_cols
    channel0 = (q % n_groups) * channels_per_group
    mean = tl.load(MEAN + q)
    rstd = tl.load(RSTD + q)
    if ONE_TILE:
        rows, offsets, mask = _group_tile(0, 1, channels_per_group, n_cols, BLOCK_R, BLOCK_S)
        x = tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + start + offsets, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        sum_dy_xc = tl.sum(dy * xc, axis=1)
        sum_dy = tl.sum(dy, axis=1)
        if COMPUTE_DW:
            tl.store(DW_PARTIAL + q * channels_per_group + rows, sum_dy_xc * rstd, mask=rows < channels_per_group)
        if COMPUTE_DB:
            tl.store(DB_PARTIAL + q * channels_per_group + rows, sum_dy, mask=rows < channels_per_group)
        w = _group_channel_param(W, channel0, rows, channels_per_group, HAS_WEIGHT, 1.0, BLOCK_R)
        c1 = tl.sum(w * sum_dy_xc) * rstd / group_size
        c2 = tl.sum(w * sum_dy) / group_size
        dx = rstd * (w[:, None] * dy - xc * (rstd * c1) - c2)
        tl.store(DX + start + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    else:
        weighted_a = tl.zeros([BLOCK_R], dtype=tl.float32)
        weighted_b = tl.zeros([BLOCK_R], dtype=tl.float32)
        for row_block in range(n_row_blocks):
            acc_a = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
            for col_block in range(n_col_blocks):
                rows, offsets, mask = _group_tile(row_block * n_col_blocks + col_block, n_col_blocks,
                                                  channels_per_group, n_cols, BLOCK_R, BLOCK_S)
                x = tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + start + offsets, mask=mask, other=0.0).to(tl.float32)
                acc_a += dy * tl.where(mask, x - mean, 0.0)
                acc_b += dy
            rows = (row_block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            sum_dy_xc = tl.sum(acc_a, axis=1)
            sum_dy = tl.sum(acc_b, axis=1)
            if COMPUTE_DW:
                tl.store(DW_PARTIAL + q * channels_per_group + rows, sum_dy_xc * rstd,
                         mask=rows < channels_per_group)
            if COMPUTE_DB:
                tl.store(DB_PARTIAL + q * channels_per_group + rows, sum_dy, mask=rows < channels_per_group)
            w = _group_channel_param(W, channel0, rows, channels_per_group, HAS_WEIGHT, 1.0, BLOCK_R)
            weighted_a += w * sum_dy_xc
            weighted_b += w * sum_dy
        c1 = tl.sum(weighted_a) * rstd / group_size
        c2 = tl.sum(weighted_b) / group_size
        n_tiles = n_row_blocks * n_col_blocks
        for j in range(n_tiles):
            rows, offsets, mask = _group_tile(n_tiles - 1 - j, n_col_blocks, channels_per_group, n_cols,
                                              BLOCK_R, BLOCK_S)
            x = tl.load(X + start + offsets, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + start + offsets, mask=mask, other=0.0).to(tl.float32)
            w = _group_channel_param(W, channel0, rows, channels_per_group, HAS_WEIGHT, 1.0, BLOCK_R)
            dx = rstd * (w[:, None] * dy - (x - mean) * (rstd * c1) - c2)
            tl.store(DX + start + offsets, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def group_norm_group_backward_kernel(
    DY, X, DX, W, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, n_groups, n_tasks, channels_per_group, n_cols,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, ONE_TILE: tl.constexpr,
    LOOP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """The (sample, group)s as the forward's kernel."""
    if LOOP:
        for q in range(tl.program_id(0).to(tl.int64), n_tasks, tl.num_programs(0)):
            _group_norm_backward_group(q, DY, X, DX, W, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, n_groups,
                                       channels_per_group, n_cols, HAS_WEIGHT, COMPUTE_DW, COMPUTE_DB, ONE_TILE,
                                       BLOCK_R, BLOCK_S)
    else:
        _group_norm_backward_group(tl.program_id(0).to(tl.int64), DY, X, DX, W, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL,
                                   n_groups, channels_per_group, n_cols, HAS_WEIGHT, COMPUTE_DW, COMPUTE_DB, ONE_TILE,
                                   BLOCK_R, BLOCK_S)


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


def _combine_block(n_partials: int) -> int:
    return max(16, min(1024, next_pow2(n_partials)))


class GroupNormConfig(NamedTuple):
    plan: str  # "one_tile", "group" or "tiles" (see the module docstring)
    block_r: int  # tile rows (channels of a group), one_tile / group plans
    block_s: int  # tile columns (spatial positions)
    num_warps: int
    # one_tile / group: at most this many programs, each looping over groups (fewer groups in
    # flight: more of each group's second pass in L2); 0: one program a group.
    max_programs: int = 0


# Padded elements of a group that one program holds in registers: x in the forward, 32 a thread
# at 16 warps (64 registers: two programs an SM); x and dy in the backward, 16 each a thread at
# 32 warps (61 registers). Register counts: Triton 3.9 for sm_90, bf16, no spills.
GROUP_TILE_MAX = 16384
# Elements a tile of the "group" plan: 32 of x a thread at 16 warps in the forward (~32 KiB of
# bf16 loads in flight an SM, one program an SM: 95-112 registers), 16 of x and 16 of dy in the
# backward (92).
GROUP_TILE_FORWARD = 16384
GROUP_TILE_BACKWARD = 8192
# The backward's "group" plan reads a group's x and dy twice, the second time hoping for L2: with
# more than this many elements of groups in flight (x and dy of the groups the SMs hold, bf16:
# half the H100's 50 MB L2) the second read misses and the "tiles" plan is faster (H100, bf16,
# [32, 512, 128, 128] G32, 132 x 262144 elements in flight: backward 1.005 ms against 0.888).
GROUP_BACKWARD_RESIDENT = 6 * 2**20


def group_norm_config(n_samples, num_groups, channels_per_group, n_cols, device, backward=False) -> GroupNormConfig:
    """The plan and tile shape for x [n_samples, num_groups * channels_per_group, n_cols]."""
    block_r, block_s = next_pow2(channels_per_group), next_pow2(n_cols)
    if block_r * block_s <= GROUP_TILE_MAX:
        per_warp = 512 if backward else 1024
        return GroupNormConfig("one_tile", block_r, block_s, max(1, min(32, block_r * block_s // per_warp)))
    n_programs = n_samples * num_groups
    sms = persistent_programs(device, 2**31 - 1, 1)  # the SM count (2 in the interpreter)
    # At least one program an SM, and waves at least 3/4 full (a group is a long program).
    resident = min(n_programs, sms) * channels_per_group * n_cols
    if n_programs >= sms and 4 * n_programs >= 3 * cdiv(n_programs, sms) * sms and \
            not (backward and resident > GROUP_BACKWARD_RESIDENT):
        tile = GROUP_TILE_BACKWARD if backward else GROUP_TILE_FORWARD
        block_s = min(block_s, tile)
        return GroupNormConfig("group", min(block_r, tile // block_s), block_s, 16)
    return GroupNormConfig("tiles", 0, 0, 0)


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


def group_norm_forward(x, num_groups, weight, bias, eps, config: GroupNormConfig | None = None):
    """x [N, C, *] -> (y like x (contiguous, x's dtype), mean fp32 [N, G], rstd fp32 [N, G]).
    ``config``: a plan other than ``group_norm_config``'s (tuning, tests)."""
    weight, bias = check_group_norm_args(x, num_groups, weight, bias)
    x = x.contiguous()
    n_samples, n_channels = x.shape[:2]
    n_cols = math.prod(x.shape[2:])
    cpg = n_channels // num_groups
    y = new_output(x.shape, x.dtype, x.device)
    mean = new_output((n_samples, num_groups), torch.float32, x.device)
    rstd = new_output((n_samples, num_groups), torch.float32, x.device)
    if n_samples * n_channels == 0 or n_cols == 0:  # no elements, or empty groups: torch's statistics of those
        mean.zero_()
        rstd.fill_(float("nan"))
        return y, mean, rstd
    config = config or group_norm_config(n_samples, num_groups, cpg, n_cols, x.device)
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    if config.plan != "tiles":
        n_tasks = n_samples * num_groups
        grid = (torch.sym_min(n_tasks, config.max_programs) if config.max_programs else n_tasks,)
        launch(group_norm_group_forward_kernel, grid, x, y, w, b, mean, rstd, num_groups, n_tasks, cpg, n_cols, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ONE_TILE=config.plan == "one_tile",
            LOOP=config.max_programs > 0, BLOCK_R=config.block_r, BLOCK_S=config.block_s, num_warps=config.num_warps)
        return y, mean, rstd
    t = _Tiles(x)
    seg_mean = new_output((t.n_rows * t.n_segs,), torch.float32, x.device)
    seg_m2 = new_output((t.n_rows * t.n_segs,), torch.float32, x.device)
    tiles = {"BLOCK_R": t.block_r, "BLOCK_S": t.block_s, "num_warps": t.num_warps}
    launch(group_norm_stats_kernel, (t.n_tiles,),
        x, x, seg_mean, seg_m2, mean, t.n_rows, t.n_cols, t.n_segs, cpg, BACKWARD=False, **tiles)
    launch(group_norm_combine_kernel, (n_samples * num_groups,),
        seg_mean, seg_m2, x, mean, rstd, seg_mean, seg_m2, t.n_cols, t.n_segs, num_groups, cpg, eps,
        BACKWARD=False, HAS_WEIGHT=False, BLOCK_S=t.block_s, BLOCK_K=_combine_block(cpg * t.n_segs), num_warps=4)
    launch(group_norm_forward_kernel, (t.n_tiles,),
        x, y, w, b, mean, rstd, t.n_rows, t.n_cols, t.n_segs, t.n_tiles, n_channels, cpg,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **tiles)
    return y, mean, rstd


def group_norm_backward(dy, x, num_groups, weight, bias, mean, rstd, compute_dw, compute_db,
                        config: GroupNormConfig | None = None):
    """(dx like x (contiguous), dw, db) of group_norm_forward; dw / db None when not computed.
    ``config``: a plan other than ``group_norm_config``'s (tuning, tests)."""
    weight = contiguous_or_none(weight)
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    x, dy = x.contiguous(), dy.contiguous()
    n_samples, n_channels = x.shape[:2]
    n_cols = math.prod(x.shape[2:])
    cpg = n_channels // num_groups
    dx = new_output(x.shape, x.dtype, x.device)
    dw = db = None
    if n_samples * n_channels == 0 or n_cols == 0:
        if compute_dw:
            dw = x.new_zeros(n_channels, dtype=weight.dtype)
        if compute_db:
            db = x.new_zeros(n_channels, dtype=bias.dtype)
        return dx, dw, db
    config = config or group_norm_config(n_samples, num_groups, cpg, n_cols, x.device, backward=True)
    w = weight if weight is not None else x
    f32 = torch.float32
    if config.plan != "tiles":
        # Per (sample, channel): rstd sum(dy (x - mean)) and sum(dy), summed over samples below.
        dw_part = new_output((n_samples * n_channels,), f32, x.device) if compute_dw else None
        db_part = new_output((n_samples * n_channels,), f32, x.device) if compute_db else None
        n_tasks = n_samples * num_groups
        grid = (torch.sym_min(n_tasks, config.max_programs) if config.max_programs else n_tasks,)
        launch(group_norm_group_backward_kernel, grid,
            dy, x, dx, w, mean, rstd, dw_part if compute_dw else dx, db_part if compute_db else dx,
            num_groups, n_tasks, cpg, n_cols,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            ONE_TILE=config.plan == "one_tile", LOOP=config.max_programs > 0, BLOCK_R=config.block_r,
            BLOCK_S=config.block_s, num_warps=config.num_warps)
        if compute_dw:
            dw = dw_part.view(n_samples, n_channels).sum(0).to(weight.dtype)
        if compute_db:
            db = db_part.view(n_samples, n_channels).sum(0).to(bias.dtype)
        return dx, dw, db
    t = _Tiles(x)
    sum_dy_xc = new_output((t.n_rows * t.n_segs,), f32, x.device)
    sum_dy = new_output((t.n_rows * t.n_segs,), f32, x.device)
    c1 = new_output((n_samples * num_groups,), f32, x.device)
    c2 = new_output((n_samples * num_groups,), f32, x.device)
    tiles = {"BLOCK_R": t.block_r, "BLOCK_S": t.block_s, "num_warps": t.num_warps}
    launch(group_norm_stats_kernel, (t.n_tiles,),
        x, dy, sum_dy_xc, sum_dy, mean, t.n_rows, t.n_cols, t.n_segs, cpg, BACKWARD=True, **tiles)
    launch(group_norm_combine_kernel, (n_samples * num_groups,),
        sum_dy_xc, sum_dy, w, mean, rstd, c1, c2, t.n_cols, t.n_segs, num_groups, cpg, 0.0,
        BACKWARD=True, HAS_WEIGHT=weight is not None, BLOCK_S=t.block_s, BLOCK_K=_combine_block(cpg * t.n_segs),
        num_warps=4)
    launch(group_norm_backward_kernel, (t.n_tiles,),
        dy, x, dx, w, mean, rstd, c1, c2, t.n_rows, t.n_cols, t.n_segs, t.n_tiles, n_channels, cpg,
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
