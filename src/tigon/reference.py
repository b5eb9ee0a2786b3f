"""Reference implementations of tigon's ops and losses in plain torch: one ``<op>_ref`` a
formula, shared by the tests (their float64 ground truth) and ``tigon bench`` (its "torch eager"
and "torch.compile" columns). Nothing here calls a tigon kernel or imports the rest of tigon
(the lowest layer of tests/test_layering.py).

The dtype rule: a reference computes in the wider of its inputs' dtype and float32 ("the wide
dtype": float64 inputs give a float64 reference, bf16 / fp16 / fp32 ones torch's eager fp32
upcast) and returns what the op returns: an activation's output in its input's dtype, a loss in
the wide dtype. Each docstring says where a formula keeps to its inputs' dtype instead (RoPE as
HF computes it, the MLPs, the preference losses) and what ``upcast=False`` does where it is
offered: the same formula on the inputs as they are, as the model code runs it (HF's modules:
the benchmark's baseline).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
import torch.nn.functional as F

# The activations of the GLUs and the MoE experts, by tigon's names for them.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_erf": F.gelu,
}


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in the wider of its dtype and float32: bf16 / fp16 / fp32 -> fp32, float64 stays."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _caster(upcast: bool):
    """``wide`` when upcast, else the identity (the formula in the inputs' own dtypes)."""
    return wide if upcast else _same


def _optional(cast, t):
    """cast(t), or None for None (an absent weight or bias)."""
    return None if t is None else cast(t)


# ---- normalisations ----

def _plus(weight, offset):
    return weight + offset if offset else weight


def rms_norm_ref(x, weight, eps=1e-6, offset=0.0, casting="llama"):
    """RMSNorm over the last dim: x [..., N], weight [N] or None; returns x's shape.

    casting="llama": HF's LlamaRMSNorm: x / rms in the wide dtype, rounded to x's dtype, times
    (weight + offset) (torch's promotion: an fp32 weight gives an fp32 output). "gemma":
    GemmaRMSNorm: the product (offset + weight) too in the wide dtype, then x's dtype. "none":
    the plain expression in the inputs' dtypes (Liger's reference). weight None: x / rms only."""
    if casting == "none":
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return xn if weight is None else _plus(weight, offset) * xn
    xf = wide(x)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xn.to(x.dtype)
    if casting == "llama":
        return _plus(weight, offset) * xn.to(x.dtype)
    return (xn * (offset + wide(weight))).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps=1e-6, offset=0.0, casting="llama"):
    """(rms_norm_ref(residual + x), residual + x): x, residual [..., N]; the sum in their dtype."""
    s = residual + x
    return rms_norm_ref(s, weight, eps, offset, casting), s


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5, upcast=True):
    """LayerNorm over the last dim: x [..., N], weight / bias [N] or None; in x's dtype.

    upcast=True: torch's layer_norm on the wide copies (a float64 reference for float64 inputs);
    False: on the inputs as they are (what nn.LayerNorm runs: the benchmark's eager baseline)."""
    cast = _caster(upcast)
    y = F.layer_norm(cast(x), x.shape[-1:], _optional(cast, weight), _optional(cast, bias), eps)
    return y.to(x.dtype)


def group_norm_ref(x, num_groups, weight=None, bias=None, eps=1e-5, upcast=True):
    """GroupNorm: x [N, C, *], weight / bias [C] or None; in x's dtype. upcast as layer_norm_ref.
    A bias without a weight gets a weight of ones (torch's CPU backward fails without one)."""
    if weight is None and bias is not None:
        weight = torch.ones_like(bias).detach()
    cast = _caster(upcast)
    return F.group_norm(cast(x), num_groups, _optional(cast, weight), _optional(cast, bias), eps).to(x.dtype)


def dyt_ref(x, alpha, gamma, beta=None, upcast=True):
    """DyT: gamma * tanh(alpha * x) + beta. x [..., N], alpha [1] or [], gamma / beta [N] (beta
    may be None); in x's dtype. upcast=False: in the inputs' dtypes, as DyT's paper's code."""
    cast = _caster(upcast)
    y = cast(gamma) * torch.tanh(cast(alpha) * cast(x))
    return (y if beta is None else y + cast(beta)).to(x.dtype)


