"""Log-probabilities of the target tokens under a linear head, for the chunked post-training losses.

logp[i] = log softmax(x[i] @ W^T + b)[target[i]], 0 where target[i] == ignore_index.
x [N, H] (fp32 / bf16 / fp16), weight [V, H], bias [V] or None, target [N] int -> logp [N] fp32.

The forward forms the [N, V] logits in x's dtype, and the cross-entropy kernel turns them in
place into d(-logp) / d logits = softmax - onehot (zero rows where ignored), which is kept for
the backward. The caller walks the batch in chunks, so one chunk's logits are the memory cost.
The backward is two matmuls (and a matrix-vector product for the bias) with the per-row
grad_output folded into the [N, H] operands, never into the [N, V] buffer:
    dx = -(G @ W) * g[:, None],   dW = -G^T @ (x * g[:, None]),   db = -G^T @ g.
No extra kernel: the Triton work is cross_entropy_kernel's. Written in the setup_context
style, so torch.func.grad_and_value (the chunked base) can transform it.
"""

from __future__ import annotations

import torch

from tigon.ops.cross_entropy import (
    CrossEntropyOptions,
    check_cross_entropy_options,
    cross_entropy_norms,
    cross_entropy_rows,
)
from tigon.ops.fused_linear_cross_entropy import check_flce_args
from tigon.ops._common import new_output


def linear_head_logits(x, weight, bias):
    """[N, V] logits x @ weight^T + bias in x's dtype (the matmul runs in it, as autocast would)."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    wc = weight if weight.dtype == x2.dtype else weight.to(x2.dtype)
    logits = new_output((x2.shape[0], weight.shape[0]), x2.dtype, x2.device)
    if bias is not None:
        torch.addmm(bias.to(x2.dtype), x2, wc.t(), out=logits)
    else:
        torch.mm(x2, wc.t(), out=logits)
    return logits


def linear_head_backward(g_logits, x, weight, bias, row_grad, needs):
    """Gradients (dx, dW, db) of sum_i row_grad[i] * f_i(x @ W^T + b) given G = d f_i / d logits
    [N, V]: the per-row factor is applied to the [N, H] operands, never to G."""
    need_x, need_w, need_b = needs
    r = row_grad.to(torch.float32)
    dx = dw = db = None
    if need_x:
        wc = weight if weight.dtype == g_logits.dtype else weight.to(g_logits.dtype)
        dx = ((g_logits @ wc).float() * r[:, None]).to(x.dtype)
    if need_w:
        dw = (g_logits.t() @ (x.float() * r[:, None]).to(g_logits.dtype)).to(weight.dtype)
    if need_b and bias is not None:
        db = (r.to(g_logits.dtype) @ g_logits).to(bias.dtype)
    return dx, dw, db


def keep_logit_grad(ctx, inputs, output, compute_grad):
    """setup_context of a linear-head row op: inputs start with (x, weight, bias), output is
    (rows, G); G is kept for ``linear_head_rows_backward``."""
    _, grad_logits = output
    ctx.mark_non_differentiable(grad_logits)
    ctx.compute_grad = compute_grad
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(*inputs[:3], grad_logits)


def linear_head_rows_backward(ctx, row_grad, name):
    """backward of a linear-head row op given the per-row factor (row_grad) on its G."""
    if not ctx.compute_grad:
        raise RuntimeError(f"{name} ran without a gradient (compute_grad=False) but one was asked for")
    x, weight, bias, g_logits = ctx.saved_tensors
    grads = linear_head_backward(g_logits, x, weight, bias, row_grad, ctx.needs_input_grad[:3])
    return grads + (None,) * (ctx.n_inputs - 3)


class LinearTokenLogpsFunction(torch.autograd.Function):
    """(logp [N] fp32, G [N, V]): G is the saved gradient buffer, returned only so that
    setup_context can keep it; it is not differentiable. compute_grad=False (no gradient will
    be asked for) skips writing G."""

    @staticmethod
    def forward(x, weight, bias, target, ignore_index, compute_grad=True):
        check_flce_args(x, weight, target, bias)
        if x.ndim != 2 or target.ndim != 1:
            raise ValueError(f"x must be [N, H] and target [N], got {tuple(x.shape)} and {tuple(target.shape)}")
        opts = CrossEntropyOptions(ignore_index=ignore_index, reduction="none")
        target, opts = check_cross_entropy_options(target, x.shape[0], weight.shape[0], opts)
        logits = linear_head_logits(x, weight, bias)
        norms = cross_entropy_norms(target, opts)
        grad = logits if compute_grad else None
        loss_rows, _, _ = cross_entropy_rows(logits, target, norms, grad, opts)
        return loss_rows.neg_(), logits

    @staticmethod
    def setup_context(ctx, inputs, output):
        keep_logit_grad(ctx, inputs, output, inputs[5] if len(inputs) > 5 else True)

    @staticmethod
    def backward(ctx, grad_logp, _grad_buffer):
        # G holds d(-logp) / d logits: the row factor is -grad_logp.
        return linear_head_rows_backward(ctx, grad_logp.neg(), "linear_token_logps")
