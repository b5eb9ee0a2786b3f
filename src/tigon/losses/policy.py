"""Policy-gradient losses (the GRPO family) on the chunked base, with TRL's formulas.

Inputs are the completion positions of a batch of sampled sequences: x [B, T, H] the policy's
last hidden states there, selected_token_ids [B, T] the sampled tokens, attention_mask [B, T]
(1 on completion tokens, 0 on padding; TRL's completion_mask, times its tool_mask if any),
advantages [B] (or [B, T]). The logits (x @ weight^T + bias) / temperature are formed a chunk of
sequences at a time and never for the whole batch.

With lp the policy's per-token log-probs, old the sampling policy's (``old_per_token_logps``,
default lp with no gradient: one update per generation) and A the advantages, TRL's
``GRPOTrainer._compute_loss`` (trl 1.16) is, per token:
  r = exp(lp - old) ("token" importance sampling) or, per sequence, exp(masked mean of lp - old)
  ("sequence": GSPO);
  clip types (grpo, bnpo, dr_grpo, dapo):  -min(min(r, delta) A, clamp(r, 1 - eps_low, 1 + eps_high) A)
  cispo:  -min(r, eps_high) (no gradient) A lp
  sapo:   -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos where A > 0, else _neg
then times ``importance_sampling_ratio`` (the vLLM generation / training mismatch correction,
given) and plus beta * (exp(ref - lp) - (ref - lp) - 1) (k3 KL to the reference, times r with
``use_bias_correction_kl``); aggregated with the mask m as:
  grpo, sapo:      mean over sequences of sum_t(loss m) / max(1, sum_t m)
  bnpo:            sum(loss m) / max(1, sum m)
  dr_grpo:         sum(loss m) / (B * max_completion_length)
  dapo, cispo:     sum(loss m) / num_items_in_batch (default: max(1, sum m); TRL 1.16 passes its
                   generation batch's token count / processes * accumulation steps / steps per
                   generation)
``loss_type="gspo"`` is "grpo" with sequence-level importance sampling. TRL also divides the
grpo, sapo, bnpo and dr_grpo losses by the gradient-accumulation steps: the caller's to do.
"""

from __future__ import annotations

import torch

from tigon.functional import linear_token_logps
from tigon.losses.base import (
    LossModule,
    check_chunk_size,
    contiguous_chunks,
    head_logits,
    head_vocab,
    plain_numbers,
    rows_per_chunk,
    run_chunked,
    token_logps,
)
from tigon.ops._common import matmul_dtype, traced
from tigon.ops._cross_entropy_common import labels_checked

GRPO_LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "gspo")
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IGNORE = -100  # the target of masked positions handed to the log-prob kernels
TORCH_BYTES_PER_LOGIT = 3 * 4  # the torch math (compiled=True): fp32 logits and two fp32 temporaries
# The entropy metric's extra pass of the head, a slice of tokens at a time: its fp32 logits and
# temporaries stay within a few hundred MB (256 x 152K x 4 bytes = 156 MB each) whatever the chunk.
ENTROPY_ROWS = 256


def completion_token_logps(x, weight, bias, target, temperature, fused, need_entropy=False):
    """(log p(target) [S, T] fp32, 0 where target == IGNORE; entropy [S, T] fp32 or None) of
    the logits (x @ weight^T + bias) / temperature. fused: tigon's linear_token_logps (the
    cross-entropy kernel on the chunk's logits in x's dtype); otherwise torch on fp32 logits. The
    entropy (a metric: no gradient) costs one more pass of the head."""
    if temperature != 1.0:
        x = x / temperature
        bias = None if bias is None else bias / temperature
    if fused:
        lp = linear_token_logps(x, weight, target, bias, IGNORE)
    else:
        lp, _ = token_logps(head_logits(x, weight, bias), target, IGNORE)
    entropy = None
    if need_entropy:
        with torch.no_grad():
            x2 = x.reshape(-1, x.shape[-1])
            entropy = torch.cat([token_entropy(head_logits(x2[s:s + ENTROPY_ROWS], weight, bias))
                                 for s in range(0, x2.shape[0], ENTROPY_ROWS)]).view(x.shape[:-1])
    return lp, entropy


