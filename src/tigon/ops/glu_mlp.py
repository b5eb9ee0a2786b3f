"""Gated MLP out = (act(x @ Wg^T) * (x @ Wu^T)) @ Wd^T that saves only x for its backward.

x [..., H], gate_weight / up_weight [I, H], down_weight [H, I] -> out [..., H]. Meant for
layers under gradient checkpointing (torch.utils.checkpoint, non-reentrant), where the layer's
forward runs twice anyway:

- Nothing of size [tokens, I] is saved. The backward recomputes gate and up one column slice of
  I at a time (into one [a_j | b_j] buffer), and from them c_j, dW_down[:, j], dc_j, da_j / db_j
  (written over a_j / b_j), dW_gate[j], dW_up[j] and dx += da_j Wg_j + db_j Wu_j (fp32
  accumulation). Its transient memory is three [tokens, slice]
  buffers and an fp32 dx, instead of the two [tokens, I] activations (gate and up) that an MLP
  keeps for its backward.
- In checkpoint's recomputation, when saving this op's inputs is the last thing the recompute
  needs (checkpoint's early stop: the MLP is the last op of a Llama-style layer that saves
  anything), the forward skips its three matmuls: its output is never read.

Per layer under checkpointing this is the FLOPs of 11 matmuls (3 forward, 8 backward) where an
MLP that keeps gate and up does 12 (3 forward, 3 again in the recompute, 6 backward). The forward
runs in wider slices than the backward (it is not at the memory peak), so the recomputed gate and
up may differ from the forward's in the last bit, as with any recomputation.
"""

from __future__ import annotations

import torch

from tigon.ops._common import (
    accumulate_mm,
    as_rows,
    check_same_device,
    check_tensor,
    checkpoint_recompute_stops_after,
    matmul_dtype,
    new_output,
)
from tigon.ops.glu import ACTIVATIONS, glu_backward, glu_forward

# Bytes of one [tokens, slice] buffer (three are live in the backward). H100, a Llama-1B MLP block
# under checkpoint, fwd+bwd at 8192 tokens (benchmarks/mlp_checkpoint.py): budgets of 16 / 32 /
# 64 / 128 MiB took 6.38 / 5.06 / 4.93 / 5.02 ms (peak 112 / 160 / 256 / 448 MiB), against 5.45 ms
# (256 MiB) for the path that keeps gate and up. Below 32 MiB the fp32 dx, read and written once
# per slice, and the narrower matmuls cost more than they save.
SLICE_BUDGET_BYTES = 32 * 2**20
# The forward runs before the peak (the end of the backward, when the gradients exist), so its
# slices are 4x wider: at 8192 tokens of a Llama-1B MLP, one slice instead of four, 4 host calls
# instead of 13 (the forward of a checkpointed step is host-bound on slow hosts).
FORWARD_SLICE_BUDGET_BYTES = 128 * 2**20
# Narrower slices than this cost more than they save: more matmuls, and the fp32 dx read and
# written once more per slice (with 512- and 256-column slices a Llama-1B step at batch 32 and
# 64 x 1024 ran 11% and 28% slower than with the MLP that keeps gate and up).
MIN_SLICE_COLUMNS = 2048


