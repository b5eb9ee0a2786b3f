"""GRPO-family losses against a float64 reference written from TRL's formulas over the full
logits, and that reference against TRL's own ``GRPOTrainer._compute_loss`` (when TRL is
installed): loss, gradients of x, weight and bias, and TRL's logged metrics."""

import types
from collections import defaultdict

import pytest
import torch

from tests.helpers import DEVICE, pick, randn, rel_err
from tigon.losses import TigonGRPOLoss, grpo_loss, per_token_logps

# (sequences, completion tokens, hidden, vocab); 5 sequences -> uneven chunks at chunk_sequences=2
SHAPE = pick(cpu=(5, 7, 16, 37), gpu=(8, 512, 1024, 32000))
LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "gspo"]


def make(B, T, H, V, bias=True, dtype=torch.float32, seed=0):
    """Inputs as GRPO sees them: ragged completions (one empty), advantages of both signs, and
    old / reference log-probs a little off the policy's, so that the clipping is exercised."""
    torch.manual_seed(seed)
    x = randn((B, T, H), dtype, requires_grad=True)
    w = randn((V, H), dtype, scale=H**-0.5 * 2, requires_grad=True)
    b = randn((V,), dtype, scale=0.3, requires_grad=True) if bias else None
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    lengths = torch.tensor([T, T - 2, 1, 0, T - 3][:B] + [T] * max(0, B - 5), device=DEVICE)
    mask = (torch.arange(T, device=DEVICE) < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, 0)  # the pad token on padding
    adv = randn((B,), torch.float32)
    with torch.no_grad():
        lp = reference_logps(x.double(), w.double(), None if b is None else b.double(), ids, 1.0).float()
    old = lp + 0.3 * randn((B, T), torch.float32)
    ref = lp + 0.2 * randn((B, T), torch.float32)
    return x, w, b, ids, mask, adv, old, ref


def reference_logps(x, w, b, ids, temperature):
    logits = (x @ w.t() + (b if b is not None else 0)) / temperature
    return torch.gather(logits.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)


def reference_entropy(x, w, b, temperature):
    logp = ((x @ w.t() + (b if b is not None else 0)) / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def reference_grpo(x, w, b, ids, mask, adv, *, old=None, ref=None, beta=0.04, eps_low=0.2, eps_high=0.2, delta=None,
                   loss_type="dapo", level="token", max_len=None, temperature=1.0, is_ratio=None, items=None,
                   bias_kl=False, tau_pos=1.0, tau_neg=1.05):
    """TRL 1.16's GRPOTrainer._compute_loss, written out (float64 in, float64 out)."""
    lp = reference_logps(x, w, b, ids, temperature)
    m = mask.to(lp.dtype)
    a = adv.to(lp.dtype)
    a = a.unsqueeze(1) if a.dim() == 1 else a
    old = lp.detach() if old is None else old.to(lp.dtype)
    if loss_type == "gspo":
        loss_type, level = "grpo", "sequence"
    log_ratio = lp - old
    log_w = log_ratio if level == "token" else ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        r = ref.to(lp.dtype)
        kl = torch.exp(r - lp) - (r - lp) - 1
        if bias_kl:
            kl = kl * coef_1
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
    elif loss_type == "sapo":
        tau = torch.where(a > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * a
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        c1 = torch.clamp(coef_1, max=delta) if delta is not None else coef_1
        per_token = -torch.min(c1 * a, coef_2 * a)
    if is_ratio is not None:
        per_token = per_token * is_ratio.to(lp.dtype)
    if beta != 0.0:
        per_token = per_token + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * (max_len or x.shape[1]))
    normalizer = m.sum() if items is None else torch.as_tensor(float(items), dtype=lp.dtype)
    return (per_token * m).sum() / normalizer.clamp(min=1.0)


def trl_grpo(x, w, b, ids, mask, adv, *, old=None, ref=None, beta=0.04, eps_low=0.2, eps_high=0.2, delta=None,
             loss_type="dapo", level="token", max_len=None, temperature=1.0, is_ratio=None, items=None,
             bias_kl=False, tau_pos=1.0, tau_neg=1.05):
    """(loss, logged metrics) of TRL's own GRPOTrainer._compute_loss on a stand-in trainer whose
    policy log-probs are reference_logps of (x, w, b)."""
    trl = pytest.importorskip("trl")
    if loss_type == "gspo":
        loss_type, level = "grpo", "sequence"

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        return reference_logps(x, w, b, ids, temperature), reference_entropy(x, w, b, temperature), None

    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, max_completion_length=max_len or x.shape[1],
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, sapo_temperature_pos=tau_pos,
                                   sapo_temperature_neg=tau_neg, steps_per_generation=1),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True, model=types.SimpleNamespace(
            training=True), current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t,
                                          gather_for_metrics=lambda t: t))
    inputs = dict(prompt_ids=ids[:, :0], prompt_mask=mask[:, :0], completion_ids=ids, completion_mask=mask,
                  advantages=adv.double(), old_per_token_logps=None if old is None else old.double(),
                  ref_per_token_logps=None if ref is None else ref.double(),
                  importance_sampling_ratio=None if is_ratio is None else is_ratio.double(),
                  num_items_in_batch=torch.tensor(float(mask.sum() if items is None else items), dtype=torch.float64))
    loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


