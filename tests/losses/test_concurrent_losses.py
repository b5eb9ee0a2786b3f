"""Chunked losses over one head weight at once: two losses whose forwards both run before either
backward (two models sharing a head, or a policy and its reference), and two threads each running
one. Each gets the gradients it gets alone: a head op's accumulator is bound to its own call."""

import threading

import pytest
import torch

import tigon.ops.linear_token_logps as lt
from tests.helpers import DEVICE, launches_take_turns, randn, run_in_threads
from tigon.losses import dpo_loss

PAIRS, TOKENS, HIDDEN, VOCAB = 3, 5, 12, 37


def head():
    w = randn((VOCAB, HIDDEN), torch.float32, scale=HIDDEN**-0.5 * 2, requires_grad=True)
    b = randn((VOCAB,), torch.float32, scale=0.3, requires_grad=True)
    return w, b


def batch():
    x = randn((2 * PAIRS, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    target = torch.randint(0, VOCAB, (2 * PAIRS, TOKENS), device=DEVICE)
    target[:, :2] = -100
    return x, target


def loss_of(x, target, w, b):
    """DPO over three chunks (one pair each), so the head's accumulator takes several backwards."""
    return dpo_loss(x, w, target, b, chunk_pairs=1)[0]


def gradients(loss, x, w, b):
    return torch.autograd.grad(loss, (x, w, b))


def assert_same(got, want):
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_two_losses_over_one_head_forwards_before_backwards():
    w, b = head()
    batches = [batch(), batch()]
    want = [gradients(loss_of(x, t, w, b), x, w, b) for x, t in batches]
    losses = [loss_of(x, t, w, b) for x, t in batches]
    for loss, (x, _), ref in zip(reversed(losses), reversed(batches), reversed(want)):
        assert_same(gradients(loss, x, w, b), ref)


@pytest.fixture
def kernels_take_turns(monkeypatch):
    """Triton's interpreter is not thread-safe: the ops' kernel launches take turns (everything
    else, the loss's head-gradient blocks among it, runs concurrently)."""
    launches_take_turns(monkeypatch)


def test_two_threads_run_chunked_losses_over_one_head(kernels_take_turns, monkeypatch):
    """Both threads reach their first chunk's head backward before either goes on, so both
    losses' head-gradient blocks are open at once. On CUDA, autograd runs every backward of the
    device on one engine thread of its own, whichever thread called it: there a barrier inside
    the backward would wait for itself, so the threads run free (their backwards interleave as
    the engine takes them)."""
    w, b = head()
    batches = [batch(), batch()]
    want = [gradients(loss_of(x, t, w, b), x, w, b) for x, t in batches]
    both_inside = threading.Barrier(2, timeout=60)
    seen = threading.local()
    inner = lt.linear_head_backward

    def linear_head_backward(*args, **kwargs):
        if not getattr(seen, "first", False):
            seen.first = True
            both_inside.wait()
        return inner(*args, **kwargs)

    if DEVICE != "cuda":
        monkeypatch.setattr(lt, "linear_head_backward", linear_head_backward)
    got = [None, None]

    def run(i):
        x, t = batches[i]
        got[i] = gradients(loss_of(x, t, w, b), x, w, b)

    run_in_threads(run, barriers=(both_inside,))
    for i in range(2):
        assert_same(got[i], want[i])
