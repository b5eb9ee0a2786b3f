import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.reference import relu_squared_ref

# (2, 4099) strided: two column blocks of 4096 a row; contiguous shapes run as one long row.
SHAPES = pick(cpu=[(2, 3, 37), (5, 1100), (2, 4099), (7,)], gpu=[(4, 1024, 14336), (8191, 11008), (3, 4099)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_relu_squared_matches_reference(shape, dtype, non_contiguous):
    x = randn(shape, dtype, scale=2.0, shift=0.3, non_contiguous=non_contiguous, requires_grad=True)
    check_op(TF.relu_squared, relu_squared_ref, [x], dtype=dtype, what=f"relu_squared{shape}")


def test_relu_squared_float16():
    x = randn((3, 50), torch.float16, scale=2.0, requires_grad=True)
    check_op(TF.relu_squared, relu_squared_ref, [x], dtype=torch.float16)


def test_relu_squared_zero_stride_scalar_and_empty_inputs():
    """An expanded [1, N] row and an expanded scalar (their gradients are sums over the copies),
    a 0-dim tensor, and empty tensors: as torch."""
    row = randn((1, 45), torch.float32, requires_grad=True)
    check_op(lambda r: TF.relu_squared(r.expand(6, 45)), lambda r: relu_squared_ref(r.expand(6, 45)), [row],
             dtype=torch.float32)
    scalar = randn((), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda s: TF.relu_squared(s.expand(4, 9)), lambda s: relu_squared_ref(s.expand(4, 9)), [scalar],
             dtype=torch.float32)
    check_op(TF.relu_squared, relu_squared_ref, [scalar], dtype=torch.float32)
    for shape in [(0,), (3, 0), (0, 5)]:
        x = randn(shape, torch.float32, requires_grad=True)
        y = TF.relu_squared(x)
        y.sum().backward()
        assert y.shape == shape and x.grad.shape == shape


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # 1e20^2 -> inf
def test_relu_squared_nan_and_inf_as_torch():
    values = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -2.5, 3.0, 1e20]
    for dtype in DTYPES:
        x = torch.tensor(values, device=DEVICE, dtype=dtype, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        dy = torch.tensor([1.0, 2.0, -1.0, 1.0, 1.0, 1.0, 0.5, 1.0], device=DEVICE, dtype=dtype)
        y, y_ref = TF.relu_squared(x), torch.relu(x_ref).square()
        y.backward(dy)
        y_ref.backward(dy)
        torch.testing.assert_close(y, y_ref, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True, rtol=0, atol=0)


def test_relu_squared_second_backward_over_retained_graph():
    x = randn((7, 48), torch.float32, requires_grad=True)
    loss = (TF.relu_squared(x) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * once)


def test_relu_squared_leaves_its_input_alone():
    x = randn((5, 33), torch.float32, requires_grad=True)
    before = x.detach().clone()
    dy = randn((5, 33), torch.float32)
    dy_before = dy.clone()
    TF.relu_squared(x).backward(dy)
    assert torch.equal(x.detach(), before) and torch.equal(dy, dy_before)


def test_relu_squared_bad_inputs():
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.relu_squared(randn((4, 8), torch.float64))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        TF.relu_squared(torch.ones(4, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        TF.relu_squared([1.0, -2.0])


@pytest.mark.parametrize("non_contiguous", [False, True])
def test_relu_squared_custom_ops_pass_opcheck(non_contiguous):
    from tigon.ops.relu_squared import relu_squared_backward_op, relu_squared_op

    x = randn((3, 5, 37), torch.float32, non_contiguous=non_contiguous, requires_grad=True)
    assert set(torch.library.opcheck(relu_squared_op.library_op, (x,)).values()) == {"SUCCESS"}
    dy = randn((3, 5, 37), torch.float32, non_contiguous=non_contiguous)
    assert set(torch.library.opcheck(relu_squared_backward_op.library_op, (dy, x.detach())).values()) == {"SUCCESS"}


def test_relu_squared_compiles_without_graph_breaks():
    x = randn((3, 5, 37), torch.float32, requires_grad=True)
    cotangent = randn((3, 5, 37), torch.float32)
    assert_compiles_like_eager(lambda x: (TF.relu_squared(x * 2.0 - 0.5) * cotangent).sum(), [x])