OPTIONS = {  # case -> (grpo_loss keywords, the reference's)
    "defaults": ({}, {}),
    "no KL": (dict(beta=0.0), dict(beta=0.0)),
    "asymmetric clip, delta": (dict(epsilon_low=0.1, epsilon_high=0.28, delta=1.5),
                               dict(eps_low=0.1, eps_high=0.28, delta=1.5)),
    "temperature, bias-corrected KL": (dict(temperature=0.7, use_bias_correction_kl=True),
                                       dict(temperature=0.7, bias_kl=True)),
    "sequence level": (dict(importance_sampling_level="sequence"), dict(level="sequence")),
    "on-policy (no old log-probs)": ({"old": None}, {"old": None}),
}


def run_ours(x, w, b, ids, mask, adv, old, ref, opts, loss_type, **extra):
    kw = dict(opts)
    old_lp = kw.pop("old", old)
    return grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old_lp,
                     loss_type=loss_type, **kw, **extra)


def run_reference(x, w, b, ids, mask, adv, old, ref, opts, loss_type, fn=reference_grpo, **extra):
    kw = dict(opts)
    old_lp = kw.pop("old", old)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    out = fn(x64, w64, b64, ids, mask, adv, old=old_lp, ref=ref, loss_type=loss_type, **kw, **extra)
    loss = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(loss, [t for t in (x64, w64, b64) if t is not None])
    return out, grads


