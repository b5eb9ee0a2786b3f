"""Preference losses on the chunked base (TRL's formulas), each a function and a module.

Inputs: x [2B, T, H] (B chosen sequences, then their B rejected ones), the lm_head weight
[V, H] (and bias), target [2B, T] with ignore_index on prompt / padding tokens. Returns
(loss, metrics): metrics holds per-pair chosen / rejected log-probs and rewards, the mean
logit, and the NLL term when one is added.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tigon.functional import linear_token_logps
from tigon.losses.base import (
    LossModule,
    contiguous_chunks,
    head_logits,
    head_vocab,
    plain_numbers,
    run_chunked,
    token_logps,
)
from tigon.ops._cross_entropy_common import labels_checked

DPO_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_pair",
             "aot_unpaired", "apo_zero", "apo_down", "discopop")
# Losses of the whole batch's log-ratios at once (sorted over pairs): see _run's two passes.
BATCH_COUPLED_DPO_TYPES = ("aot", "aot_pair", "aot_unpaired")


# The pair losses take their options by keyword, without defaults (each loss passes them all): a
# float default read inside a checkpoint region trips dynamo with dynamic shapes (see plain_numbers).


def dpo_pair_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, loss_type, label_smoothing, discopop_tau):
    """Per-pair DPO losses [n] of TRL 1.16's DPOTrainer (``label_smoothing`` also smooths
    "sigmoid", the conservative DPO of earlier TRL; 0 is TRL 1.16's). "aot_pair" is TRL 1.16's
    "aot_unpaired" (its earlier name); the aot types sort over the pairs given."""
    ref_c = ref_chosen if ref_chosen is not None else torch.zeros_like(chosen)  # reference-free: log-probs 0
    ref_r = ref_rejected if ref_rejected is not None else torch.zeros_like(rejected)
    chosen_ratio, rejected_ratio = chosen - ref_c, rejected - ref_r
    margin = chosen_ratio - rejected_ratio
    ls = label_smoothing

    def smoothed(z):
        return -F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls

    if loss_type == "sigmoid":
        losses = smoothed(beta * margin)
    elif loss_type == "ipo":  # on length-averaged log-probs (dpo_loss averages them for ipo)
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "robust":
        losses = (-(1 - ls) * F.logsigmoid(beta * margin) + ls * F.logsigmoid(-beta * margin)) / (1 - 2 * ls)
    elif loss_type == "exo_pair":
        z = beta * margin
        losses = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-ls))
                  + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(ls)))
    elif loss_type == "nca_pair":
        zc, zr = beta * chosen_ratio, beta * rejected_ratio
        losses = -F.logsigmoid(zc) - 0.5 * F.logsigmoid(-zc) - 0.5 * F.logsigmoid(-zr)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    elif loss_type == "sppo_hard":
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "aot":
        delta = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_c - ref_r, dim=0)[0]
        losses = smoothed(beta * delta)
    elif loss_type in ("aot_pair", "aot_unpaired"):
        delta = torch.sort(chosen_ratio, dim=0)[0] - torch.sort(rejected_ratio, dim=0)[0]
        losses = smoothed(beta * delta)
    elif loss_type == "apo_zero":
        losses = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * margin)
    else:  # discopop
        z = beta * margin
        mix = torch.sigmoid(z / discopop_tau)
        losses = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    return losses, dict(chosen_rewards=(beta * chosen_ratio).detach(),
                        rejected_rewards=(beta * rejected_ratio).detach())


def orpo_pair_loss(chosen, rejected, _ref_c, _ref_r, *, beta):
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, dict(chosen_rewards=(beta * chosen).detach(), rejected_rewards=(beta * rejected).detach(),
                               log_odds_ratio=ratio.detach(), log_odds_chosen=log_odds.detach())


def cpo_pair_loss(chosen, rejected, _ref_c, _ref_r, *, beta, label_smoothing, gamma):
    """CPO's sigmoid loss; with gamma (SimPO's margin) as SimPO's -logsigmoid(beta * diff - gamma)."""
    logits = beta * (chosen - rejected) - gamma
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, dict(chosen_rewards=(beta * chosen).detach(), rejected_rewards=(beta * rejected).detach())


