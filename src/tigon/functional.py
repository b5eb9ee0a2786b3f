"""Plain functions over the tigon ops (differentiable; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import torch

from tigon.ops import (
    cross_entropy_op,
    embedding_op,
    fused_add_rms_norm_op,
    fused_linear_cross_entropy_op,
    rms_norm_op,
)
from tigon.ops._common import check_tensor_args
from tigon.ops.cross_entropy import CrossEntropyOverLogits, checked_cross_entropy_options, rows_alias
from tigon.ops.embedding import check_padding_idx, tied_grad_slot
from tigon.ops.fused_linear_cross_entropy import checked_flce_options
from tigon.ops.glu import GELU_APPROXIMATIONS, activation_name, check_activation, glu_op
from tigon.ops.glu_mlp import glu_down_proj as _glu_down_proj
from tigon.ops.glu_mlp import glu_mlp_input_only
from tigon.ops.jsd import check_jsd_options, jsd_op, linear_jsd_op
from tigon.ops.layer_norm import layer_norm_op
from tigon.ops.linear_token_logps import check_ignore_index, linear_token_logps_op
from tigon.ops.rms_norm import check_casting
from tigon.ops.rope import check_constant_tables, check_unsqueeze_dim, rope_op


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
    check_tensor_args(x=x, weight=weight, bias=bias)  # before the op: its schema's error would not name them
    return layer_norm_op(x, weight, bias, float(eps))[0]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """HF's ``apply_rotary_pos_emb`` in one kernel: returns (q_embed, k_embed).

    q [B, Hq, T, D], k [B, Hk, T, D] (or [B, T, H, D] with unsqueeze_dim=2); cos, sin
    [1|B, T, R] (R <= D, even). With position_ids [1|B, T], cos / sin are tables [P, R].
    ``interleaved=True``: adjacent pairs (x[2j], x[2j+1]) rotate together (torchtune's layout)
    and cos / sin hold one angle per pair, [.., R/2].
    """
    check_tensor_args(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    check_unsqueeze_dim(unsqueeze_dim)
    check_constant_tables(cos, sin)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    return rope_op(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)


def glu(a, b, activation="silu", gate_multiplier=1.0, out_multiplier=1.0) -> torch.Tensor:
    """act(a * gate_multiplier) * b * out_multiplier, elementwise; a, b [..., I] of one dtype.
    activation: one of tigon's names ("silu", "gelu_tanh", "gelu_erf") or an HF alias."""
    check_tensor_args(a=a, b=b)
    activation = activation_name(activation)
    check_activation(activation, gate_multiplier=gate_multiplier, out_multiplier=out_multiplier)
    return glu_op(a, b, activation, float(gate_multiplier), float(out_multiplier))


def swiglu(a, b, *, gate_multiplier=1.0) -> torch.Tensor:
    """silu(a * gate_multiplier) * b, elementwise; a, b [..., I] of one dtype."""
    return glu(a, b, "silu", gate_multiplier)


def geglu(a, b, approximate="tanh", *, gate_multiplier=1.0) -> torch.Tensor:
    """gelu(a * gate_multiplier) * b with ``approximate`` "tanh" (HF's gelu_pytorch_tanh) or
    "none" (exact erf)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return glu(a, b, GELU_APPROXIMATIONS[approximate], gate_multiplier)


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu", *, inplace=False, gate_multiplier=1.0,
                  down_multiplier=1.0) -> torch.Tensor:
    """((act(a * gate_multiplier) * b) @ down_weight.T + down_bias) * down_multiplier, keeping
    only a and b for the backward. a, b [..., I], down_weight [H, I], down_bias [H] -> [..., H].

    activation: one of tigon's names ("silu", "gelu_tanh", "gelu_erf") or an HF alias
    ("gelu_pytorch_tanh", ...). inplace=True lets the backward write the gradients of a and b
    over a and b (saves two [tokens, I] buffers; a and b must be intermediates nothing else
    reads, and backward can then run only once).
    """
    check_tensor_args(a=a, b=b, down_weight=down_weight, down_bias=down_bias)
    return _glu_down_proj(a, b, down_weight, down_bias, activation_name(activation), inplace=inplace,
                          gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


def glu_mlp(x, gate_weight, up_weight, down_weight, activation="silu", *, gate_multiplier=1.0,
            down_multiplier=1.0) -> torch.Tensor:
    """(act(x @ gate_weight.T * gate_multiplier) * (x @ up_weight.T)) @ down_weight.T *
    down_multiplier, keeping only x for the backward (gate and up are recomputed there in
    column slices). x [..., H], gate / up weights [I, H], down weight [H, I]. Meant for layers
    under torch.utils.checkpoint (non-reentrant), where its recomputation is skipped when
    nothing after it needs it; outside checkpointing it trades two matmuls for two [tokens, I]
    activations. (Falcon-H1's ``mlp_multipliers`` are the two multipliers.)"""
    check_tensor_args(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    return glu_mlp_input_only(x, gate_weight, up_weight, down_weight, activation_name(activation),
                              gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


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
    when logits require grad (no [N, V] gradient allocated; do not read logits afterwards); under
    torch.compile it is ignored (the functional op runs, the logits are left alone).
    Returns the loss, or (loss, [z_loss], [token_accuracy], [predicted_tokens]) with the
    extras asked for; predicted tokens are the argmax per row (int64), -1 where ignored.
    """
    logits2, target1 = _ce_rows(logits, target)
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, weight, lse_square_scale, softcap,
                                         use_token_scaling, return_z_loss, return_token_accuracy,
                                         return_predicted_tokens)
    compute_grad = torch.is_grad_enabled() and logits2.requires_grad
    if inplace and compute_grad and not torch.compiler.is_compiling():
        rows = logits2 if logits2.stride(-1) == 1 else logits2.contiguous()  # a copy of ours to write over
        if not rows_alias(rows):  # rows sharing memory cannot each hold their own gradient
            return _loss_outputs(CrossEntropyOverLogits.apply(rows, target1, opts), target, opts)
    return _loss_outputs(cross_entropy_op(logits2, target1, *opts, compute_grad), target, opts)


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
    tigon.ops.embedding): the two backward passes then fill one [V, H] gradient (eager mode;
    under torch.compile the slot is not used and each returns its own gradient).
    """
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, ce_weight, lse_square_scale,
                                         softcap, use_token_scaling, return_z_loss, return_token_accuracy,
                                         return_predicted_tokens)
    chunk_budget, accum_dtype = checked_flce_options(chunk_budget, accum_dtype)
    grad = torch.is_grad_enabled()
    need = (grad and _requires_grad(x), grad and _requires_grad(weight), grad and _requires_grad(bias))
    args = (x, weight, target, bias, *opts, chunk_budget, accum_dtype, *need)
    with tied_grad_slot(tied_slot):
        return _loss_outputs(fused_linear_cross_entropy_op(*args), target, opts)


def embedding(ids, weight, padding_idx=None, tied_slot=None) -> torch.Tensor:
    """weight[ids]: ids [...] integer, weight [V, H] -> [..., H] in weight's dtype. The backward
    sums each token's rows in fp32 in a fixed order (deterministic) and adds them into the
    weight's gradient; ``padding_idx`` rows get no gradient (as nn.Embedding). ``tied_slot``:
    see fused_linear_cross_entropy."""
    check_padding_idx(padding_idx)  # before the op: its schema would refuse a non-int with a vaguer error
    with tied_grad_slot(tied_slot):
        return embedding_op(ids, weight, padding_idx)


def linear_token_logps(x, weight, target, bias=None, ignore_index=-100) -> torch.Tensor:
    """log softmax(x @ weight.T + bias)[target] per row, 0 where target == ignore_index.

    x [..., H], weight [V, H], bias [V] or None, target [...] -> fp32 [...]. Forms the rows'
    [rows, V] logits once (meant for a chunk of a batch, as the post-training losses use it)
    and keeps their gradient for a two-matmul backward.
    """
    check_tensor_args(x=x, weight=weight, target=target, bias=bias)
    check_ignore_index(ignore_index)  # before the op: its schema would refuse a non-int with a vaguer error
    x2 = x.reshape(-1, x.shape[-1])
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    logp, _ = linear_token_logps_op(x2, weight, bias, target.reshape(-1), ignore_index, compute_grad)
    return logp.view(target.shape)


def linear_jsd(x, weight, teacher_x, teacher_weight, bias=None, teacher_bias=None, beta=0.5, temperature=1.0):
    """Generalised JSD per row between the student x @ weight.T + bias and the teacher
    teacher_x @ teacher_weight.T + teacher_bias (beta 0: KL(teacher || student), 1: KL(student
    || teacher)), logits divided by temperature. x [..., Hs], teacher_x [..., Ht] -> fp32 [...].
    Gradients flow to the student only. Forms the rows' logits once (meant for a chunk)."""
    check_tensor_args(x=x, weight=weight, teacher_x=teacher_x, teacher_weight=teacher_weight, bias=bias,
                      teacher_bias=teacher_bias)
    check_jsd_options(beta, temperature)  # before the op (a ValueError / TypeError naming the argument)
    lead = x.shape[:-1]
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    loss, _ = linear_jsd_op(x.reshape(-1, x.shape[-1]), weight, bias,
                            teacher_x.reshape(-1, teacher_x.shape[-1]).detach(), teacher_weight.detach(),
                            None if teacher_bias is None else teacher_bias.detach(), float(beta),
                            float(temperature), compute_grad)
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
    check_jsd_options(beta)  # before the op (a ValueError / TypeError naming the argument)
    check_ignore_index(ignore_index)
    check_tensor_args(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, target=target)
    compute_grad = torch.is_grad_enabled() and student_logprobs.requires_grad
    loss, _ = jsd_op(student_logprobs, teacher_logprobs.detach(), target, float(beta), ignore_index, compute_grad)
    return loss


def _requires_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _loss_outputs(outputs, target, opts):
    """The loss (shaped like target for reduction "none"), plus the extras asked for (the ops
    return empty tensors for the others, and their gradients after these four)."""
    loss, z_loss, accuracy, predicted = outputs[:4]
    extras = [e for e, asked in ((z_loss, opts.returns_z_loss), (accuracy, opts.return_token_accuracy),
                                 (predicted, opts.return_predicted_tokens)) if asked]
    if target.ndim != 1:
        if opts.reduction == "none":
            loss = loss.view(target.shape)
            extras = [e.view(target.shape) for e in extras]
        elif opts.return_predicted_tokens:  # the predicted tokens are per row whatever the reduction
            extras[-1] = extras[-1].view(target.shape)
    return (loss, *extras) if extras else loss