def mlp_slice_columns(n_rows: int, n_cols: int, element_size: int, budget: int | None = None) -> int:
    """Columns of one slice of the intermediate (a multiple of 64, or all of I)."""
    budget = SLICE_BUDGET_BYTES if budget is None else budget
    width = budget // max(1, n_rows * element_size)
    width = max(MIN_SLICE_COLUMNS, width // 64 * 64)
    return min(n_cols, width)


def column_slices(n_cols: int, width: int):
    return [slice(start, min(start + width, n_cols)) for start in range(0, n_cols, width)]


def check_glu_mlp_args(x, gate_weight, up_weight, down_weight, activation):
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
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    check_same_device(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)


def _as(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def gate_up_slice(x2, wg, wu, cols):
    """[gate_j | up_j] = [x Wg_j^T | x Wu_j^T] for the column slice ``cols``, as one [rows, 2w]
    buffer written by two matmuls (no stacked copy of the weights)."""
    width = cols.stop - cols.start
    out = torch.empty((x2.shape[0], 2 * width), dtype=x2.dtype, device=x2.device)
    torch.mm(x2, wg[cols].t(), out=out[:, :width])
    torch.mm(x2, wu[cols].t(), out=out[:, width:])
    return out


class GLUMLPFunction(torch.autograd.Function):
    """out = (act(x Wg^T) * (x Wu^T)) Wd^T, saving x only; see the module docstring."""

    # Recomputations skipped since import (a counter for tests and benchmarks).
    skipped_recomputes = 0

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate_weight, up_weight, down_weight, activation="silu", slice_columns=None):
        check_glu_mlp_args(x, gate_weight, up_weight, down_weight, activation)
        mm = matmul_dtype(x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
        ctx.save_for_backward(x)
        ctx.weights = (gate_weight, up_weight, down_weight)  # kept, not saved (see the note in tigon.ops._common)
        ctx.activation = activation
        ctx.matmul_dtype = mm
        out_shape = (*x.shape[:-1], down_weight.shape[0])
        n_rows, n_cols = x.numel() // max(1, x.shape[-1]), gate_weight.shape[0]
        element_size = torch.finfo(mm).bits // 8
        ctx.slice_columns = slice_columns or mlp_slice_columns(n_rows, n_cols, element_size)
        if checkpoint_recompute_stops_after(1):
            GLUMLPFunction.skipped_recomputes += 1
            return x.new_empty(out_shape, dtype=mm)  # checkpoint stops once x is saved (above)
        x2 = _as(as_rows(x), mm)
        wg, wu, wd = _as(gate_weight, mm), _as(up_weight, mm), _as(down_weight, mm)
        forward_columns = slice_columns or mlp_slice_columns(n_rows, n_cols, element_size,
                                                             FORWARD_SLICE_BUDGET_BYTES)
        c = torch.empty((n_rows, n_cols), dtype=mm, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for cols in column_slices(n_cols, forward_columns):
                ab_j = gate_up_slice(x2, wg, wu, cols)
                width = cols.stop - cols.start
                glu_forward(ab_j[:, :width], ab_j[:, width:], activation, out=c[:, cols])
                del ab_j
            out = c @ wd.t()
        return out.view(out_shape)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        gate_weight, up_weight, down_weight = ctx.weights
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
        mm, act = ctx.matmul_dtype, ctx.activation
        x2 = _as(as_rows(x), mm)
        dout2 = _as(as_rows(dout), mm)
        wg, wu, wd = _as(gate_weight, mm), _as(up_weight, mm), _as(down_weight, mm)
        n_cols = wg.shape[0]
        d_wg = torch.empty(wg.shape, dtype=mm, device=x.device) if need_wg else None
        d_wu = torch.empty(wu.shape, dtype=mm, device=x.device) if need_wu else None
        d_wd = torch.empty(wd.shape, dtype=mm, device=x.device) if need_wd else None
        dx = new_output(x2.shape, torch.float32, x.device) if need_x else None  # the first slice writes it
        need_ab = need_x or need_wg or need_wu
        for i, cols in enumerate(column_slices(n_cols, ctx.slice_columns)):
            width = cols.stop - cols.start
            ab_j = gate_up_slice(x2, wg, wu, cols)  # [gate_j | up_j], as in the forward
            a_j, b_j = ab_j[:, :width], ab_j[:, width:]
            c_j = glu_forward(a_j, b_j, act)
            if need_wd:
                torch.mm(dout2.t(), c_j, out=d_wd[:, cols])
            if need_ab:
                torch.mm(dout2, wd[:, cols], out=c_j)  # dc_j, over c_j
                glu_backward(c_j, a_j, b_j, act, da_out=a_j, db_out=b_j)  # [da_j | db_j] over ab_j
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
        return (dx, *grads, None, None)
