"""tigon.functional.sparsemax against a float64 sort-based reference (Martins & Astudillo's
algorithm), forward and backward: small and large supports, rows up to 65536 wide, rows built to
need many Newton steps, ties, other dims, strided / expanded inputs, non-finite values."""

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tigon import functional as TF
from tigon.reference import sparsemax_ref

# (257, 40): 64 rows a forward program, several row blocks a persistent backward program.
SHAPES = pick(cpu=[(2, 3, 33), (257, 40), (3, 40000)],
              gpu=[(16384, 4096), (4099, 32768), (3, 333, 1001), (64, 65536)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [3.0, 0.02])
def test_sparsemax_matches_reference(shape, dtype, scale):
    """scale 3: supports of a few entries; 0.02: of hundreds (a third of a 40-wide row)."""
    x = randn(shape, dtype, non_contiguous=dtype == torch.float32, scale=scale, requires_grad=True)
    check_op(TF.sparsemax, sparsemax_ref, [x], dtype=dtype, what=f"sparsemax{shape} scale {scale}")


@pytest.mark.parametrize("row", ["geometric", "linear", "ties", "one large", "uniform", "narrow"])
def test_sparsemax_hard_rows(row):
    """Rows that make Newton's method take many steps (geometric and evenly spaced values),
    ties, a single dominant entry (one-hot), all equal (1/n each), and an n-vector of spread
    < 1/n (everything in the support)."""
    n = 700
    i = torch.arange(n, device=DEVICE, dtype=torch.float32)
    x = {"geometric": 2.0 ** -(i % 40), "linear": -i * 1e-3, "ties": (i % 7).floor() * 0.05,
         "one large": torch.where(i == 311, 50.0, -(i % 13)), "uniform": torch.full((n,), 0.25, device=DEVICE),
         "narrow": i * 1e-6}[row]
    x = x[torch.randperm(n, device=DEVICE)].reshape(1, n).requires_grad_()
    check_op(TF.sparsemax, sparsemax_ref, [x], dtype=torch.float32, what=f"sparsemax {row}")
    y = TF.sparsemax(x.detach())
    assert (y >= 0).all() and abs(y.double().sum().item() - 1) < 1e-5


def test_sparsemax_entry_at_tau_is_outside_the_support():
    """bf16 rows with an entry exactly at tau (max - 1 for a support of one; 0.5 for the support
    1, 0.75, 0.75): 0 there, and the gradients of the strict support."""
    x = randn((6, 50), torch.bfloat16, scale=0.1) - 4.0
    x[:3, 0] = 1.0
    x[:3, 1] = 0.0  # tau = 1 - 1: a support of one, the gradient zero
    x[3:, :3] = torch.tensor([1.0, 0.75, 0.75])
    x[3:, 3] = 0.5  # tau = (2.5 - 1) / 3
    x.requires_grad_()
    check_op(TF.sparsemax, sparsemax_ref, [x], dtype=torch.bfloat16, what="sparsemax, an entry at tau")
    y = TF.sparsemax(x.detach())
    assert (y[3:, 3] == 0).all() and (y[:3, 1] == 0).all() and (y[:3, 0] == 1).all()


@pytest.mark.parametrize("dim", [0, 1])
def test_sparsemax_over_other_dims(dim):
    x = randn((5, 6, 7), torch.float32, scale=0.5, requires_grad=True)
    check_op(lambda x: TF.sparsemax(x, dim), lambda x: sparsemax_ref(x, dim), [x], dtype=torch.float32,
             what=f"sparsemax dim={dim}")


def test_sparsemax_expanded_input_and_retained_graph():
    base = randn((1, 45), torch.float32, scale=0.3, requires_grad=True)
    check_op(lambda b: TF.sparsemax(b.expand(6, 45)), lambda b: sparsemax_ref(b.expand(6, 45)), [base],
             dtype=torch.float32)
    x = randn((7, 48), torch.float32, scale=0.3, requires_grad=True)
    loss = (TF.sparsemax(x) * randn((7, 48), torch.float32)).sum()
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * once) and (once != 0).any()


def test_sparsemax_non_finite_values():
    """-inf entries are masked out (0, the rest as if they were absent); rows with NaN or +inf,
    or only -inf, are NaN, and so is their gradient."""
    x = randn((5, 9), torch.float32)
    x[0, 2] = x[0, 7] = float("-inf")
    x[1] = float("-inf")
    x[2, 3] = float("inf")
    x[3, 8] = float("nan")
    x.requires_grad_()
    y = TF.sparsemax(x)
    kept = [c for c in range(9) if c not in (2, 7)]
    torch.testing.assert_close(y[0, kept], sparsemax_ref(x.detach()[0, kept].double()).float())
    assert (y[0, [2, 7]] == 0).all() and y[1:4].isnan().all()
    torch.testing.assert_close(y[4], sparsemax_ref(x.detach()[4].double()).float())
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert g[1:4].isnan().all() and not g[[0, 4]].isnan().any()


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_sparsemax_empty(shape):
    x = randn(shape, torch.float32, requires_grad=True)
    y = TF.sparsemax(x)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape


def test_sparsemax_module():
    from tigon.nn import TigonSparsemax

    x = randn((4, 5, 6), torch.bfloat16, requires_grad=True)
    check_op(TigonSparsemax(1), lambda x: sparsemax_ref(x, 1), [x], dtype=torch.bfloat16, what="TigonSparsemax(1)")


def test_sparsemax_bad_inputs():
    x = randn((4, 16), torch.float32)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        TF.sparsemax(x.double())
    with pytest.raises(ValueError, match="dim -3 is out of range"):
        TF.sparsemax(x, -3)
    with pytest.raises(ValueError, match="x's dim of size 65537 is larger than the supported maximum 65536"):
        TF.sparsemax(torch.zeros(1, 65537, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        TF.sparsemax(None)


def test_sparsemax_custom_ops_pass_opcheck():
    from tigon.ops.sparsemax import sparsemax_backward_op, sparsemax_op

    x = randn((3, 5, 37), torch.float32, non_contiguous=True, scale=0.3, requires_grad=True)
    assert set(torch.library.opcheck(sparsemax_op.library_op, (x,)).values()) == {"SUCCESS"}
    y = sparsemax_op(x.detach())
    dy = randn((3, 5, 37), torch.float32)
    assert set(torch.library.opcheck(sparsemax_backward_op.library_op, (dy, y)).values()) == {"SUCCESS"}
