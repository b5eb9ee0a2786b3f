"""Preference losses on the chunked base (TRL's formulas), each a function and a module.

Inputs: x [2B, T, H] (B chosen sequences, then their B rejected ones), the lm_head weight
[V, H] (and bias), target [2B, T] with ignore_index on prompt / padding tokens. Returns
(loss, metrics): metrics holds per-pair chosen / rejected log-probs and rewards, the mean
logit, and the NLL term when one is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tigon.losses.base import ChunkedPreferenceFunction

DPO_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_pair_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid", label_smoothing=0.0):
    ref_c = ref_chosen if ref_chosen is not None else torch.zeros_like(chosen)  # reference-free: log-probs 0
    ref_r = ref_rejected if ref_rejected is not None else torch.zeros_like(rejected)
    margin = (chosen - ref_c) - (rejected - ref_r)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - beta * margin)
    return losses, dict(chosen_rewards=(beta * (chosen - ref_c)).detach(),
                        rejected_rewards=(beta * (rejected - ref_r)).detach())


def orpo_pair_loss(chosen, rejected, _ref_c, _ref_r, beta=0.1):
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, dict(chosen_rewards=(beta * chosen).detach(), rejected_rewards=(beta * rejected).detach(),
                               log_odds_ratio=ratio.detach(), log_odds_chosen=log_odds.detach())


def cpo_pair_loss(chosen, rejected, _ref_c, _ref_r, beta=0.1, label_smoothing=0.0, gamma=0.0):
    """CPO's sigmoid loss; with gamma (SimPO's margin) as SimPO's -logsigmoid(beta * diff - gamma)."""
    logits = beta * (chosen - rejected) - gamma
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, dict(chosen_rewards=(beta * chosen).detach(), rejected_rewards=(beta * rejected).detach())


def _run(pair_loss, options, x, weight, target, bias, ref_x=None, ref_weight=None, ref_bias=None,
         ref_chosen_logps=None, ref_rejected_logps=None, ignore_index=-100, average_log_prob=False, nll_weight=0.0,
         chunk_pairs=1, compiled=False):
    names: list = []
    loss, *values = ChunkedPreferenceFunction.apply(
        x, weight, bias, target, ref_x, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, pair_loss,
        options, ignore_index, average_log_prob, nll_weight, int(chunk_pairs), compiled, names)
    return loss, dict(zip(names, values))


def dpo_loss(x, weight, target, bias=None, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, ref_x=None,
             ref_weight=None, ref_bias=None, ref_chosen_logps=None, ref_rejected_logps=None, ignore_index=-100,
             average_log_prob=False, compute_nll_loss=False, chunk_pairs=1, compiled=False):
    """DPO (loss_type "sigmoid", "ipo" or "hinge"). The reference comes from ref_x / ref_weight
    (the reference model's last hidden states and head), or precomputed ref_*_logps; with
    neither, it is reference-free. compute_nll_loss adds the chosen tokens' NLL (RPO)."""
    if loss_type not in DPO_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_TYPES}, got {loss_type!r}")
    return _run(dpo_pair_loss, dict(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing), x, weight,
                target, bias, ref_x, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, ignore_index,
                average_log_prob or loss_type == "ipo", 1.0 if compute_nll_loss else 0.0, chunk_pairs, compiled)


def orpo_loss(x, weight, target, bias=None, *, beta=0.1, ignore_index=-100, compute_nll_loss=True, chunk_pairs=1,
              compiled=False):
    """ORPO: NLL of the chosen tokens minus beta * logsigmoid(log odds ratio) (average log-probs)."""
    return _run(orpo_pair_loss, dict(beta=beta), x, weight, target, bias, ignore_index=ignore_index,
                average_log_prob=True, nll_weight=1.0 if compute_nll_loss else 0.0, chunk_pairs=chunk_pairs,
                compiled=compiled)


def cpo_loss(x, weight, target, bias=None, *, beta=0.1, label_smoothing=0.0, alpha=1.0, ignore_index=-100,
             average_log_prob=False, chunk_pairs=1, compiled=False):
    """CPO: -logsigmoid(beta * (chosen - rejected)) plus alpha * NLL of the chosen tokens."""
    return _run(cpo_pair_loss, dict(beta=beta, label_smoothing=label_smoothing), x, weight, target, bias,
                ignore_index=ignore_index, average_log_prob=average_log_prob, nll_weight=alpha,
                chunk_pairs=chunk_pairs, compiled=compiled)


def simpo_loss(x, weight, target, bias=None, *, beta=2.0, gamma=0.5, label_smoothing=0.0, alpha=0.0,
               ignore_index=-100, chunk_pairs=1, compiled=False):
    """SimPO: -logsigmoid(beta * (chosen - rejected) - gamma) on length-normalised log-probs."""
    return _run(cpo_pair_loss, dict(beta=beta, label_smoothing=label_smoothing, gamma=gamma), x, weight, target,
                bias, ignore_index=ignore_index, average_log_prob=True, nll_weight=alpha, chunk_pairs=chunk_pairs,
                compiled=compiled)


class _PreferenceLoss(nn.Module):
    fn = None

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, x, weight, target, bias=None, **kwargs):
        return type(self).fn(x, weight, target, bias, **{**self.options, **kwargs})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class TigonDPOLoss(_PreferenceLoss):
    fn = staticmethod(dpo_loss)


class TigonORPOLoss(_PreferenceLoss):
    fn = staticmethod(orpo_loss)


class TigonCPOLoss(_PreferenceLoss):
    fn = staticmethod(cpo_loss)


class TigonSimPOLoss(_PreferenceLoss):
    fn = staticmethod(simpo_loss)
