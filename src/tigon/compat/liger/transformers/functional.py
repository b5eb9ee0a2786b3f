"""``liger_kernel.transformers.functional`` on tigon: Liger's ``liger_*`` functions and their
``Liger*Function`` classes (``Liger*Function.apply(...)`` with the positional arguments of
Liger's ``forward``), running ``tigon.functional``, ``tigon.losses`` and tigon's RoPE drop-ins.

Liger's arguments that only choose among its own kernels (``in_place``, ``row_mode``,
``chunk_mem_const``, ``*_impl``, ``*_mode``) are accepted and have no effect: the values are
tigon's. Options tigon lacks raise, naming the argument. See ``tigon.compat.liger.NAME_MAP``
for each name, and the names this module does not provide (importing one raises ImportError
with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon import functional as TF
from tigon.compat.liger.names import not_provided_getattr
from tigon.losses import fused_linear_jsd as _fused_linear_jsd
from tigon.patching.rope import rope_drop_in

CASTING_MODES = {"llama": "llama", "gemma": "gemma", "none": "none", 0: "llama", 1: "gemma", -1: "none"}


def casting(casting_mode) -> str:
    """tigon's casting for Liger's ``casting_mode`` ("llama", "gemma", "none" or Liger's ints 0, 1, -1)."""
    if isinstance(casting_mode, bool) or not isinstance(casting_mode, (str, int)) or casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be 'llama', 'gemma' or 'none' (or Liger's 0, 1, -1), got {casting_mode!r}")
    return CASTING_MODES[casting_mode]


def refuse_torch_legacy(fn: str, **legacy) -> None:
    """torch's deprecated ``size_average`` / ``reduce``: Liger ignores them, tigon refuses a value
    that would change the reduction under torch's rules."""
    for name, (value, default) in legacy.items():
        if value is not default:
            raise NotImplementedError(f"{fn}: {name}={value!r} (torch's deprecated argument) is not supported; "
                                      "use reduction=")


def check_accum_dtype(accum_dtype, weight, what: str) -> None:
    """tigon accumulates this head's gradient in the weight's own dtype: an accum_dtype is only a no-op."""
    if accum_dtype is not None and accum_dtype != weight.dtype:
        raise NotImplementedError(f"{what}: accum_dtype={accum_dtype} is not supported (the weight's gradient is "
                                  f"accumulated in its dtype, {weight.dtype}); pass accum_dtype=None, or keep the "
                                  "lm_head in float32")


# ---- cross entropy ----

@dataclass
class CrossEntropyOutput:
    """Liger's result of a cross entropy asked for extras: the loss and the ones asked for (else None)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def ce_outputs(out, return_z_loss, return_token_accuracy, return_predicted_tokens, lse_square_scale):
    """(loss, z_loss, token_accuracy, predicted_tokens), None where not asked, from tigon's
    ``loss`` or ``(loss, *extras asked)``. tigon returns no z-loss without a z-loss term
    (lse_square_scale 0): Liger's is zeros then."""
    returned_z = return_z_loss and bool(lse_square_scale)
    loss, *extras = out if isinstance(out, tuple) else (out,)
    extras = iter(extras)
    z_loss = next(extras) if returned_z else (torch.zeros_like(loss) if return_z_loss else None)
    return (loss, z_loss, *(next(extras) if asked else None for asked in (return_token_accuracy,
                                                                          return_predicted_tokens)))


def _ce_result(parts):
    loss, z_loss, accuracy, predicted = parts
    if z_loss is None and accuracy is None and predicted is None:
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


def _cross_entropy(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                   return_z_loss, return_token_accuracy, return_predicted_tokens):
    """tigon's cross entropy as Liger's: the gradient is written over ``_input`` during the
    forward pass when it requires grad (do not read it afterwards), as Liger's kernel does."""
    out = TF.cross_entropy(_input, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing, weight=weight, lse_square_scale=lse_square_scale,
                           softcap=softcap, return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                           return_predicted_tokens=return_predicted_tokens, inplace=True)
    return ce_outputs(out, return_z_loss, return_token_accuracy, return_predicted_tokens, lse_square_scale)


class LigerCrossEntropyFunction:
    """``apply(...)`` -> (loss, z_loss, token_accuracy, predicted_tokens), None where not asked;
    tigon.functional.cross_entropy with ``inplace=True``."""

    @staticmethod
    def apply(_input, target, weight, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
              softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False):
        return _cross_entropy(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                              softcap, return_z_loss, return_token_accuracy, return_predicted_tokens)


def liger_cross_entropy(input, target, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                        reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                        softcap: float | None = None, return_z_loss: bool = False, return_token_accuracy: bool = False,
                        return_predicted_tokens: bool = False):
    """Liger's drop-in for ``F.cross_entropy`` (logits [..., V], classes last): the loss, or a
    CrossEntropyOutput when extras are asked for. As Liger's, the gradient is written over
    ``input`` in the forward pass (input must not be read afterwards)."""
    refuse_torch_legacy("liger_cross_entropy", size_average=(size_average, None), reduce=(reduce, None))
    return _ce_result(_cross_entropy(input, target, weight, ignore_index, lse_square_scale, label_smoothing,
                                     reduction, softcap, return_z_loss, return_token_accuracy,
                                     return_predicted_tokens))


def _fused_linear_cross_entropy(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                                label_smoothing, reduction, softcap, return_z_loss, accum_dtype, use_token_scaling,
                                return_token_accuracy, return_predicted_tokens):
    out = TF.fused_linear_cross_entropy(
        _input, weight, target, bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        ce_weight=ce_weight, lse_square_scale=lse_square_scale, softcap=softcap, use_token_scaling=use_token_scaling,
        return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens, accum_dtype=accum_dtype)
    return ce_outputs(out, return_z_loss, return_token_accuracy, return_predicted_tokens, lse_square_scale)


class LigerFusedLinearCrossEntropyFunction:
    """``apply(...)`` -> (loss, z_loss, token_accuracy, predicted_tokens), None where not asked;
    tigon.functional.fused_linear_cross_entropy (``ce_impl``, ``ce_mode``, ``chunk_mem_const``:
    Liger's kernel choices, no effect; tigon sizes its chunks by its chunk budget)."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
              use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
              ce_mode=None, chunk_mem_const=1):
        return _fused_linear_cross_entropy(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                                           label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
                                           use_token_scaling, return_token_accuracy, return_predicted_tokens)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
                                     lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                                     reduction: str = "mean", softcap: float | None = None,
                                     return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
                                     return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                                     chunk_mem_const: int = 1):
    """Cross entropy of ``input @ weight.T + bias`` without the logits: the loss, or a
    CrossEntropyOutput when extras are asked for (tigon.functional.fused_linear_cross_entropy)."""
    return _ce_result(_fused_linear_cross_entropy(input, weight, target, bias, ce_weight, ignore_index,
                                                  lse_square_scale, label_smoothing, reduction, softcap,
                                                  return_z_loss, accum_dtype, use_token_scaling,
                                                  return_token_accuracy, return_predicted_tokens))


# ---- divergences ----

def _jsd(_input, target, shift_labels, beta, ignore_index):
    """Liger's generalised JSD of student log-probs ``_input`` against teacher ``target``, in the
    inputs' dtype (tigon.functional.jsd computes in fp32)."""
    return TF.jsd(_input, target, shift_labels, beta=beta, ignore_index=ignore_index).to(_input.dtype)


class LigerJSDFunction:
    """``apply(_input, target, shift_labels=None, beta=0.5, ignore_index=-100, jsd_impl=None,
    jsd_mode=None)``: tigon.functional.jsd (student log-probs first, Liger's beta)."""

    @staticmethod
    def apply(_input, target, shift_labels=None, beta=0.5, ignore_index=-100, jsd_impl=None, jsd_mode=None):
        return _jsd(_input, target, shift_labels, beta, ignore_index)


def liger_jsd(input, target, shift_labels=None, beta: float = 0.5, ignore_index: int = -100):
    """Generalised JSD between student log-probs ``input`` and teacher log-probs ``target`` [BT, V]."""
    return _jsd(input, target, shift_labels, beta, ignore_index)


def _linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta, ignore_index,
                temperature, accum_dtype):
    check_accum_dtype(accum_dtype, student_weight, "liger_fused_linear_jsd")
    loss, _ = _fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                beta=jsd_beta, temperature=temperature, ignore_index=ignore_index)
    return loss