def token_entropy(logits):
    """-sum p log p per row of fp32 logits [rows, V], as logsumexp(z) - sum p z."""
    lse = torch.logsumexp(logits, -1, keepdim=True)
    return (lse - (torch.exp(logits - lse) * logits).sum(-1, keepdim=True)).squeeze(-1)


def under_autocast(*tensors):
    """The tensors in autocast's dtype when autocast is on (the head's matmuls then run in it, as
    F.linear's would), else as given; None stays None. Cast once per call, not per chunk."""
    first = next(t for t in tensors if t is not None)
    if not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = matmul_dtype(first)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def check_number(name, value, *, positive):
    """A real number (not a bool), > 0 with ``positive``, else >= 0; a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be a number {'>' if positive else '>='} 0, got {value!r}")


def completion_targets(selected_token_ids, attention_mask):
    """The sampled tokens as the log-prob kernels' targets: IGNORE where attention_mask is 0."""
    return torch.where(attention_mask != 0, selected_token_ids, IGNORE)


def completion_positions(attention_mask):
    """Flat positions [n] (int64, into B * T) of the completion tokens (attention_mask != 0) of a
    [B, T] batch. Finding them is one host sync."""
    return attention_mask.reshape(-1).nonzero().squeeze(1)


def rows_at(t, positions, B, T):
    """The rows of t [B, T, ...] (or [B, 1], broadcast over T) at flat positions [n]; None stays None."""
    if t is None:
        return None
    return t.expand(B, T, *t.shape[2:]).reshape(B * T, *t.shape[2:])[positions]


