"""The activation and down projection of a gated MLP, out = ((act(a g) * b) Wd^T + bias) d, from
gate a and up b computed by the caller's layers (so LoRA or quantised gate / up layers keep their
own forward): op ``tigon::glu_down``, ``glu_down_proj``.

a, b [..., I]; down weight [H, I]; act is one of tigon's GLU activations (``tigon.ops.glu``); the
multipliers g, d are 1 except in Falcon-H1. It keeps a and b, not c = act(a) * b, and recomputes c
in the backward: one [tokens, I] activation fewer than autograd keeps. Its forward walks the rows
in slices (c is never whole: under gradient checkpointing this forward runs again inside the
backward, where a full c on top of a and b was a layer's memory peak); its backward walks the I
columns in slices: dc_j = dout W[:, j], c_j, dW[:, j] = dout^T c_j, then da_j / db_j. With
``inplace=True`` da and db are written over a and b (intermediates nothing else reads, as in an
MLP), so the backward allocates nothing of [tokens, I] and can run only once. ``glu_down`` takes
the down projection as a layer: fused when it is a plain nn.Linear.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tigon.ops._common import (
    as_rows,
    autocast_off,
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


def column_slices(n_cols: int, width: int):
    return [slice(start, min(start + width, n_cols)) for start in range(0, n_cols, width)]


def as_dtype(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)



# ---- activation + down projection ----

def glu_down_forward(a2, b2, w, bias, activation, multipliers, mm):
    """((act(a2 g) * b2) @ w^T + bias) d in row slices, as (act(a2 g) * b2 d) @ w^T + bias d;
    [M, I] x2 -> [M, H] in the matmul dtype ``mm`` (contiguous). Autocast must be off."""
    if bias is not None and multipliers[1] != 1.0:
        bias = bias * multipliers[1]
    n_rows = a2.shape[0]
    bias_mm = None if bias is None else as_dtype(bias, mm)
    # Traced (the triton_op under torch.compile): one slice, no loop over a symbolic row count
    # (it would specialize the graph on the token count); Inductor plans the memory.
    if traced(a2) or (step := down_proj_slice_rows(n_rows)) >= n_rows:
        c = glu_forward(a2, b2, activation, gate_multiplier=multipliers[0], out_multiplier=multipliers[1])
        return F.linear(as_dtype(c, mm), as_dtype(w, mm), bias_mm)
    w_t = as_dtype(w, mm).t()
    out = torch.empty((n_rows, w.shape[0]), dtype=mm, device=a2.device)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        c_r = as_dtype(glu_forward(a2[rows], b2[rows], activation, gate_multiplier=multipliers[0],
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
        d_weight = (dout2.t() @ as_dtype(c, mm)).to(w.dtype)
    if need_ab:
        da, db = glu_backward(dout2 @ as_dtype(w, mm), a2, b2, activation, gate_multiplier=multipliers[0],
                              out_multiplier=multipliers[1])
    return da, db, d_weight


def glu_down_backward(dout, a, b, w, bias, activation, multipliers, mm, slice_columns, need_ab, need_w, need_bias,
                      inplace=False):
    """(da, db, d_weight, d_bias) of glu_down_forward, each None when not needed; with ``inplace``
    da and db are written over a and b (then returned as None)."""
    gate_multiplier, down_multiplier = multipliers
    a2, b2 = as_rows(a), as_rows(b)
    dout2 = as_dtype(dout.reshape(-1, dout.shape[-1]), mm)
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
    w_mm = as_dtype(w, mm)
    for start in range(0, n_cols, slice_columns):
        cols = slice(start, min(start + slice_columns, n_cols))
        a_j, b_j = a2[:, cols], b2[:, cols]
        if need_w:
            c_j = as_dtype(glu_forward(a_j, b_j, activation, gate_multiplier=gate_multiplier,
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


# ---- custom ops: torch.ops.tigon.glu_down and its backwards (see tigon.ops.rms_norm) ----
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
