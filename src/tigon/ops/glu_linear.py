"""GLU activation followed by the down projection, with the activation recomputed in backward.

out = (act(a) * b) @ down_weight^T (+ down_bias), for a, b [..., I] and down_weight [H, I].
Autograd would keep c = act(a) * b alive for the down projection's weight gradient; this
function keeps only a and b and recomputes c (one cheap elementwise pass) in the backward,
saving one [tokens, I] activation per MLP layer.

The forward walks the rows in slices (c_r = act(a_r) * b_r, out_r = c_r @ W^T), so c is never
whole: under gradient checkpointing this forward runs again inside the backward, where a full
[tokens, I] c on top of the saved a and b was a layer's memory peak. Each output row is still
one matmul over all of I (no extra rounding).

The backward walks the I columns in slices: dc_j = dout @ W[:, j], c_j, dW[:, j] = dout^T c_j,
then da_j / db_j. Its transient memory is two [tokens, I / n_slices] buffers, not
two [tokens, I]. With reuse_inputs=True, da and db are written over a and b (dead after their
slice is read), so the backward allocates nothing of [tokens, I]; a and b must then be
intermediates nothing else reads (as in an MLP), and the backward can run only once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon.ops._common import as_rows, check_same_device, check_tensor, matmul_dtype, new_output
from tigon.ops.glu import check_glu_args, glu_backward, glu_forward

# Columns per backward slice: slices stay large matmuls (N >= 1024) while the transient (dc_j
# and c_j) is half an intermediate. H100 (benchmarks/mlp_slices.py, fwd+bwd of a SwiGLU MLP):
# 1 / 2 / 4 slices took 12.52 / 12.38 / 12.82 ms at T8192 H4096 I14336 and 30.86 / 31.19 / 31.24
# ms at T65536 H2048 I8192; 2 and 4 had the same peak memory, 1 had 48-288 MB more.
BACKWARD_SLICES = 2
MIN_SLICE_COLUMNS = 1024
# Rows per forward slice: c_r is at most a quarter of c, and slices of >= 2048 rows keep the
# matmuls large.
FORWARD_SLICES = 4
MIN_SLICE_ROWS = 2048


def backward_slice_columns(n_cols: int, min_columns: int = MIN_SLICE_COLUMNS) -> int:
    """Columns of one backward slice of an I = n_cols wide intermediate (a multiple of 64)."""
    width = -(-n_cols // BACKWARD_SLICES)
    width = -(-width // 64) * 64
    return min(n_cols, max(width, min_columns))


def forward_slice_rows(n_rows: int) -> int:
    """Rows of one forward slice (a multiple of 64, or all rows)."""
    rows = -(-n_rows // FORWARD_SLICES)
    if rows > 64:
        rows = -(-rows // 64) * 64
    return min(n_rows, max(rows, MIN_SLICE_ROWS))


def glu_down_forward(a2, b2, w, bias, activation):
    """(act(a2) * b2) @ w^T + bias in row slices; [M, I] x2 -> [M, H]. Matmuls in the autocast
    dtype when autocast is on, else in a2's dtype (w must then match it, as F.linear)."""
    n_rows = a2.shape[0]
    step = forward_slice_rows(n_rows)
    if step >= n_rows:
        return F.linear(glu_forward(a2, b2, activation), w, bias)  # autocast, if on, picks the matmul dtype
    device_type = a2.device.type
    mm = matmul_dtype(a2, down_weight=w)
    w_t = w.to(mm).t()
    bias_mm = None if bias is None else bias.to(mm)
    out = torch.empty((n_rows, w.shape[0]), dtype=mm, device=a2.device)
    with torch.autocast(device_type, enabled=False):
        for start in range(0, n_rows, step):
            rows = slice(start, min(start + step, n_rows))
            c_r = glu_forward(a2[rows], b2[rows], activation).to(mm)
            if bias_mm is None:
                torch.mm(c_r, w_t, out=out[rows])
            else:
                torch.addmm(bias_mm, c_r, w_t, out=out[rows])
            del c_r
    return out


class GLUDownProjFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a, b, down_weight, down_bias=None, activation="silu", reuse_inputs=False,
                slice_columns=None):
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
        a2, b2 = as_rows(a), as_rows(b)
        out = glu_down_forward(a2, b2, down_weight, down_bias, activation)
        ctx.save_for_backward(a2, b2, down_weight)
        ctx.activation = activation
        ctx.matmul_dtype = out.dtype
        ctx.bias_dtype = None if down_bias is None else down_bias.dtype
        ctx.reuse_inputs = bool(reuse_inputs)
        ctx.slice_columns = slice_columns or backward_slice_columns(a2.shape[1])
        ctx.consumed = False
        return out.view(*a.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        if ctx.consumed:
            raise RuntimeError(
                "GLUDownProjFunction with reuse_inputs=True wrote its backward over a and b, so it cannot "
                "run backward twice (retain_graph=True); use reuse_inputs=False for that"
            )
        a2, b2, w = ctx.saved_tensors
        mm = ctx.matmul_dtype
        dout2 = dout.reshape(-1, dout.shape[-1]).to(mm)
        need_w, need_bias = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_ab = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n_cols = a2.shape[1]
        d_bias = da = db = d_weight = None
        if need_bias:
            d_bias = dout2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if need_w:
            d_weight = new_output(w.shape, w.dtype, w.device)
        in_place = ctx.reuse_inputs and a2.dtype == mm
        if need_ab:
            da = a2 if in_place else new_output(a2.shape, a2.dtype, a2.device)
            db = b2 if in_place else new_output(b2.shape, b2.dtype, b2.device)
        w_mm = w.to(mm)
        for start in range(0, n_cols, ctx.slice_columns):
            cols = slice(start, min(start + ctx.slice_columns, n_cols))
            a_j, b_j = a2[:, cols], b2[:, cols]
            if need_w:
                c_j = glu_forward(a_j, b_j, ctx.activation).to(mm)
                if d_weight.dtype == mm:
                    torch.mm(dout2.t(), c_j, out=d_weight[:, cols])
                else:
                    d_weight[:, cols] = dout2.t() @ c_j
                del c_j
            if need_ab:
                dc_j = dout2 @ w_mm[:, cols]
                glu_backward(dc_j, a_j, b_j, ctx.activation, da_out=da[:, cols], db_out=db[:, cols])
                del dc_j
        if need_ab:
            if in_place:
                ctx.consumed = True
                # a and b were overwritten: a later reader of them raises instead of misreading.
                for t in (a2, b2):
                    torch.autograd.graph.increment_version(t)
            shape = dout.shape[:-1] + (n_cols,)
            da, db = da.view(shape), db.view(shape)
        return da, db, d_weight, d_bias, None, None, None