def poly_norm_ref(x, weight, bias, eps=1e-6):
    """PolyCom's PolyNorm (its README's module): x [..., N], weight [3], bias [1] or []; computed
    in the wide dtype (weight and bias promote to it), returned in x's dtype."""
    xf = wide(x)

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    return (weight[0] * norm(xf**3) + weight[1] * norm(xf**2) + weight[2] * norm(xf) + bias).to(x.dtype)


# ---- activations, row-wise maps, rotary embeddings, embedding, MLPs, MoE experts ----

def glu_ref(a, b, activation="silu", upcast=True):
    """act(a) * b (SwiGLU: "silu"; GeGLU: "gelu_tanh" or "gelu_erf"): a, b of one shape; in a's
    dtype. upcast=False: in the inputs' dtype, as HF's MLP modules (the benchmark's baseline)."""
    cast = _caster(upcast)
    return (ACTIVATIONS[activation](cast(a)) * cast(b)).to(a.dtype)


def glu_mlp_ref(x, gate_weight, up_weight, down_weight, activation="silu"):
    """down(glu_ref(x @ gate.T, x @ up.T)): x [..., H], gate / up [I, H], down [H, I]; the
    projections in the inputs' dtype, the GLU as glu_ref."""
    return F.linear(glu_ref(x @ gate_weight.t(), x @ up_weight.t(), activation), down_weight)


def relu_squared_ref(x, upcast=True):
    """relu(x)^2 in x's dtype; upcast=False: in x's dtype throughout (transformers' ACT2FN["relu2"])."""
    return torch.relu(_caster(upcast)(x)).square().to(x.dtype)


def relu_squared_mlp_ref(x, up_weight, down_weight, up_bias=None, down_bias=None):
    """Nemotron's MLP: down(relu(up(x))^2) in the inputs' dtype. x [..., H], up [I, H], down [H, I]."""
    return F.linear(relu_squared_ref(F.linear(x, up_weight, up_bias), upcast=False), down_weight, down_bias)


def softmax_ref(x, dim=-1, upcast=True):
    """softmax over ``dim`` in x's dtype (upcast=False: torch's softmax on x as it is)."""
    return torch.softmax(_caster(upcast)(x), dim).to(x.dtype)


def sparsemax_ref(x, dim=-1):
    """Sparsemax over ``dim`` by sorting (Martins & Astudillo): the support size k is the largest
    with 1 + k z_(k) > sum_{j<=k} z_(j), tau = (sum of the top k - 1) / k, y = relu(z - tau);
    differentiable through the sort. In the wide dtype, returned in x's. An entry equal to tau
    is outside the support: 0, and no gradient (relu's, not clamp_min's)."""
    z = wide(x).movedim(dim, -1)
    zs = torch.sort(z, dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cumsum = zs.cumsum(-1)
    support = (1 + k * zs > cumsum).sum(-1, keepdim=True)
    tau = (cumsum.gather(-1, support - 1) - 1) / support
    return torch.relu(z - tau).movedim(-1, dim).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q, k, cos, sin, unsqueeze_dim=1):
    """HF's apply_rotary_pos_emb (halves rotated), in the inputs' dtype: q, k [B, H, T, D] (or
    [B, T, H, D] with unsqueeze_dim=2), cos, sin [B or 1, T, R]. R < D: Phi-3's partial rotary
    (the first R dims rotate, the rest pass through). Returns (q', k')."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    out = []
    for x in (q, k):
        x_rot = x[..., :rot]
        y = x_rot * cos + _rotate_half(x_rot) * sin
        out.append(y if rot == x.shape[-1] else torch.cat((y, x[..., rot:]), dim=-1))
    return tuple(out)


def rope_interleaved_ref(x, cos, sin, unsqueeze_dim=2):
    """torchtune's RotaryPositionalEmbeddings, in x's dtype: adjacent pairs (x[2j], x[2j+1])
    rotate by the pair's angle. x [B, T, H, D]; cos, sin [.., T, R/2] (one angle a pair); dims
    past R pass through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = 2 * cos.shape[-1]
    pairs = x[..., :rot].unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def embedding_ref(ids, weight, padding_idx=None):
    """weight[ids]: ids [...] (int), weight [V, H] -> [..., H] in weight's dtype; padding_idx's row
    gets no gradient."""
    return F.embedding(ids, weight, padding_idx=padding_idx)


