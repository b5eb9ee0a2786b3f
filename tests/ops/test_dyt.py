import pytest
import torch

from tests.helpers import DTYPES, check_module, check_op, pick, randn
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.nn import TigonDyT
from tigon.ops import dyt as dyt_ops
from tigon.reference import dyt_ref

# CPU: several row blocks (257, 40: 64-row forward tiles; 128-row backward tiles, two persistent
# programs of one or two blocks each); several column blocks of 2048 (3, 4200: one backward
# program a column block). More programs a column block: test_dyt_many_programs.
SHAPES = pick(
    cpu=[(2, 3, 33), (257, 40), (3, 4200)],
    gpu=[(4, 1024, 4096), (16384, 8192), (3001, 8189), (65536, 768)],
)


def dyt_inputs(shape, dtype, beta=True, alpha_shape=(1,), **x_options):
    x = randn(shape, dtype, scale=2.0, requires_grad=True, **x_options)
    alpha = randn(alpha_shape, dtype, scale=0.1, shift=0.7, requires_grad=True)
    gamma = randn(shape[-1:], dtype, shift=1.0, requires_grad=True)
    b = randn(shape[-1:], dtype, requires_grad=True) if beta else None
    return [x, alpha, gamma, b]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [True, False])
def test_dyt_matches_reference(shape, dtype, beta):
    check_op(TF.dyt, dyt_ref, dyt_inputs(shape, dtype, beta), dtype=dtype, what=f"dyt{shape} beta={beta}")


@pytest.mark.parametrize("alpha_shape", [(), (1,)])
def test_dyt_float16_strided_and_0dim_alpha(alpha_shape):
    check_op(TF.dyt, dyt_ref, dyt_inputs((5, 3, 70), torch.float16, alpha_shape=alpha_shape, non_contiguous=True),
             dtype=torch.float16)


def test_dyt_bfloat16_input_with_float32_parameters():
    """Output in x's dtype, each gradient in its parameter's."""
    x = randn((6, 40), torch.bfloat16, scale=2.0, requires_grad=True)
    _, alpha, gamma, beta = dyt_inputs((6, 40), torch.float32)
    check_op(TF.dyt, dyt_ref, [x, alpha, gamma, beta], dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [(5, 4200), (300, 40)])
def test_dyt_many_programs(monkeypatch, shape):
    """The backward's persistent grid as on a GPU: several programs a column block (their fp32
    partial sums, of every column block, summed by dyt_partials_sum_kernel)."""
    monkeypatch.setattr(dyt_ops, "persistent_programs", lambda device, n_tasks, per_sm: min(n_tasks, 9))
    check_op(TF.dyt, dyt_ref, dyt_inputs(shape, torch.float32), dtype=torch.float32, what=f"dyt{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compute", [(True, True, True), (True, False, False), (False, True, False)])
def test_dyt_partials_sum(dtype, compute):
    """300 partial rows (three 128-row steps) of 100 columns (four 32-column programs), and
    6000 dalpha partials (two steps): fp32 sums, outputs in the parameters' dtypes and shapes."""
    partials = [randn(shape, torch.float32) if c else None for shape, c in zip([(300, 20), (300, 100), (300, 100)],
                                                                               compute)]
    alpha, gamma, beta = randn((), dtype), randn((100,), dtype), randn((100,), dtype)
    sums = dyt_ops.dyt_partials_sum(*partials, alpha, gamma, beta)
    for got, partial, like in zip(sums, partials, (alpha, gamma, beta)):
        if partial is None:
            assert got is None
            continue
        want = (partial.double().sum() if like.ndim == 0 else partial.double().sum(0)).to(dtype)
        assert got.shape == like.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)


def test_dyt_tanh_is_accurate_over_its_whole_range():
    """The kernel's own tanh (no libdevice in the interpreter), at small, medium, large and
    non-finite arguments: within a few fp32 ulp of float64 tanh, and its derivative too."""
    u = torch.cat([torch.logspace(-12, 1.5, 301), torch.tensor([0.2499, 0.25, 0.2501, 30.0, 1e30, float("inf")])])
    u = torch.cat([u, -u, torch.zeros(1)]).to(torch.float32).to(randn((1,), torch.float32).device)
    x = u[None].clone().requires_grad_(True)
    one = torch.ones(1, device=u.device)
    y = TF.dyt(x, one, torch.ones(u.numel(), device=u.device))
    want = torch.tanh(u.double())
    assert torch.all((y[0].double() - want).abs() <= 4e-7 * want.abs())
    y.backward(torch.ones_like(y))
    dwant = torch.cosh(u.double()).pow(-2)  # not 1 - tanh^2, which float64 rounds to 0 at u = 30
    # fp32 exp's own conditioning: sech^2(u) ~ 4 exp(-2|u|), whose argument carries a relative
    # rounding error, so the tolerance grows with |u| (H100: 2.4e-6 relative at u = 30).
    assert torch.all((x.grad[0].double() - dwant).abs() <= 1e-6 * (1 + 2 * u.double().abs().clamp(max=100)) * dwant)