def check_preference_args(x, weight, target, bias, ref_x, ref_weight, ref_chosen_logps, ref_rejected_logps):
    if x.ndim != 3:
        raise ValueError(f"x must be [2B, T, H] (chosen rows then rejected rows), got shape {tuple(x.shape)}")
    if x.shape[0] % 2:
        raise ValueError(f"x has {x.shape[0]} sequences: chosen and rejected must come in pairs (an even count)")
    if target.shape != x.shape[:2]:
        raise ValueError(f"target has shape {tuple(target.shape)} but x has {tuple(x.shape[:2])} sequences x tokens")
    if weight.ndim != 2 or weight.shape[1] != x.shape[2]:
        raise ValueError(f"weight must be [V, {x.shape[2]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if ref_x is not None:
        if ref_weight is None:
            raise ValueError("ref_x needs ref_weight (the reference model's lm_head weight)")
        if ref_x.shape[:2] != x.shape[:2]:
            raise ValueError(f"ref_x has shape {tuple(ref_x.shape)} but x has {tuple(x.shape)}: the reference "
                             "model must see the same sequences")
    pairs = x.shape[0] // 2
    for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        if t is not None and t.shape != (pairs,):
            raise ValueError(f"{name} must be [{pairs}] (one per pair), got {tuple(t.shape)}")
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("give both ref_chosen_logps and ref_rejected_logps, or neither")


def sequence_logps(x, weight, bias, target, ignore_index, average, fused=True):
    """Per-sequence sum (or mean) of log p(target) [S], and the per-token log-probs [S, T].

    fused: tigon's linear_token_logps (the cross-entropy kernel on the chunk's logits, in x's
    dtype); otherwise plain torch on fp32 logits (what torch.compile fuses)."""
    if fused:
        lp = linear_token_logps(x, weight, target, bias, ignore_index)
        mask = target != ignore_index
    else:
        lp, mask = token_logps(head_logits(x, weight, bias), target, ignore_index)
    logps = lp.sum(-1)
    if average:
        logps = logps / mask.sum(-1).clamp_min(1)
    return logps, lp


def logit_sums(x, weight_colsum, bias_sum):
    """Per-sequence sum of the logits over tokens and vocab, x [S, T, H] -> [S] fp32, from the
    head's column sums [H] (no logits needed: sum_v (x w_v + b_v) = x . sum_v w_v + sum_v b_v)."""
    return (x.detach().float() @ weight_colsum).sum(-1) + bias_sum * x.shape[1]


def head_sums(weight, bias):
    """(sum over V of weight's rows [H] fp32, sum of bias or 0) for logit_sums."""
    colsum = weight.detach().sum(0, dtype=torch.float32)
    return colsum, (bias.detach().float().sum() if bias is not None else 0.0)


def check_nll_target(nll_target, target, nll_weight):
    if nll_target is None:
        return
    if not nll_weight:
        raise ValueError("nll_target was given but no NLL term is computed (compute_nll_loss=False)")
    if not isinstance(nll_target, torch.Tensor) or nll_target.is_floating_point() or nll_target.is_complex() \
            or nll_target.dtype == torch.bool:
        raise TypeError(f"nll_target must be an integer tensor of token ids, got "
                        f"{getattr(nll_target, 'dtype', type(nll_target).__name__)}")
    if nll_target.shape != target.shape:
        raise ValueError(f"nll_target has shape {tuple(nll_target.shape)} but target has {tuple(target.shape)} "
                         "(both [2B, T]; the NLL term reads nll_target's chosen half)")
    if nll_target.device != target.device:
        raise ValueError(f"nll_target is on {nll_target.device} but target is on {target.device}")


def _run(pair_loss, options, x, weight, target, bias, ref_x=None, ref_weight=None, ref_bias=None,
         ref_chosen_logps=None, ref_rejected_logps=None, ignore_index=-100, average_log_prob=False, nll_weight=0.0,
         chunk_pairs=1, compiled=False, nll_target=None, coupled=False):
    """The pair losses on the chunked base. ``coupled``: the pair loss reads the whole batch at
    once (sorts over pairs), so the sequences' log-probs are formed first without gradient, the
    loss and its gradient with respect to them taken over the batch, and the chunked pass then
    differentiates sum(gradient * log-probs) (exact, for one more pass of the head); traced by
    torch.compile, the batch is one chunk instead."""
    check_preference_args(x, weight, target, bias, ref_x, ref_weight, ref_chosen_logps, ref_rejected_logps)
    check_nll_target(nll_target, target, nll_weight)
    options, nll_weight = plain_numbers(options), float(nll_weight)
    pairs = x.shape[0] // 2
    if coupled and torch.compiler.is_compiling():
        chunk_pairs, coupled = pairs, False
    nll_source = target if nll_target is None else nll_target
    chosen_tokens = (nll_source[:pairs] != ignore_index).sum().clamp_min(1)
    per_side_logits = pairs * x.shape[1] * weight.shape[0]
    ref_logps = None if ref_chosen_logps is None else torch.cat((ref_chosen_logps, ref_rejected_logps)).float()
    colsum, bias_sum = head_sums(weight, bias)
    fused = not compiled
    rows = [torch.cat((c, c + pairs)) for c in contiguous_chunks(pairs, chunk_pairs, x.device, "chunk_pairs")]

    def coupled_pass():
        """(pair_grad [2P], coupled_loss): the batch loss's gradient on the sequences' log-probs."""
        with torch.no_grad():
            seq_logps = torch.empty(2 * pairs, dtype=torch.float32, device=x.device)
            ref_all = ref_logps if ref_x is None else torch.empty_like(seq_logps)
            for r in rows:
                seq_logps[r], _ = sequence_logps(x[r], weight, bias, target[r], ignore_index, average_log_prob, fused)
                if ref_x is not None:
                    ref_all[r], _ = sequence_logps(ref_x[r], ref_weight, ref_bias, target[r], ignore_index,
                                                   average_log_prob, fused)
        leaf = seq_logps.requires_grad_()
        with torch.enable_grad():
            ref_c, ref_r = (None, None) if ref_all is None else (ref_all[:pairs], ref_all[pairs:])
            losses, _ = pair_loss(leaf[:pairs], leaf[pairs:], ref_c, ref_r, **options)
            coupled_loss = losses.sum() / pairs
            (pair_grad,) = torch.autograd.grad(coupled_loss, leaf)
        return pair_grad, coupled_loss

    def chunk_fn(xc, tc, ref_xc, ref_lp, nll_tc, g, w, b, ref_w, ref_b):
        n = xc.shape[0] // 2
        logps, lp = sequence_logps(xc, w, b, tc, ignore_index, average_log_prob, fused)
        sums = logit_sums(xc, colsum, bias_sum)
        if ref_xc is not None:
            with torch.no_grad():
                ref_lp, _ = sequence_logps(ref_xc, ref_w, ref_b, tc, ignore_index, average_log_prob, fused)
        ref_c, ref_r = (None, None) if ref_lp is None else (ref_lp[:n], ref_lp[n:])
        losses, metrics = pair_loss(logps[:n], logps[n:], ref_c, ref_r, **options)
        # coupled: the batch's loss gradient on these log-probs, as a linear surrogate
        loss = (g * logps).sum() if g is not None else losses.sum() / pairs
        metrics = dict(metrics, chosen_logps=logps[:n], rejected_logps=logps[n:],
                       chosen_logits_mean=sums[:n].sum() / per_side_logits,
                       rejected_logits_mean=sums[n:].sum() / per_side_logits)
        if nll_weight:
            if nll_tc is not None:  # the chosen rows' head runs a second time, on nll_target
                _, lp = sequence_logps(xc[:n], w, b, nll_tc[:n], ignore_index, False, fused)
            nll = -lp[:n].sum() / chosen_tokens
            loss = loss + nll_weight * nll
            metrics["nll_loss"] = nll
        return loss, metrics

    detach = (lambda t: t.detach() if t is not None else None)
    # The labels checked once for the batch (a host sync per head call would stall the chunk loop)
    checked = target if nll_target is None else torch.cat((target, nll_target))
    with labels_checked(checked, head_vocab(weight, ref_weight), ignore_index):
        pair_grad, coupled_loss = coupled_pass() if coupled else (None, None)
        loss, metrics = run_chunked(chunk_fn, [x, target, detach(ref_x), ref_logps, nll_target, pair_grad],
                                    [weight, bias, detach(ref_weight), detach(ref_bias)], rows, compiled)
    if coupled:  # the surrogate's value replaced by the loss's, its gradient kept
        loss = loss - loss.detach() + coupled_loss.detach() + metrics.get("nll_loss", 0.0) * nll_weight
    return loss, metrics


def dpo_loss(x, weight, target, bias=None, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05,
             ref_x=None, ref_weight=None, ref_bias=None, ref_chosen_logps=None, ref_rejected_logps=None,
             ignore_index=-100, average_log_prob=False, compute_nll_loss=False, chunk_pairs=1, compiled=False):
    """DPO with TRL 1.16's loss types (DPO_TYPES; see dpo_pair_loss). The reference comes from
    ref_x / ref_weight (the reference model's last hidden states and head), or precomputed
    ref_*_logps; with neither, it is reference-free. compute_nll_loss adds the chosen tokens'
    NLL (RPO). ipo averages the log-probs over each sequence's tokens (as TRL normalises it);
    the aot types sort over the whole batch (one more pass of the head: see _run)."""
    if loss_type not in DPO_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_TYPES}, got {loss_type!r}")
    if not 0 <= label_smoothing < 0.5 or (loss_type == "exo_pair" and not 0 < label_smoothing):
        raise ValueError(f"label_smoothing must be in [0, 0.5) (exo_pair: in (0, 0.5), e.g. 1e-3), got "
                         f"{label_smoothing!r}")
    if not discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0, got {discopop_tau!r}")
    return _run(dpo_pair_loss, dict(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                                    discopop_tau=discopop_tau), x, weight,
                target, bias, ref_x, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, ignore_index,
                average_log_prob or loss_type == "ipo", 1.0 if compute_nll_loss else 0.0, chunk_pairs, compiled,
                coupled=loss_type in BATCH_COUPLED_DPO_TYPES)


