"""The ReLU² MLP (Nemotron's, Primer's): out = relu(x Wu^T + bu)^2 Wd^T + bd.

x [..., H], up_weight [I, H], down_weight [H, I], biases [I] / [H] or None; out [..., H] in the
matmul dtype (autocast's when it is on, else x's). One op (``tigon::relu_squared_mlp``) that keeps
x and the pre-activation a = x Wu^T + bu for the backward, not relu(a)^2: autograd over the eager
module keeps relu(a) and relu(a)^2 (two [tokens, I] activations), this op one.

- Forward: a in one matmul, then c = relu(a)^2 and out = c Wd^T + bd in row slices (c is never
  whole: a quarter of it at most, as ``glu_down_proj``'s forward).
- Backward, in column slices of I (``tigon.ops.glu_mlp``'s slice policy): dc_j = dout Wd[:, j],
  then one kernel reads a_j and dc_j and writes da_j = 2 relu(a_j) dc_j and c_j = relu(a_j)^2
  (over dc_j), dWd[:, j] = dout^T c_j. Then dWu = da^T x, dbu = sum(da), dx = da Wu: six matmuls
  in all, as autograd's, and one [tokens, slice] buffer of transient. da is written over a when
  autograd frees the graph after this backward (``_internals.graph_retained``) and nothing traces
  it, else into a new buffer, so a second backward over a retained graph is exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tigon.ops._common import (
    as_rows,
    autocast_off,
    check_same_device,
    check_tensor,
    custom_op,
    fake_grad,
    matmul_dtype,
    new_output,
    or_empty,
    traced,
)
from tigon.ops._internals import graph_retained
from tigon.ops.glu_down import check_slice_columns, column_slices, down_proj_slice_columns, down_proj_slice_rows
from tigon.ops.relu_squared import relu_squared_backward, relu_squared_forward


def _as(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def check_relu_squared_mlp_args(x, up_weight, down_weight, up_bias, down_bias):
    check_tensor("x", x, min_ndim=1)
    check_tensor("up_weight", up_weight, ndim=2)
    check_tensor("down_weight", down_weight, ndim=2)
    hidden, inter = x.shape[-1], up_weight.shape[0]
    if up_weight.shape[1] != hidden:
        raise ValueError(f"up_weight has shape {tuple(up_weight.shape)}; expected [I, H] with H = x's last dim "
                         f"{hidden}")
    if tuple(down_weight.shape) != (hidden, inter):
        raise ValueError(f"down_weight has shape {tuple(down_weight.shape)}; expected [H, I] = {[hidden, inter]}")
    for name, bias, size in (("up_bias", up_bias, inter), ("down_bias", down_bias, hidden)):
        if bias is not None:
            check_tensor(name, bias, ndim=1)
            if bias.shape[0] != size:
                raise ValueError(f"{name} has shape {tuple(bias.shape)}; expected [{size}]")
    check_same_device(x=x, up_weight=up_weight, down_weight=down_weight, up_bias=up_bias, down_bias=down_bias)


def relu_squared_mlp_forward(x, up_weight, down_weight, up_bias, down_bias, mm):
    """(out [rows, H], a [rows, I]), both contiguous in ``mm``. Autocast must be off."""
    x2 = _as(as_rows(x), mm)
    wd, bd = _as(down_weight, mm), _as(down_bias, mm)
    pre = F.linear(x2, _as(up_weight, mm), _as(up_bias, mm))
    n_rows = pre.shape[0]
    step = down_proj_slice_rows(n_rows)
    if step >= n_rows:
        return F.linear(relu_squared_forward(pre), wd, bd), pre
    out = torch.empty((n_rows, wd.shape[0]), dtype=mm, device=x.device)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        c_r = relu_squared_forward(pre[rows])
        if bd is None:
            torch.mm(c_r, wd.t(), out=out[rows])
        else:
            torch.addmm(bd, c_r, wd.t(), out=out[rows])
        del c_r
    return out, pre


def relu_squared_mlp_backward(dout, x, pre, up_weight, down_weight, up_bias, down_bias, mm, slice_columns, needs,
                              inplace=False):
    """(dx, d_up_weight, d_down_weight, d_up_bias, d_down_bias), each None where ``needs`` (five
    flags, in that order) says so. ``inplace``: da is written over ``pre`` (contiguous). Autocast
    must be off."""
    need_x, need_wu, need_wd, need_bu, need_bd = needs
    need_da = need_x or need_wu or need_bu
    x2 = _as(as_rows(x), mm)
    dout2 = _as(as_rows(dout), mm)
    pre2 = pre if inplace else as_rows(pre)
    wu, wd = _as(up_weight, mm), _as(down_weight, mm)
    n_cols = pre2.shape[1]
    width = slice_columns or down_proj_slice_columns(n_cols)
    d_wd = torch.empty(wd.shape, dtype=mm, device=x.device) if need_wd else None
    da = None
    if need_da:
        da = pre2 if inplace else new_output(pre2.shape, mm, x.device)
    for cols in column_slices(n_cols, width):
        if need_da:
            buf = dout2 @ wd[:, cols]  # dc_j, then c_j over it
            relu_squared_backward(buf, pre2[:, cols], dx_out=da[:, cols], y_out=buf if need_wd else None)
        elif need_wd:
            buf = relu_squared_forward(pre2[:, cols])
        else:
            break
        if need_wd:
            torch.mm(dout2.t(), buf, out=d_wd[:, cols])
        del buf
    dx = d_wu = d_bu = d_bd = None
    if need_bd:
        d_bd = dout2.sum(0, dtype=torch.float32).to(down_bias.dtype)
    if need_bu:
        d_bu = da.sum(0, dtype=torch.float32).to(up_bias.dtype)
    if need_wu:
        d_wu = _as(da.t() @ x2, up_weight.dtype)
    if need_x:
        dx = (da @ wu).to(x.dtype).view(x.shape)
    return dx, d_wu, _as(d_wd, down_weight.dtype), d_bu, d_bd


# ---- custom ops: torch.ops.tigon.relu_squared_mlp and its backwards (see tigon.ops.glu_mlp) ----
#
# The matmul dtype is an argument, picked by the caller from the autocast state; the ops run with
# autocast off. ``slice_columns`` 0: the default slices of the backward.


@custom_op("tigon::relu_squared_mlp", mutates_args=())
def relu_squared_mlp_op(x: Tensor, up_weight: Tensor, down_weight: Tensor, up_bias: Tensor | None,
                        down_bias: Tensor | None, matmul_dtype: torch.dtype, slice_columns: int
                        ) -> tuple[Tensor, Tensor]:
    """(out [..., H], a [rows, I]): out = relu(a)^2 Wd^T + bd with a = x Wu^T + bu, both
    contiguous in ``matmul_dtype``. a is the backward's buffer (the functional API does not
    return it): the eager backward writes da over it when the graph is freed after it."""
    check_relu_squared_mlp_args(x, up_weight, down_weight, up_bias, down_bias)
    with autocast_off(x.device.type):
        out, pre = relu_squared_mlp_forward(x, up_weight, down_weight, up_bias, down_bias, matmul_dtype)
    return out.view(*x.shape[:-1], out.shape[-1]), pre


@relu_squared_mlp_op.register_fake
def _(x, up_weight, down_weight, up_bias, down_bias, matmul_dtype, slice_columns):
    check_relu_squared_mlp_args(x, up_weight, down_weight, up_bias, down_bias)
    return (x.new_empty((*x.shape[:-1], down_weight.shape[0]), dtype=matmul_dtype),
            x.new_empty((math.prod(x.shape[:-1]), up_weight.shape[0]), dtype=matmul_dtype))


@custom_op("tigon::relu_squared_mlp_backward", mutates_args=())
def relu_squared_mlp_backward_op(dout: Tensor, x: Tensor, pre: Tensor, up_weight: Tensor, down_weight: Tensor,
                                 up_bias: Tensor | None, down_bias: Tensor | None, matmul_dtype: torch.dtype,
                                 slice_columns: int, need_x: bool, need_up_weight: bool, need_down_weight: bool,
                                 need_up_bias: bool, need_down_bias: bool
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_up_weight, d_down_weight, d_up_bias, d_down_bias), each like its input, empty where
    not needed."""
    needs = (need_x, need_up_weight, need_down_weight, need_up_bias, need_down_bias)
    with autocast_off(x.device.type):
        grads = relu_squared_mlp_backward(dout, x, pre, up_weight, down_weight, up_bias, down_bias, matmul_dtype,
                                          slice_columns, needs)
    return tuple(or_empty(g, x) for g in grads)


