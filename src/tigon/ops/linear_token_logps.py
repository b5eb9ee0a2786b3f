"""Log-probabilities of the target tokens under a linear head, for the chunked post-training losses.

logp[i] = log softmax(x[i] @ W^T + b)[target[i]], 0 where target[i] == ignore_index.
x [N, H] (fp32 / bf16 / fp16), weight [V, H], bias [V] or None, target [N] int -> logp [N] fp32.

The forward forms the [N, V] logits in x's dtype, and the cross-entropy kernel turns them in
place into d(-logp) / d logits = softmax - onehot (zero rows where ignored), which the op
returns as a second (non-differentiable) output and its autograd keeps for the backward. The
caller walks the batch in chunks, so one chunk's logits are the memory cost. The backward is
two matmuls (and a matrix-vector product for the bias) with the per-row grad_output folded into
the [N, H] operands, never into the [N, V] buffer:
    dx = -(G @ W) * g[:, None],   dW = -G^T @ (x * g[:, None]),   db = -G^T @ g.
No extra kernel: the Triton work is cross_entropy_kernel's, and the backward is torch matmuls
(traced as such by torch.compile). An op call made inside ``accumulate_head_grads`` (the chunked
losses' eager loop) has its dW matmul add into the block's accumulator instead of returning a
[V, H] gradient per chunk; the call binds the accumulator to its autograd node in the forward.

The op is ``torch.ops.tigon.linear_token_logps`` (a torch.library custom op with its autograd
registered; ``tigon.functional.linear_token_logps`` calls it). Like every custom op with a
registered autograd it is not transformable by torch.func (grad, vmap): differentiate it with
torch.autograd, as the chunked losses do.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from tigon import ambient
from tigon.ops._common import accumulate_mm, check_same_device, check_tensor, custom_op, new_output
from tigon.ops._cross_entropy_common import CrossEntropyOptions, check_cross_entropy_options, cross_entropy_norms
from tigon.ops.cross_entropy import cross_entropy_rows


def check_ignore_index(ignore_index) -> None:
    """``ignore_index`` must be an int (checked before the op: its schema's error is vaguer)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def check_linear_head(x, weight, bias, prefix=""):
    """x [N, H], weight [V, H], bias [V] or None (floating); metadata only (fake-safe)."""
    check_tensor(f"{prefix}x", x, ndim=2)
    check_tensor(f"{prefix}weight", weight, ndim=2)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"{prefix}weight has shape {tuple(weight.shape)} ([V, H]) but {prefix}x's H is {x.shape[1]}")
    if bias is not None:
        check_tensor(f"{prefix}bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{prefix}bias has {bias.shape[0]} entries but {prefix}weight has {weight.shape[0]} rows")