class LigerFusedLinearJSDFunction:
    """``apply(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None,
    jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None, jsd_impl=None,
    jsd_mode=None)``: tigon.losses.fused_linear_jsd's loss."""

    @staticmethod
    def apply(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, jsd_beta=0.5,
              ignore_index=-100, temperature=1.0, accum_dtype=None, jsd_impl=None, jsd_mode=None):
        return _linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta,
                           ignore_index, temperature, accum_dtype)


def liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None,
                           jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                           accum_dtype=None):
    """JSD between the student's and the teacher's heads without their logits (a chunk of rows at a
    time), averaged over the rows whose shift_labels is not ignore_index."""
    return _linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta,
                       ignore_index, temperature, accum_dtype)


def _kl_div(y_pred, y_true, reduction, log_target, eps):
    if eps != 1e-10 and not log_target:
        raise NotImplementedError(f"eps={eps!r}: tigon's kl_div takes log(y_true) as it is (0 where y_true == 0), "
                                  "it does not clamp y_true at eps; only Liger's default eps=1e-10 is accepted")
    return TF.kl_div(y_pred, y_true, reduction=reduction, log_target=log_target)


class LigerKLDivLossFunction:
    """``apply(y_pred, y_true, reduction="batchmean", log_target=False, eps=1e-10)``: tigon.functional.kl_div."""

    @staticmethod
    def apply(y_pred, y_true, reduction="batchmean", log_target=False, eps=1e-10):
        return _kl_div(y_pred, y_true, reduction, log_target, eps)


