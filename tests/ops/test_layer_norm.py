import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn, rel_err
from tigon import functional as TF
from tigon.reference import layer_norm_ref

SHAPES = pick(
    cpu=[(2, 3, 33), (7, 128), (257, 40)],
    gpu=[(4, 1024, 4096), (16384, 4096), (3001, 8189), (65536, 768)],
)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias", "none"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_layer_norm_matches_reference(shape, dtype, affine, non_contiguous):
    # A large common offset: catches one-pass variance formulas that cancel catastrophically.
    x = randn(shape, dtype, non_contiguous=non_contiguous, shift=8.0, requires_grad=True)
    w = randn(shape[-1:], dtype, shift=1.0, requires_grad=True) if "weight" in affine else None
    b = randn(shape[-1:], dtype, requires_grad=True) if "bias" in affine else None
    check_op(lambda x, w, b: TF.layer_norm(x, w, b), layer_norm_ref, [x, w, b], dtype=dtype,
             what=f"layer_norm[{affine}]")


def test_layer_norm_frozen_parameters():
    x = randn((5, 70), torch.float32, requires_grad=True)
    w = randn((70,), torch.float32, shift=1.0)
    b = randn((70,), torch.float32, requires_grad=True)
    check_op(lambda x, w, b: TF.layer_norm(x, w, b), layer_norm_ref, [x, w, b], dtype=torch.float32)


def test_layer_norm_zero_stride_and_strided_inputs():
    """x expanded from a [1, N] leaf, weight and bias expanded from scalars, and strided ones:
    torch's values and gradients (the kernels read weight / bias with unit stride)."""
    base = randn((1, 45), torch.float32, shift=2.0, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)
    shift = randn((), torch.float32, requires_grad=True)
    check_op(lambda b, s, t: TF.layer_norm(b.expand(6, 45), s.expand(45), t.expand(45)),
             lambda b, s, t: layer_norm_ref(b.expand(6, 45), s.expand(45), t.expand(45)), [base, scale, shift],
             dtype=torch.float32)
    x = randn((6, 45), torch.float32, requires_grad=True)
    w, b = randn((90,), torch.float32, requires_grad=True), randn((135,), torch.float32, requires_grad=True)
    check_op(lambda x, w, b: TF.layer_norm(x, w[::2], b[::3]), lambda x, w, b: layer_norm_ref(x, w[::2], b[::3]),
             [x, w, b], dtype=torch.float32)


def test_layer_norm_second_backward_over_retained_graph():
    x = randn((7, 48), torch.float32, requires_grad=True)
    w = randn((48,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((48,), torch.float32, requires_grad=True)
    loss = 0.5 * (TF.layer_norm(x, w, b) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in (x, w, b)]
    loss.backward()
    for t, g in zip((x, w, b), once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), (0, 0), (0, 5)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_empty_rows_or_hidden_size(shape, affine):
    """As torch.nn.functional.layer_norm: an empty output, empty (or zero) gradients, no error."""
    x = randn(shape, torch.float32, requires_grad=True)
    w = randn(shape[-1:], torch.float32, requires_grad=True) if affine else None
    b = randn(shape[-1:], torch.float32, requires_grad=True) if affine else None
    y = TF.layer_norm(x, w, b)
    assert y.shape == torch.nn.functional.layer_norm(x, shape[-1:], w, b).shape
    y.sum().backward()
    assert x.grad.shape == shape
    if affine:
        assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_layer_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    with pytest.raises(ValueError, match="bias has shape"):
        TF.layer_norm(x, randn((16,), torch.float32), randn((17,), torch.float32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        TF.layer_norm([1.0, 2.0], None, None)


def assert_compiles_like_eager(fn, inputs, rel=None):
    """torch.compile(fn) (AOTAutograd, dynamic shapes) gives fn's eager loss and gradients, and
    dynamo traces fn in one graph. ``rel``: compare by relative Frobenius error instead of
    elementwise (for a compiled path that sums in another order than eager's)."""
    def loss_and_grads(f):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        loss = f(*leaves)
        return [loss, *torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])]

    torch._dynamo.reset()
    eager = loss_and_grads(fn)
    compiled = loss_and_grads(torch.compile(fn, backend="aot_eager", dynamic=True))
    for want, got in zip(eager, compiled):
        if rel is None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert rel_err(got, want) <= rel, (rel_err(got, want), rel)
    assert torch._dynamo.explain(fn)(*inputs).graph_break_count == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_layer_norm_custom_ops_pass_opcheck(affine, non_contiguous):
    from tigon.ops.layer_norm import layer_norm_backward_op, layer_norm_op

    x = randn((3, 5, 37), torch.float32, non_contiguous=non_contiguous, requires_grad=True)
    w = randn((37,), torch.float32, requires_grad=True) if "weight" in affine else None
    b = randn((37,), torch.float32, requires_grad=True) if "bias" in affine else None
    assert set(torch.library.opcheck(layer_norm_op.library_op, (x, w, b, 1e-5)).values()) == {"SUCCESS"}
    x, w, b = (None if t is None else t.detach() for t in (x, w, b))  # the backward op has no autograd
    _, mean, rstd = layer_norm_op(x, w, b, 1e-5)
    dy = randn((3, 5, 37), torch.float32)
    checks = torch.library.opcheck(layer_norm_backward_op.library_op,
                                   (dy, x, w, b, mean, rstd, w is not None, b is not None))
    assert set(checks.values()) == {"SUCCESS"}


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_compiles_without_graph_breaks(affine):
    x = randn((3, 5, 37), torch.float32, shift=2.0, requires_grad=True)
    w = randn((37,), torch.float32, shift=1.0, requires_grad=affine)
    b = randn((37,), torch.float32, requires_grad=affine)
    cotangent = randn((3, 5, 37), torch.float32)

    def loss(x, w, b):
        return (TF.layer_norm(x * 2.0, w if affine else None, b if affine else None) * cotangent).sum()

    assert_compiles_like_eager(loss, [x, w, b])
