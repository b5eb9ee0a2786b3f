"""``liger_kernel.chunked_loss.functional`` on tigon: Liger's chunked-loss ``Function`` classes
(``Liger*Function.apply(...)`` with the positional arguments of Liger's ``forward``) and the
``liger_fused_linear_*`` functions (their ``apply``), running ``tigon.losses``. They return what
Liger's return: ``(loss, (metrics...))`` for the preference and policy losses, the loss (or
``(loss, soft_loss, hard_loss)``) for distillation.

``compiled`` (whether Liger runs its chunk under torch.compile) has no effect: tigon runs its
fused kernels a chunk at a time either way. ``chunk_size`` is the chunk of pairs, sequences or
rows tigon's loss takes (``chunk_pairs``, ``chunk_rows``, ``chunk_sequences``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tigon import functional as TF
from tigon.compat.liger.names import not_provided_getattr
from tigon.losses import cpo_loss, dpo_loss, fused_linear_jsd, grpo_loss, kto_loss, orpo_loss, simpo_loss
from tigon.losses.policy import CLIP_LOSS_TYPES
from tigon.losses.preference import DPO_TYPES, head_sums, logit_sums

UNSUPPORTED_GRPO_TYPES = ("luspo", "vespo")  # Liger 0.8.5's loss types tigon's grpo_loss does not compute
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


def reference(loss: str, use_ref_model: bool, ref_input, ref_weight, ref_bias) -> dict:
    """tigon's reference-model arguments from Liger's (``use_ref_model=False``: reference-free;
    the reference inputs, if given, are not read, as in Liger)."""
    if not use_ref_model:
        return {}
    if ref_input is None or ref_weight is None:
        raise ValueError(f"{loss}: use_ref_model=True needs ref_input and ref_weight (the reference model's last "
                         "hidden states and lm_head weight); pass use_ref_model=False for a reference-free loss")
    return dict(ref_x=ref_input, ref_weight=ref_weight, ref_bias=ref_bias)


def check_dpo_options(loss_type, label_smoothing) -> None:
    """Liger's checks of its DPO options (tigon's loss types are accepted too)."""
    if loss_type not in DPO_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_TYPES}, got {loss_type!r}")
    if loss_type == "exo_pair" and not label_smoothing > 0:
        raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair' (the EXO paper recommends 1e-3)")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0.0, 0.5) for loss_type='robust', got {label_smoothing!r}")


def chosen_nll(metrics: dict, target, ignore_index, averaged: bool) -> torch.Tensor:
    """The chosen sequences' mean NLL per token (Liger's ``nll_loss`` metric) from the per-pair log
    probabilities the loss already formed: their sum over tokens (times each sequence's token
    count where they are averaged) over the chosen half's tokens."""
    pairs = target.shape[0] // 2
    mask = target[:pairs] != ignore_index
    logps = metrics["chosen_logps"]
    if averaged:
        logps = logps * mask.sum(-1).clamp_min(1)
    return -logps.sum() / mask.sum().clamp_min(1)


def nll_metric(metrics, compute_nll_loss, target, ignore_index, averaged, loss) -> torch.Tensor:
    """Liger's ``nll_loss`` metric: tigon's when the loss added the term, recovered from the
    log-probabilities when alpha was 0 (the term not added), 0 without compute_nll_loss."""
    if not compute_nll_loss:
        return _zero(loss)
    return metrics["nll_loss"] if "nll_loss" in metrics else chosen_nll(metrics, target, ignore_index, averaged)


def preference_outputs(metrics: dict, nll: torch.Tensor) -> tuple:
    """Liger's first five preference metrics: chosen / rejected log-probs [B], chosen / rejected
    mean logits, the NLL term."""
    return (metrics["chosen_logps"], metrics["rejected_logps"], metrics["chosen_logits_mean"],
            metrics["rejected_logits_mean"], nll)


