"""The gated MLP out = (act(x Wg^T * g) * (x Wu^T)) Wd^T * d, in two forms, and the one place
that picks between them and sizes their slices.

x [..., H], gate / up weights [I, H], down weight [H, I]; act is one of tigon's GLU
activations (``tigon.ops.glu``); the multipliers g, d are 1 except in Falcon-H1.

- ``glu_down_proj`` (op ``tigon::glu_down``): the activation and the down projection, from gate
  and up computed by the caller's layers (so LoRA or quantised gate / up layers keep their own
  forward). It keeps a = gate and b = up, not c = act(a) * b, and recomputes c in the backward:
  one [tokens, I] activation fewer than autograd keeps. Its forward walks the rows in slices (c
  is never whole: under gradient checkpointing this forward runs again inside the backward,
  where a full c on top of a and b was a layer's memory peak); its backward walks the I columns
  in slices: dc_j = dout W[:, j], c_j, dW[:, j] = dout^T c_j, then da_j / db_j. With
  ``inplace=True`` da and db are written over a and b (intermediates nothing else reads, as in
  an MLP), so the backward allocates nothing of [tokens, I] and can run only once.
- ``glu_mlp_input_only`` (op ``tigon::glu_mlp``): the whole MLP keeping only x, for layers
  under gradient checkpointing (torch.utils.checkpoint, non-reentrant), where the layer's
  forward runs twice anyway. The backward recomputes gate and up one column slice of I at a
  time (into one [a_j | b_j] buffer), and from them c_j, dW_down[:, j], dc_j, da_j / db_j (over
  a_j / b_j), dW_gate[j], dW_up[j] and dx += da_j Wg_j + db_j Wu_j (fp32 accumulation): three
  [tokens, slice] buffers and an fp32 dx instead of two [tokens, I] activations. In
  checkpoint's recomputation, when saving x is the last thing the recompute needs (checkpoint's
  early stop: the MLP is the last op of a Llama-style layer that saves anything), the forward
  skips its three matmuls: its output is never read. Per layer that is the FLOPs of 11 matmuls
  (3 forward, 8 backward) where an MLP that keeps gate and up does 12. A layer compiled on its
  own inside an eager checkpoint (torchtune's recipes: ``last_in_checkpoint``) is recomputed
  whole, without that early stop: there the op finds the recomputation at run time and skips the
  matmuls too (else 14). A checkpoint that torch.compile traces recomputes only what the
  backward reads: x, not the MLP. The
  forward runs in wider slices than the backward (it is not at the memory peak), so the
  recomputed gate and up may differ from the forward's in the last bit, as with any
  recomputation.
- ``gated_mlp``: the path choice both ``tigon.nn`` and the HF patcher use.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tigon.ops._common import (
    accumulate_mm,
    as_rows,
    autocast_off,
    capturing,
    check_same_device,
    check_tensor,
    custom_op,
    fake_grad,
    kernel_op,
    matmul_dtype,
    new_output,
    or_empty,
    traced,
)
from tigon.ops._internals import checkpoint_recompute_stops_after, in_checkpoint_recomputation, under_checkpoint
from tigon.ops.glu import check_activation, check_glu_args, glu_backward, glu_forward, glu_op

# ---- slice policy ----

# glu_down backward: columns per slice, so slices stay large matmuls (N >= 1024) while the
# transient (dc_j and c_j) is half an intermediate. H100 (benchmarks/tuning/tune_mlp_slices.py,
# fwd+bwd of a SwiGLU MLP): 1 / 2 / 4 slices took 12.52 / 12.38 / 12.82 ms at T8192 H4096
# I14336 and 30.86 / 31.19 / 31.24 ms at T65536 H2048 I8192; 2 and 4 had the same peak
# memory, 1 had 48-288 MB more.
DOWN_PROJ_BACKWARD_SLICES = 2
DOWN_PROJ_MIN_SLICE_COLUMNS = 1024
# glu_down forward: c_r is at most a quarter of c, and slices of >= 2048 rows keep the
# matmuls large.
DOWN_PROJ_FORWARD_SLICES = 4
DOWN_PROJ_MIN_SLICE_ROWS = 2048
# glu_mlp: bytes of one [tokens, slice] buffer (three are live in the backward), forward and
# backward. H100, a Llama-1B MLP block under checkpoint, fwd+bwd at 8192 tokens
# (benchmarks/tuning/tune_mlp_checkpoint.py): budgets of 16 / 32 / 64 / 128 MiB took 6.38 / 5.06 /
# 4.93 / 5.02 ms of GPU time (peak 112 / 160 / 256 / 448 MiB), against 5.45 ms (256 MiB) for the
# path that keeps gate and up. The host decides at small batch: each slice costs ~11 host calls,
# and a compiled Qwen2.5-0.5B step at 16 x 512 (H100 host) spent 31 ms of host time in the
# backward with 32 MiB (3 slices) and 14 ms with 128 MiB (1 slice), 162 -> 141 ms per step.
# Raised to 512 MiB once torch.compile launched the other ops' kernels itself and a compiled
# Qwen2.5-0.5B step became GPU-bound (profile_step.py --mlp-slice-budget-mib, H100): at 32 x 512
# 157.4 -> 152.5 ms, at 64 x 512 310.4 -> 293.4 ms (one slice instead of two or three: fewer fp32
# passes over dx, larger matmuls), for up to ~1 GiB more transient memory at those batches.
# From 128K tokens on (bf16), MLP_MIN_SLICE_COLUMNS sets the width whatever the budget.
MLP_SLICE_BUDGET_BYTES = 512 * 2**20
# Narrower glu_mlp slices than this cost more than they save: more matmuls, and the fp32 dx read
# and written once more per slice (with 512- and 256-column slices a Llama-1B step at batch 32
# and 64 x 1024 ran 11% and 28% slower than with the MLP that keeps gate and up).
MLP_MIN_SLICE_COLUMNS = 2048


def down_proj_slice_columns(n_cols: int) -> int:
    """Columns of one glu_down backward slice of an I = n_cols wide intermediate (a multiple
    of 64)."""
    width = -(-n_cols // DOWN_PROJ_BACKWARD_SLICES)
    width = -(-width // 64) * 64
    return min(n_cols, max(width, DOWN_PROJ_MIN_SLICE_COLUMNS))


def down_proj_slice_rows(n_rows: int) -> int:
    """Rows of one glu_down forward slice (a multiple of 64, or all rows)."""
    rows = -(-n_rows // DOWN_PROJ_FORWARD_SLICES)
    if rows > 64:
        rows = -(-rows // 64) * 64
    return min(n_rows, max(rows, DOWN_PROJ_MIN_SLICE_ROWS))


def mlp_slice_columns(n_rows: int, n_cols: int, element_size: int) -> int:
    """Columns of one glu_mlp slice of the intermediate (a multiple of 64, or all of I): as few
    slices as the budget allows, of equal widths (no narrow last slice: Qwen2.5-0.5B's I = 4864 at
    16K tokens is 2 x 2432, not 4096 + 768)."""
    width = MLP_SLICE_BUDGET_BYTES // max(1, n_rows * element_size)
    width = max(MLP_MIN_SLICE_COLUMNS, width // 64 * 64)
    if width >= n_cols:
        return n_cols
    n_slices = -(-n_cols // width)  # the count the budget and the floor give, then equal widths
    per_slice = -(-n_cols // n_slices)
    return -(-per_slice // 64) * 64


def column_slices(n_cols: int, width: int):
    return [slice(start, min(start + width, n_cols)) for start in range(0, n_cols, width)]


def _as(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


# ---- activation + down projection ----

def glu_down_forward(a2, b2, w, bias, activation, multipliers, mm):
    """((act(a2 g) * b2) @ w^T + bias) d in row slices, as (act(a2 g) * b2 d) @ w^T + bias d;
    [M, I] x2 -> [M, H] in the matmul dtype ``mm`` (contiguous). Autocast must be off."""
    if bias is not None and multipliers[1] != 1.0:
        bias = bias * multipliers[1]
    n_rows = a2.shape[0]
    bias_mm = None if bias is None else _as(bias, mm)
    # Traced (the triton_op under torch.compile): one slice, no loop over a symbolic row count
    # (it would specialize the graph on the token count); Inductor plans the memory.
    if traced(a2) or (step := down_proj_slice_rows(n_rows)) >= n_rows:
        c = glu_forward(a2, b2, activation, gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
        return F.linear(_as(c, mm), _as(w, mm), bias_mm)
    w_t = _as(w, mm).t()
    out = torch.empty((n_rows, w.shape[0]), dtype=mm, device=a2.device)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        c_r = _as(glu_forward(a2[rows], b2[rows], activation, gate_multiplier=multipliers[0],
                              out_multiplier=multipliers[1]), mm)
        if bias_mm is None:
            torch.mm(c_r, w_t, out=out[rows])
        else:
            torch.addmm(bias_mm, c_r, w_t, out=out[rows])
        del c_r
    return out


def traced_glu_down_backward(dout2, a2, b2, w, activation, multipliers, mm, need_ab, need_w):
    """(da, db, d_weight) of glu_down_forward for the triton_op under torch.compile, None where not
    needed: whole buffers, no writes into slices of others (functionalization would copy each
    such slice); Inductor plans the memory."""
    da = db = d_weight = None
    if need_w:
        c = glu_forward(a2, b2, activation, gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
        d_weight = (dout2.t() @ _as(c, mm)).to(w.dtype)
    if need_ab:
        da, db = glu_backward(dout2 @ _as(w, mm), a2, b2, activation, gate_multiplier=multipliers[0],
                              out_multiplier=multipliers[1])
    return da, db, d_weight


def glu_down_backward(dout, a, b, w, bias, activation, multipliers, mm, slice_columns, need_ab, need_w, need_bias,
                      inplace=False):
    """(da, db, d_weight, d_bias) of glu_down_forward, each None when not needed; with ``inplace``
    da and db are written over a and b (then returned as None)."""
    gate_multiplier, down_multiplier = multipliers
    a2, b2 = as_rows(a), as_rows(b)
    dout2 = _as(dout.reshape(-1, dout.shape[-1]), mm)
    n_cols = a2.shape[1]
    slice_columns = slice_columns or down_proj_slice_columns(n_cols)
    d_bias = da = db = d_weight = None
    if need_bias:
        d_bias = (dout2.sum(0, dtype=torch.float32) * down_multiplier).to(bias.dtype)
    if traced(dout, a, b):
        da, db, d_weight = traced_glu_down_backward(dout2, a2, b2, w, activation, multipliers, mm, need_ab, need_w)
        return (da.view(a.shape) if need_ab else None, db.view(a.shape) if need_ab else None, d_weight, d_bias)
    if need_w:
        d_weight = new_output(w.shape, w.dtype, w.device)
    if need_ab:
        da = a2 if inplace else new_output(a2.shape, a2.dtype, a2.device)
        db = b2 if inplace else new_output(b2.shape, b2.dtype, b2.device)
    w_mm = _as(w, mm)
    for start in range(0, n_cols, slice_columns):
        cols = slice(start, min(start + slice_columns, n_cols))
        a_j, b_j = a2[:, cols], b2[:, cols]
        if need_w:
            c_j = _as(glu_forward(a_j, b_j, activation, gate_multiplier=gate_multiplier,
                                  out_multiplier=down_multiplier), mm)
            if d_weight.dtype == mm:
                torch.mm(dout2.t(), c_j, out=d_weight[:, cols])
            else:
                d_weight[:, cols] = dout2.t() @ c_j
            del c_j
        if need_ab:
            dc_j = dout2 @ w_mm[:, cols]
            glu_backward(dc_j, a_j, b_j, activation, da_out=da[:, cols], db_out=db[:, cols],
                         gate_multiplier=gate_multiplier, out_multiplier=down_multiplier)
            del dc_j
    if need_ab and inplace:
        for t, t2 in ((a, a2), (b, b2)):
            if t2.data_ptr() != t.data_ptr():  # as_rows copied t: the gradient goes back into t
                t.copy_(t2.view(t.shape))
        return None, None, d_weight, d_bias
    if need_ab:
        da, db = da.view(a.shape), db.view(a.shape)
    return da, db, d_weight, d_bias


def check_glu_down_args(a, b, down_weight, down_bias, activation):
    check_glu_args(a, b, activation)
    check_tensor("down_weight", down_weight, ndim=2)
    if down_weight.shape[1] != a.shape[-1]:
        raise ValueError(
            f"down_weight has shape {tuple(down_weight.shape)}; its dim 1 must equal a's last dim {a.shape[-1]}"
        )
    if down_bias is not None:
        check_tensor("down_bias", down_bias, ndim=1)
        if down_bias.shape[0] != down_weight.shape[0]:
            raise ValueError(
                f"down_bias has shape {tuple(down_bias.shape)} but down_weight has {down_weight.shape[0]} rows"
            )
    check_same_device(a=a, down_weight=down_weight, down_bias=down_bias)


def check_slice_columns(slice_columns):
    if slice_columns is not None and (isinstance(slice_columns, bool) or not isinstance(slice_columns, int)
                                      or slice_columns <= 0):
        raise ValueError(f"slice_columns must be a positive int or None, got {slice_columns!r}")


# ---- custom ops: torch.ops.tigon.glu_down, glu_mlp and their backwards (see tigon.ops.rms_norm) ----
#
# The matmul dtype is an argument, picked by the caller from the autocast state (autocast's
# dtype when it is on, else the input's): the ops run with autocast off, and under
# torch.compile no autocast state reaches an op's implementation. ``slice_columns`` 0: the
# default slices of this file's policy.


@kernel_op("tigon::glu_down", mutates_args=())
def glu_down_op(a: Tensor, b: Tensor, down_weight: Tensor, down_bias: Optional[Tensor], activation: str,
                gate_multiplier: float, down_multiplier: float, matmul_dtype: torch.dtype, inplace: bool,
                slice_columns: int) -> Tensor:
    """((act(a g) * b) @ down_weight^T + down_bias) d, contiguous [..., H] in ``matmul_dtype``.
    ``inplace``: the backward writes da, db over a, b; ``slice_columns``: the backward's slices."""
    check_glu_down_args(a, b, down_weight, down_bias, activation)
    with autocast_off(a.device.type):
        out = glu_down_forward(as_rows(a), as_rows(b), down_weight, down_bias, activation,
                               (gate_multiplier, down_multiplier), matmul_dtype)
    return out.view(*a.shape[:-1], out.shape[-1])


