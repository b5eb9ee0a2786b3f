"""Fused linear + cross entropy: loss(x @ W^T + b, y) without the [rows, V] logits.

The rows of x are taken in chunks. For each chunk: logits = x_c @ W^T (+ b) into one reused
[chunk, V] buffer, the cross-entropy kernel turns it in place into d loss / d logits, then
dx_c = dlogits @ W and dW += dlogits^T @ x_c (db += column sums). All three matmuls run in the
forward pass; the backward only scales the stored gradients by grad_output (a launch, no pass
over memory, when grad_output == 1). With reduction="none" the gradient depends on a per-row
grad_output, so the forward computes the losses only and the backward recomputes each chunk's
logits (four matmuls instead of three).

Chunk size trade-off (``chunk_rows_for_budget``): the chunk's logits take rows * V elements of
x's dtype. Larger chunks mean fewer, larger matmuls and fewer launches (small batches run in
one chunk), and fewer read-modify-writes of dW; smaller chunks mean less memory. dW is
accumulated by cuBLAS in fp32 within each chunk and stored in W's dtype between chunks (one
rounding per chunk); ``accum_dtype=torch.float32`` keeps an fp32 accumulator instead, at
V * H * 4 bytes.
"""

from __future__ import annotations

import torch

from tigon.ops._common import (
    accumulate_mm,
    cdiv,
    check_same_device,
    check_tensor,
    chunk_budget_bytes,
    new_output,
)
from tigon.ops.cross_entropy import (
    CrossEntropyOptions,
    check_cross_entropy_options,
    cross_entropy_norms,
    cross_entropy_rows,
    reduce_loss_rows,
    scale_rows,
    scaled_gradient,
)


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


def _rows(parts, computed, dtype, device):
    """Per-chunk row outputs joined (empty when there were no rows), or None when not computed."""
    if not computed:
        return None
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def flce_chunks(x2, w, bias, target, norms, opts: CrossEntropyOptions, *, need_dx, need_dw, need_db, accum_dtype,
                chunk_rows, row_scale=None):
    """Walk the row chunks. Returns (loss_rows, z_rows, predicted, dx, dw, db); gradients are for
    grad_output = 1, or for per-row grad_output ``row_scale`` [rows] when given."""
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
    loss_parts, z_parts, predicted_parts = [], [], []
    logits_buf = torch.empty((min(chunk_rows, n_rows), vocab), dtype=x2.dtype, device=device)
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        xc = x2[start:stop]
        logits = logits_buf[: stop - start]
        if bc is not None:
            torch.addmm(bc, xc, wc.t(), out=logits)
        else:
            torch.mm(xc, wc.t(), out=logits)
        loss_c, z_c, predicted_c = cross_entropy_rows(logits, target[start:stop], norms,
                                                      logits if compute_grad else None, opts)
        loss_parts.append(loss_c)
        z_parts.append(z_c)
        predicted_parts.append(predicted_c)
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
    return (_rows(loss_parts, True, torch.float32, device),
            _rows(z_parts, bool(opts.lse_square_scale), torch.float32, device),
            _rows(predicted_parts, opts.compute_argmax, torch.int64, device), dx, dw, db)


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


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """(loss, z_loss, token_accuracy, predicted_tokens) of cross_entropy(x @ weight^T + bias,
    target); the extras are None unless ``opts`` asks for them."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, opts: CrossEntropyOptions, chunk_budget=None, accum_dtype=None,
                grad_enabled=True, tied_slot=None):
        check_flce_args(x, weight, target, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        target, opts = check_cross_entropy_options(target.reshape(-1), x2.shape[0], weight.shape[0], opts)
        check_same_device(x=x, ce_weight=opts.weight)
        if accum_dtype not in (None, torch.float32):
            raise ValueError(f"accum_dtype must be None (weight's dtype) or torch.float32, got {accum_dtype!r}")
        norms = cross_entropy_norms(target, opts)
        chunk_rows = chunk_rows_for_budget(x2.shape[0], weight.shape[0], x2.element_size(),
                                           chunk_budget_bytes(chunk_budget))
        need = [n and grad_enabled for n in ctx.needs_input_grad]  # forward runs with grad mode off
        deferred = opts.reduction == "none"
        loss_rows, z_rows, predicted, dx, dw, db = flce_chunks(
            x2, weight, bias, target, norms, opts, need_dx=need[0] and not deferred,
            need_dw=need[1] and not deferred, need_db=bias is not None and need[3] and not deferred,
            accum_dtype=accum_dtype, chunk_rows=chunk_rows)
        outputs = reduce_loss_rows(loss_rows, z_rows, predicted, norms, target, opts)
        ctx.deferred = deferred
        ctx.tied_slot = tied_slot
        ctx.x_shape = x.shape
        ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if deferred:
            ctx.save_for_backward(x2, weight, bias, target, norms)
            ctx.opts, ctx.accum_dtype, ctx.chunk_rows = opts, accum_dtype, chunk_rows
        else:
            ctx.save_for_backward(dx, dw, db)
        ctx.mark_non_differentiable(*(t for t in outputs[1:] if t is not None))
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_grad_extras):
        need = ctx.needs_input_grad
        if ctx.deferred:  # recomputed from the saved inputs: nothing saved is modified
            x2, weight, bias, target, norms = ctx.saved_tensors
            _, _, _, dx, dw, db = flce_chunks(
                x2, weight, bias, target, norms, ctx.opts, need_dx=need[0], need_dw=need[1],
                need_db=bias is not None and need[3], accum_dtype=ctx.accum_dtype, chunk_rows=ctx.chunk_rows,
                row_scale=grad_loss.reshape(-1).to(torch.float32))
        else:
            dx, dw, db = ctx.saved_tensors
            scale = grad_loss.reshape(1).to(torch.float32)
            dx = scaled_gradient(dx, scale) if dx is not None else None
            dw = scaled_gradient(dw, scale) if dw is not None else None
            db = db * scale if db is not None else None
        w_dtype, b_dtype = ctx.param_dtypes
        dx = dx.view(ctx.x_shape) if dx is not None else None
        dw = dw.to(w_dtype) if dw is not None else None
        db = db.to(b_dtype) if db is not None else None
        if dw is not None and ctx.tied_slot is not None and ctx.tied_slot.offer(dw):
            dw = None  # the tied embedding's backward adds its rows into it and returns the sum
        return dx, dw, None, db, None, None, None, None, None
