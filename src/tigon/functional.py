"""Plain functions over the tigon ops (differentiable; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import torch

from tigon.ops import (
    CrossEntropyFunction,
    EmbeddingFunction,
    FusedLinearCrossEntropyFunction,
    GLUDownProjFunction,
    GLUFunction,
    GLUMLPFunction,
    JSDFunction,
    LayerNormFunction,
    LinearJSDFunction,
    LinearTokenLogpsFunction,
    RoPEFunction,
    fused_add_rms_norm_op,
    rms_norm_op,
)
from tigon.ops.cross_entropy import CrossEntropyOptions
from tigon.ops.glu import GELU_APPROXIMATIONS, activation_name
from tigon.ops.rms_norm import check_casting

def rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama", inplace=False) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N] or None (no scaling); casting "llama", "gemma" or
    "none" (see ``tigon.ops.rms_norm``).

    ``offset=1.0`` with ``casting="gemma"`` is Gemma's ``(1 + weight)``. ``inplace`` lets the
    backward write dx over the incoming gradient (saves one buffer; the gradient must not be
    needed elsewhere).
    """
    check_casting(casting)  # before the op: its schema would refuse a non-str with a vaguer error
    return rms_norm_op(x, weight, float(eps), float(offset), casting, bool(inplace))[0]


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting="llama", inplace=False):
    """(rms_norm(x + residual), x + residual) in one pass; x, residual [..., N], weight [N] or
    None. ``inplace`` as in ``rms_norm``."""
    check_casting(casting)
    y, s, _ = fused_add_rms_norm_op(x, residual, weight, float(eps), float(offset), casting, bool(inplace))
    return y, s


