"""Sparsemax over the last dim (Martins & Astudillo, 2016): the Euclidean projection of a row z
onto the probability simplex, y = max(z - tau, 0) with tau the root of
f(tau) = sum_i max(z_i - tau, 0) - 1. Backward, with S = {i : y_i > 0}:
dx = [i in S] * (dy - mean_S(dy)).

Sort-free: the row stays in registers (up to ``MAX_FUSED_ROW`` = 65536 wide) and tau is found
by Newton's method on the piecewise-linear, convex, decreasing f (Michelot's algorithm), started
from tau = max - 1, where f >= 0. Each step from a point t with f(t) >= 0 lands at
(sum_{z > t} z - 1) / |{z > t}|, still at or below the root, and the root is exact once the
support {z > t} stops changing (a handful of steps on real rows). Every third step bisects the
bracket [lo, hi] instead, so adversarial rows still converge geometrically; a row also stops
once lo and hi hold the same support. Two Newton steps in fp64 then settle tau and the
support as a float64 reference would (entries within fp32's rounding of tau included), and
outputs at or below 2^-40 are set to 0, so that an entry equal to tau (common on bf16's grid)
stays out of the support as in the definition (the backward's support is y > 0).

Rows holding NaN or +inf (or only -inf) give NaN; -inf entries elsewhere get 0 (masking).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    MAX_FUSED_ROW,
    as_rows,
    cdiv,
    check_tensor,
    kernel_op,
    new_output,
    persistent_programs,
    row_block_config,
)
from tigon.ops._internals import launch
from tigon.ops.softmax import check_row_op_backward_args, register_output_autograd, row_backward_loop

# Outputs at or below this are 0 (see the forward kernel): far above tau's fp64 rounding, far
# below any fp32 input's resolution.
TIE_THRESHOLD = 2.0**-40
# Newton / bisection steps a row may take. Bisection every third step halves the bracket
# (width 1) at least every three steps: fp32 resolution well within this.
MAX_STEPS = 96


@triton.jit
def sparsemax_forward_kernel(X, stride_x, Y, stride_y, n_rows, n_cols, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, MAX_ITERS: tl.constexpr, TIE: tl.constexpr):
    """BLOCK_M whole rows a program, in registers; the steps run until every row has its tau."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    # A NaN or +inf entry, or nothing above -inf (also rows past n_rows): no tau, NaN out.
    has_nan = tl.sum((x != x).to(tl.int32), axis=1) > 0  # noqa: PLR0124
    bad = has_nan | (m == float("inf")) | (m == -float("inf"))
    # Relative to the row maximum: the support lies in (-1, 0], where fp32 sums keep precision.
    z = x - tl.where(bad, 0.0, m)[:, None]
    # lo, the lower end of the bracket, is kept as its support's size and sum (the Newton step
    # needs nothing else); it starts at max - 1, where f >= 0 (the maximum alone contributes 1).
    above = z > -1.0
    c_lo = tl.sum(above.to(tl.float32), axis=1)
    s_lo = tl.sum(tl.where(above, z, 0.0), axis=1)
    hi = tl.zeros([BLOCK_M], dtype=tl.float32)  # f(max) = -1 < 0, and nothing lies above it
    c_hi = tl.zeros([BLOCK_M], dtype=tl.float32)
    done = bad
    step = 0
    while (tl.sum((done == 0).to(tl.int32), axis=0) > 0) & (step < MAX_ITERS):
        newton = (s_lo - 1.0) / tl.maximum(c_lo, 1.0)  # <= the root
        if step % 3 == 2:
            t = 0.5 * (newton + hi)
        else:
            t = newton
        above = z > t[:, None]
        c_t = tl.sum(above.to(tl.float32), axis=1)
        s_t = tl.sum(tl.where(above, z, 0.0), axis=1)
        lower = (s_t - c_t * t - 1.0) >= 0.0  # f(t) >= 0: t is at or below the root
        # f(t) >= 0 with lo's support: f is linear on [lo, t] and the Newton point from lo is
        # the root (for a bisection step t is then the root itself).
        found = lower & (c_t == c_lo)
        move_lo = lower & (done == 0)
        move_hi = (lower == 0) & (done == 0)
        c_lo = tl.where(move_lo, c_t, c_lo)
        s_lo = tl.where(move_lo, s_t, s_lo)
        hi = tl.where(move_hi, t, hi)
        c_hi = tl.where(move_hi, c_t, c_hi)
        # Same support at lo and hi: the root's support, whose tau follows exactly.
        done = done | found | (c_lo == c_hi)
        step += 1
    # Two Newton steps in fp64 from the fp32 tau: whether an entry within fp32's rounding of tau
    # is in the support is then decided as a float64 reference decides it (fp32 alone misplaces
    # a few such entries in 16384 rows of 4096, each an O(1) error in its gradient). One step
    # corrects an fp32 tau on either side of the root; the second lands on it.
    zd = x.to(tl.float64) - tl.where(bad, 0.0, m).to(tl.float64)[:, None]
    tau = ((s_lo - 1.0) / tl.maximum(c_lo, 1.0)).to(tl.float64)
    for _ in tl.static_range(2):
        above = zd > tau[:, None]
        count = tl.maximum(tl.sum(above.to(tl.float64), axis=1), 1.0)
        tau = (tl.sum(tl.where(above, zd, 0.0), axis=1) - 1.0) / count
    y = zd - tau[:, None]
    # Within tau's fp64 rounding: 0, so that an entry at tau (common on bf16's grid) stays out
    # of the support, whose size the backward reads from y > 0.
    y = tl.where(y > TIE, y, 0.0).to(tl.float32)
    y = tl.where(bad[:, None], float("nan"), y)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def sparsemax_row_grad(dy, y):
    support = y > 0.0
    count = tl.sum(support.to(tl.float32), axis=1)
    mean = tl.sum(tl.where(support, dy, 0.0), axis=1) / tl.maximum(count, 1.0)
    return tl.where(support, dy - mean[:, None], tl.where(y == y, 0.0, float("nan")))  # noqa: PLR0124