class LigerFusedLinearDPOFunction:
    """``apply(_input, weight, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
    ignore_index=-100, beta=0.1, compute_nll_loss=False, compiled=True, use_ref_model=True,
    average_log_prob=False, chunk_size=1, loss_type="sigmoid", label_smoothing=0.0,
    discopop_tau=0.05, alpha=1.0)`` -> (loss, (chosen_logps, rejected_logps, chosen_logits_mean,
    rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards)); tigon.losses.dpo_loss.

    ``_input`` [2B, T, H]: B chosen sequences, then their B rejected ones. As in Liger,
    ``label_smoothing`` is not read by loss_type "sigmoid" (tigon.losses.dpo_loss would smooth it:
    conservative DPO). ``alpha`` weighs the chosen NLL (compute_nll_loss=True): tigon's dpo_loss
    adds it with weight 1, another alpha costs one more pass of the chosen half
    (tigon.functional.fused_linear_cross_entropy)."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None, ignore_index=-100,
              beta=0.1, compute_nll_loss=False, compiled=True, use_ref_model=True, average_log_prob=False,
              chunk_size=1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05, alpha=1.0):
        check_dpo_options(loss_type, label_smoothing)
        if loss_type == "sigmoid" and label_smoothing:
            _warn_once("dpo_sigmoid_label_smoothing",
                       f"LigerFusedLinearDPOLoss: label_smoothing={label_smoothing} is not read by loss_type='sigmoid' "
                       "in Liger-Kernel 0.8.5, nor here; for conservative DPO use tigon.losses.dpo_loss")
            label_smoothing = 0.0
        builtin_nll = compute_nll_loss and alpha == 1.0
        loss, metrics = dpo_loss(_input, weight, target, bias, beta=beta, loss_type=loss_type,
                                 label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                                 **reference("LigerFusedLinearDPOLoss", use_ref_model, ref_input, ref_weight, ref_bias),
                                 ignore_index=ignore_index, average_log_prob=average_log_prob,
                                 compute_nll_loss=builtin_nll, chunk_pairs=chunk_size)
        nll = metrics["nll_loss"] if builtin_nll else _zero(loss)
        if compute_nll_loss and not builtin_nll:
            pairs = _input.shape[0] // 2
            summed = TF.fused_linear_cross_entropy(_input[:pairs], weight, target[:pairs], bias,
                                                   ignore_index=ignore_index, reduction="sum")
            term = summed / (target[:pairs] != ignore_index).sum().clamp_min(1)
            loss, nll = loss + alpha * term, term.detach()
        return loss, (*preference_outputs(metrics, nll), metrics["chosen_rewards"], metrics["rejected_rewards"])


class LigerFusedLinearORPOFunction:
    """``apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1,
    compute_nll_loss=True, nll_target=None, compiled=True, chunk_size=1)`` -> (loss,
    (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen)), the last two means over
    the pairs; tigon.losses.orpo_loss."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, compute_nll_loss=True, nll_target=None,
              compiled=True, chunk_size=1):
        loss, metrics = orpo_loss(_input, weight, target, bias, beta=beta, ignore_index=ignore_index,
                                  compute_nll_loss=compute_nll_loss, chunk_pairs=chunk_size,
                                  nll_target=nll_target if compute_nll_loss else None)
        pairs = _input.shape[0] // 2
        nll = metrics["nll_loss"] if compute_nll_loss else _zero(loss)
        return loss, (*preference_outputs(metrics, nll), metrics["chosen_rewards"], metrics["rejected_rewards"],
                      metrics["log_odds_ratio"].sum() / pairs, metrics["log_odds_chosen"].sum() / pairs)


