"""Generalised Jensen-Shannon divergence between student and teacher logits, per row, with the
student's gradient written in the forward pass (in place over the student logits by default).

With a = s / temperature, b = t / temperature, P = softmax(a) (student), Q = softmax(b)
(teacher), per row:
    beta = 0:  KL(Q || P) = sum Q (log Q - log P)                       (forward KL)
    beta = 1:  KL(P || Q) = sum P (log P - log Q)                       (reverse KL)
    else:      beta KL(Q || M) + (1 - beta) KL(P || M),  M = beta Q + (1 - beta) P
(TRL's generalised JSD). The gradient, with g_j = d loss / d P_j:
    d loss / d s_i = P_i (g_i - sum_j P_j g_j) / temperature,
    g = -Q / P (beta 0),  log P - log Q + 1 (beta 1),  (1 - beta)(log P - log M) (else),
so beta 0 gives (P - Q) / temperature. For beta 0 and 1 the loss is an expectation that one
online pass can form (E_Q[b - a] - lse_b + lse_a, or E_P[a - b] - lse_a + lse_b), so the kernel
reads each row twice (log-sum-exps and loss, then the gradient); a mixed beta needs the two
log-sum-exps before log M exists, so it reads each row three times.

x [N, H] -> ``LinearJSDFunction`` forms both heads' logits for a chunk of rows and keeps the
student's gradient, like ``linear_token_logps``: the chunked distillation loss is built on it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tigon.ops._common import check_same_device, check_tensor, launch, new_output, next_pow2
from tigon.ops.linear_token_logps import keep_logit_grad, linear_head_logits, linear_head_rows_backward

FORWARD_KL, REVERSE_KL, MIXED = 0, 1, 2


@triton.jit
def jsd_kernel(
    S, stride_s, T, stride_t, G, stride_g, LOSS, n_cols, inv_temp, beta, log_beta, log_1m_beta,
    MODE: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """LOSS[row] = the divergence of row `row` (one program a row); G row = d LOSS[row] / d S row.
    G may alias S."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * stride_s
    t_row = T + row * stride_t
    g_row = G + row * stride_g
    offs = tl.arange(0, BLOCK_V)
    # Pass 1: online log-sum-exps of a and b; for beta 0 / 1 also the softmax-weighted mean of
    # b - a (under Q) or a - b (under P), rescaled with its running maximum like the sum.
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
        pa = tl.exp(a - new_a)
        pb = tl.exp(b - new_b)
        scale_a = tl.exp(m_a - new_a)
        scale_b = tl.exp(m_b - new_b)
        d_a = d_a * scale_a + tl.sum(pa, axis=0)
        d_b = d_b * scale_b + tl.sum(pb, axis=0)
        if MODE == 0:
            e_w = e_w * scale_b + tl.sum(tl.where(mask, pb * (b - a), 0.0), axis=0)
        elif MODE == 1:
            e_w = e_w * scale_a + tl.sum(tl.where(mask, pa * (a - b), 0.0), axis=0)
        m_a = new_a
        m_b = new_b
    lse_a = m_a + tl.log(d_a)
    lse_b = m_b + tl.log(d_b)
    if MODE == 0:
        loss = e_w / d_b - lse_b + lse_a
        p_dot_g = -1.0  # sum_j P_j (-Q_j / P_j)
    elif MODE == 1:
        loss = e_w / d_a - lse_a + lse_b
        p_dot_g = loss + 1.0
    else:
        # Pass 2: the loss and sum_j P_j g_j, now that log M can be formed.
        loss_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        pg_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            mask = cols < n_cols
            log_p = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_a
            log_q = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_b
            x1 = log_q + log_beta
            x2 = log_p + log_1m_beta
            hi = tl.maximum(x1, x2)
            log_m = hi + tl.log(tl.exp(x1 - hi) + tl.exp(x2 - hi))
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
            log_p = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_a
            p = tl.exp(log_p)
            if MODE == 0:
                q = tl.exp(tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_b)
                grad = p - q
            elif MODE == 1:
                log_q = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_b
                grad = p * (log_p - log_q + 1.0 - p_dot_g)
            else:
                log_q = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_b
                x1 = log_q + log_beta
                x2 = log_p + log_1m_beta
                hi = tl.maximum(x1, x2)
                log_m = hi + tl.log(tl.exp(x1 - hi) + tl.exp(x2 - hi))
                grad = p * ((1.0 - beta) * (log_p - log_m) - p_dot_g)
            tl.store(g_row + cols, (grad * inv_temp).to(G.dtype.element_ty), mask=mask)


def jsd_mode(beta: float) -> int:
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else MIXED


def check_jsd_options(beta, temperature):
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
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


class LinearJSDFunction(torch.autograd.Function):
    """(loss [N] fp32, G [N, V]) of the divergence between x @ weight^T + bias (student) and
    teacher_x @ teacher_weight^T + teacher_bias (no gradient), per row. G is the student
    logits' saved gradient (not differentiable), returned so that setup_context can keep it."""

    @staticmethod
    def forward(x, weight, bias, teacher_x, teacher_weight, teacher_bias, beta, temperature, compute_grad=True):
        check_jsd_options(beta, temperature)
        for name, xx, w, b in (("", x, weight, bias), ("teacher_", teacher_x, teacher_weight, teacher_bias)):
            check_tensor(f"{name}x", xx, ndim=2)
            check_tensor(f"{name}weight", w, ndim=2)
            if w.shape[1] != xx.shape[1]:
                raise ValueError(f"{name}weight has shape {tuple(w.shape)} ([V, H]) but {name}x's H is {xx.shape[1]}")
            if b is not None:
                check_tensor(f"{name}bias", b, ndim=1)
                if b.shape[0] != w.shape[0]:
                    raise ValueError(f"{name}bias has {b.shape[0]} entries but {name}weight has {w.shape[0]} rows")
        if teacher_x.shape[0] != x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but teacher_x has {teacher_x.shape[0]}")
        if teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"weight has {weight.shape[0]} classes but teacher_weight has {teacher_weight.shape[0]}: "
                             "the vocabularies must match")
        check_same_device(x=x, weight=weight, bias=bias, teacher_x=teacher_x, teacher_weight=teacher_weight,
                          teacher_bias=teacher_bias)
        student = linear_head_logits(x, weight, bias)
        teacher = linear_head_logits(teacher_x, teacher_weight, teacher_bias)
        loss = jsd_rows(student, teacher, student if compute_grad else None, beta, temperature)
        return loss, student

    @staticmethod
    def setup_context(ctx, inputs, output):
        keep_logit_grad(ctx, inputs, output, inputs[8] if len(inputs) > 8 else True)

    @staticmethod
    def backward(ctx, grad_loss, _grad_buffer):
        return linear_head_rows_backward(ctx, grad_loss, "linear_jsd")