def liger_kl_div(input, target, size_average: bool = True, reduce: bool = True, reduction: str = "mean",
                 log_target: bool = False, eps: float = 1e-10):
    """``F.kl_div`` (input log-probs, target probs or log-probs): tigon.functional.kl_div."""
    refuse_torch_legacy("liger_kl_div", size_average=(size_average, True), reduce=(reduce, True))
    return _kl_div(input, target, reduction, log_target, eps)


class LigerTVDLossFunction:
    """``apply(p, q, shift_labels=None, reduction="batchmean", ignore_index=-100)``: tigon.functional.tvd."""

    @staticmethod
    def apply(p, q, shift_labels=None, reduction="batchmean", ignore_index=-100):
        return TF.tvd(p, q, shift_labels, reduction=reduction, ignore_index=ignore_index)


def liger_tvd(input, target, shift_labels=None, reduction: str = "mean", ignore_index: int = -100):
    """Total variation distance between probabilities ``input`` and ``target``: tigon.functional.tvd."""
    return TF.tvd(input, target, shift_labels, reduction=reduction, ignore_index=ignore_index)


# ---- norms ----

class LigerRMSNormFunction:
    """``apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None)``:
    tigon.functional.rms_norm (in_place, row_mode: no effect)."""

    @staticmethod
    def apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        return TF.rms_norm(X, W, eps, offset, casting(casting_mode))


def liger_rms_norm(X, W, eps, offset: float = 0.0, casting_mode: str = "llama", in_place: bool = True):
    """RMSNorm of X [..., N] times W (``offset + W``): tigon.functional.rms_norm."""
    return TF.rms_norm(X, W, eps, offset, casting(casting_mode))


class LigerFusedAddRMSNormFunction:
    """``apply(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False)`` -> (rms_norm(X + R), X + R)."""

    @staticmethod
    def apply(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False):
        return TF.fused_add_rms_norm(X, R, W, eps, offset, casting(casting_mode))


def liger_fused_add_rms_norm(X, R, W, eps, offset: float = 0.0, casting_mode: str = "llama", in_place: bool = True):
    """(rms_norm(X + R), X + R) in one kernel: tigon.functional.fused_add_rms_norm."""
    return TF.fused_add_rms_norm(X, R, W, eps, offset, casting(casting_mode))


class LigerLayerNormFunction:
    """``apply(X, W, B, eps)``: tigon.functional.layer_norm."""

    @staticmethod
    def apply(X, W, B, eps):
        return TF.layer_norm(X, W, B, eps)