@triton.jit
def sparsemax_backward_kernel(DY, stride_dy, Y, stride_y, DX, stride_dx, n_rows, n_cols,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Persistent grid over row blocks (``row_backward_loop``): dx = [y > 0] (dy - mean of dy
    over y > 0); NaN where y is."""
    row_backward_loop(DY, stride_dy, Y, stride_y, DX, stride_dx, n_rows, n_cols, sparsemax_row_grad, BLOCK_M,
                      BLOCK_N)


def check_sparsemax_input(x):
    check_tensor("x", x, min_ndim=1)
    if x.shape[-1] > MAX_FUSED_ROW:
        raise ValueError(f"sparsemax holds a row in registers: x's dim of size {x.shape[-1]} is larger than the "
                         f"supported maximum {MAX_FUSED_ROW}")


def sparsemax_forward(x2):
    """x2 [M, N] (unit last stride) -> y [M, N] contiguous, x2's dtype."""
    n_rows, n_cols = x2.shape
    y = new_output((n_rows, n_cols), x2.dtype, x2.device)
    if n_rows and n_cols:
        block_m, block_n, num_warps, _ = row_block_config(n_cols, name="sparsemax dim")
        launch(sparsemax_forward_kernel, (cdiv(n_rows, block_m),), x2, x2.stride(0), y, y.stride(0), n_rows, n_cols,
               BLOCK_M=block_m, BLOCK_N=block_n, MAX_ITERS=MAX_STEPS, TIE=TIE_THRESHOLD, num_warps=num_warps)
    return y


def sparsemax_backward(dy2, y2):
    """dy2, y2 [M, N] (unit last stride) -> dx [M, N] contiguous, y2's dtype."""
    n_rows, n_cols = y2.shape
    dx = new_output((n_rows, n_cols), y2.dtype, y2.device)
    if n_rows and n_cols:
        block_m, block_n, num_warps, per_sm = row_block_config(n_cols, backward=True, name="sparsemax dim")
        programs = persistent_programs(y2.device, cdiv(n_rows, block_m), per_sm)
        launch(sparsemax_backward_kernel, (programs,), dy2, dy2.stride(0), y2, y2.stride(0), dx, dx.stride(0),
               n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dx


# ---- custom ops: torch.ops.tigon.sparsemax and its backward ----


@kernel_op("tigon::sparsemax", mutates_args=())
def sparsemax_op(x: Tensor) -> Tensor:
    """sparsemax of x [..., N] (N <= 65536) over the last dim: [..., N] contiguous, x's dtype."""
    check_sparsemax_input(x)
    return sparsemax_forward(as_rows(x)).view(x.shape)


@sparsemax_op.register_fake
def _(x):
    check_sparsemax_input(x)
    return x.new_empty(x.shape)


@kernel_op("tigon::sparsemax_backward", mutates_args=())
def sparsemax_backward_op(dy: Tensor, y: Tensor) -> Tensor:
    """dx [..., N] (contiguous, y's dtype) of y = sparsemax(x) for the incoming gradient dy."""
    check_row_op_backward_args(dy, y)
    check_sparsemax_input(y)
    return sparsemax_backward(as_rows(dy), as_rows(y)).view(y.shape)


@sparsemax_backward_op.register_fake
def _(dy, y):
    check_row_op_backward_args(dy, y)
    check_sparsemax_input(y)
    return y.new_empty(y.shape)


register_output_autograd(sparsemax_op, sparsemax_backward_op)
