"""Generalised Jensen-Shannon divergence between a student and a teacher distribution, with the
student's gradient written in the forward pass: over logits per row (``torch.ops.tigon.linear_jsd``,
the chunked distillation loss's op), and over log-probabilities averaged over rows
(``torch.ops.tigon.jsd``, what Liger's ``LigerJSD`` computes). Both are torch.library custom ops
with their autograd registered (``tigon.functional`` calls them); the gradient they form in the
forward is a second, non-differentiable output, kept for the backward.

With P the student's distribution and Q the teacher's, per row:
    beta = 0:  KL(Q || P) = sum Q (log Q - log P)                       (forward KL)
    beta = 1:  KL(P || Q) = sum P (log P - log Q)                       (reverse KL)
    else:      beta KL(Q || M) + (1 - beta) KL(P || M),  M = beta Q + (1 - beta) P
This is TRL's generalised JSD (GKD's ``generalized_jsd_loss``) and Liger's (``LigerJSD``,
``LigerFusedLinearJSD``): the same beta in all three, beta weighting the teacher in M.

Logits (``jsd_kernel``): a = s / temperature, b = t / temperature, P = softmax(a),
Q = softmax(b). The gradient, with g_j = d loss / d P_j:
    d loss / d s_i = P_i (g_i - sum_j P_j g_j) / temperature,
    g = -Q / P (beta 0),  log P - log Q + 1 (beta 1),  (1 - beta)(log P - log M) (else),
so beta 0 gives (P - Q) / temperature. For beta 0 and 1 the loss is an expectation that one
online pass can form (E_Q[log Q - log P] or E_P[log P - log Q]), so the kernel reads each row
twice (log-sum-exps and loss, then the gradient); a mixed beta needs the two log-sum-exps before
log M exists, so it reads each row three times.

Log-probabilities (``jsd_logprobs_kernel``): X = log P and Y = log Q are taken as given, as
Liger and torch's ``kl_div(log_target=True)`` do: the loss is the sum of the formula's terms
over the row (no renormalisation) and the gradient is with respect to X itself,
    -Q (beta 0),  P (X - Y + 1) (beta 1),  (1 - beta) P (X - log M) (else),
so one pass over each row forms both. Backpropagated through a log_softmax it gives the
logits' gradient above.

x [N, H] -> ``linear_jsd`` forms both heads' logits for a chunk of rows and keeps the
student's gradient, like ``linear_token_logps``: the chunked distillation loss is built on it.
``jsd``'s backward scales its saved gradient by grad_output: in place in eager when the graph
is freed after that backward; otherwise (retained graph, or traced by torch.compile) into a new
tensor through ``torch.ops.tigon.jsd_backward``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    as_rows,
    check_same_device,
    check_tensor,
    custom_op,
    fake_grad,
    new_output,
    next_pow2,
    or_empty,
    traced,
)
from tigon.ops._gradient_scaling import scale_rows
from tigon.ops._internals import graph_retained, launch
from tigon.ops._jit_math import safe_max
from tigon.ops.linear_token_logps import (
    check_linear_head,
    fake_logit_grad,
    keep_logit_grad,
    linear_head_logits,
    linear_head_rows_backward,
)

FORWARD_KL, REVERSE_KL, MIXED = 0, 1, 2


@triton.jit
def mixture_log(log_p, log_q, log_beta, log_1m_beta):
    """log M = log(beta Q + (1 - beta) P), from log P and log Q (0 < beta < 1)."""
    x1 = log_q + log_beta
    x2 = log_p + log_1m_beta
    hi = tl.maximum(x1, x2)
    return hi + tl.log(tl.exp(x1 - hi) + tl.exp(x2 - hi))


@triton.jit
def jsd_kernel(
    S, stride_s, T, stride_t, G, stride_g, LOSS, n_cols, inv_temp, beta, log_beta, log_1m_beta,
    MODE: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """LOSS[row] = the divergence of row `row` (one program a row); G row = d LOSS[row] / d S row.
    G may alias S. Log-probabilities are formed from the row maximum, (a - m_a) - log d_a:
    a - lse_a would round lse_a at the logits' magnitude (1e-3 at logits of 1e4)."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * stride_s
    t_row = T + row * stride_t
    g_row = G + row * stride_g
    offs = tl.arange(0, BLOCK_V)
    # Pass 1: online maxima and sums of exp(a - m_a), exp(b - m_b); for beta 0 / 1 also the
    # softmax-weighted sum of (b - m_b) - (a - m_a) (under Q) or its negation (under P), kept
    # relative to the running maxima: when they move, the sum so far shifts by its weight times
    # the change, then rescales like the weights.
    m_a = -float("inf")
    d_a = 0.0
    m_b = -float("inf")
    d_b = 0.0
    e_w = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        mask = cols < n_cols
        a = tl.load(s_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
        b = tl.load(t_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
        new_a = tl.maximum(m_a, tl.max(a, axis=0))
        new_b = tl.maximum(m_b, tl.max(b, axis=0))
        # Everything is kept relative to safe_max of the maxima (0 while a row is -inf so far):
        # leading -inf blocks (a masked vocabulary) give sums of 0, not exp(-inf + inf) = NaN.
        ref_a = safe_max(new_a)
        ref_b = safe_max(new_b)
        pa = tl.exp(a - ref_a)
        pb = tl.exp(b - ref_b)
        scale_a = tl.exp(m_a - ref_a)
        scale_b = tl.exp(m_b - ref_b)
        if MODE == 0:
            shift = (safe_max(m_b) - ref_b) - (safe_max(m_a) - ref_a)
            e_w = (e_w + d_b * shift) * scale_b + tl.sum(tl.where(mask, pb * ((b - ref_b) - (a - ref_a)), 0.0), axis=0)
        elif MODE == 1:
            shift = (safe_max(m_a) - ref_a) - (safe_max(m_b) - ref_b)
            e_w = (e_w + d_a * shift) * scale_a + tl.sum(tl.where(mask, pa * ((a - ref_a) - (b - ref_b)), 0.0), axis=0)
        d_a = d_a * scale_a + tl.sum(pa, axis=0)
        d_b = d_b * scale_b + tl.sum(pb, axis=0)
        m_a = new_a
        m_b = new_b
    log_d_a = tl.log(d_a)
    log_d_b = tl.log(d_b)
    if MODE == 0:
        loss = e_w / d_b - log_d_b + log_d_a  # E_Q[log Q - log P]
        p_dot_g = -1.0  # sum_j P_j (-Q_j / P_j)
    elif MODE == 1:
        loss = e_w / d_a - log_d_a + log_d_b  # E_P[log P - log Q]
        p_dot_g = loss + 1.0
    else:
        # Pass 2: the loss and sum_j P_j g_j, now that log M can be formed.
        loss_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        pg_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            mask = cols < n_cols
            log_p = (tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - m_a) - log_d_a
            log_q = (tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - m_b) - log_d_b
            log_m = mixture_log(log_p, log_q, log_beta, log_1m_beta)
            p = tl.exp(log_p)
            q = tl.exp(log_q)
            g = (1.0 - beta) * (log_p - log_m)
            loss_acc += tl.where(mask, beta * q * (log_q - log_m) + p * g, 0.0)
            pg_acc += tl.where(mask, p * g, 0.0)
        loss = tl.sum(loss_acc, axis=0)
        p_dot_g = tl.sum(pg_acc, axis=0)
    tl.store(LOSS + row, loss)
    if COMPUTE_GRAD:
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            mask = cols < n_cols
            log_p = (tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - m_a) - log_d_a
            p = tl.exp(log_p)
            log_q = (tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - m_b) - log_d_b
            if MODE == 0:
                grad = p - tl.exp(log_q)
            elif MODE == 1:
                grad = p * (log_p - log_q + 1.0 - p_dot_g)
            else:
                log_m = mixture_log(log_p, log_q, log_beta, log_1m_beta)
                grad = p * ((1.0 - beta) * (log_p - log_m) - p_dot_g)
            tl.store(g_row + cols, (grad * inv_temp).to(G.dtype.element_ty), mask=mask)


@triton.jit
def jsd_logprobs_kernel(
    X, stride_x, Y, stride_y, G, stride_g, LOSS, LABELS, SCALE, n_cols, ignore_index, beta, log_beta,
    log_1m_beta, MODE: tl.constexpr, HAS_LABELS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program a row of log-probabilities X (student) and Y (teacher): LOSS[row] = SCALE[0]
    times the row's divergence, G row = its gradient with respect to X (one pass). A row whose
    label is ignore_index gets 0 for both and its X, Y are not read."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    g_row = G + row * stride_g
    offs = tl.arange(0, BLOCK_V)
    ignored = False
    if HAS_LABELS:
        ignored = tl.load(LABELS + row) == ignore_index
    if ignored:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offs
                tl.store(g_row + cols, tl.zeros([BLOCK_V], dtype=G.dtype.element_ty), mask=cols < n_cols)
    else:
        scale = tl.load(SCALE)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            mask = cols < n_cols
            log_p = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            log_q = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
            if MODE == 0:
                q = tl.exp(log_q)
                term = q * (log_q - log_p)
                grad = -q
            elif MODE == 1:
                p = tl.exp(log_p)
                term = p * (log_p - log_q)
                grad = term + p
            else:
                log_m = mixture_log(log_p, log_q, log_beta, log_1m_beta)
                grad = (1.0 - beta) * tl.exp(log_p) * (log_p - log_m)
                term = beta * tl.exp(log_q) * (log_q - log_m) + grad
            acc += tl.where(mask, term, 0.0)
            if COMPUTE_GRAD:
                tl.store(g_row + cols, (grad * scale).to(G.dtype.element_ty), mask=mask)
        tl.store(LOSS + row, tl.sum(acc, axis=0) * scale)


def jsd_mode(beta: float) -> int:
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else MIXED


def check_jsd_options(beta, temperature=1.0):
    for name, value in (("beta", beta), ("temperature", temperature)):
        try:
            float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def jsd_rows(student, teacher, grad, beta, temperature):
    """Launch on checked [N, V] logits (unit last stride): -> loss [N] fp32; grad (None: no
    gradient) receives d loss[i] / d student[i] and may be student itself."""
    n_rows, n_cols = student.shape
    loss = new_output((n_rows,), torch.float32, student.device)
    if n_rows:
        # Two rows of logits stream together: half the CE kernel's block, a warp per 512.
        block = min(8192, next_pow2(n_cols))
        num_warps = max(4, min(16, block // 512))
        log_beta = math.log(beta) if beta > 0 else 0.0
        log_1m_beta = math.log(1 - beta) if beta < 1 else 0.0
        launch(jsd_kernel, (n_rows,),
            student, student.stride(0), teacher, teacher.stride(0),
            grad if grad is not None else student, grad.stride(0) if grad is not None else 0,
            loss, n_cols, 1.0 / temperature, float(beta), log_beta, log_1m_beta,
            MODE=jsd_mode(beta), COMPUTE_GRAD=grad is not None, BLOCK_V=block, num_warps=num_warps,
        )
    return loss


def check_linear_jsd_args(x, weight, bias, teacher_x, teacher_weight, teacher_bias):
    """Metadata checks of tigon::linear_jsd (its real and fake implementations)."""
    check_linear_head(x, weight, bias)
    check_linear_head(teacher_x, teacher_weight, teacher_bias, prefix="teacher_")
    if teacher_x.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but teacher_x has {teacher_x.shape[0]}")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"weight has {weight.shape[0]} classes but teacher_weight has {teacher_weight.shape[0]}: "
                         "the vocabularies must match")
    check_same_device(x=x, weight=weight, bias=bias, teacher_x=teacher_x, teacher_weight=teacher_weight,
                      teacher_bias=teacher_bias)


# ---- custom op: torch.ops.tigon.linear_jsd ----


@custom_op("tigon::linear_jsd", mutates_args=())
def linear_jsd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], teacher_x: Tensor, teacher_weight: Tensor,
                  teacher_bias: Optional[Tensor], beta: float, temperature: float,
                  compute_grad: bool) -> tuple[Tensor, Tensor]:
    """(loss [N] fp32, G [N, V] in x's dtype) of the divergence per row between the student
    x @ weight^T + bias and the teacher teacher_x @ teacher_weight^T + teacher_bias (no
    gradient). G is the student logits' gradient (not differentiable), kept for the backward;
    an empty tensor when compute_grad is False. beta and temperature are checked by the caller
    (``check_jsd_options``)."""
    check_linear_jsd_args(x, weight, bias, teacher_x, teacher_weight, teacher_bias)
    student = linear_head_logits(x, weight, bias)
    teacher = linear_head_logits(teacher_x, teacher_weight, teacher_bias)
    loss = jsd_rows(student, teacher, student if compute_grad else None, beta, temperature)
    return loss, student if compute_grad else x.new_empty(0)


@linear_jsd_op.register_fake
def _(x, weight, bias, teacher_x, teacher_weight, teacher_bias, beta, temperature, compute_grad):
    check_linear_jsd_args(x, weight, bias, teacher_x, teacher_weight, teacher_bias)
    return x.new_empty(x.shape[0], dtype=torch.float32), fake_logit_grad(x, weight, compute_grad)


def _linear_jsd_setup_context(ctx, inputs, output):
    keep_logit_grad(ctx, inputs, output, inputs[8])


def _linear_jsd_backward(ctx, grad_loss, _grad_buffer):
    return linear_head_rows_backward(ctx, grad_loss, "linear_jsd")


linear_jsd_op.register_autograd(_linear_jsd_backward, setup_context=_linear_jsd_setup_context)


def jsd_logprobs_rows(student, teacher, labels, scale, grad, beta, ignore_index):
    """Launch on checked [N, V] log-probabilities (unit last stride): -> loss [N] fp32, each row
    times scale (a one-element fp32 tensor) and 0 where labels (None: no row ignored) hold
    ignore_index; grad (None: no gradient) receives d sum(loss) / d student."""
    n_rows, n_cols = student.shape
    loss = new_output((n_rows,), torch.float32, student.device)
    if n_rows:
        # One read of each row: a streaming pass, a warp per 512 elements of the block.
        block = min(4096, next_pow2(n_cols))
        log_beta = math.log(beta) if beta > 0 else 0.0
        log_1m_beta = math.log(1 - beta) if beta < 1 else 0.0
        launch(jsd_logprobs_kernel, (n_rows,),
            student, student.stride(0), teacher, teacher.stride(0),
            grad if grad is not None else student, grad.stride(0) if grad is not None else 0,
            loss, labels if labels is not None else scale, scale, n_cols, ignore_index, float(beta), log_beta,
            log_1m_beta, MODE=jsd_mode(beta), HAS_LABELS=labels is not None, COMPUTE_GRAD=grad is not None,
            BLOCK_V=block, num_warps=max(4, min(8, block // 512)),
        )
    return loss


def check_jsd_args(student, teacher, target):
    """Metadata checks of tigon::jsd (its real and fake implementations)."""
    check_tensor("student_logprobs", student, min_ndim=1)
    check_tensor("teacher_logprobs", teacher, min_ndim=1)
    if teacher.shape != student.shape:
        raise ValueError(f"teacher_logprobs has shape {tuple(teacher.shape)} but student_logprobs has "
                         f"{tuple(student.shape)}: they must match ([..., V], the same vocabulary)")
    if target is not None:
        check_tensor("target", target, floating=False)
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise TypeError(f"target must hold integer labels, got dtype {target.dtype}")
        if target.shape != student.shape[:-1]:
            raise ValueError(f"target has shape {tuple(target.shape)} but the log-probabilities have "
                             f"{tuple(student.shape[:-1])} rows ([..., V] -> target [...])")
    check_same_device(student_logprobs=student, teacher_logprobs=teacher, target=target)


def _rows_view(t):
    """A contiguous [..., V] tensor as [rows, V] (V may be 0)."""
    return t.view(math.prod(t.shape[:-1]), t.shape[-1])


# ---- custom ops: torch.ops.tigon.jsd and its backward ----


@custom_op("tigon::jsd", mutates_args=())
def jsd_op(student: Tensor, teacher: Tensor, target: Optional[Tensor], beta: float, ignore_index: int,
           compute_grad: bool) -> tuple[Tensor, Tensor]:
    """(loss fp32 [], G) for student and teacher log-probabilities [..., V]: the mean over the
    rows whose target is not ignore_index (all rows without a target; all ignored gives 0) of
    the generalised JSD; G [..., V] (contiguous, the student's dtype) is d loss / d student,
    kept for the backward (not differentiable), an empty tensor when compute_grad is False.
    Ignored rows are not read. beta and ignore_index are checked by the caller."""
    check_jsd_args(student, teacher, target)
    student2, teacher2 = as_rows(student), as_rows(teacher)
    labels = None if target is None else target.reshape(-1).contiguous()  # read by row index
    n_rows = student2.shape[0]
    if labels is None:
        scale = torch.full((1,), 1.0 / max(n_rows, 1), dtype=torch.float32, device=student.device)
    else:  # on the device: no host sync
        scale = (1.0 / (labels != ignore_index).sum().clamp_min(1).to(torch.float32)).reshape(1)
    grad = new_output(student.shape, student.dtype, student.device) if compute_grad else None
    loss = jsd_logprobs_rows(student2, teacher2, labels, scale, None if grad is None else _rows_view(grad), beta,
                             ignore_index).sum()
    return loss, or_empty(grad, student)


@jsd_op.register_fake
def _(student, teacher, target, beta, ignore_index, compute_grad):
    check_jsd_args(student, teacher, target)
    return (student.new_empty((), dtype=torch.float32),
            fake_grad(student, compute_grad, student))


@custom_op("tigon::jsd_backward", mutates_args=())
def jsd_backward_op(grad: Tensor, grad_loss: Tensor) -> Tensor:
    """grad * grad_loss (a one-element tensor) in grad's dtype, into a new contiguous tensor;
    grad [..., V] (the saved gradient of tigon::jsd) is left as it is."""
    _check_jsd_backward_args(grad, grad_loss)
    out = new_output(grad.shape, grad.dtype, grad.device)
    scale_rows(_rows_view(grad.contiguous()), grad_loss.reshape(1).to(torch.float32), out=_rows_view(out))
    return out


@jsd_backward_op.register_fake
def _(grad, grad_loss):
    _check_jsd_backward_args(grad, grad_loss)
    return grad.new_empty(grad.shape)


def _check_jsd_backward_args(grad, grad_loss):
    check_tensor("grad", grad, min_ndim=1)
    check_tensor("grad_loss", grad_loss)
    if grad_loss.numel() != 1:
        raise ValueError(f"grad_loss must have one element (the loss's gradient), got shape {tuple(grad_loss.shape)}")
    check_same_device(grad=grad, grad_loss=grad_loss)


def _jsd_backward_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _jsd_backward_backward(ctx, d_out):
    """jsd_backward is linear in each input (a backward over jsd's backward, create_graph=True)."""
    grad, grad_loss = ctx.saved_tensors
    d_grad = jsd_backward_op(d_out, grad_loss) if ctx.needs_input_grad[0] else None
    d_scale = None
    if ctx.needs_input_grad[1]:
        d_scale = (d_out.float() * grad.float()).sum().reshape(grad_loss.shape).to(grad_loss.dtype)
    return d_grad, d_scale


jsd_backward_op.register_autograd(_jsd_backward_backward, setup_context=_jsd_backward_setup_context)


def _jsd_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])
    ctx.compute_grad = inputs[5]


def _jsd_backward(ctx, grad_loss, _grad_buffer):
    if grad_loss is None:
        return (None,) * 6
    if not ctx.compute_grad:
        raise RuntimeError("jsd ran without a gradient (grad mode was off) but one was asked for")
    (grad,) = ctx.saved_tensors
    if not traced(grad, grad_loss) and not graph_retained():
        # Eager, and the graph is freed after this backward: scale the saved gradient in place
        # and hand it to autograd (no copy; a grad_output of 1 costs a launch, no pass).
        out = grad
        scale_rows(_rows_view(grad), grad_loss.reshape(1).to(torch.float32))
    else:  # retained (it is read again by the next backward), or traced: a new tensor
        out = jsd_backward_op(grad, grad_loss)
    return out, None, None, None, None, None


jsd_op.register_autograd(_jsd_backward, setup_context=_jsd_setup_context)
