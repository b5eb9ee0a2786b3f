import pytest
import torch

from tests.helpers import DTYPES, check_module, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.nn import TigonPolyNorm
from tigon.reference import poly_norm_ref

# CPU: several rows a program and several row blocks a persistent backward program (257, 40).
SHAPES = pick(
    cpu=[(2, 3, 33), (7, 128), (257, 40)],
    gpu=[(4, 1024, 4096), (16384, 8192), (3001, 8189), (65536, 768)],
)


def poly_inputs(shape, dtype, bias_shape=(1,), **x_options):
    x = randn(shape, dtype, requires_grad=True, **x_options)
    weight = randn((3,), dtype, scale=0.3, shift=0.3, requires_grad=True)
    bias = randn(bias_shape, dtype, requires_grad=True)
    return [x, weight, bias]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_poly_norm_matches_reference(shape, dtype, non_contiguous):
    # bf16: weight and bias gradients are each one sum over the whole input, which the rounding of
    # the cotangent to bf16 alone moves by up to ~2% (eager torch as much): a looser bound there,
    # eager torch's error still bounding ours.
    tol = 3e-2 if dtype == torch.bfloat16 else None
    check_op(TF.poly_norm, poly_norm_ref, poly_inputs(shape, dtype, non_contiguous=non_contiguous), dtype=dtype,
             tol=tol, what=f"poly_norm{shape}")


def test_poly_norm_float16_0dim_bias_and_eps():
    """Liger's module keeps the bias as a 0-dim tensor: accepted, its gradient of that shape."""
    x, weight, bias = poly_inputs((5, 70), torch.float16, bias_shape=())
    check_op(lambda x, w, b: TF.poly_norm(x, w, b, eps=1e-3), lambda x, w, b: poly_norm_ref(x, w, b, eps=1e-3),
             [x, weight, bias], dtype=torch.float16)


def test_poly_norm_bfloat16_input_with_float32_parameters():
    """Output in x's dtype, each gradient in its parameter's."""
    x = randn((6, 40), torch.bfloat16, requires_grad=True)
    _, weight, bias = poly_inputs((6, 40), torch.float32)
    check_op(TF.poly_norm, poly_norm_ref, [x, weight, bias], dtype=torch.bfloat16, tol=3e-2)


def test_poly_norm_zero_stride_strided_and_frozen_parameters():
    row = randn((1, 45), torch.float32, requires_grad=True)
    weight = randn((9,), torch.float32, shift=0.3, requires_grad=True)
    bias = randn((1,), torch.float32, requires_grad=True)
    check_op(lambda r, w, b: TF.poly_norm(r.expand(6, 45), w[::3], b),
             lambda r, w, b: poly_norm_ref(r.expand(6, 45), w[::3], b), [row, weight, bias], dtype=torch.float32)
    x, weight, bias = poly_inputs((7, 30), torch.float32)
    weight.requires_grad_(False)
    check_op(TF.poly_norm, poly_norm_ref, [x, weight, bias], dtype=torch.float32)


def test_poly_norm_zero_and_non_finite_rows():
    """A zero row gives the bias (and finite gradients); a NaN or inf poisons only its own row."""
    x, weight, bias = (t.detach() for t in poly_inputs((4, 20), torch.float32))
    x[0] = 0.0
    x[2, 3] = float("nan")
    x[3, 5] = float("inf")
    x.requires_grad_(True)
    y = TF.poly_norm(x, weight, bias)
    want = poly_norm_ref(x.detach(), weight, bias)
    assert torch.equal(y[0], bias.expand(20))
    torch.testing.assert_close(y[:2], want[:2])
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[3]).all()
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad[:2]).all()


def test_poly_norm_second_backward_over_retained_graph():
    inputs = poly_inputs((7, 48), torch.float32)
    loss = (TF.poly_norm(*inputs) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in inputs]
    loss.backward()
    for t, g in zip(inputs, once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_poly_norm_empty_rows_or_hidden_size(shape):
    x, weight, bias = poly_inputs(shape, torch.float32)
    y = TF.poly_norm(x, weight, bias)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


def test_poly_norm_bad_inputs():
    x, weight, bias = poly_inputs((4, 16), torch.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \[3\]"):
        TF.poly_norm(x, torch.ones(4, device=x.device), bias)
    with pytest.raises(ValueError, match="bias must be a one-element tensor"):
        TF.poly_norm(x, weight, torch.zeros(2, device=x.device))
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.poly_norm(x.double(), weight, bias)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        TF.poly_norm(x, weight, 0.0)


def test_poly_norm_custom_ops_pass_opcheck():
    from tigon.ops.poly_norm import poly_norm_backward_op, poly_norm_op

    x, weight, bias = poly_inputs((3, 5, 37), torch.float32, non_contiguous=True)
    assert set(torch.library.opcheck(poly_norm_op.library_op, (x, weight, bias, 1e-6)).values()) == {"SUCCESS"}
    x, weight, bias = (t.detach() for t in (x, weight, bias))
    _, rstd = poly_norm_op(x, weight, bias, 1e-6)
    dy = randn((3, 5, 37), torch.float32)
    checks = torch.library.opcheck(poly_norm_backward_op.library_op, (dy, x, weight, bias, rstd, True))
    assert set(checks.values()) == {"SUCCESS"}


def test_poly_norm_compiles_without_graph_breaks():
    inputs = poly_inputs((3, 5, 37), torch.float32)
    cotangent = randn((3, 5, 37), torch.float32)

    def loss(x, weight, bias):
        return (TF.poly_norm(x * 2.0, weight, bias) * cotangent).sum()

    assert_compiles_like_eager(loss, inputs)


class PolyNorm(torch.nn.Module):
    """PolyCom's reference module."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3) / 3)
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.eps = eps

    def forward(self, x):
        return poly_norm_ref(x, self.weight, self.bias, self.eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_poly_norm_module_matches_reference(dtype):
    theirs = PolyNorm(eps=1e-5)
    ours = TigonPolyNorm(eps=1e-5)
    for name, p in ours.state_dict().items():  # the same initial state
        torch.testing.assert_close(p, theirs.state_dict()[name], rtol=0, atol=0)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor([0.2, -0.5, 0.9]))
        theirs.bias.fill_(0.3)
    x = randn((3, 5, 24), dtype, requires_grad=True)
    check_module(ours, theirs, [x], dtype=dtype, what="TigonPolyNorm")