def orpo_loss(x, weight, target, bias=None, *, beta=0.1, ignore_index=-100, compute_nll_loss=True, chunk_pairs=1,
              compiled=False, nll_target=None):
    """ORPO: NLL of the chosen tokens minus beta * logsigmoid(log odds ratio) (average log-probs).

    nll_target [2B, T] (as Liger's): the NLL term's targets instead of target's (Liger's ORPO
    trainer passes the whole sequence, prompt tokens included); only its chosen half is read,
    and the NLL is averaged over its non-ignored tokens. The odds ratio uses target. It costs a
    second pass of the chosen rows through the head."""
    return _run(orpo_pair_loss, dict(beta=beta), x, weight, target, bias, ignore_index=ignore_index,
                average_log_prob=True, nll_weight=1.0 if compute_nll_loss else 0.0, chunk_pairs=chunk_pairs,
                compiled=compiled, nll_target=nll_target)


def cpo_loss(x, weight, target, bias=None, *, beta=0.1, label_smoothing=0.0, alpha=1.0, ignore_index=-100,
             average_log_prob=False, chunk_pairs=1, compiled=False):
    """CPO: -logsigmoid(beta * (chosen - rejected)) plus alpha * NLL of the chosen tokens."""
    return _run(cpo_pair_loss, dict(beta=beta, label_smoothing=label_smoothing, gamma=0.0), x, weight, target, bias,
                ignore_index=ignore_index, average_log_prob=average_log_prob, nll_weight=alpha,
                chunk_pairs=chunk_pairs, compiled=compiled)


