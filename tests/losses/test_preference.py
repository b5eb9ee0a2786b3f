"""Chunked preference losses against plain-torch references over the full logits (TRL's formulas)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEVICE, check_op, pick, randn
from tigon.losses import (
    TigonDPOLoss,
    TigonORPOLoss,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from tigon.reference import chosen_nll_ref, dpo_pair_losses_ref, dpo_ref, kto_ref, sequence_logps_ref

# (pairs, tokens, hidden, vocab): 3 pairs -> uneven chunks at chunk_pairs=2
SHAPE = pick(cpu=(3, 7, 16, 37), gpu=(4, 256, 512, 32000))


def make(pairs, tokens, hidden, vocab, bias=False, dtype=torch.float32):
    x = randn((2 * pairs, tokens, hidden), dtype, requires_grad=True)
    w = randn((vocab, hidden), dtype, scale=hidden**-0.5 * 2, requires_grad=True)
    b = randn((vocab,), dtype, scale=0.3, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (2 * pairs, tokens), device=DEVICE)
    target[:, : tokens // 3] = -100  # prompt
    target[1, -2:] = -100  # padding on one sequence
    return x, w, b, target


def run(fn, ref, x, w, b, what):
    inputs = [x, w] + ([b] if b is not None else [])
    check_op(lambda x, w, *b: fn(x, w, b[0] if b else None)[0], lambda x, w, *b: ref(x, w, b[0] if b else None),
             inputs, dtype=torch.float32, tol=1e-4, what=what, worse_than_eager=4.0, noise_floor=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("reference", ["precomputed", "model", "free"])
@pytest.mark.parametrize("chunk_pairs", [1, 2])
def test_dpo_matches_reference(loss_type, reference, chunk_pairs):
    x, w, b, target = make(*SHAPE, bias=reference == "model")
    pairs, average, beta, ls = SHAPE[0], loss_type == "ipo", 0.2, 0.1 if loss_type == "sigmoid" else 0.0
    kw = {}
    if reference == "precomputed":
        kw = dict(ref_chosen_logps=randn((pairs,), torch.float32) - 5,
                  ref_rejected_logps=randn((pairs,), torch.float32) - 5)
        ref_c, ref_r = kw["ref_chosen_logps"], kw["ref_rejected_logps"]
    elif reference == "model":
        ref_x, ref_w = randn(tuple(x.shape), torch.float32), randn(tuple(w.shape), torch.float32, scale=0.3)
        kw = dict(ref_x=ref_x, ref_weight=ref_w)
        with torch.no_grad():
            lp, _, _ = sequence_logps_ref(ref_x.double(), ref_w.double(), target, average=average)
        ref_c, ref_r = lp[:pairs], lp[pairs:]
    else:
        ref_c = ref_r = 0.0

    def rc(t):
        return ref_c.to(t.dtype) if torch.is_tensor(ref_c) else ref_c

    def rr(t):
        return ref_r.to(t.dtype) if torch.is_tensor(ref_r) else ref_r

    run(lambda x, w, b: dpo_loss(x, w, target, b, beta=beta, loss_type=loss_type, label_smoothing=ls,
                                 chunk_pairs=chunk_pairs, **kw),
        lambda x, w, b: dpo_ref(x, w, target, rc(x), rr(x), b, beta=beta, loss_type=loss_type, label_smoothing=ls,
                                average=average),
        x, w, b, f"dpo[{loss_type}, {reference}, chunks of {chunk_pairs}]")


@pytest.mark.parametrize("loss_type", ["robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_pair",
                                       "apo_zero", "apo_down", "discopop"])
@pytest.mark.parametrize("reference", ["precomputed", "model"])
@pytest.mark.parametrize("chunk_pairs", [1, 2])
def test_dpo_trl_loss_types(loss_type, reference, chunk_pairs):
    """TRL 1.16's further DPO loss types; the aot ones sort over the whole batch, also when the
    batch is walked in chunks."""
    x, w, b, target = make(*SHAPE, bias=True)
    pairs, beta, ls, tau = SHAPE[0], 0.2, 0.05 if loss_type in ("robust", "exo_pair", "aot", "aot_pair") else 0.0, 0.1
    if reference == "precomputed":
        ref_c, ref_r = randn((pairs,), torch.float32) - 5, randn((pairs,), torch.float32) - 5
        kw = dict(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    else:
        ref_x, ref_w = randn(tuple(x.shape), torch.float32), randn(tuple(w.shape), torch.float32, scale=0.3)
        kw = dict(ref_x=ref_x, ref_weight=ref_w)
        with torch.no_grad():
            lp, _, _ = sequence_logps_ref(ref_x.double(), ref_w.double(), target)
        ref_c, ref_r = lp[:pairs], lp[pairs:]

    def reference_loss(x, w, b):
        logps, _, _ = sequence_logps_ref(x, w, target, b)
        return dpo_pair_losses_ref(logps[:pairs], logps[pairs:], ref_c.to(x.dtype), ref_r.to(x.dtype), loss_type, beta,
                                   ls, tau).mean()

    run(lambda x, w, b: dpo_loss(x, w, target, b, beta=beta, loss_type=loss_type, label_smoothing=ls,
                                 discopop_tau=tau, chunk_pairs=chunk_pairs, **kw),
        reference_loss, x, w, b, f"dpo[{loss_type}, {reference}, chunks of {chunk_pairs}]")
    loss, metrics = dpo_loss(x, w, target, b, beta=beta, loss_type=loss_type, label_smoothing=ls, discopop_tau=tau,
                             chunk_pairs=chunk_pairs, compute_nll_loss=True, **kw)
    with torch.no_grad():
        x64, w64, b64 = x.double(), w.double(), b.double()
        want = reference_loss(x64, w64, b64) + chosen_nll_ref(x64, w64, target, b64)
    assert abs(loss.item() - want.item()) < 1e-4 * max(1.0, abs(want.item())), (loss.item(), want.item())
    assert metrics["chosen_logps"].shape == (pairs,)


def test_dpo_with_nll_and_metrics():
    x, w, b, target = make(*SHAPE, bias=True)
    pairs = SHAPE[0]
    rc, rr = randn((pairs,), torch.float32) - 5, randn((pairs,), torch.float32) - 5
    run(lambda x, w, b: dpo_loss(x, w, target, b, beta=0.1, ref_chosen_logps=rc, ref_rejected_logps=rr,
                                 compute_nll_loss=True, chunk_pairs=2),
        lambda x, w, b: dpo_ref(x, w, target, rc.to(x.dtype), rr.to(x.dtype), b, beta=0.1, nll=True),
        x, w, b, "dpo + nll")
    loss, m = TigonDPOLoss(beta=0.1, compute_nll_loss=True)(x, w, target, b, ref_chosen_logps=rc, ref_rejected_logps=rr)
    logps, _, _ = sequence_logps_ref(x.double(), w.double(), target, b.double())
    assert torch.allclose(m["chosen_logps"].double(), logps[:pairs], rtol=1e-4)
    assert torch.allclose(m["rejected_rewards"].double(), 0.1 * (logps[pairs:] - rr.double()), rtol=1e-4, atol=1e-6)
    assert torch.allclose(m["nll_loss"].double(), chosen_nll_ref(x.double(), w.double(), target, b.double()), rtol=1e-4)
    full_logits = x.double() @ w.double().t() + b.double()
    assert torch.allclose(m["chosen_logits_mean"].double(), full_logits[:pairs].mean(), rtol=1e-4, atol=1e-6)


def test_orpo_matches_reference():
    x, w, b, target = make(*SHAPE)
    beta = 0.1

    def ref(x, w, b):
        logps, _, _ = sequence_logps_ref(x, w, target, b, True)
        n = x.shape[0] // 2
        c, r = logps[:n], logps[n:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return chosen_nll_ref(x, w, target, b) - beta * F.logsigmoid(log_odds).mean()

    run(lambda x, w, b: orpo_loss(x, w, target, b, beta=beta, chunk_pairs=2), ref, x, w, b, "orpo")


@pytest.mark.parametrize("which", ["cpo", "simpo"])
def test_cpo_and_simpo_match_reference(which):
    x, w, b, target = make(*SHAPE)
    beta, gamma, ls = (0.1, 0.0, 0.05) if which == "cpo" else (2.0, 0.5, 0.0)

    def ref(x, w, b):
        logps, _, _ = sequence_logps_ref(x, w, target, b, which == "simpo")
        n = x.shape[0] // 2
        z = beta * (logps[:n] - logps[n:]) - gamma
        losses = -F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls
        return losses.mean() + (chosen_nll_ref(x, w, target, b) if which == "cpo" else 0)

    fn = ((lambda x, w, b: cpo_loss(x, w, target, b, beta=beta, label_smoothing=ls)) if which == "cpo" else
          (lambda x, w, b: simpo_loss(x, w, target, b, beta=beta, gamma=gamma)))
    run(fn, ref, x, w, b, which)


def test_grad_output_scales_and_frozen_head():
    x, w, b, target = make(*SHAPE)
    loss, _ = dpo_loss(x, w.detach(), target, chunk_pairs=2)
    (loss * 3.0).backward()
    g3 = x.grad.clone()
    x.grad = None
    dpo_loss(x, w.detach(), target, chunk_pairs=3)[0].backward()
    assert torch.allclose(g3, 3.0 * x.grad, rtol=1e-5, atol=1e-7)


def test_bad_inputs_are_clear_errors():
    x, w, b, target = make(*SHAPE)
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(x[:-1], w, target[:-1])
    with pytest.raises(ValueError, match="ref_x has shape"):
        dpo_loss(x, w, target, ref_x=x[:, :-1].detach(), ref_weight=w.detach())
    with pytest.raises(ValueError, match="ref_chosen_logps must be"):
        dpo_loss(x, w, target, ref_chosen_logps=torch.zeros(SHAPE[0] + 1), ref_rejected_logps=torch.zeros(SHAPE[0]))
    with pytest.raises(ValueError, match="target has shape"):
        dpo_loss(x, w, target[:, :-1])
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, w, target, loss_type="kto")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\) \(exo_pair"):
        dpo_loss(x, w, target, loss_type="exo_pair")  # log(0): an infinite loss otherwise
    with pytest.raises(ValueError, match="label_smoothing must be"):
        dpo_loss(x, w, target, loss_type="robust", label_smoothing=0.5)  # divides by 1 - 2 ls
    with pytest.raises(ValueError, match="discopop_tau must be > 0"):
        dpo_loss(x, w, target, loss_type="discopop", discopop_tau=0.0)
    for bad in (0, -1, 1.5):  # were clamped to 1 (or truncated) without a word
        with pytest.raises(ValueError, match=f"chunk_pairs must be a positive int, got {bad}"):
            dpo_loss(x, w, target, chunk_pairs=bad)
        with pytest.raises(ValueError, match=f"chunk_rows must be a positive int, got {bad}"):
            kto_loss(x, w, target, torch.ones(x.shape[0], dtype=torch.bool, device=x.device), chunk_rows=bad)


@pytest.mark.parametrize("reference", ["precomputed", "model", "free"])
def test_kto_matches_reference(reference):
    pairs, tokens, hidden, vocab = SHAPE
    x, w, b, target = make(pairs, tokens, hidden, vocab, bias=True)
    n = x.shape[0]
    labels = torch.tensor([True, False, True, True, False, False][:n] + [True] * max(0, n - 6), device=DEVICE)
    beta, wd, wu, kl = 0.3, 1.0, 1.5, 0.05
    kw = {}
    if reference == "precomputed":
        kw = dict(ref_logps=randn((n,), torch.float32) - 8)
        ref_lp = kw["ref_logps"]
    elif reference == "model":
        ref_x, ref_w = randn(tuple(x.shape), torch.float32), randn(tuple(w.shape), torch.float32, scale=0.3)
        kw = dict(ref_x=ref_x, ref_weight=ref_w)
        with torch.no_grad():
            ref_lp = sequence_logps_ref(ref_x.double(), ref_w.double(), target)[0]
    else:
        ref_lp = None

    run(lambda x, w, b: kto_loss(x, w, target, labels, b, beta=beta, desirable_weight=wd, undesirable_weight=wu,
                                 kl=kl, chunk_rows=4, **kw),
        lambda x, w, b: kto_ref(x, w, target, labels, b, ref_lp, beta, wd, wu, kl), x, w, b, f"kto[{reference}]")
    with pytest.raises(ValueError, match="preference_labels"):
        kto_loss(x, w, target, labels.float())


@pytest.mark.exhaustive  # Inductor's C++ build on the CPU (~25 s); tests/losses/test_compile.py traces the losses
def test_compiled_path_matches_uncompiled():
    """torch.compile(grad_and_value(chunk), dynamic=True) gives the eager results (to rounding)."""
    x, w, b, target = make(*SHAPE, bias=True)
    eager, m_eager = dpo_loss(x, w, target, b, chunk_pairs=2)
    eager.backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    compiled, m_compiled = dpo_loss(x, w, target, b, chunk_pairs=2, compiled=True)
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-7)
    for g, t in zip(grads, (x, w, b)):
        assert torch.allclose(t.grad, g, rtol=1e-4, atol=1e-6)
    assert torch.allclose(m_compiled["chosen_logps"], m_eager["chosen_logps"], rtol=1e-5, atol=1e-6)


def test_dpo_bf16_and_non_contiguous_hidden_states():
    """bf16 hidden states and head, x a strided view (as x[:, :-1] of a longer sequence)."""
    pairs, tokens, hidden, vocab = SHAPE
    base = randn((2 * pairs, tokens + 1, hidden), torch.bfloat16, requires_grad=True)
    w = randn((vocab, hidden), torch.bfloat16, scale=hidden**-0.5 * 2, requires_grad=True)
    target = torch.randint(0, vocab, (2 * pairs, tokens), device=DEVICE)
    target[:, :2] = -100
    rc, rr = randn((pairs,), torch.float32) - 5, randn((pairs,), torch.float32) - 5
    # The loss is fp32 whatever the inputs (as tigon's other losses); cast to compare with eager bf16.
    check_op(lambda base, w: dpo_loss(base[:, :-1], w, target, ref_chosen_logps=rc, ref_rejected_logps=rr,
                                      chunk_pairs=2)[0].to(base.dtype),
             lambda base, w: dpo_ref(base[:, :-1], w, target, rc.to(base.dtype), rr.to(base.dtype), beta=0.1),
             [base, w], dtype=torch.bfloat16, tol=3e-2, what="dpo bf16 strided", worse_than_eager=4.0,
             noise_floor=2e-2)


@pytest.mark.parametrize("clamp_kl", [None, True, False])
@pytest.mark.parametrize("kl", [0.3, -0.4])
def test_kto_kl_clamping(clamp_kl, kl):
    """TRL 1.16's KTOTrainer clamps the batch KL estimate at 0 (tigon's default, clamp_kl=True);
    clamp_kl=False takes it as given, as Liger's chunked KTO loss does."""
    pairs, tokens, hidden, vocab = SHAPE
    x, w, b, target = make(pairs, tokens, hidden, vocab, bias=True)
    n = x.shape[0]
    labels = torch.arange(n, device=DEVICE) % 3 != 1
    ref_lp = randn((n,), torch.float32) - 8
    used_kl = max(kl, 0.0) if clamp_kl in (None, True) else kl
    kw = {} if clamp_kl is None else dict(clamp_kl=clamp_kl)
    kl_arg = torch.tensor(kl, device=DEVICE) if clamp_kl is False else kl
    run(lambda x, w, b: kto_loss(x, w, target, labels, b, beta=0.5, kl=kl_arg, ref_logps=ref_lp, chunk_rows=4, **kw),
        lambda x, w, b: kto_ref(x, w, target, labels, b, ref_lp, 0.5, 1.0, 1.0, used_kl), x, w, b,
        f"kto[kl={kl}, clamp_kl={clamp_kl}]")


