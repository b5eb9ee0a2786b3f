"""Distillation on the chunked base: generalised JSD between student and teacher (TRL's GKD form).

With p_s, p_t the softmaxes of student and teacher logits divided by ``temperature``:
beta = 0 is KL(p_t || p_s) (forward KL), beta = 1 is KL(p_s || p_t) (reverse KL), otherwise
beta * KL(p_t || m) + (1 - beta) * KL(p_s || m) with m = beta * p_t + (1 - beta) * p_s.
Averaged over the tokens whose target is not ignore_index (all tokens without a target).
``fused_linear_jsd`` takes hidden states and heads and forms the logits a chunk of tokens at a
time; ``jsd_loss`` takes logits that already exist; ``TigonJSD`` (``tigon.functional.jsd``)
takes log-probabilities, as Liger's ``LigerJSD``. beta means the same in all of them, and in
TRL's GKD and Liger's JSD losses. Gradients flow to the student only.

``chunk_budget`` is the bytes of logits one chunk of rows may hold (default
``tigon.ops._common.DEFAULT_CHUNK_BUDGET``): the fused path's student and teacher logits (each
in its inputs' dtype); for the torch math (``compiled=True``, ``jsd_loss``) about six fp32
[rows, V] temporaries. ``chunk_rows`` sets the rows per chunk directly instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tigon.functional import jsd, linear_jsd
from tigon.losses.base import contiguous_chunks, head_logits, rows_per_chunk, run_chunked
from tigon.ops._common import chunk_budget_bytes
from tigon.ops.jsd import check_jsd_options

TORCH_BYTES_PER_LOGIT = 6 * 4  # torch's generalised JSD holds about six fp32 [rows, V] temporaries


def generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """Per-token divergence [rows] of fp32 logits [rows, V]."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack((s + math.log(1 - beta), t + math.log(beta))), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def fused_linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target=None, student_bias=None,
                     teacher_bias=None, *, beta=0.5, temperature=1.0, ignore_index=-100, chunk_rows=None,
                     chunk_budget=None, compiled=False):
    """JSD(student_x @ student_weight.T, teacher_x @ teacher_weight.T) without the full logits.
    student_x [..., Hs], teacher_x [..., Ht] over the same tokens, weights [V, Hs] / [V, Ht],
    target [...] (only its ignore_index positions matter) or None. Returns (loss, metrics).
    chunk_budget: bytes of student + teacher logits per chunk (see the module's docstring)."""
    check_jsd_options(beta, temperature)
    beta, temperature = float(beta), float(temperature)  # see plain_numbers
    sx, tx = student_x.reshape(-1, student_x.shape[-1]), teacher_x.reshape(-1, teacher_x.shape[-1])
    if sx.shape[0] != tx.shape[0]:
        raise ValueError(f"student_x has {sx.shape[0]} tokens but teacher_x has {tx.shape[0]}")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student_weight has {student_weight.shape[0]} classes, teacher_weight "
                         f"{teacher_weight.shape[0]}: the vocabularies must match")
    if student_weight.shape[1] != sx.shape[1] or teacher_weight.shape[1] != tx.shape[1]:
        raise ValueError("student_weight / teacher_weight must be [V, H] with H the last dim of student_x / teacher_x")
    mask = torch.ones(sx.shape[0], dtype=torch.bool, device=sx.device) if target is None else \
        target.reshape(-1) != ignore_index
    if mask.shape[0] != sx.shape[0]:
        raise ValueError(f"target has {mask.shape[0]} elements but the inputs have {sx.shape[0]} tokens")
    n_valid = mask.sum().clamp_min(1)

    def chunk_fn(sxc, txc, mc, sw, sb, tw, tb):
        if compiled:  # plain torch on fp32 logits, for torch.compile to fuse
            with torch.no_grad():
                t_logits = head_logits(txc, tw, tb)
            per_token = generalized_jsd(head_logits(sxc, sw, sb), t_logits, beta, temperature)
        else:  # tigon's JSD kernel on the chunk's logits in the inputs' dtypes
            per_token = linear_jsd(sxc, sw, txc, tw, sb, tb, beta=beta, temperature=temperature)
        return (per_token * mc).sum() / n_valid, {}

    # The fused path holds the student's and the teacher's chunk logits, in x's and teacher_x's dtypes.
    per_logit = TORCH_BYTES_PER_LOGIT if compiled else sx.element_size() + tx.element_size()
    rows = rows_per_chunk(chunk_rows, chunk_budget, sx.shape[0], student_weight.shape[0], per_logit)
    detach = (lambda t: t.detach() if t is not None else None)
    loss, metrics = run_chunked(chunk_fn, [sx, detach(tx), mask], [student_weight, student_bias,
                                                                  detach(teacher_weight), detach(teacher_bias)],
                                contiguous_chunks(sx.shape[0], rows, sx.device), compiled)
    return loss, metrics


