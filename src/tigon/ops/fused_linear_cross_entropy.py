"""Fused linear + cross entropy: loss(x @ W^T + b, y) without the [rows, V] logits.

The rows of x are taken in chunks. For each chunk: logits = x_c @ W^T (+ b) into one reused
[chunk, V] buffer, the cross-entropy kernel turns it in place into d loss / d logits, then
dx_c = dlogits @ W and dW += dlogits^T @ x_c (db += column sums). All three matmuls run in the
forward pass; the backward only scales the stored gradients by grad_output (a launch, no pass
over memory, when grad_output == 1). With reduction="none" the gradient depends on a per-row
grad_output, so the forward computes the losses only and the backward recomputes each chunk's
logits (four matmuls instead of three). The chunk walk itself (``linear_loss_chunks``) also
serves the vocabulary-sharded head (tigon.ops.vocab_parallel_linear_cross_entropy).

Chunk size trade-off (``chunk_rows_for_budget``): the chunk's logits take rows * V elements of
x's dtype. Larger chunks mean fewer, larger matmuls and fewer launches (small batches run in
one chunk), and fewer read-modify-writes of dW; smaller chunks mean less memory. dW is
accumulated by cuBLAS in fp32 within each chunk and stored in W's dtype between chunks (one
rounding per chunk); ``accum_dtype=torch.float32`` keeps an fp32 accumulator instead, at
V * H * 4 bytes.

Custom ops: ``torch.ops.tigon.fused_linear_cross_entropy`` returns the gradients it forms as
extra (non-differentiable) outputs, saved for its registered backward, which scales them
(``scaled_gradient``: in place in eager when the graph is freed); reduction "none" recomputes in
``tigon::fused_linear_cross_entropy_backward``. With tied embeddings the backward may hand dW to
the embedding's (``TiedGradSlot`` in tigon.ops.embedding; eager only).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tigon.ops._common import (
    accumulate_mm,
    cdiv,
    check_same_device,
    check_tensor,
    chunk_budget_bytes,
    custom_op,
    fake_grad,
    new_output,
    or_empty,
)
from tigon.ops._cross_entropy_common import (
    N_OPTIONS,
    CrossEntropyOptions,
    check_option_values,
    check_target_and_class_weight,
    checked_norms,
    cross_entropy_norms,
    fake_op_loss_outputs,
    kernel_target_and_options,
    op_loss_outputs,
)
from tigon.ops._gradient_scaling import scale_rows, scaled_gradient
from tigon.ops.cross_entropy import cross_entropy_rows
from tigon.ops.embedding import current_tied_slot


def chunk_rows_for_budget(n_rows: int, vocab: int, element_size: int, budget_bytes: int) -> int:
    """Rows per chunk: as many as fit the budget, then evened out over the chunks needed (so
    the last chunk is not a sliver), in multiples of 64 rows where that is possible."""
    fit = max(1, budget_bytes // max(1, vocab * element_size))
    if fit >= n_rows:
        return max(1, n_rows)
    if fit >= 64:
        fit = fit // 64 * 64
    n_chunks = cdiv(n_rows, fit)
    rows = cdiv(n_rows, n_chunks)
    return min(fit, cdiv(rows, 64) * 64) if fit >= 64 else rows


def linear_loss_chunks(x2, w, bias, chunk_rows, chunk_loss, *, need_dx, need_dw, need_db, accum_dtype,
                       row_scale=None):
    """The chunk walk of a loss over a linear head's logits: for each chunk of rows [start, stop)
    of x2 [rows, H], logits = x_c @ w.T (+ bias) [chunk, V] into one reused buffer (matmuls in
    x2's dtype), then ``chunk_loss(logits, start, stop, grad)`` -> the chunk's row outputs (a
    tuple), writing d loss / d logits for grad_output = 1 over logits when ``grad`` is logits
    (None: no gradient wanted). From those: dx (x2's dtype), dw (accum_dtype or w's), db (fp32)
    as asked, for grad_output 1 or per-row grad_output ``row_scale`` [rows]. Returns (the row
    outputs of each chunk, dx, dw, db), None for each gradient not asked for."""
    n_rows, _ = x2.shape
    vocab = w.shape[0]
    device = x2.device
    compute_grad = need_dx or need_dw or need_db
    wc = w if w.dtype == x2.dtype else w.to(x2.dtype)  # matmuls in x's dtype (as autocast would)
    bc = None if bias is None else bias.to(x2.dtype)
    dx = new_output(x2.shape, x2.dtype, device) if need_dx else None
    dw = None
    if need_dw:
        dw_dtype = accum_dtype or w.dtype
        # The first chunk's matmul writes dW outright (no zero fill).
        dw = (new_output if n_rows > 0 else torch.zeros)(w.shape, dtype=dw_dtype, device=device)
    db = torch.zeros(vocab, dtype=torch.float32, device=device) if need_db else None
    outputs = []
    logits_buf = torch.empty((min(chunk_rows, n_rows), vocab), dtype=x2.dtype, device=device)
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        xc = x2[start:stop]
        logits = logits_buf[: stop - start]
        if bc is not None:
            torch.addmm(bc, xc, wc.t(), out=logits)
        else:
            torch.mm(xc, wc.t(), out=logits)
        outputs.append(chunk_loss(logits, start, stop, logits if compute_grad else None))
        if not compute_grad:
            continue
        if row_scale is not None:
            scale_rows(logits, row_scale[start:stop])
        if need_dx:
            torch.mm(logits, wc, out=dx[start:stop])
        if need_dw:
            accumulate_mm(dw, logits.t(), xc, first=start == 0)
        if need_db:
            db += logits.sum(0, dtype=torch.float32)
    return outputs, dx, dw, db


def joined_rows(parts, computed, dtype, device):
    """Per-chunk row outputs joined (empty when there were no rows), or None when not computed."""
    if not computed:
        return None
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def flce_chunks(x2, w, bias, target, norms, opts: CrossEntropyOptions, *, need_dx, need_dw, need_db, accum_dtype,
                chunk_rows, row_scale=None):
    """Walk the row chunks. Returns (loss_rows, z_rows, predicted, dx, dw, db); gradients are for
    grad_output = 1, or for per-row grad_output ``row_scale`` [rows] when given."""

    def chunk_loss(logits, start, stop, grad):
        return cross_entropy_rows(logits, target[start:stop], norms, grad, opts)

    outputs, dx, dw, db = linear_loss_chunks(x2, w, bias, chunk_rows, chunk_loss, need_dx=need_dx, need_dw=need_dw,
                                             need_db=need_db, accum_dtype=accum_dtype, row_scale=row_scale)
    loss_parts, z_parts, predicted_parts = (list(parts) for parts in zip(*outputs)) if outputs else ([], [], [])
    device = x2.device
    return (joined_rows(loss_parts, True, torch.float32, device),
            joined_rows(z_parts, bool(opts.lse_square_scale), torch.float32, device),
            joined_rows(predicted_parts, opts.compute_argmax, torch.int64, device), dx, dw, db)


def check_flce_args(x, weight, target, bias):
    check_tensor("x", x, min_ndim=2)
    check_tensor("weight", weight, ndim=2)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} ([V, H]) but x's last dim (H) is {x.shape[-1]}")
    check_tensor("target", target, min_ndim=1, floating=False)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if target.numel() != n_rows:
        raise ValueError(f"target has {target.numel()} elements but x has {n_rows} rows "
                         f"(x {tuple(x.shape)}, target {tuple(target.shape)})")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} entries but weight has {weight.shape[0]} rows")
    check_same_device(x=x, weight=weight, target=target, bias=bias)


def check_accum_dtype(accum_dtype) -> None:
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"accum_dtype must be None (weight's dtype) or torch.float32, got {accum_dtype!r}")


def checked_flce_options(chunk_budget, accum_dtype) -> tuple[int, torch.dtype | None]:
    """(chunk budget in bytes, None for the default; accum_dtype None or torch.float32), checked
    with a ValueError naming the argument."""
    budget = chunk_budget_bytes(chunk_budget)
    check_accum_dtype(accum_dtype)
    return budget, accum_dtype


def _check_args(x, weight, target, bias, opts, accum_dtype):
    """Metadata checks of both ops, for their real and fake implementations (the plain values,
    which a fake implementation may get as symbolic ints, in ``_check_values``)."""
    check_accum_dtype(accum_dtype)  # an output's dtype
    check_flce_args(x, weight, target, bias)
    check_target_and_class_weight(target.reshape(-1), target.numel(), weight.shape[0], opts.weight)
    check_same_device(x=x, ce_weight=opts.weight)


def _check_values(opts, chunk_budget, accum_dtype):
    """The plain values (real implementations; the functional entry checks them first)."""
    check_option_values(opts)
    checked_flce_options(chunk_budget, accum_dtype)


def _kernel_inputs(x, weight, target, opts, chunk_budget):
    """(x2 [rows, H] with unit last stride, target [rows] and opts as the kernel reads them, rows per chunk)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    target, opts = kernel_target_and_options(target.reshape(-1), opts)
    return x2, target, opts, chunk_rows_for_budget(x2.shape[0], weight.shape[0], x2.element_size(), chunk_budget)


def _gradient_outputs(x, weight, dx, dw, db):
    """(dx [x.shape], dw [V, H], db fp32 [V]) as the ops return them: empty where not computed."""
    return (dx.view(x.shape) if dx is not None else x.new_empty(0),
            or_empty(dw, weight),
            db if db is not None else x.new_empty(0, dtype=torch.float32))


def _fake_gradient_outputs(x, weight, accum_dtype, need_dx, need_dw, need_db):
    return (fake_grad(x, need_dx, x),
            weight.new_empty(weight.shape, dtype=accum_dtype or weight.dtype) if need_dw else weight.new_empty(0),
            x.new_empty(weight.shape[0], dtype=torch.float32) if need_db else x.new_empty(0, dtype=torch.float32))


# ---- custom ops: torch.ops.tigon.fused_linear_cross_entropy and its backward ----
#
# Schema: x, weight, target, bias, then CrossEntropyOptions' fields in order (as
# tigon::cross_entropy's), chunk_budget (bytes), accum_dtype, and which gradients to form.
#
# Plain custom ops, not kernel_op's triton_ops, so Inductor calls them as opaque Python (one call
# a step, forward and backward): traced, the body's loop over row chunks would specialize the
# graph on the token count (a recompile per new sequence length, then eager once the cache is
# full), and its per-chunk writes into slices of dx and accumulation into dw would be
# functionalized into copies of those buffers. Untraced, the chunk loop allocates one chunk of
# logits at a time, the point of the op.

@custom_op("tigon::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
    label_smoothing: float, class_weight: Optional[Tensor], lse_square_scale: float, softcap: Optional[float],
    use_token_scaling: bool, return_z_loss: bool, return_token_accuracy: bool, return_predicted_tokens: bool,
    defer_label_check: bool, chunk_budget: int, accum_dtype: Optional[torch.dtype], need_dx: bool, need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, z_loss, token_accuracy, predicted_tokens, dx, dw, db) of cross_entropy(x @ weight.T +
    bias, target), x [..., H], weight [V, H], target [...]. With reduction "mean" / "sum" the
    gradients the need_* flags ask for are formed here, for grad_output 1: dx [..., H] in x's
    dtype, dw [V, H] in accum_dtype (or weight's), db fp32 [V]; the others, and all three for
    "none" (whose backward recomputes them), are empty. The loss outputs as tigon::cross_entropy's."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, class_weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens,
                               defer_label_check)
    _check_values(opts, chunk_budget, accum_dtype)
    _check_args(x, weight, target, bias, opts, accum_dtype)
    x2, target, opts, chunk_rows = _kernel_inputs(x, weight, target, opts, chunk_budget)
    norms = checked_norms(target, weight.shape[0], opts)
    in_forward = reduction != "none"  # "none": the gradient depends on each row's grad_output
    loss_rows, z_rows, predicted, dx, dw, db = flce_chunks(
        x2, weight, bias, target, norms, opts, need_dx=need_dx and in_forward, need_dw=need_dw and in_forward,
        need_db=bias is not None and need_db and in_forward, accum_dtype=accum_dtype, chunk_rows=chunk_rows)
    return (*op_loss_outputs(loss_rows, z_rows, predicted, norms, target, opts, x2),
            *_gradient_outputs(x, weight, dx, dw, db))


@fused_linear_cross_entropy_op.register_fake
def _(x, weight, target, bias, *args):
    opts = CrossEntropyOptions(*args[:N_OPTIONS])
    _chunk_budget, accum_dtype, need_dx, need_dw, need_db = args[N_OPTIONS:]
    _check_args(x, weight, target, bias, opts, accum_dtype)
    in_forward = opts.reduction != "none"
    return (*fake_op_loss_outputs(target.numel(), opts, x),
            *_fake_gradient_outputs(x, weight, accum_dtype, need_dx and in_forward, need_dw and in_forward,
                                    bias is not None and need_db and in_forward))


@custom_op("tigon::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward_op(
    grad_loss: Tensor, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
    reduction: str, label_smoothing: float, class_weight: Optional[Tensor], lse_square_scale: float,
    softcap: Optional[float], use_token_scaling: bool, return_z_loss: bool, return_token_accuracy: bool,
    return_predicted_tokens: bool, defer_label_check: bool, chunk_budget: int, accum_dtype: Optional[torch.dtype],
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) as tigon::fused_linear_cross_entropy's, for per-row grad_output grad_loss
    [rows] (reduction "none"): each chunk's logits are formed again (four matmuls)."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, class_weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens,
                               defer_label_check)
    _check_values(opts, chunk_budget, accum_dtype)
    _check_args(x, weight, target, bias, opts, accum_dtype)
    x2, target, opts, chunk_rows = _kernel_inputs(x, weight, target, opts, chunk_budget)
    _, _, _, dx, dw, db = flce_chunks(
        x2, weight, bias, target, cross_entropy_norms(target, opts), opts, need_dx=need_dx, need_dw=need_dw,
        need_db=bias is not None and need_db, accum_dtype=accum_dtype, chunk_rows=chunk_rows,
        row_scale=grad_loss.reshape(-1).to(torch.float32))
    return _gradient_outputs(x, weight, dx, dw, db)