def simpo_loss(x, weight, target, bias=None, *, beta=2.0, gamma=0.5, label_smoothing=0.0, alpha=0.0,
               ignore_index=-100, chunk_pairs=1, compiled=False):
    """SimPO: -logsigmoid(beta * (chosen - rejected) - gamma) on length-normalised log-probs."""
    return _run(cpo_pair_loss, dict(beta=beta, label_smoothing=label_smoothing, gamma=gamma), x, weight, target,
                bias, ignore_index=ignore_index, average_log_prob=True, nll_weight=alpha, chunk_pairs=chunk_pairs,
                compiled=compiled)


class TigonDPOLoss(LossModule):
    """``loss, metrics = module(x, weight, target, bias=None, **overrides)``: dpo_loss with the
    options given at construction (``TigonDPOLoss(beta=0.1, loss_type="sigmoid", ...)``); x
    [2B, T, H] (B chosen sequences, then their B rejected ones), weight [V, H], target [2B, T]."""

    fn = staticmethod(dpo_loss)


class TigonORPOLoss(LossModule):
    """``loss, metrics = module(x, weight, target, bias=None, nll_target=None)``; see orpo_loss."""

    fn = staticmethod(orpo_loss)

    def forward(self, x, weight, target, bias=None, nll_target=None, **kwargs):
        return orpo_loss(x, weight, target, bias, **{**self.options, **kwargs, "nll_target": nll_target})


class TigonCPOLoss(LossModule):
    """``loss, metrics = module(x, weight, target, bias=None, **overrides)``: cpo_loss with the
    options given at construction; x [2B, T, H] (chosen, then rejected), weight [V, H], target
    [2B, T]."""

    fn = staticmethod(cpo_loss)