def liger_layer_norm(X, W, B, eps):
    """LayerNorm of X [..., N] over the last dim: tigon.functional.layer_norm."""
    return TF.layer_norm(X, W, B, eps)


def _group_norm(X, weight, bias, num_channels, num_groups, eps):
    if X.ndim < 2 or X.shape[1] != num_channels:
        raise ValueError(f"X must be [N, num_channels={num_channels}, *], got shape {tuple(X.shape)}")
    return TF.group_norm(X, num_groups, weight, bias, eps)


class LigerGroupNormFunction:
    """``apply(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps)``:
    tigon.functional.group_norm."""

    @staticmethod
    def apply(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps):
        return _group_norm(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps)


def liger_group_norm(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps):
    """GroupNorm of X [N, C, *]: tigon.functional.group_norm."""
    return _group_norm(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups, eps)


class LigerPolyNormFunction:
    """``apply(X, W, B, eps=1e-6, in_place=True)``: tigon.functional.poly_norm."""

    @staticmethod
    def apply(X, W, B, eps=1e-6, in_place=True):
        return TF.poly_norm(X, W, B, eps)


def liger_poly_norm(X, W, B, eps=1e-6, in_place=True):
    """PolyNorm of X [..., N], W [3], B one element: tigon.functional.poly_norm."""
    return TF.poly_norm(X, W, B, eps)


class LigerDyTFunction:
    """``apply(x, alpha, gamma, beta)``: tigon.functional.dyt."""

    @staticmethod
    def apply(x, alpha, gamma, beta):
        return TF.dyt(x, alpha, gamma, beta)


def liger_dyt(x, alpha, gamma, beta):
    """Dynamic Tanh gamma * tanh(alpha * x) + beta: tigon.functional.dyt."""
    return TF.dyt(x, alpha, gamma, beta)


# ---- activations ----