def check_policy_args(x, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
                      old_per_token_logps, ref_x, ref_weight, importance_sampling_ratio):
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, H] (the completion positions' hidden states), got shape {tuple(x.shape)}")
    bt = tuple(x.shape[:2])
    if weight.ndim != 2 or weight.shape[1] != x.shape[2]:
        raise ValueError(f"weight must be [V, {x.shape[2]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:1]):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if tuple(selected_token_ids.shape) != bt or selected_token_ids.is_floating_point() \
            or selected_token_ids.dtype == torch.bool:
        raise ValueError(f"selected_token_ids must be integer token ids of shape {bt}, got "
                         f"{selected_token_ids.dtype} {tuple(selected_token_ids.shape)}")
    if tuple(attention_mask.shape) != bt:
        raise ValueError(f"attention_mask must be {bt} (1 on completion tokens), got {tuple(attention_mask.shape)}")
    if advantages.shape not in ((bt[0],), bt):
        raise ValueError(f"advantages must be [{bt[0]}] (one per sequence) or {bt}, got {tuple(advantages.shape)}")
    for name, t in (("ref_per_token_logps", ref_per_token_logps), ("old_per_token_logps", old_per_token_logps)):
        if t is not None and tuple(t.shape) != bt:
            raise ValueError(f"{name} must be {bt}, got {tuple(t.shape)}")
    if importance_sampling_ratio is not None and importance_sampling_ratio.shape not in (bt, (bt[0], 1)):
        raise ValueError(f"importance_sampling_ratio must be {bt} (token level) or [{bt[0]}, 1] (sequence "
                         f"level), got {tuple(importance_sampling_ratio.shape)}")
    if ref_x is not None:
        if ref_weight is None:
            raise ValueError("ref_x needs ref_weight (the reference model's lm_head weight)")
        if tuple(ref_x.shape[:2]) != bt:
            raise ValueError(f"ref_x has shape {tuple(ref_x.shape)} but x has {tuple(x.shape)}: the reference "
                             "model must see the same completions")
        if ref_per_token_logps is not None:
            raise ValueError("give ref_x / ref_weight or ref_per_token_logps, not both")


def check_finite_advantages(advantages):
    """A NaN or infinite advantage would make every gradient NaN: refuse it (eager only; it
    reads the values, a host sync; a traced or captured call skips the check)."""
    if traced(advantages) or torch.compiler.is_compiling() or \
            (advantages.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if not bool(torch.isfinite(advantages).all()):
        bad = advantages[~torch.isfinite(advantages)]
        raise ValueError(f"advantages hold {bad.numel()} non-finite value(s) (e.g. {bad[0].item()}): a group whose "
                         "rewards are all NaN, or a zero std without an epsilon; they would make every gradient NaN")


def _policy_options(loss_type, importance_sampling_level, beta, epsilon_low, epsilon_high, delta, temperature,
                    sapo_temperature_pos, sapo_temperature_neg, max_completion_length, num_items_in_batch, T):
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level is None:
        importance_sampling_level = "sequence" if loss_type == "gspo" else "token"
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                         f"{importance_sampling_level!r}")
    if loss_type == "gspo" and importance_sampling_level != "sequence":
        raise ValueError("loss_type='gspo' is sequence-level importance sampling: importance_sampling_level "
                         f"must be 'sequence' or None, got {importance_sampling_level!r}")
    for name, v in (("beta", beta), ("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
        check_number(name, v, positive=False)
    for name, v in (("temperature", temperature), ("sapo_temperature_pos", sapo_temperature_pos),
                    ("sapo_temperature_neg", sapo_temperature_neg)):
        check_number(name, v, positive=True)
    if delta is not None:
        check_number("delta (the two-sided clip's upper bound, or None)", delta, positive=True)
    if max_completion_length is None:
        max_completion_length = T
    if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) \
            or max_completion_length <= 0:
        raise ValueError(f"max_completion_length must be a positive int or None (T), got {max_completion_length!r}")
    if num_items_in_batch is not None and loss_type not in ("dapo", "cispo"):
        raise ValueError(f"num_items_in_batch is the normaliser of the dapo and cispo losses, not of {loss_type!r}")
    return dict(loss_type="grpo" if loss_type == "gspo" else loss_type, sequence=importance_sampling_level ==
                "sequence", beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                temperature=temperature, sapo_temperature_pos=sapo_temperature_pos,
                sapo_temperature_neg=sapo_temperature_neg, max_completion_length=max_completion_length)


def per_token_policy_loss(lp, old, ref, adv, m, is_ratio, *, loss_type, sequence, beta, epsilon_low, epsilon_high,
                          delta, sapo_temperature_pos, sapo_temperature_neg, use_bias_correction_kl):
    """(per-token loss [S, T] or [S, 1], coef_1 (the importance ratio), per-token KL or None):
    TRL's formulas on a chunk of S sequences. lp, old, ref [S, T] fp32, adv [S, 1] or [S, T], m
    [S, T] fp32."""
    log_ratio = lp - old
    if sequence:
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if use_bias_correction_kl:
            kl = kl * coef_1
    if loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * lp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        c1 = torch.clamp(coef_1, max=delta) if delta is not None else coef_1
        loss = -torch.min(c1 * adv, coef_2 * adv)
    if is_ratio is not None:
        loss = loss * is_ratio
    if kl is not None:
        loss = loss + beta * kl
    return loss, coef_1, kl


def grpo_loss(x, weight, selected_token_ids, attention_mask, advantages, bias=None, *, ref_per_token_logps=None,
              old_per_token_logps=None, ref_x=None, ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2,
              epsilon_high=0.2, delta=None, loss_type="dapo", importance_sampling_level=None,
              max_completion_length=None, temperature=1.0, importance_sampling_ratio=None, num_items_in_batch=None,
              use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              compute_entropy=False, chunk_sequences=None, chunk_budget=None, compiled=False):
    """(loss, metrics) of the GRPO family (see the module's docstring for the formulas).

    x [B, T, H], weight [V, H], selected_token_ids [B, T] int, attention_mask [B, T],
    advantages [B] or [B, T], bias [V] or None. The reference log-probs for the KL term (beta >
    0) are ``ref_per_token_logps`` [B, T], or are computed without gradient from ``ref_x`` [B,
    T, H'] and ``ref_weight`` / ``ref_bias`` (the reference model's hidden states and head);
    with neither, beta must be 0. ``importance_sampling_ratio`` [B, T] or [B, 1]: TRL's
    vLLM correction (computed by the caller from the sampler's log-probs and truncated or
    masked as it chooses). ``num_items_in_batch``: dapo / cispo's normaliser (see the module's
    docstring for what TRL divides by); default this batch's completion tokens.

    metrics (detached, TRL's names): ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max`` (clip types),
    ``cispo_clip_ratio`` (cispo), ``kl`` (beta > 0), ``entropy`` (compute_entropy: one more pass
    of the head, no gradient), and ``per_token_logps`` [B, T]. Chunks are of
    ``chunk_sequences`` sequences, or as many as fit ``chunk_budget`` bytes of logits (default
    tigon's one chunk budget); with token-level importance sampling an eager call takes the
    completion tokens alone (attention_mask != 0, one host sync to find them), in chunks of
    ``chunk_sequences * T`` tokens or of the budget's. ``compiled=True``: torch math instead of the fused kernel, for
    torch.compile of the loss. Non-finite advantages raise a ValueError (eager; a host sync)."""
    check_policy_args(x, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
                      old_per_token_logps, ref_x, ref_weight, importance_sampling_ratio)
    B, T = x.shape[:2]
    opts = _policy_options(loss_type, importance_sampling_level, beta, epsilon_low, epsilon_high, delta, temperature,
                           sapo_temperature_pos, sapo_temperature_neg, max_completion_length, num_items_in_batch, T)
    if opts["beta"] != 0.0 and ref_per_token_logps is None and ref_x is None:
        raise ValueError("beta > 0 needs the reference: ref_per_token_logps, or ref_x with ref_weight")
    check_finite_advantages(advantages)
    opts = plain_numbers(opts)
    loss_type, sequence, temperature = opts.pop("loss_type"), opts.pop("sequence"), opts.pop("temperature")
    max_len = opts.pop("max_completion_length")
    use_kl = opts["beta"] != 0.0

    x, weight, bias = under_autocast(x, weight, bias)
    if ref_x is not None:
        ref_x, ref_weight, ref_bias = under_autocast(ref_x, ref_weight, ref_bias)
    m = attention_mask.to(torch.float32)
    target = completion_targets(selected_token_ids, attention_mask)
    adv = advantages.detach().to(torch.float32)
    adv = adv.unsqueeze(-1) if adv.ndim == 1 else adv
    tokens = m.sum().clamp_min(1.0)
    if loss_type in ("grpo", "sapo"):  # each sequence's weight: 1 / (B * its token count)
        row_scale = 1.0 / (m.sum(-1, keepdim=True).clamp_min(1.0) * B)
    elif loss_type == "bnpo":
        row_scale = (1.0 / tokens).expand(B, 1)
    elif loss_type == "dr_grpo":
        row_scale = m.new_full((B, 1), 1.0 / (B * max_len))
    else:  # dapo, cispo
        items = tokens if num_items_in_batch is None else \
            torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=x.device).clamp_min(1.0)
        row_scale = (1.0 / items).expand(B, 1)
    fused = not compiled
    if chunk_sequences is not None:
        check_chunk_size("chunk_sequences", chunk_sequences)
    as_float = (lambda t: None if t is None else t.detach().float())
    ref_lp_all, old_lp_all, is_ratio = (as_float(t) for t in (ref_per_token_logps, old_per_token_logps,
                                                              importance_sampling_ratio))
    ref_x, ref_weight, ref_bias = (None if t is None else t.detach() for t in (ref_x, ref_weight, ref_bias))

    def chunk_fn(xc, tc, mc, advc, scale, ref_lp, old_lp, ratio, ref_xc, w, b, ref_w, ref_b):
        """Rows of sequences ([S, T] per token; mc their mask) or of completion tokens ([n])."""
        lp, entropy = completion_token_logps(xc, w, b, tc, temperature, fused, compute_entropy)
        if use_kl and ref_lp is None:
            with torch.no_grad():
                ref_lp, _ = completion_token_logps(ref_xc, ref_w, ref_b, tc, temperature, fused)
        old = lp.detach() if old_lp is None else old_lp
        loss_t, coef_1, kl = per_token_policy_loss(lp, old, ref_lp, advc, mc, ratio, loss_type=loss_type,
                                                   sequence=sequence, use_bias_correction_kl=use_bias_correction_kl,
                                                   **opts)
        per_row = loss_t if mc is None else (loss_t * mc).sum(-1, keepdim=True)
        metrics = {"per_token_logps": lp.detach()}  # and the per-token (or per-sequence) values of the others
        if kl is not None:
            metrics["kl"] = kl.detach()
        if entropy is not None:
            metrics["entropy"] = entropy
        if loss_type == "cispo":
            metrics["cispo"] = (coef_1 > opts["epsilon_high"]) & (advc > 0)
        elif loss_type in CLIP_LOSS_TYPES:
            metrics["low"] = (coef_1 < 1 - opts["epsilon_low"]) & (advc < 0)
            metrics["high"] = (coef_1 > 1 + opts["epsilon_high"]) & (advc > 0)
        return (per_row * scale).sum(), metrics

    shared = [weight, bias, ref_weight, ref_bias]
    with labels_checked(target, head_vocab(weight, ref_weight), IGNORE):
        # Eager, token-level importance sampling: the head runs on the completion tokens only
        # (the padding's log-probs are 0 and carry no gradient), in chunks of tokens that fill
        # the chunk budget whatever T is. One host sync finds them.
        kept = None
        if fused and not sequence and not torch.compiler.is_compiling() and not traced(x):
            kept = completion_positions(attention_mask)
        if kept is not None and kept.numel():
            def tokens_of(t):
                return rows_at(t, kept, B, T)

            n = kept.numel()
            per_chunk = rows_per_chunk(None if chunk_sequences is None else chunk_sequences * T, chunk_budget, n,
                                       weight.shape[0], x.element_size(), "chunk_sequences")
            loss, raw = run_chunked(
                chunk_fn, [tokens_of(x), tokens_of(target), None, tokens_of(adv), tokens_of(row_scale),
                           tokens_of(ref_lp_all), tokens_of(old_lp_all), tokens_of(is_ratio), tokens_of(ref_x)],
                shared, contiguous_chunks(n, per_chunk, x.device, "chunk_sequences"), compiled)
            raw = {k: torch.zeros(B * T, dtype=v.dtype, device=v.device).index_copy_(0, kept, v).view(B, T)
                   for k, v in raw.items()}
        else:
            per_chunk = rows_per_chunk(chunk_sequences, chunk_budget, B, T * weight.shape[0],
                                       x.element_size() if fused else TORCH_BYTES_PER_LOGIT, "chunk_sequences")
            loss, raw = run_chunked(
                chunk_fn, [x, target, m, adv, row_scale, ref_lp_all, old_lp_all, is_ratio, ref_x], shared,
                contiguous_chunks(B, per_chunk, x.device, "chunk_sequences"), compiled)
    return loss, policy_metrics(raw, m, loss_type)


def policy_metrics(raw, m, loss_type):
    """TRL's logged metrics from the per-token values [B, T] (per-sequence ones [B, 1] with
    sequence-level importance sampling) that chunk_fn returned, m the completion mask [B, T]."""
    B = m.shape[0]
    tokens = m.sum().clamp_min(1.0)

    def masked_mean(v):  # TRL's masked mean over the batch's tokens (a mean over sequences for [B, 1])
        v = v.float()
        return v.sum() / B if v.shape[-1] == 1 else (v * m).sum() / tokens

    def seq_mean(v):  # TRL's masked_seq_mean (NaN for a sequence without tokens)
        v = v.float()
        return v.squeeze(-1) if v.shape[-1] == 1 else (v * m).sum(-1) / m.sum(-1)

    metrics = {"per_token_logps": raw["per_token_logps"]}
    for name in ("kl", "entropy"):
        if name in raw:
            metrics[name] = masked_mean(raw[name])
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_mean(raw["cispo"])
    elif loss_type in CLIP_LOSS_TYPES:
        low, high = raw["low"], raw["high"]
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(low | high)
        for per_seq, reduce, key, empty in ((seq_mean(low), torch.amin, "low_min", float("inf")),
                                            (seq_mean(high), torch.amax, "high_max", float("-inf"))):
            # over the sequences with tokens (NaN when none has), as TRL's nanmin / nanmax
            value = reduce(per_seq.nan_to_num(nan=empty))
            metrics["clip_ratio/" + key] = torch.where(torch.isnan(per_seq).all(), float("nan"), value)
    return metrics


@torch.no_grad()
def per_token_logps(x, weight, selected_token_ids, attention_mask=None, bias=None, *, temperature=1.0,
                    compute_entropy=False, chunk_sequences=None, chunk_budget=None):
    """The per-token log-probs [B, T] fp32 (0 where attention_mask is 0) of the sampled tokens
    under (x @ weight^T + bias) / temperature, without gradient: the old policy's or the
    reference's pass of GRPO (``old_per_token_logps`` / ``ref_per_token_logps``) on the same
    kernel and no backward buffer. The head runs on the completion tokens only (one host sync
    finds them; every token without attention_mask), in chunks of ``chunk_sequences * T`` tokens or
    of the chunk budget's. With compute_entropy, also each token's entropy [B, T] (0 where
    attention_mask is 0; one more pass of the head): returns (logps, entropy)."""
    if x.ndim != 3 or tuple(selected_token_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"x must be [B, T, H] and selected_token_ids [B, T], got {tuple(x.shape)} and "
                         f"{tuple(selected_token_ids.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"attention_mask must be {tuple(x.shape[:2])}, got {tuple(attention_mask.shape)}")
    check_number("temperature", temperature, positive=True)
    if chunk_sequences is not None:
        check_chunk_size("chunk_sequences", chunk_sequences)
    B, T = x.shape[:2]
    x, weight, bias = under_autocast(x, weight, bias)
    kept = torch.arange(B * T, device=x.device) if attention_mask is None else completion_positions(attention_mask)
    n = kept.numel()
    target = rows_at(selected_token_ids, kept, B, T)
    per_chunk = rows_per_chunk(None if chunk_sequences is None else chunk_sequences * T, chunk_budget, n,
                               weight.shape[0], x.element_size(), "chunk_sequences")
    logps = torch.zeros(B * T, dtype=torch.float32, device=x.device)
    entropy = torch.zeros(B * T, dtype=torch.float32, device=x.device) if compute_entropy else None
    if n:
        x_rows = rows_at(x, kept, B, T)
        with labels_checked(target, weight.shape[0], IGNORE):
            for rows in contiguous_chunks(n, per_chunk, x.device, "chunk_sequences"):
                lp, ent = completion_token_logps(x_rows[rows], weight, bias, target[rows], float(temperature), True,
                                                 compute_entropy)
                logps.index_copy_(0, kept[rows], lp)
                if compute_entropy:
                    entropy.index_copy_(0, kept[rows], ent)
    logps = logps.view(B, T)
    return (logps, entropy.view(B, T)) if compute_entropy else logps


class TigonGRPOLoss(LossModule):
    """``loss, metrics = module(x, weight, selected_token_ids, attention_mask, advantages, bias=None,
    **per_call)``: grpo_loss with the options given at construction (beta, epsilon_low, loss_type,
    ...); a keyword at the call overrides them."""

    fn = staticmethod(grpo_loss)

    def forward(self, x, weight, selected_token_ids, attention_mask, advantages, bias=None, **kwargs):
        return grpo_loss(x, weight, selected_token_ids, attention_mask, advantages, bias,
                         **{**self.options, **kwargs})