def test_kto_kl_must_be_one_number():
    x, w, b, target = make(*SHAPE)
    labels = torch.ones(x.shape[0], dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="kl"):
        kto_loss(x, w, target, labels, kl=torch.zeros(x.shape[0], device=DEVICE))


@pytest.mark.parametrize("chunk_pairs", [1, 2])
def test_orpo_nll_target(chunk_pairs):
    """Liger's nll_target: the NLL term uses it (its chosen half, normalised by its non-ignored
    count) while the odds ratio uses target. Here nll_target also covers the prompt tokens."""
    x, w, b, target = make(*SHAPE, bias=True)
    pairs = SHAPE[0]
    nll_target = torch.randint(0, SHAPE[3], target.shape, device=DEVICE)
    nll_target = torch.where(target != -100, target, nll_target)
    nll_target[0, 0] = -100  # its own padding
    nll_target[pairs:] = -100  # the rejected half is never read
    beta = 0.2

    def ref(x, w, b):
        logps, _, _ = sequence_logps_ref(x, w, target, b, True)
        c, r = logps[:pairs], logps[pairs:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        _, lp, mask = sequence_logps_ref(x[:pairs], w, nll_target[:pairs], b)
        return -lp.sum() / mask.sum() - beta * F.logsigmoid(log_odds).mean()

    run(lambda x, w, b: orpo_loss(x, w, target, b, beta=beta, nll_target=nll_target, chunk_pairs=chunk_pairs), ref,
        x, w, b, f"orpo nll_target[chunks of {chunk_pairs}]")
    loss, metrics = TigonORPOLoss(beta=beta)(x, w, target, b, nll_target=nll_target)
    _, lp, mask = sequence_logps_ref(x[:pairs].double(), w.double(), nll_target[:pairs], b.double())
    assert torch.allclose(metrics["nll_loss"].double(), -lp.sum() / mask.sum(), rtol=1e-4)
    assert torch.allclose(loss.double(), ref(x.double(), w.double(), b.double()), rtol=1e-4)
    assert not torch.allclose(loss, orpo_loss(x, w, target, b, beta=beta)[0])  # nll_target changes the loss
    with pytest.raises(ValueError, match="nll_target"):
        orpo_loss(x, w, target, b, nll_target=nll_target[:, :-1])
    with pytest.raises(ValueError, match="nll_target"):
        orpo_loss(x, w, target, b, nll_target=nll_target, compute_nll_loss=False)
    with pytest.raises(TypeError, match="nll_target"):
        orpo_loss(x, w, target, b, nll_target=nll_target.float())