def test_dyt_non_finite_inputs():
    """As torch: x = +-inf gives +-gamma + beta and a zero gradient of x; NaN stays NaN."""
    x = randn((2, 6), torch.float32)
    x[0, 1], x[1, 4], x[1, 5] = float("inf"), float("-inf"), float("nan")
    x.requires_grad_(True)
    alpha = torch.full((1,), 0.5, device=x.device)
    gamma, beta = randn((6,), torch.float32, shift=1.0), randn((6,), torch.float32)
    y = TF.dyt(x, alpha, gamma, beta)
    want = dyt_ref(x.detach(), alpha, gamma, beta)
    torch.testing.assert_close(y, want, equal_nan=True)
    assert y[0, 1] == gamma[1] + beta[1] and y[1, 4] == beta[4] - gamma[4]
    y.backward(torch.ones_like(y))
    assert x.grad[0, 1] == 0 and x.grad[1, 4] == 0 and torch.isnan(x.grad[1, 5])


def test_dyt_zero_stride_and_frozen_parameters():
    """x expanded from one row, gamma expanded from a scalar, a frozen alpha and gamma: torch's
    values and gradients."""
    row = randn((1, 45), torch.float32, requires_grad=True)
    alpha = randn((1,), torch.float32, shift=0.5, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda r, a, s: TF.dyt(r.expand(6, 45), a, s.expand(45)),
             lambda r, a, s: dyt_ref(r.expand(6, 45), a, s.expand(45)), [row, alpha, scale], dtype=torch.float32)
    x, alpha, gamma, beta = dyt_inputs((7, 30), torch.float32)
    alpha.requires_grad_(False)
    gamma.requires_grad_(False)
    check_op(TF.dyt, dyt_ref, [x, alpha, gamma, beta], dtype=torch.float32)


def test_dyt_second_backward_over_retained_graph():
    inputs = dyt_inputs((7, 48), torch.float32)
    loss = (TF.dyt(*inputs) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in inputs]
    loss.backward()
    for t, g in zip(inputs, once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_dyt_empty_rows_or_hidden_size(shape):
    x, alpha, gamma, beta = dyt_inputs(shape, torch.float32)
    y = TF.dyt(x, alpha, gamma, beta)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
    for p in (alpha, gamma, beta):
        assert torch.equal(p.grad, torch.zeros_like(p))


def test_dyt_bad_inputs():
    x, alpha, gamma, beta = dyt_inputs((4, 16), torch.float32)
    with pytest.raises(ValueError, match="alpha must be a one-element tensor"):
        TF.dyt(x, gamma, gamma, beta)
    with pytest.raises(ValueError, match="gamma has shape"):
        TF.dyt(x, alpha, gamma[:15], beta)
    with pytest.raises(ValueError, match="beta has shape"):
        TF.dyt(x, alpha, gamma, beta[:3])
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.dyt(x.double(), alpha, gamma, beta)
    with pytest.raises(TypeError, match="alpha must be a torch.Tensor"):
        TF.dyt(x, 0.5, gamma, beta)


def test_dyt_custom_ops_pass_opcheck():
    from tigon.ops.dyt import dyt_backward_op, dyt_op

    x, alpha, gamma, beta = dyt_inputs((3, 5, 37), torch.float32, non_contiguous=True)
    assert set(torch.library.opcheck(dyt_op.library_op, (x, alpha, gamma, beta)).values()) == {"SUCCESS"}
    x, alpha, gamma, beta = (t.detach() for t in (x, alpha, gamma, beta))
    dy = randn((3, 5, 37), torch.float32)
    checks = torch.library.opcheck(dyt_backward_op.library_op, (dy, x, alpha, gamma, beta, True, True, True))
    assert set(checks.values()) == {"SUCCESS"}


def test_dyt_compiles_without_graph_breaks():
    inputs = dyt_inputs((3, 5, 37), torch.float32)
    cotangent = randn((3, 5, 37), torch.float32)

    def loss(x, alpha, gamma, beta):
        return (TF.dyt(x * 2.0, alpha, gamma, beta) * cotangent).sum()

    assert_compiles_like_eager(loss, inputs)


class DyT(torch.nn.Module):
    """The reference module (Liger's parameter names)."""

    def __init__(self, hidden_size, init_alpha=0.5, beta=True):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.full((1,), init_alpha))
        self.gamma = torch.nn.Parameter(torch.randn(hidden_size) * 0.1 + 1)
        self.beta = torch.nn.Parameter(torch.randn(hidden_size) * 0.1) if beta else None

    def forward(self, x):
        return dyt_ref(x, self.alpha, self.gamma, self.beta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [True, False])
def test_dyt_module_matches_reference(dtype, beta):
    x = randn((3, 5, 24), dtype, scale=2.0, requires_grad=True)
    check_module(TigonDyT(24, init_alpha=0.8, beta=beta), DyT(24, 0.8, beta), [x], dtype=dtype,
                 what=f"TigonDyT(beta={beta})")
    module = TigonDyT(24)
    assert module.alpha.item() == 0.5 and module.beta is not None and torch.equal(module.gamma, torch.ones(24))
