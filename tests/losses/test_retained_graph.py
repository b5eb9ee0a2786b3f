"""Backward over a retained graph: k backwards give exactly k times one backward's gradient, for
the chunked losses (whose gradients are formed in the forward and saved) and for the linear-head
row ops they are built on; 0.5 * loss gives exactly half; no backward reads a value on the host."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import DEVICE, randn
from tigon import functional as TF
from tigon.losses import dpo_loss, fused_linear_jsd, jsd_loss, kto_loss, orpo_loss

PAIRS, TOKENS, HIDDEN, VOCAB = 3, 5, 12, 37


def first(out):
    return out[0] if isinstance(out, tuple) else out


def preference_case(dtype=torch.float32):
    x = randn((2 * PAIRS, TOKENS, HIDDEN), dtype, requires_grad=True)
    w = randn((VOCAB, HIDDEN), dtype, scale=HIDDEN**-0.5 * 2, requires_grad=True)
    b = randn((VOCAB,), dtype, scale=0.3, requires_grad=True)
    target = torch.randint(0, VOCAB, (2 * PAIRS, TOKENS), device=DEVICE)
    target[:, :2] = -100
    return x, w, b, target


def distillation_case():
    sx = randn((2, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    sw = randn((VOCAB, HIDDEN), torch.float32, scale=HIDDEN**-0.5 * 2, requires_grad=True)
    tx, tw = randn((2, TOKENS, 20), torch.float32), randn((VOCAB, 20), torch.float32, scale=20**-0.5 * 3)
    target = torch.randint(0, VOCAB, (2, TOKENS), device=DEVICE)
    target[:, :2] = -100
    return sx, sw, tx, tw, target


def cases():
    """(name, loss function of no arguments, leaves)."""
    x, w, b, target = preference_case()
    rc, rr = randn((PAIRS,), torch.float32) - 5, randn((PAIRS,), torch.float32) - 5
    yield "dpo", lambda: dpo_loss(x, w, target, b, ref_chosen_logps=rc, ref_rejected_logps=rr, chunk_pairs=2), [x, w, b]
    xv = randn((2 * PAIRS * TOKENS, HIDDEN), torch.float32, requires_grad=True)  # x a view of a leaf
    yield "dpo on a view", lambda: dpo_loss(xv.view(2 * PAIRS, TOKENS, HIDDEN), w, target, chunk_pairs=2), [xv, w]
    xb, wb, bb, tb = preference_case(torch.bfloat16)
    yield "dpo bf16", lambda: dpo_loss(xb, wb, tb, bb, chunk_pairs=2), [xb, wb, bb]
    yield "orpo", lambda: orpo_loss(x, w, target, b, chunk_pairs=2), [x, w, b]
    labels = torch.tensor([True, False, True, True, False, False], device=DEVICE)
    yield "kto", lambda: kto_loss(x, w, target, labels, b, kl=0.1, chunk_rows=4), [x, w, b]
    sx, sw, tx, tw, dtarget = distillation_case()
    yield "fused_linear_jsd", lambda: fused_linear_jsd(sx, sw, tx, tw, dtarget, beta=0.3, chunk_rows=3), [sx, sw]
    s_logits = (sx.detach() @ sw.detach().t()).requires_grad_()
    t_logits = tx @ tw.t()
    yield "jsd_loss", lambda: jsd_loss(s_logits, t_logits, dtarget, beta=0.5, chunk_rows=4), [s_logits]
    # The row ops: a non-uniform row weighting, so the per-row factor is exercised.
    rows = 2 * PAIRS * TOKENS
    weights = torch.rand(rows, device=DEVICE) + 0.5
    x2 = randn((rows, HIDDEN), torch.float32, requires_grad=True)
    flat_target = target.reshape(-1)
    yield "linear_token_logps", lambda: (TF.linear_token_logps(x2, w, flat_target, b) * weights).sum(), [x2, w, b]
    tx2 = randn((rows, 20), torch.float32)
    yield "linear_jsd", lambda: (TF.linear_jsd(x2, w, tx2, tw, b, beta=0.4) * weights).sum(), [x2, w, b]


NAMES = ["dpo", "dpo on a view", "dpo bf16", "orpo", "kto", "fused_linear_jsd", "jsd_loss", "linear_token_logps",
         "linear_jsd"]


def case(name):
    """Fresh inputs (no .grad yet) for one case."""
    return next((fn, leaves) for n, fn, leaves in cases() if n == name)


def test_every_case_is_listed():
    assert [name for name, _, _ in cases()] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_retained_graph_backward_gives_k_times_the_gradient(name):
    fn, leaves = case(name)
    first(fn()).backward()
    single = [t.grad.clone() for t in leaves]
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in single)
    for t in leaves:
        t.grad = None
    loss = first(fn())
    for k in (1, 2, 3):
        loss.backward(retain_graph=True)
        for i, (t, g) in enumerate(zip(leaves, single)):
            assert torch.equal(t.grad, g * k), f"{name}: leaf {i} after {k} backwards is not {k}x the gradient"
    # Another loss adds into .grad between two backwards of the retained graph.
    for t in leaves:
        t.grad = None
    loss = first(fn())
    loss.backward(retain_graph=True)
    other = sum((t.float() ** 2).sum() for t in leaves)
    other.backward()
    other_grads = [t.grad - g for t, g in zip(leaves, single)]
    loss.backward()
    for i, (t, g, o) in enumerate(zip(leaves, single, other_grads)):
        assert torch.equal(t.grad, (g + o) + g), f"{name}: leaf {i} wrong after another loss's backward"


@pytest.mark.parametrize("name", NAMES)
def test_scaled_loss_gives_scaled_gradient(name):
    fn, leaves = case(name)
    first(fn()).backward()
    single = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    (0.5 * first(fn())).backward()
    for i, (t, g) in enumerate(zip(leaves, single)):
        assert torch.equal(t.grad, g * 0.5), f"{name}: leaf {i} of 0.5 * loss is not half the gradient"
    for t in leaves:
        t.grad = None
    half = 0.5 * first(fn())
    half.backward(retain_graph=True)
    half.backward()
    for i, (t, g) in enumerate(zip(leaves, single)):
        assert torch.equal(t.grad, g * 0.5 + g * 0.5), f"{name}: leaf {i} of two backwards of 0.5 * loss"


# The aten ops that read a tensor's values on the host: on the GPU each waits for the device
# (item(), bool(), float() and int() reach _local_scalar_dense; nonzero and masked_select size
# their output from the data; equal answers a Python bool).
HOST_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.equal, torch.ops.aten.is_nonzero,
              torch.ops.aten.nonzero, torch.ops.aten.masked_select, torch.ops.aten._unique2,
              torch.ops.aten.unique_consecutive, torch.ops.aten.unique_dim}


class HostReads(TorchDispatchMode):
    """Records, while active, every op of HOST_READS that runs (the CPU stand-in for
    torch.cuda.set_sync_debug_mode, which sees CUDA syncs only)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_backward_reads_no_value_on_the_host(name):
    """The saved gradients are scaled by grad_output on the device, whatever its value (1 from
    loss.backward(), 0.5, or a retained graph's backward): no host read, so the host keeps
    queueing the backward's kernels while the device works. The gradients stay exact."""
    fn, leaves = case(name)
    first(fn()).backward()
    single = [t.grad.clone() for t in leaves]
    for scale, retain in ((1.0, False), (0.5, False), (1.0, True), (0.25, True)):
        for t in leaves:
            t.grad = None
        loss = first(fn())
        out = loss if scale == 1.0 else scale * loss
        with HostReads() as reads:
            out.backward(retain_graph=retain)
        assert reads.seen == [], f"{name}: the backward (x{scale}, retain_graph={retain}) read {reads.seen}"
        for i, (t, g) in enumerate(zip(leaves, single)):
            assert torch.equal(t.grad, g * scale), f"{name}: leaf {i} of the backward x{scale}, retain_graph={retain}"