def assert_close_grads(ours, ref, tol, what):
    for name, g, r in zip(("x", "weight", "bias"), ours, ref):
        err = rel_err(g, r)
        assert err < tol, f"{what}: {name} gradient off by {err:.2e}"


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_matches_trl_formulas(loss_type, options):
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    opts, ref_opts = OPTIONS[options]
    if loss_type == "gspo" and "importance_sampling_level" in opts:
        opts = {k: v for k, v in opts.items() if k != "importance_sampling_level"}
    loss, metrics = run_ours(x, w, b, ids, mask, adv, old, ref, opts, loss_type, chunk_sequences=2)
    grads = torch.autograd.grad(loss, [x, w, b])
    ref_loss, ref_grads = run_reference(x, w, b, ids, mask, adv, old, ref, ref_opts, loss_type)
    what = f"{loss_type}, {options}"
    assert rel_err(loss, ref_loss) < 1e-5, (what, loss.item(), ref_loss.item())
    assert_close_grads(grads, ref_grads, 1e-4, what)
    with torch.no_grad():
        lp = reference_logps(x.double(), w.double(), b.double(), ids, ref_opts.get("temperature", 1.0))
    assert rel_err(metrics["per_token_logps"], lp * mask) < 1e-5


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_is_trls_own_loss(loss_type, options):
    """The float64 reference above against TRL's GRPOTrainer._compute_loss: loss, gradients and
    the metrics TRL logs, which tigon's metrics must equal."""
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    opts, ref_opts = OPTIONS[options]
    if loss_type == "gspo":
        opts = {k: v for k, v in opts.items() if k != "importance_sampling_level"}
    (trl_loss, trl_metrics), trl_grads = run_reference(x, w, b, ids, mask, adv, old, ref, ref_opts, loss_type,
                                                       fn=trl_grpo)
    ref_loss, ref_grads = run_reference(x, w, b, ids, mask, adv, old, ref, ref_opts, loss_type)
    assert rel_err(ref_loss, trl_loss) < 1e-12
    assert_close_grads(ref_grads, trl_grads, 1e-12, f"{loss_type}, {options}: reference vs TRL")
    _, metrics = run_ours(x, w, b, ids, mask, adv, old, ref, opts, loss_type, compute_entropy=True)
    assert set(trl_metrics) | {"per_token_logps"} == set(metrics), (sorted(trl_metrics), sorted(metrics))
    for k, v in trl_metrics.items():
        assert abs(float(metrics[k]) - v) < 1e-5 * max(1.0, abs(v)), (k, float(metrics[k]), v)


def test_grpo_with_reference_model_importance_ratio_and_token_advantages():
    """The KL reference from the reference model's hidden states and head, a vLLM importance
    ratio, per-token advantages, dapo's normaliser given."""
    B, T, H, V = SHAPE
    x, w, b, ids, mask, adv, old, _ = make(*SHAPE)
    ref_x, ref_w = randn((B, T, H + 3), torch.float32), randn((V, H + 3), torch.float32, scale=0.3)
    ref_b = randn((V,), torch.float32, scale=0.1)
    adv_t = randn((B, T), torch.float32)
    is_ratio = torch.rand(B, T, device=DEVICE) * 1.5 + 0.2
    loss, metrics = grpo_loss(x, w, ids, mask, adv_t, b, old_per_token_logps=old, ref_x=ref_x, ref_weight=ref_w,
                              ref_bias=ref_b, importance_sampling_ratio=is_ratio, num_items_in_batch=40,
                              temperature=0.9, chunk_sequences=3)
    grads = torch.autograd.grad(loss, [x, w, b])
    with torch.no_grad():
        ref_lp = reference_logps(ref_x.double(), ref_w.double(), ref_b.double(), ids, 0.9)
    ref_loss, ref_grads = run_reference(x, w, b, ids, mask, adv_t, old, ref_lp, dict(temperature=0.9), "dapo",
                                        is_ratio=is_ratio, items=40)
    assert rel_err(loss, ref_loss) < 1e-5
    assert_close_grads(grads, ref_grads, 1e-4, "reference model")
    try:  # TRL's own loss, when installed
        import trl  # noqa: F401
    except ImportError:
        return
    (trl_loss, trl_metrics), _ = run_reference(x, w, b, ids, mask, adv_t, old, ref_lp, dict(temperature=0.9), "dapo",
                                               fn=trl_grpo, is_ratio=is_ratio, items=40)
    assert rel_err(loss, trl_loss) < 1e-5
    assert abs(float(metrics["kl"]) - trl_metrics["kl"]) < 1e-5 * max(1.0, abs(trl_metrics["kl"]))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_grpo_bf16(loss_type):
    """bf16 inputs against float64. With the clip out of reach: within 2e-2 (loss) and 3e-2
    (gradients). With clip 0.2, a token whose ratio lies within bf16's log-prob rounding of a
    bound is clipped on one side and not on the other (3.5e-2 at T 512 from that alone), so
    there the check is against torch computing the same in bf16: tigon no worse."""
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE, dtype=torch.bfloat16)
    for clip in ({"epsilon_low": 0.99, "epsilon_high": 1e6}, {}):
        loss, _ = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old,
                            loss_type=loss_type, **clip)
        grads = torch.autograd.grad(loss, [x, w, b])
        ref_opts = {"eps_low": 0.99, "eps_high": 1e6} if clip else {}
        ref_loss, ref_grads = run_reference(x, w, b, ids, mask, adv, old, ref, ref_opts, loss_type)
        if clip:
            assert rel_err(loss, ref_loss) < 2e-2
            assert_close_grads(grads, ref_grads, 3e-2, f"bf16 {loss_type}")
            continue
        eager = reference_grpo(x, w, b, ids, mask, adv, old=old, ref=ref, loss_type=loss_type)
        eager_grads = torch.autograd.grad(eager, [x, w, b])
        assert rel_err(loss, ref_loss) <= max(2e-2, rel_err(eager, ref_loss))
        for name, g, e, r in zip(("x", "weight", "bias"), grads, eager_grads, ref_grads):
            assert rel_err(g, r) <= max(3e-2, rel_err(e, r)), f"bf16 {loss_type} clipped: {name} gradient"