class LigerFusedLinearCPOFunction:
    """``apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
    label_smoothing=0.0, compute_nll_loss=True, compiled=True, average_log_prob=False,
    chunk_size=1)`` -> (loss, (chosen_logps, rejected_logps, chosen_logits_mean,
    rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards)); tigon.losses.cpo_loss."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
              compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1):
        loss, metrics = cpo_loss(_input, weight, target, bias, beta=beta, label_smoothing=label_smoothing,
                                 alpha=alpha if compute_nll_loss else 0.0, ignore_index=ignore_index,
                                 average_log_prob=average_log_prob, chunk_pairs=chunk_size)
        nll = nll_metric(metrics, compute_nll_loss, target, ignore_index, average_log_prob, loss)
        return loss, (*preference_outputs(metrics, nll), metrics["chosen_rewards"], metrics["rejected_rewards"])


class LigerFusedLinearSimPOFunction:
    """``apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
    label_smoothing=0.0, compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1)`` ->
    (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards)); tigon.losses.simpo_loss (length-averaged log-probs)."""

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
              compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1):
        loss, metrics = simpo_loss(_input, weight, target, bias, beta=beta, gamma=gamma,
                                   label_smoothing=label_smoothing, alpha=alpha if compute_nll_loss else 0.0,
                                   ignore_index=ignore_index, chunk_pairs=chunk_size)
        nll = nll_metric(metrics, compute_nll_loss, target, ignore_index, True, loss)
        return loss, (*preference_outputs(metrics, nll), metrics["chosen_rewards"], metrics["rejected_rewards"])


class LigerFusedLinearKTOFunction:
    """``apply(_input, weight, target, preference_labels, bias=None, ref_input=None,
    ref_weight=None, ref_bias=None, kl=None, ignore_index=-100, beta=0.1, compiled=True,
    use_ref_model=True, average_log_prob=False, chunk_size=1)`` -> (loss, (chosen_logps_sum,
    rejected_logps_sum, chosen_logits_sum, rejected_logits_sum, chosen_rewards_sum,
    rejected_rewards_sum)); tigon.losses.kto_loss with ``kl`` taken as given (clamp_kl=False,
    as Liger's)."""

    @staticmethod
    def apply(_input, weight, target, preference_labels, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
              kl=None, ignore_index=-100, beta=0.1, compiled=True, use_ref_model=True, average_log_prob=False,
              chunk_size=1):
        if preference_labels is None:
            raise ValueError("preference_labels must be given: a bool tensor [N], True for a desirable sequence")
        loss, metrics = kto_loss(_input, weight, target, preference_labels, bias, beta=beta, kl=kl, clamp_kl=False,
                                 **reference("LigerFusedLinearKTOLoss", use_ref_model, ref_input, ref_weight, ref_bias),
                                 ignore_index=ignore_index, average_log_prob=average_log_prob, chunk_rows=chunk_size)
        chosen, rejected = preference_labels, ~preference_labels
        colsum, bias_sum = head_sums(weight, bias)
        sums = logit_sums(_input, colsum, bias_sum)
        logps, rewards = metrics["logps"], metrics["rewards"]
        return loss, ((logps * chosen).sum(), (logps * rejected).sum(), sums[chosen].sum(), sums[rejected].sum(),
                      (rewards * chosen).sum(), (rewards * rejected).sum())


class LigerFusedLinearJSDFunction:
    """``apply(student_input, student_weight, teacher_input, teacher_weight, true_labels,
    student_bias, teacher_bias, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
    ignore_index=-100, temperature=1.0, compiled=True, chunk_size=1024,
    return_soft_hard_loss=False)`` -> weight_hard_loss * hard + weight_soft_loss * soft (with
    ``return_soft_hard_loss``: (loss, soft, hard)): soft the generalised JSD of the heads' logits
    over temperature (tigon.losses.fused_linear_jsd), hard the student's cross entropy against
    true_labels (tigon.functional.fused_linear_cross_entropy), each a mean over the tokens whose
    label is not ignore_index. student_input [BT, Hs], teacher_input [BT, Ht]; the teacher gets
    no gradient."""

    @staticmethod
    def apply(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
              weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0, compiled=True,
              chunk_size=1024, return_soft_hard_loss=False):
        zero = _zero(student_input)
        soft = hard = zero
        if weight_soft_loss != 0 or return_soft_hard_loss:
            soft, _ = fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, true_labels,
                                       student_bias, teacher_bias, beta=beta, temperature=temperature,
                                       ignore_index=ignore_index, chunk_rows=chunk_size)
        if weight_hard_loss != 0 or return_soft_hard_loss:
            hard = TF.fused_linear_cross_entropy(student_input, student_weight, true_labels, student_bias,
                                                 ignore_index=ignore_index)
        loss = weight_hard_loss * hard + weight_soft_loss * soft
        return (loss, soft.detach(), hard.detach()) if return_soft_hard_loss else loss


def _dapo_items(loss_type, attention_mask, num_items_in_batch):
    """Liger's dapo / cispo normaliser as tigon's ``num_items_in_batch``: the given count over the
    ranks (TRL's is the whole generation batch's), or, on several ranks, the mean completion
    tokens per rank; None (this batch's tokens) on one rank."""
    if loss_type not in ("dapo", "cispo"):
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=attention_mask.device) / world
    if world == 1:
        return None
    tokens = attention_mask.to(torch.float32).sum()
    dist.all_reduce(tokens)
    return tokens / world