class TigonSimPOLoss(LossModule):
    """``loss, metrics = module(x, weight, target, bias=None, **overrides)``: simpo_loss with the
    options given at construction; x [2B, T, H] (chosen, then rejected), weight [V, H], target
    [2B, T]."""

    fn = staticmethod(simpo_loss)


def kto_loss(x, weight, target, preference_labels, bias=None, *, beta=0.1, desirable_weight=1.0,
             undesirable_weight=1.0, kl=None, clamp_kl=True, ref_x=None, ref_weight=None, ref_bias=None,
             ref_logps=None, ignore_index=-100, average_log_prob=False, chunk_rows=2, compiled=False):
    """KTO over unpaired sequences x [N, T, H] with preference_labels [N] (True: desirable).
    The reference log-probs come from ref_x / ref_weight or ref_logps [N] (else 0); ``kl`` is
    the batch's KL estimate (a number or one-element tensor, no gradient; None: 0), as TRL
    computes it from mismatched prompt / completion pairs. ``clamp_kl=True`` clamps it at 0, as
    TRL 1.16's KTOTrainer does (after its mean over ranks); ``clamp_kl=False`` takes it as
    given, as Liger's chunked KTO loss does. Mean over sequences."""
    if x.ndim != 3 or target.shape != x.shape[:2]:
        raise ValueError(f"x must be [N, T, H] and target [N, T], got {tuple(x.shape)} and {tuple(target.shape)}")
    if preference_labels.shape != x.shape[:1] or preference_labels.dtype != torch.bool:
        raise ValueError(f"preference_labels must be a bool tensor of shape [{x.shape[0]}], got "
                         f"{preference_labels.dtype} {tuple(preference_labels.shape)}")
    if ref_x is not None and (ref_weight is None or ref_x.shape[:2] != x.shape[:2]):
        raise ValueError("ref_x must come with ref_weight and cover the same sequences as x")
    if ref_logps is not None and ref_logps.shape != x.shape[:1]:
        raise ValueError(f"ref_logps must be [{x.shape[0]}], got {tuple(ref_logps.shape)}")
    if isinstance(kl, torch.Tensor) and kl.numel() != 1:
        raise ValueError(f"kl must be one number (the batch's KL estimate), got a tensor of shape {tuple(kl.shape)}")
    n = x.shape[0]
    beta, desirable_weight, undesirable_weight = float(beta), float(desirable_weight), float(undesirable_weight)
    kl_value = torch.as_tensor(0.0 if kl is None else kl, dtype=torch.float32, device=x.device).detach().reshape(())
    if clamp_kl:
        kl_value = kl_value.clamp_min(0)
    ref_lp_all = None if ref_logps is None else ref_logps.float()

    def chunk_fn(xc, tc, labels, ref_xc, ref_lp, w, b, ref_w, ref_b):
        logps, _ = sequence_logps(xc, w, b, tc, ignore_index, average_log_prob, not compiled)
        if ref_xc is not None:
            with torch.no_grad():
                ref_lp, _ = sequence_logps(ref_xc, ref_w, ref_b, tc, ignore_index, average_log_prob, not compiled)
        ratio = logps - (ref_lp if ref_lp is not None else 0.0)
        losses = torch.where(labels, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl_value))),
                             undesirable_weight * (1 - torch.sigmoid(beta * (kl_value - ratio))))
        return losses.sum() / n, dict(logps=logps, rewards=beta * ratio)

    detach = (lambda t: t.detach() if t is not None else None)
    with labels_checked(target, head_vocab(weight, ref_weight), ignore_index):
        return run_chunked(chunk_fn, [x, target, preference_labels, detach(ref_x), ref_lp_all],
                           [weight, bias, detach(ref_weight), detach(ref_bias)],
                           contiguous_chunks(n, chunk_rows, x.device), compiled)


class TigonKTOLoss(LossModule):
    """``loss, metrics = module(x, weight, target, preference_labels, bias=None, **overrides)``:
    kto_loss with the options given at construction; x [N, T, H], weight [V, H], target [N, T],
    preference_labels [N] bool (True: desirable)."""

    fn = staticmethod(kto_loss)

    def forward(self, x, weight, target, preference_labels, bias=None, **kwargs):
        return kto_loss(x, weight, target, preference_labels, bias, **{**self.options, **kwargs})