def test_empty_completions_give_zero_loss_and_gradients():
    x, w, b, ids, _, adv, old, ref = make(*SHAPE)
    mask = torch.zeros_like(ids)
    for loss_type in LOSS_TYPES:
        loss, metrics = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old,
                                  loss_type=loss_type)
        grads = torch.autograd.grad(loss, [x, w, b])
        assert loss.item() == 0.0, loss_type
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), loss_type
        assert all(torch.isfinite(v).all() or k.endswith(("_min", "_max")) for k, v in metrics.items()), metrics


def test_second_backward_and_scaled_loss():
    """A retained graph's second backward gives the same gradients; a scaled loss (gradient
    accumulation) scales them."""
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    loss, _ = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old, loss_type="grpo")
    (loss * 0.25).backward(retain_graph=True)
    first = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    loss.backward()
    for f, t in zip(first, (x, w, b)):
        torch.testing.assert_close(f * 4, t.grad, rtol=1e-6, atol=1e-8)


def test_module_and_per_token_logps(monkeypatch):
    from tigon.losses import policy

    monkeypatch.setattr(policy, "ENTROPY_ROWS", 4)  # the entropy pass in several token slices
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    module = TigonGRPOLoss(beta=0.0, loss_type="bnpo", epsilon_high=0.28)
    assert "epsilon_high=0.28" in repr(module)
    loss, _ = module(x, w, ids, mask, adv, b, old_per_token_logps=old)
    ref_loss = reference_grpo(x.double(), w.double(), b.double(), ids, mask, adv, old=old, beta=0.0, eps_high=0.28,
                              loss_type="bnpo")
    assert rel_err(loss, ref_loss) < 1e-5
    lp, entropy = per_token_logps(x, w, ids, mask, b, temperature=0.8, compute_entropy=True, chunk_sequences=2)
    assert not lp.requires_grad
    with torch.no_grad():
        want = reference_logps(x.double(), w.double(), b.double(), ids, 0.8) * mask
        want_entropy = reference_entropy(x.double(), w.double(), b.double(), 0.8) * mask
    assert rel_err(lp, want) < 1e-5 and rel_err(entropy, want_entropy) < 1e-5