class LigerSiLUMulFunction:
    """``apply(a, b, gate_multiplier=1.0, down_multiplier=1.0)`` -> silu(a * gate_multiplier) * b *
    down_multiplier: tigon.functional.glu."""

    @staticmethod
    def apply(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        return TF.glu(a, b, "silu", gate_multiplier, down_multiplier)


def liger_swiglu(a, b):
    """silu(a) * b: tigon.functional.swiglu."""
    return TF.swiglu(a, b)


class LigerGELUMulFunction:
    """``apply(a, b)`` -> gelu_tanh(a) * b: tigon.functional.geglu."""

    @staticmethod
    def apply(a, b):
        return TF.geglu(a, b, "tanh")


def liger_geglu(a, b):
    """gelu(a, approximate="tanh") * b: tigon.functional.geglu."""
    return TF.geglu(a, b, "tanh")


class LigerReLUSquaredFunction:
    """``apply(X)`` -> relu(X)^2: tigon.functional.relu_squared."""

    @staticmethod
    def apply(X):
        return TF.relu_squared(X)


def liger_relu_squared(x):
    """relu(x)^2: tigon.functional.relu_squared."""
    return TF.relu_squared(x)


class LigerSoftmaxFunction:
    """``apply(input_)``: softmax over the last dim, tigon.functional.softmax."""

    @staticmethod
    def apply(input_):
        return TF.softmax(input_, -1)


def liger_softmax(x):
    """softmax of x over the last dim: tigon.functional.softmax."""
    return TF.softmax(x, -1)


class LigerSparsemaxFunction:
    """``apply(x, dim)``: tigon.functional.sparsemax."""

    @staticmethod
    def apply(x, dim):
        return TF.sparsemax(x, dim)


def liger_sparsemax(input, dim: int = -1):
    """sparsemax of input over ``dim``: tigon.functional.sparsemax."""
    return TF.sparsemax(input, dim)


# ---- rotary embeddings ----

def rotary(q, k, cos, sin, unsqueeze_dim=1, rotary_dim=None):
    """Liger's RoPE: cos / sin [1|B, T, R] (position_ids are not read, as in Liger), the first
    ``rotary_dim`` entries of each head rotated (None: R); with ``rotary_dim == 2R`` cos / sin hold
    one angle per pair (GPT-OSS). tigon.functional.apply_rotary_pos_emb."""
    if rotary_dim is not None and rotary_dim != cos.shape[-1]:
        if rotary_dim != 2 * cos.shape[-1]:
            raise ValueError(f"rotary_dim={rotary_dim!r}: cos / sin must have rotary_dim entries (or rotary_dim / 2, "
                             f"one angle per pair) in their last dim, got {cos.shape[-1]}")
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return TF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


class LigerRopeFunction:
    """``apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None)`` -> (q, k) rotated."""

    @staticmethod
    def apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        return rotary(q, k, cos, sin, unsqueeze_dim, rotary_dim)


def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """HF's ``apply_rotary_pos_emb`` (q [B, Hq, T, D], k [B, Hk, T, D], cos / sin [1|B, T, R]) in one kernel."""
    return rotary(q, k, cos, sin, unsqueeze_dim, rotary_dim)


def multimodal_rotary(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's multimodal RoPE: cos / sin [3, B, T, D] hold the temporal, height and width
    angles; ``mrope_section`` picks each section's from its row (the selection in torch, the
    rotation in tigon's kernel)."""
    if cos.ndim != 4 or cos.shape[0] != 3:
        raise ValueError(f"cos / sin must be [3, B, T, D] (temporal, height, width), got {tuple(cos.shape)}")
    sections = [int(s) for s in mrope_section] * 2
    if sum(sections) != cos.shape[-1]:
        raise ValueError(f"mrope_section {list(mrope_section)} covers {sum(sections) // 2} of cos's "
                         f"{cos.shape[-1] // 2} frequencies")

    def pick(t):
        return torch.cat([part[i % 3] for i, part in enumerate(t.split(sections, dim=-1))], dim=-1)

    return TF.apply_rotary_pos_emb(q, k, pick(cos), pick(sin), unsqueeze_dim=unsqueeze_dim)


class LigerQwen2VLMRopeFunction:
    """``apply(q, k, cos, sin, mrope_section, unsqueeze_dim=1)`` -> (q, k) rotated."""

    @staticmethod
    def apply(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        return multimodal_rotary(q, k, cos, sin, mrope_section, unsqueeze_dim)


def liger_qwen2vl_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's ``apply_multimodal_rotary_pos_emb``: the sections picked, then tigon's RoPE kernel."""
    return multimodal_rotary(q, k, cos, sin, mrope_section, unsqueeze_dim)


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """Liger's drop-in for HF's ``apply_rotary_pos_emb``: ``liger_rope``."""
    return rotary(q, k, cos, sin, unsqueeze_dim, rotary_dim)


def liger_llama4_text_rotary_pos_emb(xq, xk, freqs_cis):
    """Llama 4's ``apply_rotary_emb`` (xq, xk [B, T, H, D], complex freqs_cis): tigon's drop-in
    for it (tigon.patching.rope, form "complex_bthd")."""
    return rope_drop_in("complex_bthd")(xq, xk, freqs_cis)


__getattr__ = not_provided_getattr(__name__, "liger_kernel.transformers.functional")

__all__ = ["CrossEntropyOutput", "LigerCrossEntropyFunction", "LigerDyTFunction", "LigerFusedAddRMSNormFunction",
           "LigerFusedLinearCrossEntropyFunction", "LigerFusedLinearJSDFunction", "LigerGELUMulFunction",
           "LigerGroupNormFunction", "LigerJSDFunction", "LigerKLDivLossFunction", "LigerLayerNormFunction",
           "LigerPolyNormFunction", "LigerQwen2VLMRopeFunction", "LigerRMSNormFunction", "LigerReLUSquaredFunction",
           "LigerRopeFunction", "LigerSiLUMulFunction", "LigerSoftmaxFunction", "LigerSparsemaxFunction",
           "LigerTVDLossFunction", "liger_cross_entropy", "liger_dyt", "liger_fused_add_rms_norm",
           "liger_fused_linear_cross_entropy", "liger_fused_linear_jsd", "liger_geglu", "liger_group_norm", "liger_jsd",
           "liger_kl_div", "liger_layer_norm", "liger_poly_norm", "liger_qwen2vl_mrope", "liger_relu_squared",
           "liger_rms_norm", "liger_rope", "liger_softmax", "liger_sparsemax", "liger_swiglu", "liger_tvd"]
