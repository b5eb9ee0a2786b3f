"""One chunked base for every preference loss: the logits are formed a chunk of pairs at a time.

A preference batch holds B chosen sequences then B rejected ones: x [2B, T, H], target [2B, T].
For each chunk of pairs the base computes the chunk's logits (x_c @ W^T + b, in fp32), the
per-sequence log-probabilities of the targets, and the loss's terms for those pairs, and takes
the gradients of the chunk's share of the loss with respect to x_c, W and b in the same call
(``torch.func.grad_and_value``). The loss is a sum over pairs (normalisers are computed from
the whole batch first), so the chunk gradients add up to the full gradients exactly. The
gradients are formed in the forward pass; the backward scales them by grad_output.

A loss is a function ``pair_loss(chosen_logps, rejected_logps, ref_chosen_logps,
ref_rejected_logps, **options) -> (per-pair losses [b], metrics dict of per-pair tensors)``,
plus optional NLL of the chosen sequences added by the base (``nll_weight``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.func import grad_and_value


def sequence_logps(x, weight, bias, target, ignore_index, average):
    """Sum (or mean) over tokens of log p(target) under logits x @ weight.T + bias, in fp32.
    x [n, T, H], target [n, T] -> (logps [n], token counts [n], sum of logits, number of logits)."""
    logits = x.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    mask = target != ignore_index
    token_logps = torch.gather(logits.log_softmax(-1), -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    token_logps = token_logps * mask
    counts = mask.sum(-1)
    logps = token_logps.sum(-1)
    if average:
        logps = logps / counts.clamp_min(1)
    return logps, counts, logits.sum((-1, -2)), token_logps.sum()


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


class ChunkedPreferenceFunction(torch.autograd.Function):
    """(loss, metrics) of a pairwise preference loss over x [2B, T, H]; see the module doc."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ref_x, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps,
                pair_loss: Callable, options: dict, ignore_index: int, average_log_prob: bool, nll_weight: float,
                chunk_pairs: int, compiled: bool, metric_names: list):
        check_preference_args(x, weight, target, bias, ref_x, ref_weight, ref_chosen_logps, ref_rejected_logps)
        pairs = x.shape[0] // 2
        chosen_tokens = (target[:pairs] != ignore_index).sum().clamp_min(1)  # NLL: mean over chosen tokens
        n_logits = x.shape[0] * x.shape[1] * weight.shape[0]

        def chunk_loss(xc, w, b, tc, ref_c, ref_r):
            logps, _, logit_sum, token_logp_sum = sequence_logps(xc, w, b, tc, ignore_index, average_log_prob)
            n = xc.shape[0] // 2
            losses, metrics = pair_loss(logps[:n], logps[n:], ref_c, ref_r, **options)
            loss = losses.sum() / pairs
            nll = None
            if nll_weight:
                _, _, _, chosen_sum = sequence_logps(xc[:n], w, b, tc[:n], ignore_index, False)
                nll = -chosen_sum / chosen_tokens
                loss = loss + nll_weight * nll
            metrics = dict(metrics, chosen_logps=logps[:n].detach(), rejected_logps=logps[n:].detach(),
                           chosen_logits_sum=logit_sum[:n].sum().detach(),
                           rejected_logits_sum=logit_sum[n:].sum().detach())
            if nll is not None:
                metrics["nll_loss"] = nll.detach()
            return loss, metrics

        need = ctx.needs_input_grad
        argnums = tuple(i for i, flag in ((0, need[0]), (1, need[1]), (2, need[2] and bias is not None)) if flag)
        step = grad_and_value(chunk_loss, argnums=argnums, has_aux=True) if argnums else None
        if compiled and step is not None:
            step = torch.compile(step, dynamic=True)
        grads = {i: None for i in (0, 1, 2)}
        total = x.new_zeros((), dtype=torch.float32)
        collected: dict[str, list] = {}
        for start in range(0, pairs, chunk_pairs):
            stop = min(start + chunk_pairs, pairs)
            rows = torch.cat((torch.arange(start, stop), torch.arange(pairs + start, pairs + stop))).to(x.device)
            xc, tc = x[rows], target[rows]
            ref_c, ref_r = _reference_logps(ref_x, ref_weight, ref_bias, rows, ref_chosen_logps,
                                            ref_rejected_logps, start, stop, tc, ignore_index, average_log_prob)
            args = (xc, weight, bias, tc, ref_c, ref_r)
            if step is None:
                with torch.no_grad():
                    loss_c, metrics = chunk_loss(*args)
            else:
                g, (loss_c, metrics) = step(*args)
                for i, gi in zip(argnums, g):
                    if i == 0:
                        if grads[0] is None:
                            grads[0] = torch.zeros_like(x, dtype=torch.float32)
                        grads[0].index_add_(0, rows, gi.float())
                    else:
                        grads[i] = gi.float() if grads[i] is None else grads[i] + gi.float()
            total = total + loss_c
            for k, v in metrics.items():
                collected.setdefault(k, []).append(v)
        out_metrics = {}
        for k, parts in collected.items():
            out_metrics[k] = torch.stack(parts).sum() if parts[0].ndim == 0 else torch.cat(parts)
        per_side = n_logits / 2
        chosen_sum, rejected_sum = out_metrics.pop("chosen_logits_sum"), out_metrics.pop("rejected_logits_sum")
        out_metrics.update(chosen_logits_mean=chosen_sum / per_side, rejected_logits_mean=rejected_sum / per_side,
                           logits_mean=(chosen_sum + rejected_sum) / n_logits)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads.values()))
        ctx.has = [g is not None for g in grads.values()]
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*out_metrics.values())
        metric_names[:] = list(out_metrics)  # the caller's list: the outputs' names after the loss
        return (total, *out_metrics.values())

    @staticmethod
    def backward(ctx, grad_loss, *_grad_metrics):
        saved = ctx.saved_tensors
        out = []
        for has, g, dtype in zip(ctx.has, saved, ctx.dtypes):
            out.append((g * grad_loss).to(dtype) if has else None)
        return (*out,) + (None,) * 14


def _reference_logps(ref_x, ref_weight, ref_bias, rows, ref_chosen, ref_rejected, start, stop, tc, ignore_index,
                     average):
    if ref_x is not None:
        with torch.no_grad():
            logps, *_ = sequence_logps(ref_x[rows], ref_weight, ref_bias, tc, ignore_index, average)
        n = logps.shape[0] // 2
        return logps[:n], logps[n:]
    if ref_chosen is not None:
        return ref_chosen[start:stop].float(), ref_rejected[start:stop].float()
    return None, None