@fused_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, x, weight, target, bias, *args):
    opts = CrossEntropyOptions(*args[:N_OPTIONS])
    _chunk_budget, accum_dtype, need_dx, need_dw, need_db = args[N_OPTIONS:]
    _check_args(x, weight, target, bias, opts, accum_dtype)
    return _fake_gradient_outputs(x, weight, accum_dtype, need_dx, need_dw, bias is not None and need_db)


def _setup_context(ctx, inputs, output):
    x, weight, target, bias = inputs[:4]
    options = inputs[4:4 + N_OPTIONS]
    chunk_budget, accum_dtype, need_dx, need_dw, need_db = inputs[4 + N_OPTIONS:]
    ctx.set_materialize_grads(False)  # the extras' gradients arrive as None
    ctx.mark_non_differentiable(*output[1:])
    ctx.formed = (need_dx, need_dw, bias is not None and need_db)  # the gradients the forward was asked for
    ctx.per_row = options[1] == "none"
    ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
    if ctx.per_row:  # the backward recomputes from the inputs
        ctx.save_for_backward(x, target)
        # Parameters (and the class weights): kept, not saved (see the note in tigon.ops._common).
        ctx.weight, ctx.bias, ctx.options = weight, bias, options
        ctx.chunk_budget, ctx.accum_dtype = chunk_budget, accum_dtype
    else:
        ctx.save_for_backward(*output[4:])
    ctx.tied_slot = current_tied_slot()  # eager only: None under torch.compile