def layer_norm(x, weight, bias, eps=1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over the last dim; weight, bias [N] or None."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb`` in one kernel: returns (q_embed, k_embed).

    q [B, Hq, T, D], k [B, Hk, T, D] (or [B, T, H, D] with unsqueeze_dim=2); cos, sin
    [1|B, T, R] (R <= D, even). With position_ids [1|B, T], cos / sin are tables [P, R].
    """
    return RoPEFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def swiglu(a, b, *, gate_multiplier=1.0) -> torch.Tensor:
    """silu(a * gate_multiplier) * b, elementwise; a, b [..., I] of one dtype."""
    return GLUFunction.apply(a, b, "silu", gate_multiplier)


def geglu(a, b, approximate="tanh", *, gate_multiplier=1.0) -> torch.Tensor:
    """gelu(a * gate_multiplier) * b with ``approximate`` "tanh" (HF's gelu_pytorch_tanh) or
    "none" (exact erf)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return GLUFunction.apply(a, b, GELU_APPROXIMATIONS[approximate], gate_multiplier)


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu", *, inplace=False, gate_multiplier=1.0,
                  down_multiplier=1.0) -> torch.Tensor:
    """((act(a * gate_multiplier) * b) @ down_weight.T + down_bias) * down_multiplier, keeping
    only a and b for the backward. a, b [..., I], down_weight [H, I], down_bias [H] -> [..., H].

    activation: one of tigon's names ("silu", "gelu_tanh", "gelu_erf") or an HF alias
    ("gelu_pytorch_tanh", ...). inplace=True lets the backward write the gradients of a and b
    over a and b (saves two [tokens, I] buffers; a and b must be intermediates nothing else
    reads, and backward can then run only once).
    """
    return GLUDownProjFunction.apply(a, b, down_weight, down_bias, activation_name(activation), inplace,
                                     gate_multiplier, down_multiplier)


def glu_mlp(x, gate_weight, up_weight, down_weight, activation="silu", *, gate_multiplier=1.0,
            down_multiplier=1.0) -> torch.Tensor:
    """(act(x @ gate_weight.T * gate_multiplier) * (x @ up_weight.T)) @ down_weight.T *
    down_multiplier, keeping only x for the backward (gate and up are recomputed there in
    column slices). x [..., H], gate / up weights [I, H], down weight [H, I]. Meant for layers
    under torch.utils.checkpoint (non-reentrant), where its recomputation is skipped when
    nothing after it needs it; outside checkpointing it trades two matmuls for two [tokens, I]
    activations. (Falcon-H1's ``mlp_multipliers`` are the two multipliers.)"""
    return GLUMLPFunction.apply(x, gate_weight, up_weight, down_weight, activation_name(activation),
                                gate_multiplier, down_multiplier)


def _ce_rows(logits, target):
    """logits [..., V] and target [...] (or flattened [rows]) as [rows, V] and [rows]."""
    if not isinstance(logits, torch.Tensor) or logits.ndim == 0:
        raise ValueError("logits must be a tensor [..., V] with the classes last, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)!r}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(target).__name__}")
    rows = logits.shape[:-1]
    if target.shape != rows and not (target.ndim == 1 and target.numel() == math.prod(rows)):
        raise ValueError(f"target has shape {tuple(target.shape)}; for logits {tuple(logits.shape)} ([..., V]) it "
                         f"must be {tuple(rows)} or flat [{math.prod(rows)}]")
    return logits.reshape(math.prod(rows), logits.shape[-1]), target.reshape(-1)


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                  lse_square_scale=0.0, softcap=None, use_token_scaling=False, return_z_loss=False,
                  return_token_accuracy=False, return_predicted_tokens=False, inplace=False):
    """Cross entropy of logits [..., V] against class indices target [...], loss in fp32.

    Options as ``torch.nn.functional.cross_entropy`` (ignore_index, reduction, label_smoothing,
    class weight), plus z-loss ``lse_square_scale * logsumexp^2``, Gemma 2's logit
    soft-capping ``softcap * tanh(logits / softcap)`` and ``use_token_scaling`` (each token's
    loss times its predicted probability of the target, detached). "mean" averages over
    non-ignored tokens; an all-ignored batch gives 0 (not NaN). Unlike torch, the classes are
    the last dim. ``inplace=True`` writes the gradient over ``logits`` during the forward pass
    when logits require grad (no [N, V] gradient allocated; do not read logits afterwards).
    Returns the loss, or (loss, [z_loss], [token_accuracy], [predicted_tokens]) with the
    extras asked for; predicted tokens are the argmax per row (int64), -1 where ignored.
    """
    logits2, target1 = _ce_rows(logits, target)
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens)
    outputs = CrossEntropyFunction.apply(logits2, target1, opts, inplace, torch.is_grad_enabled())
    return _loss_outputs(outputs, target, opts)


def fused_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, ce_weight=None, lse_square_scale=0.0, softcap=None,
                               use_token_scaling=False, return_z_loss=False, return_token_accuracy=False,
                               return_predicted_tokens=False, chunk_budget=None, accum_dtype=None, tied_slot=None):
    """cross_entropy(x @ weight.T + bias, target) without materialising the [rows, V] logits.

    x [..., H] (bf16 or fp32), weight [V, H] (x's dtype or fp32; tied embeddings and frozen
    heads are fine), bias [V] or None, target [...] class indices. Cross-entropy options as
    ``cross_entropy`` (``ce_weight`` is its class weight). ``chunk_budget``: bytes of logits a
    chunk may hold (default 512 MiB); ``accum_dtype=torch.float32`` accumulates dW in fp32
    (V * H * 4 bytes more). Gradients are computed in the forward pass (reduction "mean" /
    "sum"); the backward scales them by grad_output. ``tied_slot``: a TiedGradSlot shared with
    ``embedding`` of the same forward when ``weight`` is also the input embedding (see
    tigon.ops.embedding): the two backward passes then fill one [V, H] gradient.
    """
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, ce_weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens)
    outputs = FusedLinearCrossEntropyFunction.apply(x, weight, target, bias, opts, chunk_budget, accum_dtype,
                                                    torch.is_grad_enabled(), tied_slot)
    return _loss_outputs(outputs, target, opts)


