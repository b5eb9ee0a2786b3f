"""tigon.ops._common.TigonOp: a plain eager call runs the op's body and autograd formula directly
(no torch dispatcher) and gives what the dispatcher's path gives, bit for bit; anything that
would intercept the op (fake tensors, dispatch modes, torch.func, torch.compile) gets the
dispatcher's path."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import DEVICE, randn
from tigon import functional as TF
from tigon.ops import _internals
from tigon.ops import rms_norm as rms_norm_module
from tigon.ops._common import TigonOp


@pytest.fixture
def dispatcher_calls(monkeypatch):
    """Counts calls that went through torch's dispatcher (a TigonOp's library op), by op name."""
    calls = []
    original = TigonOp.__call__

    def counting_call(self, *args, **kwargs):
        library_op = self.library_op

        def counted(*a, **k):
            calls.append(library_op._name)
            return library_op(*a, **k)

        self.__dict__["library_op"] = counted
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__["library_op"] = library_op

    monkeypatch.setattr(TigonOp, "__call__", counting_call)
    return calls


def rms_norm_training(x, w):
    """(y, dx, dw) of rms_norm(x, w) with an upstream gradient that is not all ones."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = TF.rms_norm(x, w)
    y.backward(torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y).to(y.dtype))
    return y, x.grad, w.grad


def _hot_op_calls():
    """{op: a forward call on fresh leaves} for the ops of ``tigon bench --host``."""
    def leaf(*shape):
        return randn(shape, torch.float32, requires_grad=True)

    target = torch.tensor([3, -100, 0, 7, 1], device=DEVICE)
    return dict(
        rms_norm=lambda: TF.rms_norm(leaf(5, 48), leaf(48)),
        layer_norm=lambda: TF.layer_norm(leaf(5, 48), leaf(48), leaf(48)),
        rope=lambda: torch.cat([t.flatten() for t in TF.apply_rotary_pos_emb(
            leaf(1, 4, 5, 16), leaf(1, 2, 5, 16), randn((1, 5, 16), torch.float32), randn((1, 5, 16), torch.float32))]),
        swiglu=lambda: TF.swiglu(leaf(5, 40), leaf(5, 40)),
        cross_entropy=lambda: TF.cross_entropy(leaf(5, 11), target),
        fused_linear_cross_entropy=lambda: TF.fused_linear_cross_entropy(leaf(5, 16), leaf(11, 16), target),
    )


@pytest.mark.parametrize("op", list(_hot_op_calls()))
def test_plain_eager_call_skips_the_dispatcher(op, dispatcher_calls):
    """Forward and backward (rope's backward op takes stride lists: still direct)."""
    call = _hot_op_calls()[op]
    out = call()
    out.sum().backward()
    with torch.no_grad():
        call()
    assert dispatcher_calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_path_equals_the_dispatchers_bit_for_bit(dtype):
    x, w = randn((7, 48), dtype), randn((48,), dtype)
    direct = rms_norm_training(x, w)
    _internals.set_lean_eager(False)
    try:
        dispatched = rms_norm_training(x, w)
    finally:
        _internals.set_lean_eager(True)
    for a, b in zip(direct, dispatched, strict=True):
        assert torch.equal(a, b)


def test_glu_mlp_under_autocast_equals_the_dispatchers():
    """The body's own matmuls see autocast as they do below the dispatcher."""
    x = randn((6, 32), torch.float32, requires_grad=True)
    weights = [randn(shape, torch.float32, scale=0.2, requires_grad=True) for shape in ((40, 32), (40, 32), (32, 40))]

    def run():
        for t in (x, *weights):
            t.grad = None
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = TF.glu_mlp(x, *weights)
        out.float().sum().backward()
        return out, x.grad, *(w.grad for w in weights)

    direct = run()
    _internals.set_lean_eager(False)
    try:
        dispatched = run()
    finally:
        _internals.set_lean_eager(True)
    for a, b in zip(direct, dispatched, strict=True):
        assert torch.equal(a, b)


def test_modes_and_transforms_take_the_dispatcher(dispatcher_calls):
    x, w = randn((5, 48), torch.float32), randn((48,), torch.float32)
    with FlopCounterMode(display=False):
        TF.rms_norm(x, w)
    assert dispatcher_calls == ["rms_norm"]
    dispatcher_calls.clear()
    with FakeTensorMode() as fake:
        y = TF.rms_norm(fake.from_tensor(x), fake.from_tensor(w))
    assert dispatcher_calls == ["rms_norm"] and y.shape == x.shape
    dispatcher_calls.clear()
    # torch.func over tigon's ops is refused by torch's custom-op autograd, as before the direct
    # path: the call must reach it, not an autograd.Function that torch.func would misread.
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(lambda t: TF.rms_norm(t, w).sum())(x)
    assert dispatcher_calls == ["rms_norm"]


def test_compiled_call_takes_the_dispatcher(dispatcher_calls):
    x, w = randn((5, 48), torch.float32), randn((48,), torch.float32)
    torch._dynamo.reset()
    out = torch.compile(lambda t: TF.rms_norm(t, w), backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, TF.rms_norm(x, w))
    assert "rms_norm" in dispatcher_calls


def test_op_without_an_autograd_formula_is_not_run_bare_under_grad(dispatcher_calls):
    """A backward op called where a gradient is asked of it (no formula registered for it): the
    dispatcher's path, which says so, never a silently ungraded output."""
    x, w = randn((5, 48), torch.float32), randn((48,), torch.float32)
    _, rstd, _ = rms_norm_module.rms_norm_forward(x, w, 1e-6, 0.0, "llama")
    dy = randn((5, 48), torch.float32, requires_grad=True)
    dx, _ = rms_norm_module.rms_norm_backward_op(dy, x, w, rstd, 0.0, "llama", True, None)
    assert dispatcher_calls == ["rms_norm_backward"] and dx.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        dx.sum().backward()
