"""Plain functions over the tigon ops (differentiable; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from tigon.ops import (
    CrossEntropyFunction,
    EmbeddingFunction,
    FusedAddRMSNormFunction,
    FusedLinearCrossEntropyFunction,
    GLUDownProjFunction,
    GLUFunction,
    GLUMLPFunction,
    LayerNormFunction,
    LinearJSDFunction,
    LinearTokenLogpsFunction,
    RMSNormFunction,
    RoPEFunction,
)

_GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu_erf"}


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama", in_place=False) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N]; see ``tigon.ops.rms_norm`` for the casting modes.

    ``offset=1.0`` with ``casting="gemma"`` is Gemma's ``(1 + weight)``. ``in_place`` lets the
    backward write dx over the incoming gradient (saves one buffer; the gradient must not be
    needed elsewhere).
    """
    return RMSNormFunction.apply(x, weight, eps, offset, casting, in_place)


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting="llama"):
    """(rms_norm(x + residual), x + residual) in one pass; x, residual [..., N], weight [N]."""
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting, False)


def layer_norm(x, weight, bias, eps=1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over the last dim; weight, bias [N] or None."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb`` in one kernel: returns (q_embed, k_embed).

    q [B, Hq, T, D], k [B, Hk, T, D] (or [B, T, H, D] with unsqueeze_dim=2); cos, sin
    [1|B, T, R] (R <= D, even). With position_ids [1|B, T], cos / sin are tables [P, R].
    """
    return RoPEFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def swiglu(a, b) -> torch.Tensor:
    """silu(a) * b, elementwise; a, b [..., I] of one dtype."""
    return GLUFunction.apply(a, b, "silu")


def geglu(a, b, approximate="tanh") -> torch.Tensor:
    """gelu(a) * b with ``approximate`` "tanh" (HF's gelu_pytorch_tanh) or "none" (exact erf)."""
    if approximate not in _GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return GLUFunction.apply(a, b, _GELU_APPROXIMATIONS[approximate])


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu", reuse_inputs=False) -> torch.Tensor:
    """(act(a) * b) @ down_weight.T + down_bias, keeping only a and b for the backward.

    activation: "silu", "gelu_tanh" or "gelu_erf". reuse_inputs=True lets the backward write
    the gradients of a and b over a and b (saves two [tokens, I] buffers; a and b must be
    intermediates nothing else reads, and backward can then run only once).
    """
    return GLUDownProjFunction.apply(a, b, down_weight, down_bias, activation, reuse_inputs)


def glu_mlp(x, gate_weight, up_weight, down_weight, activation="silu") -> torch.Tensor:
    """(act(x @ gate_weight.T) * (x @ up_weight.T)) @ down_weight.T, keeping only x for the
    backward (gate and up are recomputed there in column slices). x [..., H], gate / up weights
    [I, H], down weight [H, I]. Meant for layers under torch.utils.checkpoint (non-reentrant),
    where its recomputation is skipped when nothing after it needs it; outside checkpointing it
    trades two matmuls for two [tokens, I] activations."""
    return GLUMLPFunction.apply(x, gate_weight, up_weight, down_weight, activation)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                  lse_square_scale=0.0, softcap=None, return_z_loss=False, return_token_accuracy=False,
                  inplace=True):
    """Cross entropy of logits [..., V] against class indices target [...], loss in fp32.

    Options as ``torch.nn.functional.cross_entropy`` (ignore_index, reduction, label_smoothing,
    class weight), plus z-loss ``lse_square_scale * logsumexp^2`` and Gemma 2's logit
    soft-capping ``softcap * tanh(logits / softcap)``. "mean" averages over non-ignored tokens;
    an all-ignored batch gives 0 (not NaN). With ``inplace`` (default) the gradient is written
    over ``logits`` during the forward pass when logits require grad: do not read logits after.
    Returns the loss, or (loss, [z_loss], [token_accuracy]) with the extras asked for.
    """
    v = logits.shape[-1] if logits.ndim else 0
    loss, z_loss, accuracy = CrossEntropyFunction.apply(
        logits.reshape(-1, v) if logits.ndim != 2 else logits, target.reshape(-1), ignore_index, reduction,
        label_smoothing, weight, lse_square_scale, softcap, return_z_loss, return_token_accuracy, inplace,
        torch.is_grad_enabled())
    return _loss_outputs(loss, z_loss, accuracy, target, reduction, return_z_loss, return_token_accuracy)


def fused_linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, ce_weight=None, lse_square_scale=0.0, softcap=None,
                               return_z_loss=False, return_token_accuracy=False, chunk_budget=None,
                               accum_dtype=None, tied_slot=None):
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
    loss, z_loss, accuracy = FusedLinearCrossEntropyFunction.apply(
        x, weight, target, bias, ignore_index, reduction, label_smoothing, ce_weight, lse_square_scale, softcap,
        return_z_loss, return_token_accuracy, chunk_budget, accum_dtype, torch.is_grad_enabled(), tied_slot)
    return _loss_outputs(loss, z_loss, accuracy, target, reduction, return_z_loss, return_token_accuracy)


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
                                      None if teacher_bias is None else teacher_bias.detach(), float(beta),
                                      float(temperature), compute_grad)
    return loss.view(lead)


def _loss_outputs(loss, z_loss, accuracy, target, reduction, return_z_loss, return_token_accuracy):
    """The loss (shaped like target for reduction "none"), plus the extras asked for."""
    if reduction == "none" and target.ndim != 1:
        loss = loss.view(target.shape)
        z_loss = z_loss.view(target.shape) if z_loss is not None else None
        accuracy = accuracy.view(target.shape) if accuracy is not None else None
    if not (return_z_loss or return_token_accuracy):
        return loss
    return (loss,) + ((z_loss,) if return_z_loss else ()) + ((accuracy,) if return_token_accuracy else ())
