"""Dynamic Tanh (DyT, Zhu et al. 2025): y = gamma * tanh(alpha * x) + beta over the last dim.

x [..., N]; alpha a one-element tensor (the learnt scalar); gamma [N]; beta [N] or None. fp32
arithmetic, output in x's dtype. Both directions are bandwidth-bound (2 and 3 elements moved an
element of x), so every element is read and written once:
- forward: a flat grid of [BLOCK_M, BLOCK_N] tiles (4096 elements, 8 warps a program);
- backward: a persistent grid of one 16-warp program an SM, (column blocks) x (P row programs).
  A program walks every P-th row block of its column block with the parameter gradients'
  sums in registers (elementwise, [BLOCK_M, BLOCK_N]: no reduction inside the loop), reduces
  them once and writes fp32 partials ([P, N], P = SMs / column blocks); one small kernel sums
  the partials into dgamma, dbeta and dalpha in their parameters' dtypes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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
    next_pow2,
    or_empty,
    persistent_programs,
)
from tigon.ops._internals import launch
from tigon.ops._jit_math import tanh_and_sech2


@triton.jit
def dyt_forward_kernel(
    X, stride_x, Y, stride_y, ALPHA, GAMMA, BETA, n_rows, n_cols, n_col_blocks,
    HAS_BETA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile a program, column blocks fastest (neighbouring programs
    cover a band of whole rows)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    alpha = tl.load(ALPHA).to(tl.float32)
    gamma = tl.load(GAMMA + cols, mask=col_mask, other=0.0).to(tl.float32)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    t, _ = tanh_and_sech2(alpha * x)
    y = t * gamma[None, :]
    if HAS_BETA:
        y += tl.load(BETA + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def dyt_backward_kernel(
    DY, stride_dy, X, stride_x, DX, stride_dx, ALPHA, GAMMA, DA_PARTIAL, DG_PARTIAL, DB_PARTIAL,
    n_rows, n_cols,
    COMPUTE_DA: tl.constexpr, COMPUTE_DG: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (column blocks, P): program (c, p) walks the row blocks p, p + P, ... of column
    block c, and writes its fp32 partial sums once: dgamma and dbeta to row p of [P, N]
    buffers, dalpha to [P, column blocks]."""
    col_block = tl.program_id(0)
    pid = tl.program_id(1)
    n_programs = tl.num_programs(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    alpha = tl.load(ALPHA).to(tl.float32)
    gamma = tl.load(GAMMA + cols, mask=col_mask, other=0.0).to(tl.float32)
    da = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        t, sech2 = tanh_and_sech2(alpha * x)
        g = dy * gamma[None, :] * sech2  # the gradient of tanh's argument
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (g * alpha).to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DA:
            da += g * x
        if COMPUTE_DG:
            dg += dy * t
        if COMPUTE_DB:
            db += dy
    if COMPUTE_DA:
        tl.store(DA_PARTIAL + pid * tl.num_programs(0) + col_block, tl.sum(da))
    if COMPUTE_DG:
        tl.store(DG_PARTIAL + pid.to(tl.int64) * n_cols + cols, tl.sum(dg, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def dyt_partials_sum_kernel(
    DA_PARTIAL, DG_PARTIAL, DB_PARTIAL, DA, DG, DB, n_partials, n_cols, n_da_partials,
    COMPUTE_DA: tl.constexpr, COMPUTE_DG: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program c: DG[cols] = sum over p of DG_PARTIAL[p, cols] (DB likewise) for its BLOCK_C
    columns, in the outputs' dtypes; program 0 also DA[0] = the sum of the dalpha partials."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    dg = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P).to(tl.int64)
        mask = (p < n_partials)[:, None] & col_mask[None, :]
        offsets = p[:, None] * n_cols + cols[None, :]
        if COMPUTE_DG:
            dg += tl.load(DG_PARTIAL + offsets, mask=mask, other=0.0)
        if COMPUTE_DB:
            db += tl.load(DB_PARTIAL + offsets, mask=mask, other=0.0)
    if COMPUTE_DG:
        tl.store(DG + cols, tl.sum(dg, axis=0).to(DG.dtype.element_ty), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)
    if COMPUTE_DA and pid == 0:
        da = tl.zeros([BLOCK_P * BLOCK_C], dtype=tl.float32)
        for start in range(0, n_da_partials, BLOCK_P * BLOCK_C):
            k = start + tl.arange(0, BLOCK_P * BLOCK_C)
            da += tl.load(DA_PARTIAL + k, mask=k < n_da_partials, other=0.0)
        tl.store(DA, tl.sum(da, axis=0).to(DA.dtype.element_ty))


class DytConfig(NamedTuple):
    block_m: int  # rows a tile
    block_n: int  # columns a tile
    num_warps: int
    programs_per_sm: int  # backward: persistent programs an SM


# Widest column block of a tile (wider rows are walked in column blocks; DyT has no row reduction).
DYT_MAX_BLOCK_N = 2048


def dyt_forward_config(n_cols: int) -> DytConfig:
    """4096 elements and 8 warps a program (16 elements a thread, as the row kernels' forward;
    32 registers: a full SM). Register counts here: Triton 3.9 for sm_90, bf16."""
    block_n = min(next_pow2(max(n_cols, 1)), DYT_MAX_BLOCK_N)
    return DytConfig(max(1, 4096 // block_n), block_n, 8, 1)


def dyt_backward_config(n_cols: int, element_size: int = 2) -> DytConfig:
    """16 warps, one program an SM; 16-bit inputs: 8192-element tiles, 16 elements of x and of
    dy a thread (32 KiB of loads in flight an SM) and three [BLOCK_M, BLOCK_N] fp32 sums, 122
    registers (<= 128: the program fits an SM), no spills. fp32 inputs: 4096 (8192 spills)."""
    block_n = min(next_pow2(max(n_cols, 1)), DYT_MAX_BLOCK_N)
    return DytConfig(max(1, (16384 // max(element_size, 2)) // block_n), block_n, 16, 1)


def check_dyt_args(x, alpha, gamma, beta):
    """x [..., N], alpha one element, gamma and beta [N] (beta may be None), on one device;
    returns (alpha, gamma, beta) as the kernels read them (unit stride)."""
    check_tensor("x", x, min_ndim=1)
    check_tensor("alpha", alpha)
    if alpha.ndim > 1 or alpha.numel() != 1:
        raise ValueError(f"alpha must be a one-element tensor (shape [] or [1]), got shape {tuple(alpha.shape)}")
    n = x.shape[-1]
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None:
            check_tensor(name, p, ndim=1)
            if p.shape[0] != n:
                raise ValueError(f"{name} has shape {tuple(p.shape)} but x's last dim is {n}")
    check_same_device(x=x, alpha=alpha, gamma=gamma, beta=beta)
    return contiguous_or_none(alpha), contiguous_or_none(gamma), contiguous_or_none(beta)


def dyt_forward(x, alpha, gamma, beta, config: DytConfig | None = None):
    """x [..., N] -> y [..., N] (contiguous, x's dtype). ``config``: a launch shape other than
    ``dyt_forward_config``'s (tuning)."""
    alpha, gamma, beta = check_dyt_args(x, alpha, gamma, beta)
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps, _ = config or dyt_forward_config(n_cols)
    y = new_output((n_rows, n_cols), x.dtype, x.device)
    if n_rows and n_cols:
        col_blocks = cdiv(n_cols, block_n)
        launch(dyt_forward_kernel, (cdiv(n_rows, block_m) * col_blocks,),
            x2, x2.stride(0), y, y.stride(0), alpha, gamma, beta if beta is not None else gamma, n_rows, n_cols,
            col_blocks, HAS_BETA=beta is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y.view(x.shape)


def dyt_partials_sum(da_partial, dg_partial, db_partial, alpha, gamma, beta):
    """(dalpha like alpha, dgamma like gamma, dbeta like beta) from fp32 partials: da_partial
    any shape, dg_partial / db_partial [P, N]; each None where its partial is None."""
    partial = dg_partial if dg_partial is not None else db_partial
    n_partials, n_cols = partial.shape if partial is not None else (0, 0)
    da = new_output(alpha.shape, alpha.dtype, alpha.device) if da_partial is not None else None
    dg = new_output((n_cols,), gamma.dtype, gamma.device) if dg_partial is not None else None
    db = new_output((n_cols,), beta.dtype, beta.device) if db_partial is not None else None
    some = next(t for t in (da_partial, dg_partial, db_partial) if t is not None)
    # Few rows (P <= the SM count): one or two steps of 128, 32 columns a program. (Fixed: P is
    # symbolic when the op body is traced with dynamic shapes.)
    block_p, block_c = 128, 32
    launch(dyt_partials_sum_kernel, (torch.sym_max(1, cdiv(n_cols, block_c)),),
        *(t if t is not None else some for t in (da_partial, dg_partial, db_partial)),
        *(t if t is not None else some for t in (da, dg, db)),
        n_partials, n_cols, da_partial.numel() if da_partial is not None else 0,
        COMPUTE_DA=da is not None, COMPUTE_DG=dg is not None, COMPUTE_DB=db is not None,
        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4,
    )
    return da, dg, db


def dyt_backward(dy, x, alpha, gamma, beta, compute_da, compute_dg, compute_db, config: DytConfig | None = None):
    """(dx like x, dalpha like alpha, dgamma like gamma, dbeta like beta); each parameter
    gradient None when not computed. ``config``: a launch shape other than
    ``dyt_backward_config``'s (tuning)."""
    alpha, gamma = contiguous_or_none(alpha), contiguous_or_none(gamma)
    compute_db = compute_db and beta is not None
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = new_output((n_rows, n_cols), x.dtype, x.device)
    if not (n_rows and n_cols):
        zeros = [p.new_zeros(p.shape) if c else None for p, c in ((alpha, compute_da), (gamma, compute_dg),
                                                                   (beta, compute_db))]
        return dx.view(x.shape), *zeros
    block_m, block_n, num_warps, per_sm = config or dyt_backward_config(n_cols, x.element_size())
    col_blocks = cdiv(n_cols, block_n)
    n_programs = torch.sym_max(1, persistent_programs(x.device, cdiv(n_rows, block_m) * col_blocks, per_sm)
                               // col_blocks)
    f32 = torch.float32
    da = new_output((n_programs, col_blocks), f32, x.device) if compute_da else None
    dg = new_output((n_programs, n_cols), f32, x.device) if compute_dg else None
    db = new_output((n_programs, n_cols), f32, x.device) if compute_db else None
    launch(dyt_backward_kernel, (col_blocks, n_programs),
        dy2, dy2.stride(0), x2, x2.stride(0), dx, dx.stride(0), alpha, gamma,
        da if da is not None else dx, dg if dg is not None else dx, db if db is not None else dx,
        n_rows, n_cols,
        COMPUTE_DA=compute_da, COMPUTE_DG=compute_dg, COMPUTE_DB=compute_db,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    if compute_da or compute_dg or compute_db:
        da, dg, db = dyt_partials_sum(da, dg, db, alpha, gamma, beta)
    return dx.view(x.shape), da, dg, db


# ---- custom ops: torch.ops.tigon.dyt and its backward (see tigon.ops.rms_norm) ----


@kernel_op("tigon::dyt", mutates_args=())
def dyt_op(x: Tensor, alpha: Tensor, gamma: Tensor, beta: Optional[Tensor]) -> Tensor:
    """gamma * tanh(alpha * x) + beta of x [..., N] (x's dtype)."""
    return dyt_forward(x, alpha, gamma, beta)


@dyt_op.register_fake
def _(x, alpha, gamma, beta):
    check_dyt_args(x, alpha, gamma, beta)
    return x.new_empty(x.shape)


@kernel_op("tigon::dyt_backward", mutates_args=())
def dyt_backward_op(dy: Tensor, x: Tensor, alpha: Tensor, gamma: Tensor, beta: Optional[Tensor], compute_da: bool,
                    compute_dg: bool, compute_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dalpha, dgamma, dbeta), each parameter gradient empty when not computed (beta is
    read for its dtype only)."""
    dx, da, dg, db = dyt_backward(dy, x, alpha, gamma, beta, compute_da, compute_dg, compute_db)
    return dx, or_empty(da, x), or_empty(dg, x), or_empty(db, x)


@dyt_backward_op.register_fake
def _(dy, x, alpha, gamma, beta, compute_da, compute_dg, compute_db):
    return (x.new_empty(x.shape), fake_grad(alpha, compute_da, x), fake_grad(gamma, compute_dg, x),
            fake_grad(beta, compute_db, x))


def _setup_context(ctx, inputs, output):
    x, alpha, gamma, beta = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x)
    ctx.params = (alpha, gamma, beta)  # parameters: kept, not saved (see the note in tigon.ops._common)
    ctx.needs_param_grads = (ctx.needs_input_grad[1], ctx.needs_input_grad[2],
                             beta is not None and ctx.needs_input_grad[3])


def _backward(ctx, dy):
    if dy is None:
        return None, None, None, None
    (x,) = ctx.saved_tensors
    alpha, gamma, beta = ctx.params
    compute = ctx.needs_param_grads
    dx, da, dg, db = dyt_backward_op(dy, x, alpha, gamma, beta, *compute)
    return dx, *(g if c else None for g, c in zip((da, dg, db), compute))


dyt_op.register_autograd(_backward, setup_context=_setup_context)