@glu_down_op.register_fake
def _(a, b, down_weight, down_bias, activation, gate_multiplier, down_multiplier, matmul_dtype, inplace,
      slice_columns):
    check_glu_down_args(a, b, down_weight, down_bias, activation)
    return a.new_empty((*a.shape[:-1], down_weight.shape[0]), dtype=matmul_dtype)


@kernel_op("tigon::glu_down_backward", mutates_args=())
def glu_down_backward_op(dout: Tensor, a: Tensor, b: Tensor, down_weight: Tensor, down_bias: Optional[Tensor],
                         activation: str, gate_multiplier: float, down_multiplier: float, matmul_dtype: torch.dtype,
                         slice_columns: int, need_ab: bool, need_weight: bool, need_bias: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(da, db like a, d_weight like down_weight, d_bias like down_bias), empty where not needed."""
    with autocast_off(a.device.type):
        grads = glu_down_backward(dout, a, b, down_weight, down_bias, activation, (gate_multiplier, down_multiplier),
                                  matmul_dtype, slice_columns, need_ab, need_weight, need_bias)
    return tuple(or_empty(g, a) for g in grads)


@glu_down_backward_op.register_fake
def _(dout, a, b, down_weight, down_bias, activation, gate_multiplier, down_multiplier, matmul_dtype, slice_columns,
      need_ab, need_weight, need_bias):
    return (fake_grad(a, need_ab, a), fake_grad(a, need_ab, a), fake_grad(down_weight, need_weight, a),
            fake_grad(down_bias, need_bias, a))


@custom_op("tigon::glu_down_backward_", mutates_args=("a", "b"))
def glu_down_backward_inplace_op(dout: Tensor, a: Tensor, b: Tensor, down_weight: Tensor,
                                 down_bias: Optional[Tensor], activation: str, gate_multiplier: float,
                                 down_multiplier: float, matmul_dtype: torch.dtype, slice_columns: int,
                                 need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor]:
    """glu_down_backward with da and db written over a and b; returns (d_weight, d_bias), empty
    where not needed."""
    with autocast_off(a.device.type):
        _, _, d_weight, d_bias = glu_down_backward(dout, a, b, down_weight, down_bias, activation,
                                                   (gate_multiplier, down_multiplier), matmul_dtype, slice_columns,
                                                   True, need_weight, need_bias, inplace=True)
    return or_empty(d_weight, a), or_empty(d_bias, a)


@glu_down_backward_inplace_op.register_fake
def _(dout, a, b, down_weight, down_bias, activation, gate_multiplier, down_multiplier, matmul_dtype, slice_columns,
      need_weight, need_bias):
    return fake_grad(down_weight, need_weight, a), fake_grad(down_bias, need_bias, a)


def _glu_down_setup_context(ctx, inputs, output):
    a, b, down_weight, down_bias, activation, gate_multiplier, down_multiplier, mm, inplace, slice_columns = inputs
    ctx.save_for_backward(a, b)
    ctx.params = (down_weight, down_bias)  # kept, not saved (see the note in tigon.ops._common)
    ctx.options = (activation, gate_multiplier, down_multiplier, mm, slice_columns)
    ctx.inplace = inplace
    ctx.consumed = False


def _glu_down_backward(ctx, dout):
    if ctx.consumed:
        raise RuntimeError(
            "glu_down_proj with inplace=True wrote its backward over a and b, so it cannot "
            "run backward twice (retain_graph=True); use inplace=False for that"
        )
    a, b = ctx.saved_tensors
    down_weight, down_bias = ctx.params
    need_ab = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need_weight, need_bias = ctx.needs_input_grad[2], ctx.needs_input_grad[3] and down_bias is not None
    matmul_dtype = ctx.options[3]
    # Writing over saved tensors is for eager autograd; under torch.compile the graph owns the buffers
    # (traced, not is_compiling: AOTAutograd traces the backward after Dynamo, with is_compiling off).
    if ctx.inplace and need_ab and a.dtype == matmul_dtype and not traced(dout, a, b):
        d_weight, d_bias = glu_down_backward_inplace_op(dout, a, b, down_weight, down_bias, *ctx.options,
                                                        need_weight, need_bias)
        ctx.consumed = True
        da, db = a, b
    else:
        da, db, d_weight, d_bias = glu_down_backward_op(dout, a, b, down_weight, down_bias, *ctx.options,
                                                        need_ab, need_weight, need_bias)
    return (da if need_ab else None, db if need_ab else None, d_weight if need_weight else None,
            d_bias if need_bias else None, None, None, None, None, None, None)


glu_down_op.register_autograd(_glu_down_backward, setup_context=_glu_down_setup_context)


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu", *, inplace=False, gate_multiplier=1.0,
                  down_multiplier=1.0, slice_columns=None):
    """glu_down_op with its non-tensor arguments checked and the matmul dtype picked (see
    tigon.functional.glu_down_proj)."""
    check_activation(activation, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    check_slice_columns(slice_columns)
    mm = matmul_dtype(a, down_weight=down_weight)
    return glu_down_op(a, b, down_weight, down_bias, activation, float(gate_multiplier), float(down_multiplier), mm,
                       bool(inplace), slice_columns or 0)


# ---- the whole MLP, keeping only x ----

def check_glu_mlp_args(x, gate_weight, up_weight, down_weight, activation):
    check_activation(activation)
    check_tensor("x", x, min_ndim=1)
    for name, w in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)):
        check_tensor(name, w, ndim=2)
    hidden = x.shape[-1]
    if gate_weight.shape[1] != hidden or up_weight.shape != gate_weight.shape:
        raise ValueError(f"gate_weight {tuple(gate_weight.shape)} and up_weight {tuple(up_weight.shape)} must both be "
                         f"[I, H] with H = x's last dim {hidden}")
    if down_weight.shape != (hidden, gate_weight.shape[0]):
        raise ValueError(f"down_weight has shape {tuple(down_weight.shape)}; expected [H, I] = "
                         f"{[hidden, gate_weight.shape[0]]}")
    check_same_device(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)


def gate_up_slice(x2, wg, wu, cols):
    """[gate_j | up_j] = [x Wg_j^T | x Wu_j^T] for the column slice ``cols``, as one [rows, 2w]
    buffer written by two matmuls (no stacked copy of the weights)."""
    width = cols.stop - cols.start
    out = torch.empty((x2.shape[0], 2 * width), dtype=x2.dtype, device=x2.device)
    torch.mm(x2, wg[cols].t(), out=out[:, :width])
    torch.mm(x2, wu[cols].t(), out=out[:, width:])
    return out


def glu_mlp_forward(x, gate_weight, up_weight, down_weight, activation, multipliers, mm, slice_columns):
    """out [..., H] contiguous in ``mm``, gate and up formed in column slices (traced: whole, see
    traced_glu_mlp_forward). Autocast must be off."""
    n_rows, n_cols = math.prod(x.shape[:-1]), gate_weight.shape[0]
    x2 = _as(as_rows(x), mm)
    wg, wu, wd = _as(gate_weight, mm), _as(up_weight, mm), _as(down_weight, mm)
    if traced(x2):
        return traced_glu_mlp_forward(x2, wg, wu, wd, activation, multipliers).view(*x.shape[:-1], wd.shape[0])
    forward_columns = slice_columns or mlp_slice_columns(n_rows, n_cols, mm.itemsize)
    c = torch.empty((n_rows, n_cols), dtype=mm, device=x.device)
    for cols in column_slices(n_cols, forward_columns):
        ab_j = gate_up_slice(x2, wg, wu, cols)
        width = cols.stop - cols.start
        glu_forward(ab_j[:, :width], ab_j[:, width:], activation, out=c[:, cols],
                    gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
        del ab_j
    return (c @ wd.t()).view(*x.shape[:-1], wd.shape[0])


# Traced (the triton_op under torch.compile): the whole intermediate at once, no writes into
# slices of other buffers (functionalization would copy each such slice) and no loop whose
# length follows the token count (it would specialize the graph on it); Inductor plans the
# memory. Only x is saved either way; gate and up are recomputed in the backward.

def traced_glu_mlp_forward(x2, wg, wu, wd, activation, multipliers):
    """out [rows, H] of x2 [rows, H] (all in the matmul dtype)."""
    c = glu_forward(x2 @ wg.t(), x2 @ wu.t(), activation, gate_multiplier=multipliers[0],
                    out_multiplier=multipliers[1])
    return c @ wd.t()


def traced_glu_mlp_backward(dout2, x2, wg, wu, wd, activation, multipliers, need_x, need_wg, need_wu, need_wd):
    """(dx, d_wg, d_wu, d_wd) in the matmul dtype, None where not needed."""
    a, b = x2 @ wg.t(), x2 @ wu.t()
    d_wd = None
    if need_wd:
        d_wd = dout2.t() @ glu_forward(a, b, activation, gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
    if not (need_x or need_wg or need_wu):
        return None, None, None, d_wd
    da, db = glu_backward(dout2 @ wd, a, b, activation, gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
    return (da @ wg + db @ wu if need_x else None, da.t() @ x2 if need_wg else None,
            db.t() @ x2 if need_wu else None, d_wd)


def glu_mlp_backward(dout, x, gate_weight, up_weight, down_weight, activation, multipliers, mm, slice_columns,
                     need_x, need_wg, need_wu, need_wd):
    """(dx, d_gate_weight, d_up_weight, d_down_weight), each None when not needed; gate and up
    are recomputed one column slice at a time. Autocast must be off."""
    gate_multiplier, down_multiplier = multipliers
    x2 = _as(as_rows(x), mm)
    dout2 = _as(as_rows(dout), mm)
    wg, wu, wd = _as(gate_weight, mm), _as(up_weight, mm), _as(down_weight, mm)
    if traced(x2, dout2):
        dx, *grads = traced_glu_mlp_backward(dout2, x2, wg, wu, wd, activation, multipliers, need_x, need_wg, need_wu,
                                             need_wd)
        return (dx.to(x.dtype).view(x.shape) if dx is not None else None,
                *(_as(g, w.dtype) if g is not None else None
                  for g, w in zip(grads, (gate_weight, up_weight, down_weight), strict=True)))
    n_cols = wg.shape[0]
    slice_columns = slice_columns or mlp_slice_columns(x2.shape[0], n_cols, mm.itemsize)
    d_wg = torch.empty(wg.shape, dtype=mm, device=x.device) if need_wg else None
    d_wu = torch.empty(wu.shape, dtype=mm, device=x.device) if need_wu else None
    d_wd = torch.empty(wd.shape, dtype=mm, device=x.device) if need_wd else None
    dx = new_output(x2.shape, torch.float32, x.device) if need_x else None  # the first slice writes it
    need_ab = need_x or need_wg or need_wu
    for i, cols in enumerate(column_slices(n_cols, slice_columns)):
        width = cols.stop - cols.start
        ab_j = gate_up_slice(x2, wg, wu, cols)  # [gate_j | up_j], as in the forward
        a_j, b_j = ab_j[:, :width], ab_j[:, width:]
        c_j = glu_forward(a_j, b_j, activation, gate_multiplier=gate_multiplier, out_multiplier=down_multiplier)
        if need_wd:
            torch.mm(dout2.t(), c_j, out=d_wd[:, cols])
        if need_ab:
            torch.mm(dout2, wd[:, cols], out=c_j)  # dc_j, over c_j
            glu_backward(c_j, a_j, b_j, activation, da_out=a_j, db_out=b_j, gate_multiplier=gate_multiplier,
                         out_multiplier=down_multiplier)  # [da_j | db_j] over ab_j
        del c_j
        if need_wg:
            torch.mm(a_j.t(), x2, out=d_wg[cols])
        if need_wu:
            torch.mm(b_j.t(), x2, out=d_wu[cols])
        if need_x:  # dx += da_j Wg_j + db_j Wu_j, accumulated in fp32
            accumulate_mm(dx, a_j, wg[cols], first=i == 0)
            accumulate_mm(dx, b_j, wu[cols])
        del ab_j, a_j, b_j
    if need_x:
        dx = dx.to(x.dtype).view(x.shape)
    grads = [(_as(g, w.dtype) if g is not None else None)
             for g, w in ((d_wg, gate_weight), (d_wu, up_weight), (d_wd, down_weight))]
    return dx, *grads


def _glu_mlp(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor, activation: str,
             gate_multiplier: float, down_multiplier: float, matmul_dtype: torch.dtype, slice_columns: int,
             compute_output: bool, last_in_checkpoint: bool) -> Tensor:
    """(act(x Wg^T g) * (x Wu^T) d) Wd^T, contiguous [..., H] in ``matmul_dtype``; saves only x.
    ``compute_output=False`` returns an uninitialised output (checkpoint's recomputation that
    stops once x is saved: see glu_mlp_input_only); so does ``last_in_checkpoint`` while an
    eager checkpoint recomputes its region (found at run time; never while a CUDA graph is
    captured, whose replays could be of the first forward)."""
    check_glu_mlp_args(x, gate_weight, up_weight, down_weight, activation)
    if not compute_output or (last_in_checkpoint and not capturing() and in_checkpoint_recomputation()):
        return x.new_empty((*x.shape[:-1], down_weight.shape[0]), dtype=matmul_dtype)
    with autocast_off(x.device.type):
        return glu_mlp_forward(x, gate_weight, up_weight, down_weight, activation, (gate_multiplier, down_multiplier),
                               matmul_dtype, slice_columns)


# One body, two ops. tigon::glu_mlp is a triton_op (Inductor launches its kernels). A compiled
# call with ``last_in_checkpoint`` (a layer compiled on its own inside an eager checkpoint,
# torchtune's recipes) takes tigon::glu_mlp_in_eager_checkpoint, a plain custom op: its body
# must find out when it runs whether the checkpoint is recomputing it, which a traced body
# would decide once, at trace time.
glu_mlp_op = kernel_op("tigon::glu_mlp", mutates_args=())(_glu_mlp)
glu_mlp_in_eager_checkpoint_op = custom_op("tigon::glu_mlp_in_eager_checkpoint", mutates_args=())(_glu_mlp)


def _fake_glu_mlp(x, gate_weight, up_weight, down_weight, activation, gate_multiplier, down_multiplier, matmul_dtype,
                  slice_columns, compute_output, last_in_checkpoint):
    check_glu_mlp_args(x, gate_weight, up_weight, down_weight, activation)
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]), dtype=matmul_dtype)


@kernel_op("tigon::glu_mlp_backward", mutates_args=())
def glu_mlp_backward_op(dout: Tensor, x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor,
                        activation: str, gate_multiplier: float, down_multiplier: float, matmul_dtype: torch.dtype,
                        slice_columns: int, need_x: bool, need_gate_weight: bool, need_up_weight: bool,
                        need_down_weight: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_gate_weight, d_up_weight, d_down_weight), each like its input, empty where not needed."""
    with autocast_off(x.device.type):
        grads = glu_mlp_backward(dout, x, gate_weight, up_weight, down_weight, activation,
                                 (gate_multiplier, down_multiplier), matmul_dtype, slice_columns, need_x,
                                 need_gate_weight, need_up_weight, need_down_weight)
    return tuple(or_empty(g, x) for g in grads)


@glu_mlp_backward_op.register_fake
def _(dout, x, gate_weight, up_weight, down_weight, activation, gate_multiplier, down_multiplier, matmul_dtype,
      slice_columns, need_x, need_gate_weight, need_up_weight, need_down_weight):
    return (fake_grad(x, need_x, x), fake_grad(gate_weight, need_gate_weight, x),
            fake_grad(up_weight, need_up_weight, x), fake_grad(down_weight, need_down_weight, x))


def _glu_mlp_setup_context(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, activation, gate_multiplier, down_multiplier, mm, slice_columns, *_ = inputs
    ctx.save_for_backward(x)
    ctx.weights = (gate_weight, up_weight, down_weight)  # kept, not saved (see the note in tigon.ops._common)
    ctx.options = (activation, gate_multiplier, down_multiplier, mm, slice_columns)


def _glu_mlp_backward(ctx, dout):
    (x,) = ctx.saved_tensors
    needs = ctx.needs_input_grad[:4]
    grads = glu_mlp_backward_op(dout, x, *ctx.weights, *ctx.options, *needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None)


for _op in (glu_mlp_op, glu_mlp_in_eager_checkpoint_op):
    _op.register_fake(_fake_glu_mlp)
    _op.register_autograd(_glu_mlp_backward, setup_context=_glu_mlp_setup_context)


def glu_mlp_input_only(x, gate_weight, up_weight, down_weight, activation="silu", *, gate_multiplier=1.0,
                       down_multiplier=1.0, slice_columns=None, last_in_checkpoint=False):
    """glu_mlp_op with its non-tensor arguments checked and the matmul dtype picked (see
    tigon.functional.glu_mlp). In checkpoint's recomputation, when saving x is the last thing the
    recomputation needs, the op skips its matmuls (reads checkpoint's private state). Under
    torch.compile, which traces past that check, ``last_in_checkpoint`` (the caller's promise:
    nothing after this MLP in its checkpointed region is saved or returned, only the region's
    output depends on it) lets the op find the recomputation when it runs."""
    check_activation(activation, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    check_slice_columns(slice_columns)
    mm = matmul_dtype(x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    saves_x = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_weight, up_weight, down_weight))
    compute_output = torch.compiler.is_compiling() or not (saves_x and checkpoint_recompute_stops_after(1))
    op = glu_mlp_in_eager_checkpoint_op if last_in_checkpoint and torch.compiler.is_compiling() else glu_mlp_op
    return op(x, gate_weight, up_weight, down_weight, activation, float(gate_multiplier), float(down_multiplier), mm,
              slice_columns or 0, compute_output, bool(last_in_checkpoint))


# ---- which path ----

def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def glu_down(gate, up, down_proj, activation, gate_multiplier=1.0, down_multiplier=1.0):
    """down_proj(act(gate g) * up) * d from the gate / up projections' outputs (tigon owns them:
    their gradients are written over them). A plain nn.Linear down projection is fused
    (glu_down_proj, inplace); any other layer (LoRA, quantised) runs its own forward on the
    activation."""
    if type(down_proj) is nn.Linear:
        return glu_down_proj(gate, up, down_proj.weight, down_proj.bias, activation, inplace=True,
                             gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    check_activation(activation, gate_multiplier=gate_multiplier)
    out = down_proj(glu_op(gate, up, activation, float(gate_multiplier), 1.0))
    return out * down_multiplier if down_multiplier != 1.0 else out


def gated_mlp(x, gate_proj, up_proj, down_proj, activation, *, keep_input_only=True, gate_multiplier=1.0,
              down_multiplier=1.0, checkpointed=None, last_in_checkpoint=False):
    """down_proj(act(gate_proj(x) g) * up_proj(x)) * d for an MLP's three layers, by the path
    that saves the most: inside a checkpointed region, with gradients on, plain bias-free
    nn.Linear layers and ``keep_input_only`` (the caller's layer saves nothing after the MLP),
    glu_mlp_input_only, which keeps only x (the region's recomputation would form gate and up
    again anyway); otherwise ``glu_down``. ``checkpointed``: whether the call is inside one, or
    None to find out (eager: torch.utils.checkpoint's hooks; under torch.compile, which traces
    checkpointed regions without them, None counts as not checkpointed). ``last_in_checkpoint``:
    see glu_mlp_input_only."""
    if checkpointed is None:
        checkpointed = not torch.compiler.is_compiling() and under_checkpoint()
    if (keep_input_only and checkpointed and torch.is_grad_enabled() and _plain_linear(gate_proj)
            and _plain_linear(up_proj) and _plain_linear(down_proj)):
        return glu_mlp_input_only(x, gate_proj.weight, up_proj.weight, down_proj.weight, activation,
                                  gate_multiplier=gate_multiplier, down_multiplier=down_multiplier,
                                  last_in_checkpoint=last_in_checkpoint)
    return glu_down(gate_proj(x), up_proj(x), down_proj, activation, gate_multiplier, down_multiplier)