def _backward(ctx, grad_loss, *_grads_of_extras):
    need_dx, need_dw, need_db = (formed and needed for formed, needed in
                                 zip(ctx.formed, (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                  ctx.needs_input_grad[3])))
    dx = dw = db = None
    if grad_loss is not None and (need_dx or need_dw or need_db):
        if ctx.per_row:
            x, target = ctx.saved_tensors
            dx, dw, db = fused_linear_cross_entropy_backward_op(
                grad_loss, x, ctx.weight, target, ctx.bias, *ctx.options, ctx.chunk_budget, ctx.accum_dtype,
                need_dx, need_dw, need_db)
        else:
            dx, dw, db = ctx.saved_tensors
            scale = grad_loss.reshape(1).to(torch.float32)
            dx = scaled_gradient(dx, scale) if need_dx else None
            dw = scaled_gradient(dw, scale) if need_dw else None
            db = db * scale if need_db else None
        w_dtype, b_dtype = ctx.param_dtypes
        dx = dx if need_dx else None
        dw = dw.to(w_dtype) if need_dw else None
        db = db.to(b_dtype) if need_db else None
        if dw is not None and ctx.tied_slot is not None and ctx.tied_slot.offer(dw):
            dw = None  # the tied embedding's backward adds its rows into it and returns the sum
    return (dx, dw, None, db) + (None,) * (N_OPTIONS + 5)


fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)