def _fake_grads(x, up_weight, down_weight, up_bias, down_bias, needs):
    return tuple(fake_grad(t, need, x) for t, need in zip((x, up_weight, down_weight, up_bias, down_bias), needs))


@relu_squared_mlp_backward_op.register_fake
def _(dout, x, pre, up_weight, down_weight, up_bias, down_bias, matmul_dtype, slice_columns, *needs):
    return _fake_grads(x, up_weight, down_weight, up_bias, down_bias, needs)


@custom_op("tigon::relu_squared_mlp_backward_", mutates_args=("pre",))
def relu_squared_mlp_backward_inplace_op(dout: Tensor, x: Tensor, pre: Tensor, up_weight: Tensor,
                                         down_weight: Tensor, up_bias: Tensor | None, down_bias: Tensor | None,
                                         matmul_dtype: torch.dtype, slice_columns: int, need_x: bool,
                                         need_up_weight: bool, need_down_weight: bool, need_up_bias: bool,
                                         need_down_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """relu_squared_mlp_backward with da written over ``pre`` (contiguous [rows, I], read no more)."""
    needs = (need_x, need_up_weight, need_down_weight, need_up_bias, need_down_bias)
    with autocast_off(x.device.type):
        grads = relu_squared_mlp_backward(dout, x, pre, up_weight, down_weight, up_bias, down_bias, matmul_dtype,
                                          slice_columns, needs, inplace=True)
    return tuple(or_empty(g, x) for g in grads)


@relu_squared_mlp_backward_inplace_op.register_fake
def _(dout, x, pre, up_weight, down_weight, up_bias, down_bias, matmul_dtype, slice_columns, *needs):
    return _fake_grads(x, up_weight, down_weight, up_bias, down_bias, needs)


def _setup_context(ctx, inputs, output):
    x, up_weight, down_weight, up_bias, down_bias, mm, slice_columns = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.params = (up_weight, down_weight, up_bias, down_bias)  # kept, not saved (see tigon.ops._common)
    ctx.options = (mm, slice_columns)


def _backward(ctx, dout, _dpre):
    if dout is None:
        return None, None, None, None, None, None, None
    x, pre = ctx.saved_tensors
    _, _, up_bias, down_bias = ctx.params
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2],
             ctx.needs_input_grad[3] and up_bias is not None, ctx.needs_input_grad[4] and down_bias is not None)
    need_da = needs[0] or needs[1] or needs[3]
    # Writing da over a: eager autograd only, and only when this backward is the graph's last.
    if need_da and pre.is_contiguous() and not traced(dout, x, pre) and not graph_retained():
        op = relu_squared_mlp_backward_inplace_op
    else:
        op = relu_squared_mlp_backward_op
    grads = op(dout, x, pre, *ctx.params, *ctx.options, *needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None)


relu_squared_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def relu_squared_mlp(x, up_weight, down_weight, up_bias=None, down_bias=None, *, slice_columns=None):
    """relu_squared_mlp_op's output with the matmul dtype picked (see
    tigon.functional.relu_squared_mlp); ``slice_columns``: the backward's slice width."""
    check_slice_columns(slice_columns)
    mm = matmul_dtype(x, up_weight=up_weight, down_weight=down_weight)
    return relu_squared_mlp_op(x, up_weight, down_weight, up_bias, down_bias, mm, slice_columns or 0)[0]
