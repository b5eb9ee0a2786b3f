"""Generalised JSD (TRL's GKD formula: tigon.reference.jsd_loss_ref) against the chunked versions."""

import pytest
import torch

from tests.helpers import DEVICE, check_op, pick, randn
from tigon.losses import TigonFusedLinearJSD, TigonJSD, fused_linear_jsd, jsd_loss
from tigon.reference import jsd_loss_ref

# (batch, tokens, student hidden, teacher hidden, vocab)
SHAPE = pick(cpu=(2, 5, 12, 20, 37), gpu=(4, 512, 1024, 2048, 32000))


def make(bias=False):
    b, t, hs, ht, v = SHAPE
    sx = randn((b, t, hs), torch.float32, requires_grad=True)
    sw = randn((v, hs), torch.float32, scale=hs**-0.5 * 2, requires_grad=True)
    sb = randn((v,), torch.float32, scale=0.3, requires_grad=True) if bias else None
    tx, tw = randn((b, t, ht), torch.float32), randn((v, ht), torch.float32, scale=ht**-0.5 * 3)
    target = torch.randint(0, v, (b, t), device=DEVICE)
    target[:, :2] = -100
    return sx, sw, sb, tx, tw, target


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_fused_linear_jsd_matches_reference(beta, temperature):
    sx, sw, sb, tx, tw, target = make(bias=beta == 0.5)
    inputs = [sx, sw] + ([sb] if sb is not None else [])

    def ours(sx, sw, *sb):
        return fused_linear_jsd(sx, sw, tx, tw, target, sb[0] if sb else None, beta=beta, temperature=temperature,
                                chunk_rows=pick(3, 700))[0]

    def ref(sx, sw, *sb):
        s_logits = sx @ sw.t() + (sb[0] if sb else 0)
        t_logits = (tx @ tw.t()).to(sx.dtype)
        return jsd_loss_ref(s_logits, t_logits, target, beta, temperature)

    check_op(ours, ref, inputs, dtype=torch.float32, tol=1e-4, what=f"fused_linear_jsd[beta={beta}, T={temperature}]",
             worse_than_eager=4.0, noise_floor=1e-5)


def test_jsd_on_logits_and_module():
    sx, sw, _, tx, tw, target = make()
    s_logits = (sx.detach() @ sw.detach().t()).requires_grad_()
    t_logits = tx @ tw.t()
    check_op(lambda s: jsd_loss(s, t_logits, target, beta=0.4, chunk_rows=4),
             lambda s: jsd_loss_ref(s, t_logits.to(s.dtype), target, 0.4, 1.0),
             [s_logits], dtype=torch.float32, tol=1e-4, what="jsd_loss", worse_than_eager=4.0, noise_floor=1e-5)
    module = TigonFusedLinearJSD(beta=0.4, chunk_rows=4)
    loss, _ = module(sx, sw, tx, tw, target)
    assert torch.allclose(loss, jsd_loss(s_logits, t_logits, target, beta=0.4), rtol=1e-5)
    assert "beta=0.4" in repr(module)


def test_jsd_bad_inputs():
    sx, sw, _, tx, tw, target = make()
    with pytest.raises(ValueError, match="beta"):
        fused_linear_jsd(sx, sw, tx, tw, beta=1.5)
    with pytest.raises(ValueError, match="tokens"):
        fused_linear_jsd(sx, sw, tx[:, :-1], tw)
    with pytest.raises(ValueError, match="vocabularies"):
        fused_linear_jsd(sx, sw, tx, tw[:-1])
    with pytest.raises(ValueError, match="temperature"):
        jsd_loss(sx, sx, temperature=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_tigon_jsd_on_log_probs_agrees_with_the_logit_losses(beta):
    """TigonJSD (Liger's LigerJSD semantics: log-probabilities in, student first) uses the same
    beta as fused_linear_jsd / jsd_loss (TRL's): on log_softmax of the logits it gives the same
    loss, and backpropagated through the log_softmax the same logit gradient."""
    sx, sw, _, tx, tw, target = make()
    v = sw.shape[0]
    s_logits = (sx.detach() @ sw.detach().t()).requires_grad_()
    t_logits = tx @ tw.t()
    module = TigonJSD(beta=beta)
    loss = module(torch.log_softmax(s_logits, -1).view(-1, v), torch.log_softmax(t_logits, -1).view(-1, v),
                  target.view(-1))
    (g,) = torch.autograd.grad(loss, s_logits)
    ref = jsd_loss(s_logits, t_logits, target, beta=beta)
    (g_ref,) = torch.autograd.grad(ref, s_logits)
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-7)
    assert f"beta={beta}" in repr(module)
    with pytest.raises(ValueError, match="beta"):
        TigonJSD(beta=-0.1)


def test_chunk_budget_is_the_shared_default_and_checked(monkeypatch):
    """The budget (bytes of a chunk's logits: student + teacher in the fused path) defaults to
    tigon.ops._common.DEFAULT_CHUNK_BUDGET, read at the call; a budget <= 0 is a clear error."""
    import tigon.losses.distillation as distillation
    import tigon.ops._common as common

    sx, sw, _, tx, tw, target = make()
    rows, v = sx.shape[0] * sx.shape[1], sw.shape[0]
    seen = []

    def spy(n_rows, rows_per_chunk, device):
        seen.append(rows_per_chunk)
        return distillation.contiguous_chunks.__wrapped__(n_rows, rows_per_chunk, device)

    spy.__wrapped__ = distillation.contiguous_chunks
    monkeypatch.setattr(distillation, "contiguous_chunks", spy)
    full, _ = fused_linear_jsd(sx, sw, tx, tw, target, chunk_rows=rows)
    per_logit = sx.element_size() + tx.element_size()
    monkeypatch.setattr(common, "DEFAULT_CHUNK_BUDGET", 4 * per_logit * v)  # 4 rows fit: chunks of 4, 4, 2
    loss, _ = fused_linear_jsd(sx, sw, tx, tw, target)
    assert seen[-1] == 4 and torch.allclose(loss, full, rtol=1e-5)
    loss, _ = fused_linear_jsd(sx, sw, tx, tw, target, chunk_budget=3 * per_logit * v)  # 4 chunks, evened: 3 rows
    assert seen[-1] == 3 and torch.allclose(loss, full, rtol=1e-5)
    monkeypatch.setattr(common, "DEFAULT_CHUNK_BUDGET", 5 * distillation.TORCH_BYTES_PER_LOGIT * v)
    s_logits = sx.detach() @ sw.detach().t()
    jsd_loss(s_logits, tx @ tw.t(), target)
    assert seen[-1] == 5
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="chunk_budget"):
            fused_linear_jsd(sx, sw, tx, tw, target, chunk_budget=bad)
        with pytest.raises(ValueError, match="chunk_budget"):
            jsd_loss(s_logits, s_logits, chunk_budget=bad)
        with pytest.raises(ValueError, match="chunk_budget"):
            TigonFusedLinearJSD(chunk_budget=bad)
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_linear_jsd(sx, sw, tx, tw, target, chunk_rows=0)
    assert not hasattr(distillation, "DEFAULT_CHUNK_BUDGET")  # one owner: tigon.ops._common