def sequence_clip_ratio(per_token_logps, old_per_token_logps, attention_mask, advantages, epsilon_low, epsilon_high):
    """Liger's clip-ratio metric with sequence-level importance sampling: the share of completion
    tokens whose sequence's ratio is clipped (low with a negative advantage, high with a positive)."""
    mask = attention_mask.to(torch.float32)
    lp = per_token_logps.float()
    old = lp if old_per_token_logps is None else old_per_token_logps.float()
    coef = torch.exp(((lp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1.0))
    adv = advantages.float().unsqueeze(-1) if advantages.ndim == 1 else advantages.float()
    clipped = ((coef < 1 - epsilon_low) & (adv < 0)) | ((coef > 1 + epsilon_high) & (adv > 0))
    return (clipped * mask).sum() / mask.sum().clamp_min(1.0)


class LigerFusedLinearGRPOFunction:
    """``apply(_input, weight, selected_token_ids, attention_mask, advantages, bias=None,
    ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None,
    ref_bias=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
    max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True, chunk_size=1,
    vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0,
    vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None)`` ->
    (loss, (kl, clip_ratio)) (the KL metric only with beta != 0); tigon.losses.grpo_loss.

    Without a reference (``use_ref_model=False``) the KL term is 0, as in Liger.
    ``vllm_is_ratio`` is tigon's ``importance_sampling_ratio``; ``num_items_in_batch`` (dapo,
    cispo) is divided by the ranks, as Liger does. loss_type "luspo" and "vespo" are not
    supported (the vespo_* options have no other use); tigon's "gspo" is accepted."""

    @staticmethod
    def apply(_input, weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None,
              old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2,
              epsilon_high=0.2, loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
              sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True,
              chunk_size=1, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0,
              vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None):
        check_grpo_options(loss_type, importance_sampling_level)
        refs = {}
        if use_ref_model and beta != 0.0:
            if ref_per_token_logps is not None:
                if ref_input is not None:
                    _warn_once("grpo_both_refs", "LigerFusedLinearGRPOLoss: both ref_per_token_logps and ref_input "
                                                 "given: using ref_per_token_logps (as Liger)")
                refs = dict(ref_per_token_logps=ref_per_token_logps)
            elif ref_input is not None:
                refs = dict(ref_x=ref_input, ref_weight=ref_weight, ref_bias=ref_bias)
            else:
                raise ValueError("use_ref_model=True needs ref_per_token_logps, or ref_input with ref_weight; pass "
                                 "use_ref_model=False for no KL term")
        if vllm_is_ratio is not None and vllm_is_ratio.ndim == 1:
            vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)
        level = "sequence" if loss_type == "gspo" else importance_sampling_level
        loss, metrics = grpo_loss(
            _input, weight, selected_token_ids, attention_mask, advantages, bias, **refs,
            old_per_token_logps=old_per_token_logps, beta=beta if refs else 0.0, epsilon_low=epsilon_low,
            epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, importance_sampling_level=level,
            max_completion_length=max_completion_length, temperature=temperature,
            importance_sampling_ratio=vllm_is_ratio,
            num_items_in_batch=_dapo_items(loss_type, attention_mask, num_items_in_batch),
            use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg, chunk_sequences=chunk_size)
        out = [metrics.get("kl", _zero(loss))] if beta != 0.0 else []
        if loss_type == "cispo":
            out.append(metrics["cispo_clip_ratio"])
        elif loss_type == "sapo":
            out.append(_zero(loss))
        elif level == "sequence":
            out.append(sequence_clip_ratio(metrics["per_token_logps"], old_per_token_logps, attention_mask,
                                           advantages, epsilon_low, epsilon_high))
        else:
            out.append(metrics["clip_ratio/region_mean"])
        return loss, tuple(out)


def check_grpo_options(loss_type, importance_sampling_level) -> None:
    if loss_type in UNSUPPORTED_GRPO_TYPES:
        raise NotImplementedError(f"loss_type={loss_type!r} is not supported by tigon.losses.grpo_loss (its loss "
                                  f"types: {', '.join((*CLIP_LOSS_TYPES, 'cispo', 'sapo', 'gspo'))})")
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo"):
        raise ValueError(f"importance_sampling_level='sequence' is not supported for loss_type={loss_type!r} (as in "
                         "Liger): use 'token'")


liger_fused_linear_dpo = LigerFusedLinearDPOFunction.apply
liger_fused_linear_orpo = LigerFusedLinearORPOFunction.apply
liger_fused_linear_cpo = LigerFusedLinearCPOFunction.apply
liger_fused_linear_simpo = LigerFusedLinearSimPOFunction.apply
liger_fused_linear_kto = LigerFusedLinearKTOFunction.apply
liger_fused_linear_jsd = LigerFusedLinearJSDFunction.apply
liger_fused_linear_grpo = LigerFusedLinearGRPOFunction.apply

__all__ = ["LigerFusedLinearCPOFunction", "LigerFusedLinearDPOFunction", "LigerFusedLinearGRPOFunction",
           "LigerFusedLinearJSDFunction", "LigerFusedLinearKTOFunction", "LigerFusedLinearORPOFunction",
           "LigerFusedLinearSimPOFunction", "liger_fused_linear_cpo", "liger_fused_linear_dpo",
           "liger_fused_linear_grpo", "liger_fused_linear_jsd", "liger_fused_linear_kto", "liger_fused_linear_orpo",
           "liger_fused_linear_simpo"]
__getattr__ = not_provided_getattr(__name__, "liger_kernel.chunked_loss.functional")
