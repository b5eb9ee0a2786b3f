"""ReLU²: y = relu(x)^2 elementwise (Primer's squared ReLU; transformers' ACT2FN["relu2"]).

x [...] of any shape; fp32 arithmetic, one rounding to x's dtype. The backward is
dx = 2 relu(x) dy. NaN propagates as in torch (relu(NaN) = NaN). Row-strided views are read in
place; other layouts are copied once. The backward kernel can also store y (the ReLU² MLP's
backward recomputes the activation there: ``tigon.ops.relu_squared_mlp``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import as_rows, cdiv, check_tensor, kernel_op, new_output
from tigon.ops._internals import launch
from tigon.ops.glu import glu_launch_config


@triton.jit
def relu_squared_forward_kernel(X, stride_x, Y, stride_y, n_cols, blocks_per_row, BLOCK: tl.constexpr):
    """1-D grid over (row, column block) pairs; contiguous tensors arrive as a single row."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)  # not tl.maximum: NaN must stay NaN, as torch.relu
    tl.store(Y + row * stride_y + cols, (r * r).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def relu_squared_backward_kernel(
    DY, stride_dy, X, stride_x, DX, stride_dx, Y, stride_y, n_cols, blocks_per_row,
    STORE_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    """dx = 2 relu(x) dy; with STORE_Y also y = relu(x)^2. DX may alias X or DY, and Y may alias
    DY or X: each element is read before it is written, by the same program."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)
    tl.store(DX + row * stride_dx + cols, (2.0 * r * dy).to(DX.dtype.element_ty), mask=mask)
    if STORE_Y:
        tl.store(Y + row * stride_y + cols, (r * r).to(Y.dtype.element_ty), mask=mask)


def _rows(*tensors):
    """[M, N] views (unit last stride) as (rows, row length, row strides): one long row when all
    are contiguous, so no program is spent on a row's ragged tail."""
    n_rows, n_cols = tensors[0].shape
    if all(t.stride(0) == n_cols or n_rows == 1 for t in tensors):
        return 1, n_rows * n_cols, [0] * len(tensors)
    return n_rows, n_cols, [t.stride(0) for t in tensors]


def relu_squared_forward(x2, out=None):
    """x2 [M, N] (unit last stride) -> y [M, N] in x2's dtype (written into ``out`` when given)."""
    y = out if out is not None else new_output(x2.shape, x2.dtype, x2.device)
    if x2.numel():
        n_rows, n_cols, (sx, sy) = _rows(x2, y)
        block, num_warps = glu_launch_config(x2.shape[1])
        blocks_per_row = cdiv(n_cols, block)
        launch(relu_squared_forward_kernel, (n_rows * blocks_per_row,), x2, sx, y, sy, n_cols, blocks_per_row,
               BLOCK=block, num_warps=num_warps)
    return y


def relu_squared_backward(dy2, x2, dx_out=None, y_out=None):
    """dy2, x2 [M, N] (unit last strides) -> dx [M, N] (into ``dx_out`` when given, else in x2's
    dtype); with ``y_out``, relu(x2)^2 is written there too. Outputs may alias the inputs."""
    dx = dx_out if dx_out is not None else new_output(x2.shape, x2.dtype, x2.device)
    if x2.numel():
        y = y_out if y_out is not None else dx
        n_rows, n_cols, (sdy, sx, sdx, sy) = _rows(dy2, x2, dx, y)
        block, num_warps = glu_launch_config(x2.shape[1])
        blocks_per_row = cdiv(n_cols, block)
        launch(relu_squared_backward_kernel, (n_rows * blocks_per_row,), dy2, sdy, x2, sx, dx, sdx, y, sy, n_cols,
               blocks_per_row, STORE_Y=y_out is not None, BLOCK=block, num_warps=num_warps)
    return dx


def _as_rows_any(t):
    return as_rows(t.reshape(1) if t.ndim == 0 else t)


# ---- custom ops: torch.ops.tigon.relu_squared and its backward (see tigon.ops.rms_norm) ----

@kernel_op("tigon::relu_squared", mutates_args=())
def relu_squared_op(x: Tensor) -> Tensor:
    """relu(x)^2, contiguous, of x [...] (float32, float16 or bfloat16)."""
    check_tensor("x", x)
    return relu_squared_forward(_as_rows_any(x)).view(x.shape)


@relu_squared_op.register_fake
def _(x):
    check_tensor("x", x)
    return x.new_empty(x.shape)


@kernel_op("tigon::relu_squared_backward", mutates_args=())
def relu_squared_backward_op(dy: Tensor, x: Tensor) -> Tensor:
    """dx = 2 relu(x) dy, contiguous, in x's dtype."""
    return relu_squared_backward(_as_rows_any(dy), _as_rows_any(x)).view(x.shape)


@relu_squared_backward_op.register_fake
def _(dy, x):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return relu_squared_backward_op(dy, x)


relu_squared_op.register_autograd(_backward, setup_context=_setup_context)
