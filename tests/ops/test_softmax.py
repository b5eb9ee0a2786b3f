"""tigon.functional.softmax against a float64 torch reference, forward and backward: rows in
registers (several a program, persistent backward), wide rows (the looped kernels), other dims,
strided and expanded inputs, non-finite values, bad arguments."""

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tigon import functional as TF
from tigon.ops import softmax as softmax_module
from tigon.reference import softmax_ref

# (257, 40): 64 rows a forward program, several row blocks a persistent backward program;
# 33001 is past FUSED_MAX_COLS: the looped kernels, five 8192-wide chunks.
SHAPES = pick(cpu=[(2, 3, 33), (257, 40), (2, 33001)],
              gpu=[(16384, 4096), (4099, 32768), (1024, 128256), (3, 333, 1001)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_softmax_matches_reference(shape, dtype, non_contiguous):
    x = randn(shape, dtype, non_contiguous=non_contiguous, scale=3.0, requires_grad=True)
    check_op(TF.softmax, softmax_ref, [x], dtype=dtype, what=f"softmax{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_looped_kernels_on_short_rows(monkeypatch, dtype):
    """The wide-row kernels with chunks narrower than the row (several, the last partial) and a
    row shorter than a chunk."""
    monkeypatch.setattr(softmax_module, "FUSED_MAX_COLS", 16)
    monkeypatch.setattr(softmax_module, "WIDE_BLOCK", 32)
    for shape in [(5, 101), (3, 20)]:
        x = randn(shape, dtype, scale=3.0, requires_grad=True)
        check_op(TF.softmax, softmax_ref, [x], dtype=dtype, what=f"softmax looped{shape}")


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_softmax_over_other_dims(dim):
    x = randn((5, 6, 7), torch.float32, scale=2.0, requires_grad=True)
    check_op(lambda x: TF.softmax(x, dim), lambda x: softmax_ref(x, dim), [x], dtype=torch.float32,
             what=f"softmax dim={dim}")


def test_softmax_expanded_input():
    """x expanded from one row (stride 0): each row the same softmax, the gradient summed."""
    base = randn((1, 45), torch.float32, requires_grad=True)
    check_op(lambda b: TF.softmax(b.expand(6, 45)), lambda b: softmax_ref(b.expand(6, 45)), [base],
             dtype=torch.float32)


def test_softmax_second_backward_over_retained_graph():
    x = randn((7, 48), torch.float32, requires_grad=True)
    loss = (TF.softmax(x) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * once)


@pytest.mark.parametrize("wide", [False, True])
def test_softmax_non_finite_values_as_torch(monkeypatch, wide):
    """-inf entries get 0, whole leading chunks of them too (the looped kernel's online max once
    formed exp(-inf + inf) there); a row of only -inf, or with +inf or NaN, is NaN: torch's."""
    if wide:
        monkeypatch.setattr(softmax_module, "FUSED_MAX_COLS", 4)
        monkeypatch.setattr(softmax_module, "WIDE_BLOCK", 4)
    x = randn((6, 9), torch.float32)
    x[0, 2] = x[0, 7] = float("-inf")
    x[1] = float("-inf")
    x[2, 3] = float("inf")
    x[3, 8] = float("nan")
    x[5, :6] = float("-inf")
    got, want = TF.softmax(x), torch.softmax(x, -1)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)
    assert (got[0, [2, 7]] == 0).all() and got[1:4].isnan().all() and not got[4:].isnan().any()
    assert (got[5, :6] == 0).all()


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (2, 0, 4)])
def test_softmax_empty(shape):
    x = randn(shape, torch.float32, requires_grad=True)
    y = TF.softmax(x)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape


def test_softmax_module():
    from tigon.nn import TigonSoftmax

    x = randn((4, 5, 6), torch.bfloat16, requires_grad=True)
    for dim in (-1, 1):
        check_op(TigonSoftmax(dim), torch.nn.Softmax(dim), [x], dtype=torch.bfloat16, what=f"TigonSoftmax({dim})")
    assert "dim=1" in repr(TigonSoftmax(1))


def test_softmax_bad_inputs():
    x = randn((4, 16), torch.float32)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.softmax(x.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        TF.softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        TF.softmax(x, 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        TF.softmax(x, 1.0)
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        TF.softmax(torch.tensor(1.0, device=DEVICE))
    from tigon.ops.softmax import softmax_backward_op

    with pytest.raises(ValueError, match="dy has shape"):
        softmax_backward_op(x[:, :3], x)


@pytest.mark.parametrize("non_contiguous", [False, True])
def test_softmax_custom_ops_pass_opcheck(non_contiguous):
    from tigon.ops.softmax import softmax_backward_op, softmax_op

    x = randn((3, 5, 37), torch.float32, non_contiguous=non_contiguous, requires_grad=True)
    assert set(torch.library.opcheck(softmax_op.library_op, (x,)).values()) == {"SUCCESS"}
    y = softmax_op(x.detach())
    dy = randn((3, 5, 37), torch.float32, non_contiguous=non_contiguous)
    assert set(torch.library.opcheck(softmax_backward_op.library_op, (dy, y)).values()) == {"SUCCESS"}