def test_nan_advantages_and_bad_arguments_raise():
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    bad = adv.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="advantages hold 1 non-finite"):
        grpo_loss(x, w, ids, mask, bad, b, ref_per_token_logps=ref)
    cases = [
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level must be"),
        (dict(loss_type="gspo", importance_sampling_level="token"), "gspo"),
        (dict(epsilon_low=-0.1), "epsilon_low must be"),
        (dict(temperature=0), "temperature must be"),
        (dict(delta=0), "delta"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(num_items_in_batch=10, loss_type="grpo"), "num_items_in_batch"),
        (dict(ref_per_token_logps=None), "beta > 0 needs the reference"),
        (dict(ref_per_token_logps=ref[:, :-1]), "ref_per_token_logps must be"),
        (dict(importance_sampling_ratio=ref[:, :1].T), "importance_sampling_ratio must be"),
        (dict(ref_x=x.detach()), "ref_x needs ref_weight"),
    ]
    for kw, message in cases:
        call = dict(ref_per_token_logps=ref, **kw) if "ref_per_token_logps" not in kw else kw
        with pytest.raises(ValueError, match=message):
            grpo_loss(x, w, ids, mask, adv, b, **call)
    with pytest.raises(ValueError, match="attention_mask must be"):
        grpo_loss(x, w, ids, mask[:, :-1], adv, b, ref_per_token_logps=ref)
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(x, w, ids, mask, adv[:-1], b, ref_per_token_logps=ref)
    with pytest.raises(ValueError, match="selected_token_ids must be integer"):
        grpo_loss(x, w, ids.float(), mask, adv, b, ref_per_token_logps=ref)
    with pytest.raises(ValueError, match="x must be"):
        grpo_loss(x[0], w, ids, mask, adv, b, ref_per_token_logps=ref)


def test_grpo_under_autocast_runs_the_head_in_autocast_dtype():
    """Under autocast (bf16), the head's matmuls run in bf16 as F.linear's would: the loss equals
    grpo_loss on bf16 copies, and the fp32 leaves get fp32 gradients."""
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss, _ = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old)
    grads = torch.autograd.grad(loss, [x, w, b])
    assert all(g.dtype == torch.float32 for g in grads)
    low = [t.detach().bfloat16().requires_grad_() for t in (x, w, b)]
    want, _ = grpo_loss(*low[:2], ids, mask, adv, low[2], ref_per_token_logps=ref, old_per_token_logps=old)
    assert rel_err(loss, want) < 1e-6
    fp32, _ = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old)
    assert rel_err(loss, fp32) > 1e-6  # the autocast run really was in bf16


@pytest.mark.parametrize("loss_type, rows", [("dapo", "tokens"), ("gspo", "sequences")])
def test_head_runs_on_completion_tokens_only(monkeypatch, loss_type, rows):
    """Token-level importance sampling: the head's log-prob kernel sees the completion tokens
    only (no padding row), in chunks that may cut across sequences; sequence-level (gspo) walks
    whole sequences. Same loss and gradients as the float64 reference either way."""
    from tigon.losses import policy

    seen = []

    def spy(x, weight, target, bias=None, ignore_index=-100):
        seen.append(target.numel())
        return linear_token_logps(x, weight, target, bias, ignore_index)

    from tigon.functional import linear_token_logps
    monkeypatch.setattr(policy, "linear_token_logps", spy)
    x, w, b, ids, mask, adv, old, ref = make(*SHAPE)
    B, T = ids.shape
    loss, _ = grpo_loss(x, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old,
                        loss_type=loss_type, chunk_sequences=2)
    assert sum(seen) == (int(mask.sum()) if rows == "tokens" else B * T), seen
    assert len(seen) == -(-sum(seen) // (2 * T if rows == "tokens" else 2 * T)), seen
    want = reference_grpo(x.double(), w.double(), b.double(), ids, mask, adv, old=old, ref=ref, loss_type=loss_type)
    assert rel_err(loss, want) < 1e-5
    grads = torch.autograd.grad(loss, [x, w, b])
    wants = torch.autograd.grad(want, [x, w, b])
    assert all(rel_err(g, r) < 1e-4 for g, r in zip(grads, wants))
    seen.clear()  # the no-gradient pass (old policy, reference) always takes the completion tokens
    lp = per_token_logps(x, w, ids, mask, b, chunk_sequences=2)
    assert sum(seen) == int(mask.sum()) and len(seen) == -(-sum(seen) // (2 * T)), seen
    with torch.no_grad():
        assert rel_err(lp, reference_logps(x.double(), w.double(), b.double(), ids, 1.0) * mask) < 1e-5