def jsd_loss(student_logits, teacher_logits, target=None, *, beta=0.5, temperature=1.0, ignore_index=-100,
             chunk_rows=None, chunk_budget=None):
    """Generalised JSD over logits [..., V] that already exist (fp32 math a chunk of rows at a
    time; chunk_budget counts its fp32 temporaries), averaged over the rows whose target [...] is
    not ignore_index (every row without a target). Returns the loss alone, an fp32 scalar (no
    metrics). For log-probabilities, see TigonJSD."""
    check_jsd_options(beta, temperature)
    beta, temperature = float(beta), float(temperature)  # see plain_numbers
    s, t = student_logits.reshape(-1, student_logits.shape[-1]), teacher_logits.reshape(-1, teacher_logits.shape[-1])
    if s.shape != t.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    mask = torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if target is None else \
        target.reshape(-1) != ignore_index
    n_valid = mask.sum().clamp_min(1)

    def chunk_fn(sc, tc, mc):
        return (generalized_jsd(sc.float(), tc.float(), beta, temperature) * mc).sum() / n_valid, {}

    rows = rows_per_chunk(chunk_rows, chunk_budget, s.shape[0], s.shape[1], TORCH_BYTES_PER_LOGIT)
    loss, _ = run_chunked(chunk_fn, [s, t.detach(), mask], [], contiguous_chunks(s.shape[0], rows, s.device))
    return loss


class TigonFusedLinearJSD(nn.Module):
    """``loss, metrics = module(student_x, student_weight, teacher_x, teacher_weight, target=None)``."""

    def __init__(self, beta=0.5, temperature=1.0, ignore_index=-100, chunk_rows=None, chunk_budget=None,
                 compiled=False):
        super().__init__()
        check_jsd_options(beta, temperature)
        chunk_budget_bytes(chunk_budget)
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        self.chunk_rows, self.chunk_budget, self.compiled = chunk_rows, chunk_budget, compiled

    def forward(self, student_x, student_weight, teacher_x, teacher_weight, target=None, student_bias=None,
                teacher_bias=None):
        return fused_linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target, student_bias,
                                teacher_bias, beta=self.beta, temperature=self.temperature,
                                ignore_index=self.ignore_index, chunk_rows=self.chunk_rows,
                                chunk_budget=self.chunk_budget, compiled=self.compiled)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, temperature={self.temperature}"


class TigonJSD(nn.Module):
    """``loss = module(student_logprobs, teacher_logprobs, target=None)``: the generalised JSD
    between log-probabilities [..., V], averaged over the rows whose target is not ignore_index
    (``tigon.functional.jsd``, on tigon's Triton kernel). A drop-in for Liger's
    ``LigerJSD(beta, ignore_index)(log_q, log_p, shift_labels)``: student first, beta as
    Liger's and TRL's (0: KL(teacher || student), 1: KL(student || teacher)), the gradient
    taken with respect to the student's log-probabilities. The loss is fp32 (Liger's is cast to
    the inputs' dtype), and an all-ignored batch gives 0 (Liger's divides by zero)."""

    def __init__(self, beta=0.5, ignore_index=-100):
        super().__init__()
        check_jsd_options(beta)
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, student_logprobs, teacher_logprobs, target=None):
        return jsd(student_logprobs, teacher_logprobs, target, beta=self.beta, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"