def embedding(ids, weight, padding_idx=None, tied_slot=None) -> torch.Tensor:
    """weight[ids]: ids [...] integer, weight [V, H] -> [..., H] in weight's dtype. The backward
    sums each token's rows in fp32 in a fixed order (deterministic) and adds them into the
    weight's gradient; ``padding_idx`` rows get no gradient (as nn.Embedding). ``tied_slot``:
    see fused_linear_cross_entropy."""
    return EmbeddingFunction.apply(ids, weight, padding_idx, tied_slot)


def linear_token_logps(x, weight, target, bias=None, ignore_index=-100) -> torch.Tensor:
    """log softmax(x @ weight.T + bias)[target] per row, 0 where target == ignore_index.

    x [..., H], weight [V, H], bias [V] or None, target [...] -> fp32 [...]. Forms the rows'
    [rows, V] logits once (meant for a chunk of a batch, as the post-training losses use it)
    and keeps their gradient for a two-matmul backward.
    """
    x2 = x.reshape(-1, x.shape[-1])
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    logp, _ = LinearTokenLogpsFunction.apply(x2, weight, bias, target.reshape(-1), ignore_index, compute_grad)
    return logp.view(target.shape)


def linear_jsd(x, weight, teacher_x, teacher_weight, bias=None, teacher_bias=None, beta=0.5, temperature=1.0):
    """Generalised JSD per row between the student x @ weight.T + bias and the teacher
    teacher_x @ teacher_weight.T + teacher_bias (beta 0: KL(teacher || student), 1: KL(student
    || teacher)), logits divided by temperature. x [..., Hs], teacher_x [..., Ht] -> fp32 [...].
    Gradients flow to the student only. Forms the rows' logits once (meant for a chunk)."""
    lead = x.shape[:-1]
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    loss, _ = LinearJSDFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias,
                                      teacher_x.reshape(-1, teacher_x.shape[-1]).detach(), teacher_weight.detach(),
                                      None if teacher_bias is None else teacher_bias.detach(), beta,
                                      temperature, compute_grad)
    return loss.view(lead)


def jsd(student_logprobs, teacher_logprobs, target=None, *, beta=0.5, ignore_index=-100) -> torch.Tensor:
    """Generalised JSD between student and teacher log-probabilities, averaged over the rows
    whose target is not ignore_index (all rows without a target; all ignored gives 0).

    student_logprobs [..., V] (the gradient is taken with respect to them), teacher_logprobs
    [..., V] (no gradient), target [...] integer or None -> fp32 scalar. Per row, with P the
    student's and Q the teacher's distribution: beta 0 is KL(Q || P) (forward KL), beta 1 is
    KL(P || Q) (reverse KL), otherwise beta KL(Q || M) + (1 - beta) KL(P || M) with
    M = beta Q + (1 - beta) P. This beta is TRL's (GKD) and Liger's (``LigerJSD``) as they are,
    and ``linear_jsd``'s: no conversion. As ``LigerJSD(beta, ignore_index)(student_logprobs,
    teacher_logprobs, shift_labels)``: the log-probabilities are taken as given (not
    renormalised) and the gradient is that of the per-element formula with respect to them.
    """
    return JSDFunction.apply(student_logprobs, teacher_logprobs.detach() if torch.is_tensor(teacher_logprobs)
                             else teacher_logprobs, target, beta, ignore_index, torch.is_grad_enabled())


def _loss_outputs(outputs, target, opts):
    """The loss (shaped like target for reduction "none"), plus the extras asked for."""
    loss, *extras = outputs
    if opts.reduction == "none" and target.ndim != 1:
        loss = loss.view(target.shape)
        extras = [e.view(target.shape) if e is not None and e.ndim else e for e in extras]
    elif target.ndim != 1:  # the predicted tokens are per row whatever the reduction
        extras[2] = extras[2].view(target.shape) if extras[2] is not None else None
    asked = [e for e in extras if e is not None]
    return (loss, *asked) if asked else loss
