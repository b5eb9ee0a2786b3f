"""The chunked losses under torch.compile: traced with no graph break (dynamo), the eager loss,
metrics and gradients (aot_eager, dynamic shapes), and still chunked: the compiled forward
keeps no [rows, V] logits (nor their gradient) for the backward."""

import functools

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

from tests.helpers import DEVICE, randn
from tigon.losses import (
    TigonDPOLoss,
    TigonFusedLinearJSD,
    TigonGRPOLoss,
    cpo_loss,
    dpo_loss,
    fused_linear_jsd,
    grpo_loss,
    jsd_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

PAIRS, TOKENS, HIDDEN, VOCAB, TEACHER_HIDDEN = 3, 5, 12, 37, 20


def inputs(bias=True):
    x = randn((2 * PAIRS, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    w = randn((VOCAB, HIDDEN), torch.float32, scale=HIDDEN**-0.5 * 2, requires_grad=True)
    b = randn((VOCAB,), torch.float32, scale=0.3, requires_grad=True) if bias else None
    target = torch.randint(0, VOCAB, (2 * PAIRS, TOKENS), device=DEVICE)
    target[:, :2] = -100
    target[1, -1] = -100
    return x, w, b, target


def cases():
    """name -> (loss function of (x, w, b) returning (loss, metrics), its inputs)."""
    x, w, b, target = inputs()
    rc, rr = randn((PAIRS,), torch.float32) - 5, randn((PAIRS,), torch.float32) - 5
    ref_x = randn(tuple(x.shape), torch.float32)
    ref_w = randn((VOCAB, HIDDEN), torch.float32, scale=0.3)
    nll_target = torch.where(target == -100, 3, target)
    labels = torch.tensor([True, False, True, True, False, False], device=DEVICE)
    tx = randn((2 * PAIRS, TOKENS, TEACHER_HIDDEN), torch.float32)
    tw = randn((VOCAB, TEACHER_HIDDEN), torch.float32, scale=TEACHER_HIDDEN**-0.5 * 3)
    completion = (torch.arange(TOKENS, device=DEVICE) < torch.tensor([5, 3, 0, 5, 1, 4], device=DEVICE)[:, None]).long()
    ids = torch.where(target == -100, 0, target)
    adv, old, ref_lp = randn((2 * PAIRS,), torch.float32), randn(tuple(ids.shape), torch.float32) - 3, \
        randn(tuple(ids.shape), torch.float32) - 3
    grpo_module = TigonGRPOLoss(loss_type="grpo", importance_sampling_level="sequence", epsilon_high=0.28)
    dpo_module = TigonDPOLoss(beta=0.2, label_smoothing=0.1)  # floats from a module's options
    jsd_module = TigonFusedLinearJSD(beta=0.3, temperature=2.0, chunk_rows=4)
    return {
        "dpo": (lambda x, w, b: dpo_loss(x, w, target, b, ref_chosen_logps=rc, ref_rejected_logps=rr,
                                         compute_nll_loss=True, chunk_pairs=2), (x, w, b)),
        "dpo module, reference model": (lambda x, w, b: dpo_module(x, w, target, b, ref_x=ref_x, ref_weight=ref_w),
                                        (x, w, b)),
        "orpo nll_target": (lambda x, w, b: orpo_loss(x, w, target, b, chunk_pairs=2, nll_target=nll_target),
                            (x, w, b)),
        "cpo": (lambda x, w, b: cpo_loss(x, w, target, b, label_smoothing=0.05, chunk_pairs=2), (x, w, b)),
        "simpo": (lambda x, w, b: simpo_loss(x, w, target, b), (x, w, b)),
        "kto": (lambda x, w, b: kto_loss(x, w, target, labels, b, kl=torch.tensor(0.1, device=DEVICE),
                                         ref_x=ref_x, ref_weight=ref_w, chunk_rows=4), (x, w, b)),
        "dpo aot (the batch as one chunk)": (lambda x, w, b: dpo_loss(x, w, target, b, ref_chosen_logps=rc,
                                                                     ref_rejected_logps=rr, loss_type="aot",
                                                                     label_smoothing=0.1), (x, w, b)),
        "dpo discopop": (lambda x, w, b: dpo_loss(x, w, target, b, ref_x=ref_x, ref_weight=ref_w, loss_type="discopop",
                                                  chunk_pairs=2), (x, w, b)),
        "dpo torch math": (lambda x, w, b: dpo_loss(x, w, target, b, chunk_pairs=2, compiled=True), (x, w, b)),
        "fused_linear_jsd": (lambda x, w, b: fused_linear_jsd(x, w, tx, tw, target, b, beta=0.4, chunk_rows=7),
                             (x, w, b)),
        "fused_linear_jsd module": (lambda x, w: jsd_module(x, w, tx, tw, target), (x, w)),
        "fused_linear_jsd default budget": (lambda x, w: fused_linear_jsd(x, w, tx, tw, beta=0.0), (x, w)),
        "grpo dapo": (lambda x, w, b: grpo_loss(x, w, ids, completion, adv, b, ref_per_token_logps=ref_lp,
                                                old_per_token_logps=old, chunk_sequences=4), (x, w, b)),
        "grpo module, sequence level, reference model, torch math": (
            lambda x, w, b: grpo_module(x, w, ids, completion, adv, b, ref_x=ref_x, ref_weight=ref_w, temperature=0.8,
                                        compiled=True, chunk_sequences=2), (x, w, b)),
        "jsd_loss": (lambda s: (jsd_loss(s, tx @ tw.t(), target, beta=0.5, chunk_rows=4), {}),
                     ((x.detach() @ w.detach().t()).requires_grad_(),)),
    }


NAMES = list(cases())


def run(fn, args):
    loss, metrics = fn(*args)
    grads = torch.autograd.grad(loss, args)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


@pytest.mark.parametrize("name", NAMES)
def test_compiled_loss_has_no_graph_break_and_matches_eager(name):
    fn, args = cases()[name]
    # fullgraph=True: a graph break raises, with its reason (one trace, not explain's and then this)
    loss, metrics, grads = run(torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True), args)
    eager_loss, eager_metrics, eager_grads = run(fn, args)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-7)
    assert list(metrics) == list(eager_metrics)
    for k in metrics:
        torch.testing.assert_close(metrics[k], eager_metrics[k], rtol=1e-5, atol=1e-6, msg=f"{name}: metric {k}")
    for i, (g, e) in enumerate(zip(grads, eager_grads)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7, msg=f"{name}: gradient {i}")


def saved_logit_tensors(fn, args, vocab):
    """Shapes of the [..., vocab] tensors the compiled forward hands on (its outputs: the user's
    and those saved for the backward), the inputs themselves aside."""
    graphs = []

    def keep_forward(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    backend = functools.partial(aot_eager, fw_compiler=keep_forward)
    loss, _ = torch.compile(fn, backend=backend, dynamic=True)(*args)
    torch.autograd.grad(loss, args)
    (forward,) = graphs
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    shapes = []
    for node in output.args[0]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) and node.op != "placeholder" else None
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[-1] == vocab:
            shapes.append(tuple(value.shape))
    return shapes


@pytest.mark.parametrize("name", ["dpo", "kto", "fused_linear_jsd", "grpo dapo"])
def test_compiled_loss_keeps_no_chunk_logits_for_backward(name):
    """Each chunk is recomputed in the backward (a checkpoint region): the forward graph saves
    the inputs, not a chunk's logits or the gradient the tigon op formed over them."""
    fn, args = cases()[name]
    assert saved_logit_tensors(fn, args, VOCAB) == []

    def unchunked(x, w, b):  # the check sees logits kept for the backward when there are some
        logits = x @ w.t() + b
        return logits.log_softmax(-1)[..., 0].sum(), {}

    assert saved_logit_tensors(unchunked, args, VOCAB) != []


def test_compiled_training_step():
    """A whole step compiled (embedding, a layer, the head and the DPO loss from its module):
    one graph, eager's loss and parameter gradients; under no_grad too."""
    emb = torch.nn.Embedding(VOCAB, HIDDEN).to(DEVICE)
    layer = torch.nn.Linear(HIDDEN, HIDDEN).to(DEVICE)
    head = torch.nn.Linear(HIDDEN, VOCAB).to(DEVICE)
    params = [*emb.parameters(), *layer.parameters(), *head.parameters()]
    ids = torch.randint(0, VOCAB, (2 * PAIRS, TOKENS), device=DEVICE)
    target = torch.roll(ids, -1, 1)
    target[:, :2] = -100
    loss_module = TigonDPOLoss(beta=0.2, chunk_pairs=2)

    def step(ids):
        h = torch.tanh(layer(emb(ids)))
        loss, metrics = loss_module(h, head.weight, target, head.bias)
        return loss, metrics["chosen_rewards"]

    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)  # a graph break raises
    loss, rewards = compiled(ids)
    grads = torch.autograd.grad(loss, params)
    eager_loss, eager_rewards = step(ids)
    eager_grads = torch.autograd.grad(eager_loss, params)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rewards, eager_rewards, rtol=1e-5, atol=1e-7)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        quiet, _ = compiled(ids)
    torch.testing.assert_close(quiet, eager_loss.detach(), rtol=1e-5, atol=1e-7)