def moe_experts_ref(x, index, weights, gate_up, down, gate_up_bias=None, down_bias=None, activation="silu",
                    layout="gate_up", transposed=False, alpha=1.702, limit=7.0):
    """HF's expert loop (MixtralExperts / GptOssExperts eager), every option: x [T, H], index and
    weights [T, K] (index E: no expert), gate_up [E, 2I, H] and down [E, H, I] ([E, H, 2I] and
    [E, I, H] when transposed), biases [E, 2I] and [E, H]. layout "gate_up": the halves of the
    projection, "interleaved": its even and odd columns. activation: a name of ACTIVATIONS, or
    "clamped_swiglu" (GPT-OSS: alpha, limit). In x's dtype: each expert's rows are rounded to it
    and added into a zero output."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        pos, tok = torch.where(index.T == e)
        if tok.numel() == 0:
            continue
        g_u = x[tok] @ (gate_up[e] if transposed else gate_up[e].T)
        if gate_up_bias is not None:
            g_u = g_u + gate_up_bias[e]
        g, u = (g_u[..., ::2], g_u[..., 1::2]) if layout == "interleaved" else g_u.chunk(2, dim=-1)
        if activation == "clamped_swiglu":
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = (u + 1) * (g * torch.sigmoid(g * alpha))
        else:
            h = ACTIVATIONS[activation](g) * u
        y = h @ (down[e] if transposed else down[e].T)
        if down_bias is not None:
            y = y + down_bias[e]
        out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
    return out


# ---- losses over rows of logits or distributions ----

def cross_entropy_ref(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                      lse_square_scale=0.0, softcap=None, zero_when_all_ignored=True):
    """torch's cross_entropy on the (soft-capped) logits in the wide dtype, plus the z-loss
    (lse_square_scale * logsumexp^2 over the kept rows). logits [N, V] (or torch's other
    layouts), target [N]; the loss in the wide dtype ([N] for reduction "none").

    zero_when_all_ignored: a mean over no kept row is 0 (tigon's), not torch's NaN; checking it
    syncs with the host, so False keeps torch's (HF's loss, the benchmark's eager baseline)."""
    z = wide(logits)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    w = None if weight is None else weight.to(z.dtype)
    loss = F.cross_entropy(z, target, weight=w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if zero_when_all_ignored and reduction == "mean" and not (target != ignore_index).any():
        loss = (z * 0).sum()
    if lse_square_scale:
        valid = target != ignore_index
        zl = lse_square_scale * torch.logsumexp(z, -1).pow(2) * valid
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / valid.sum().clamp_min(1)}[reduction]
    return loss


def fused_linear_cross_entropy_ref(x, head_weight, target, bias=None, **options):
    """cross_entropy_ref(x @ head_weight.T + bias, target, **options): x [N, H], head_weight [V, H]
    (options' ``weight`` is cross entropy's class weights), bias [V] or None; the logits in x's
    dtype (head_weight and bias cast to it)."""
    logits = x @ head_weight.t().to(x.dtype)
    if bias is not None:
        logits = logits + bias.to(x.dtype)
    return cross_entropy_ref(logits, target, **options)


def token_logps_ref(x, weight, target, bias=None, ignore_index=-100, upcast=True):
    """log_softmax(x @ weight.T + bias)[target] per token, 0 where target is ignore_index: x [..., H],
    weight [V, H], target [...]; the logits in x's dtype, the log-probabilities in the wide one
    (upcast=False: in x's dtype too)."""
    logits = x @ weight.t().to(x.dtype)
    if bias is not None:
        logits = logits + bias.to(x.dtype)
    mask = target != ignore_index
    logps = _caster(upcast)(logits).log_softmax(-1)
    return torch.gather(logps, -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1) * mask


def _jsd_of_logprobs(s, t, beta):
    """TRL's / Liger's generalised JSD per row of log-probabilities s (student), t (teacher):
    beta 0 is KL(T || S), beta 1 KL(S || T), between them the beta-mixture's JSD."""
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack((s + math.log(1 - beta), t + math.log(beta))), 0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def _mean_over_kept_rows(rows_of, s, t, target, ignore_index):
    """rows_of(s, t) averaged over the rows whose target is not ignore_index (all rows without a
    target; 0 when none is kept). The ignored rows are never read."""
    if target is None:
        return rows_of(s, t).mean()
    keep = target != ignore_index
    return rows_of(s[keep], t[keep]).sum() / keep.sum().clamp_min(1)


def jsd_ref(student_logprobs, teacher_logprobs, target=None, beta=0.5, ignore_index=-100):
    """tigon.functional.jsd (Liger's LigerJSD): the generalised JSD of log-probability rows
    [..., V], averaged over the kept rows (target [...] or None); in the wide dtype."""
    s = wide(student_logprobs)
    return _mean_over_kept_rows(lambda s, t: _jsd_of_logprobs(s, t, beta), s, teacher_logprobs.to(s.dtype), target,
                                ignore_index)


def jsd_rows_ref(student_logits, teacher_logits, beta=0.5, temperature=1.0):
    """The generalised JSD per row of logits [..., V] (log_softmax of logits / temperature), in
    the logits' dtype (no upcast)."""
    return _jsd_of_logprobs(torch.log_softmax(student_logits / temperature, -1),
                            torch.log_softmax(teacher_logits / temperature, -1), beta)


def jsd_loss_ref(student_logits, teacher_logits, target=None, beta=0.5, temperature=1.0, ignore_index=-100):
    """tigon.losses.jsd_loss (TRL's GKD): jsd_rows_ref averaged over the kept rows."""
    return _mean_over_kept_rows(lambda s, t: jsd_rows_ref(s, t, beta, temperature), student_logits, teacher_logits,
                                target, ignore_index)


def linear_jsd_ref(x, weight, teacher_x, teacher_weight, bias=None, beta=0.5, temperature=1.0):
    """tigon.functional.linear_jsd: jsd_rows_ref of the student's logits x @ weight.T + bias and
    the teacher's teacher_x @ teacher_weight.T (rounded to the student's dtype), per row [N], in
    the wide dtype."""
    s = x @ weight.t()
    if bias is not None:
        s = s + bias
    t = (teacher_x @ teacher_weight.t()).to(s.dtype)
    return jsd_rows_ref(wide(s), wide(t), beta, temperature)


def kl_div_ref(x, target, reduction="batchmean", log_target=False, upcast=True):
    """torch's kl_div (x: log-probabilities, target: probabilities or log ones), [..., V]. upcast:
    computed in the wide dtypes, a reduced loss left in it (tigon's), "none" in the inputs'
    promoted dtype; upcast=False: torch's kl_div on the inputs as they are (the benchmark's)."""
    cast = _caster(upcast)
    # torch warns that "mean" is not KL's mean; torch.compile cannot trace warnings.simplefilter.
    with _silenced() if reduction == "mean" else contextlib.nullcontext():
        loss = F.kl_div(cast(x), cast(target), reduction=reduction, log_target=log_target)
    return loss.to(torch.promote_types(x.dtype, target.dtype)) if reduction == "none" else loss


@contextlib.contextmanager
def _silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def tvd_ref(p, q, labels=None, reduction="batchmean", ignore_index=-100, upcast=True):
    """Liger's TVD loss: 0.5 |p - q| over probability rows [..., V], rows whose label is
    ignore_index zeroed and left out of the row count; "batchmean" divides by the kept rows,
    "mean" by their elements. upcast: computed in the wide dtype, a reduced loss left in it,
    "none" in the promoted dtype of p and q; upcast=False: in that promoted dtype throughout."""
    promoted = torch.promote_types(p.dtype, q.dtype)
    work = torch.promote_types(promoted, torch.float32) if upcast else promoted
    d = (p.to(work) - q.to(work)).abs()
    v = p.shape[-1]
    if labels is None:
        kept = d.numel() // max(v, 1)
    else:
        keep = (labels != ignore_index).reshape(d.shape[:-1])
        d = torch.where(keep[..., None], d, 0.0)
        kept = keep.sum().to(d.dtype).clamp_min(1)
    if reduction == "none":
        return (0.5 * d).to(promoted)
    total = 0.5 * d.sum()
    return {"sum": total, "batchmean": total / kept, "mean": total / (kept * v)}[reduction]


# ---- preference losses over the full logits (TRL's formulas) ----

def sequence_logps_ref(x, weight, target, bias=None, average=False, ignore_index=-100):
    """(per-sequence log-probability [B] (summed, or averaged over the kept tokens), per-token
    ones [B, T] (0 where ignored), the kept-token mask [B, T]); x [B, T, H], target [B, T]; all
    in x's dtype (no upcast)."""
    lp = token_logps_ref(x, weight, target, bias, ignore_index, upcast=False)
    mask = target != ignore_index
    out = lp.sum(-1)
    return (out / mask.sum(-1) if average else out), lp, mask


def chosen_nll_ref(x, weight, target, bias=None):
    """The NLL of the chosen half (the first half of the batch), averaged over its kept tokens."""
    n = x.shape[0] // 2
    _, lp, mask = sequence_logps_ref(x[:n], weight, target[:n], bias)
    return -lp.sum() / mask.sum()


def dpo_pair_losses_ref(chosen, rejected, ref_chosen, ref_rejected, loss_type="sigmoid", beta=0.1,
                        label_smoothing=0.0, discopop_tau=0.05):
    """Per-pair losses [P] of TRL 1.16's DPOTrainer._compute_loss (reverse KL), from the policy's
    and the reference's sequence log-probabilities [P] (the reference's may be 0.0: reference
    free). "aot_pair" is TRL's "aot_unpaired"; the aot ones sort over the whole batch."""
    ls = label_smoothing
    cr, rr = chosen - ref_chosen, rejected - ref_rejected
    d = cr - rr
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
    if loss_type == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * d) + ls * F.logsigmoid(-beta * d)) / (1 - 2 * ls)
    if loss_type == "exo_pair":
        eps = torch.tensor(ls, dtype=d.dtype)
        qw, ql = torch.sigmoid(beta * d), torch.sigmoid(-beta * d)
        return qw * (F.logsigmoid(beta * d) - torch.log1p(-eps)) + ql * (F.logsigmoid(-beta * d) - torch.log(eps))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * cr) - 0.5 * F.logsigmoid(-beta * cr) - 0.5 * F.logsigmoid(-beta * rr)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * cr) - F.logsigmoid(-beta * rr)
    if loss_type == "sppo_hard":
        return (cr - 0.5 / beta) ** 2 + (rr + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_pair"):
        if loss_type == "aot":
            delta = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_chosen - ref_rejected, dim=0)[0]
        else:
            delta = torch.sort(cr, dim=0)[0] - torch.sort(rr, dim=0)[0]
        return -F.logsigmoid(beta * delta) * (1 - ls) - F.logsigmoid(-beta * delta) * ls
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * cr) + torch.sigmoid(beta * rr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * cr) + 1 - torch.sigmoid(beta * (cr - rr))
    if loss_type != "discopop":
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    z = d * beta
    mix = torch.sigmoid(z / discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def dpo_ref(x, weight, target, ref_chosen, ref_rejected, bias=None, beta=0.1, loss_type="sigmoid",
            label_smoothing=0.0, discopop_tau=0.05, average=False, nll=False):
    """DPO: the mean of dpo_pair_losses_ref over the pairs (sequence log-probabilities averaged
    over their tokens when ``average``), plus chosen_nll_ref when ``nll``."""
    logps, _, _ = sequence_logps_ref(x, weight, target, bias, average)
    n = x.shape[0] // 2
    losses = dpo_pair_losses_ref(logps[:n], logps[n:], ref_chosen, ref_rejected, loss_type, beta, label_smoothing,
                                 discopop_tau)
    return losses.mean() + (chosen_nll_ref(x, weight, target, bias) if nll else 0)


def kto_ref(x, weight, target, labels, bias=None, ref_logps=None, beta=0.1, desirable_weight=1.0,
            undesirable_weight=1.0, kl=0.0):
    """KTO over sequences [B] (labels: True for desirable ones), with the reference's sequence
    log-probabilities ref_logps [B] (None: reference free) and the KL estimate kl."""
    logps = sequence_logps_ref(x, weight, target, bias)[0]
    ratio = logps - (ref_logps.to(x.dtype) if ref_logps is not None else 0)
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(labels, chosen, rejected).mean()