def check_linear_token_logps_args(x, weight, bias, target):
    """Metadata checks of the op (the real and the fake implementation): x [N, H], weight
    [V, H], bias [V] or None, target [N] int64 / int32, one device."""
    check_linear_head(x, weight, bias)
    check_tensor("target", target, ndim=1, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got {target.dtype}")
    if target.shape[0] != x.shape[0]:
        raise ValueError(f"target has {target.shape[0]} elements but x has {x.shape[0]} rows "
                         f"(x {tuple(x.shape)}, target {tuple(target.shape)})")
    check_same_device(x=x, weight=weight, bias=bias, target=target)


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


class HeadGradSlot:
    """One tensor's accumulator in one accumulate_head_grads block: ``grad`` (None until a
    backward adds into it), ``open`` while the block is."""

    __slots__ = ("tensor", "grad", "open")

    def __init__(self, tensor):
        self.tensor, self.grad, self.open = tensor, None, True


class HeadGradAccumulators:
    """What accumulate_head_grads yields: ``get(t)``, the gradient added up for t, or None."""

    def __init__(self, slots):
        self._slots = slots

    def get(self, t):
        slot = self._slots.get(id(t))
        return slot.grad if slot is not None and slot.tensor is t else None


@contextlib.contextmanager
def accumulate_head_grads(*tensors):
    """Within the block, a linear-head row op (linear_token_logps, linear_jsd) called in this
    thread whose weight or bias is one of ``tensors`` (the same tensor objects) binds that
    tensor's accumulator to its autograd node; its eager backward, run while the block is open,
    adds that gradient into the accumulator, in the tensor's dtype, and returns None for it.
    The weight's is added by the dW matmul itself (beta = 1): a chunked loss then forms no
    [V, H] gradient per chunk and no separate add over it (three passes over the head's size per
    chunk). Yields a HeadGradAccumulators. Each block has its own accumulators: blocks of other
    threads, or over the same tensor in this one (nested, or left in any order), never share
    one; the innermost open block holding a tensor takes the calls made while it is open. A call
    made outside the block, or whose backward runs after the block was left, returns its
    gradients as usual; so does a traced forward or backward (torch.compile)."""
    slots = {id(t): HeadGradSlot(t) for t in tensors if t is not None}
    ambient.HEAD_GRAD_BLOCKS.value = (*ambient.HEAD_GRAD_BLOCKS.value, slots)
    try:
        yield HeadGradAccumulators(slots)
    finally:
        ambient.HEAD_GRAD_BLOCKS.value = tuple(b for b in ambient.HEAD_GRAD_BLOCKS.value if b is not slots)
        for slot in slots.values():
            slot.open = False


def head_grad_slot(t):
    """For an op call's forward: t's slot in the innermost of this thread's open
    accumulate_head_grads blocks that holds t, or None (none does, t is None, or tracing)."""
    if t is None or torch.compiler.is_compiling() or not ambient.HEAD_GRAD_BLOCKS.value:
        return None
    for slots in reversed(ambient.HEAD_GRAD_BLOCKS.value):
        slot = slots.get(id(t))
        if slot is not None and slot.tensor is t:
            return slot
    return None


def _open_slot(slot):
    """slot if its block is still open and this backward is eager, else None."""
    return slot if slot is not None and slot.open and not torch.compiler.is_compiling() else None


def linear_head_backward(g_logits, x, weight, bias, row_grad, needs, slots=(None, None)):
    """Gradients (dx, dW, db) of sum_i row_grad[i] * f_i(x @ W^T + b) given G = d f_i / d logits
    [N, V]: the per-row factor is applied to the [N, H] operands, never to G. ``slots``: the
    weight's and the bias's HeadGradSlot bound by the op call's forward (or None); dW and db are
    None where an open one took them."""
    need_x, need_w, need_b = needs
    w_slot, b_slot = map(_open_slot, slots)
    r = row_grad.to(torch.float32)
    dx = dw = db = None
    if need_x:
        wc = weight if weight.dtype == g_logits.dtype else weight.to(g_logits.dtype)
        dx = ((g_logits @ wc).float() * r[:, None]).to(x.dtype)
    if need_w:
        xr = (x.float() * r[:, None]).to(g_logits.dtype)
        if w_slot is None:
            dw = (g_logits.t() @ xr).to(weight.dtype)
        else:
            first = w_slot.grad is None
            if first:
                w_slot.grad = new_output(weight.shape, weight.dtype, weight.device)
            accumulate_mm(w_slot.grad, g_logits.t(), xr, first=first)
    if need_b and bias is not None:
        db = (r.to(g_logits.dtype) @ g_logits).to(bias.dtype)
        if b_slot is not None:
            b_slot.grad = db if b_slot.grad is None else b_slot.grad.add_(db)
            db = None
    return dx, dw, db


def fake_logit_grad(x, weight, compute_grad):
    """The fake of a linear-head row op's second output: G [N, V] in x's dtype, or empty."""
    return x.new_empty((x.shape[0], weight.shape[0])) if compute_grad else x.new_empty(0)


def keep_logit_grad(ctx, inputs, output, compute_grad):
    """setup_context of a linear-head row op: inputs start with (x, weight, bias), output is
    (rows, G); x and G are saved, weight and bias kept (parameters: see the note in
    tigon.ops._common), with their accumulate_head_grads slots if a block of this thread holds
    them. Bound here, in the forward, which runs in the caller's thread: the backward, wherever
    autograd runs it (a CUDA backward runs on autograd's device thread), uses the slot bound
    here and looks nothing up."""
    x, weight, bias = inputs[:3]
    _, grad_logits = output
    ctx.set_materialize_grads(False)  # G's gradient (never used) arrives as None
    ctx.mark_non_differentiable(grad_logits)
    ctx.save_for_backward(x, grad_logits)
    ctx.weight, ctx.bias = weight, bias
    ctx.head_grad_slots = (head_grad_slot(weight), head_grad_slot(bias))
    ctx.compute_grad = compute_grad
    ctx.n_inputs = len(inputs)


def linear_head_rows_backward(ctx, row_grad, name):
    """backward of a linear-head row op given the per-row factor (row_grad) on its G."""
    if row_grad is None:
        return (None,) * ctx.n_inputs
    if not ctx.compute_grad:
        raise RuntimeError(f"{name} ran without a gradient (compute_grad=False) but one was asked for")
    x, g_logits = ctx.saved_tensors
    grads = linear_head_backward(g_logits, x, ctx.weight, ctx.bias, row_grad, ctx.needs_input_grad[:3],
                                 ctx.head_grad_slots)
    return grads + (None,) * (ctx.n_inputs - 3)


# ---- custom op: torch.ops.tigon.linear_token_logps ----


@custom_op("tigon::linear_token_logps", mutates_args=())
def linear_token_logps_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
                          compute_grad: bool) -> tuple[Tensor, Tensor]:
    """(logp fp32 [N], G [N, V] in x's dtype): G = d(-logp) / d logits, the saved gradient (not
    differentiable); an empty tensor when compute_grad is False (no gradient will be asked for).
    The label range is checked (a host sync) unless inside ``labels_checked``."""
    check_linear_token_logps_args(x, weight, bias, target)
    opts = CrossEntropyOptions(ignore_index=ignore_index, reduction="none")
    target, opts = check_cross_entropy_options(target, x.shape[0], weight.shape[0], opts)
    logits = linear_head_logits(x, weight, bias)
    norms = cross_entropy_norms(target, opts)
    grad = logits if compute_grad else None
    loss_rows, _, _ = cross_entropy_rows(logits, target, norms, grad, opts)
    return loss_rows.neg_(), logits if compute_grad else x.new_empty(0)


@linear_token_logps_op.register_fake
def _(x, weight, bias, target, ignore_index, compute_grad):
    check_linear_token_logps_args(x, weight, bias, target)
    return x.new_empty(x.shape[0], dtype=torch.float32), fake_logit_grad(x, weight, compute_grad)


def _setup_context(ctx, inputs, output):
    keep_logit_grad(ctx, inputs, output, inputs[5])


def _backward(ctx, grad_logp, _grad_buffer):
    # G holds d(-logp) / d logits: the row factor is -grad_logp.
    return linear_head_rows_backward(ctx, None if grad_logp is None else grad_logp.neg(), "linear_token_logps")


linear_token_logps_op.register_autograd(_backward, setup_context=_setup_context)
