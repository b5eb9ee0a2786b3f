"""The gated MLP out = (act(x Wg^T * g) * (x Wu^T)) Wd^T * d, in two forms, and the one place
that picks between them and sizes their slices.

x [..., H], gate / up weights [I, H], down weight [H, I]; act is one of tigon's GLU
activations (``tigon.ops.glu``); the multipliers g, d are 1 except in Falcon-H1.

- ``glu_down_proj`` (op ``tigon::glu_down``, ``tigon.ops.glu_down``): the activation and the down
  projection, from gate and up computed by the caller's layers.
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

import torch
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
from tigon.ops.glu import check_activation, glu_backward, glu_forward
from tigon.ops.glu_down import as_dtype, check_slice_columns, column_slices, glu_down

# ---- slice policy ----

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
    x2 = as_dtype(as_rows(x), mm)
    wg, wu, wd = as_dtype(gate_weight, mm), as_dtype(up_weight, mm), as_dtype(down_weight, mm)
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
    x2 = as_dtype(as_rows(x), mm)
    dout2 = as_dtype(as_rows(dout), mm)
    wg, wu, wd = as_dtype(gate_weight, mm), as_dtype(up_weight, mm), as_dtype(down_weight, mm)
    if traced(x2, dout2):
        dx, *grads = traced_glu_mlp_backward(dout2, x2, wg, wu, wd, activation, multipliers, need_x, need_wg, need_wu,
                                             need_wd)
        return (dx.to(x.dtype).view(x.shape) if dx is not None else None,
                *(as_dtype(g, w.dtype) if g is not None else None
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
    grads = [(as_dtype(g, w.dtype) if g is not None else None)
             for g, w in ((d_wg, gate_weight), (d_wu, up_weight), (d_wd, down_weight))]
    return dx, *grads



# ---- custom ops: torch.ops.tigon.glu_mlp and its backward (see tigon.ops.rms_norm) ----
#
# As glu_down's: the matmul dtype is an argument (the ops run with autocast off), and
# ``slice_columns`` 0 means the default slices of this file's policy.

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
"""tigon::glu_mlp: (act(x Wg^T g) * (x Wu^T) d) Wd^T of x [..., H], gate and up weights [I, H], down
weight [H, I], contiguous [..., H] in the matmul dtype; saves only x (gate and up are recomputed in
the backward in column slices). Called through tigon.functional.glu_mlp."""
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
