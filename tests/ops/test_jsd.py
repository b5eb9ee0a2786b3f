
import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn, rel_err
from tigon import functional as TF
from tigon.ops.jsd import jsd_rows
from tigon.reference import jsd_rows_ref, linear_jsd_ref

# (rows, student hidden, teacher hidden, vocab): odd sizes; V over one kernel block on the CPU.
SHAPES = pick(cpu=[(13, 24, 40, 301), (4, 16, 8, 9001)], gpu=[(2048, 4096, 2048, 128256), (999, 1024, 1536, 32001)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_linear_jsd_matches_reference(shape, dtype, beta, temperature):
    n, hs, ht, v = shape
    x = randn((n, hs), dtype, requires_grad=True)
    w = randn((v, hs), dtype, scale=hs**-0.5 * 3, requires_grad=True)
    b = randn((v,), dtype, scale=0.5, requires_grad=True) if beta == 0.5 else None
    tx = randn((n, ht), dtype)
    tw = randn((v, ht), dtype, scale=ht**-0.5 * 3)
    check_op(lambda x, w, b: TF.linear_jsd(x, w, tx, tw, b, beta=beta, temperature=temperature),
             lambda x, w, b: linear_jsd_ref(x, w, tx.to(x.dtype), tw.to(x.dtype), b, beta, temperature),
             [x, w, b], dtype=dtype, tol=1e-4 if dtype == torch.float32 else 3e-2,
             noise_floor=4 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0,
             what=f"linear_jsd[beta={beta}, T={temperature}]")


def test_linear_jsd_identical_models_give_zero():
    """Student == teacher: every divergence is 0 and so is its gradient."""
    x = randn((7, 16), torch.float32, requires_grad=True)
    w = randn((301, 16), torch.float32, requires_grad=True)
    for beta in (0.0, 0.3, 1.0):
        loss = TF.linear_jsd(x, w, x.detach(), w.detach(), beta=beta)
        assert loss.abs().max() < 1e-5
        (gx,) = torch.autograd.grad(loss.sum(), x)
        assert gx.abs().max() < 1e-5


def test_linear_jsd_bad_inputs():
    x, w = randn((4, 8), torch.float32), randn((10, 8), torch.float32)
    with pytest.raises(ValueError, match="beta"):
        TF.linear_jsd(x, w, x, w, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        TF.linear_jsd(x, w, x, w, temperature=0.0)
    with pytest.raises(ValueError, match="teacher_x"):
        TF.linear_jsd(x, w, randn((5, 8), torch.float32), w)
    with pytest.raises(ValueError, match="vocabularies"):
        TF.linear_jsd(x, w, x, randn((11, 8), torch.float32))
    with pytest.raises(ValueError, match="teacher_weight"):
        TF.linear_jsd(x, w, x, randn((10, 7), torch.float32))


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("offsets", [(1e4, 1e4), (1e4, 0.0)])
def test_jsd_kernel_large_logits_keep_precision(beta, temperature, offsets):
    """Logits of 1e4 + randn (fp32): log-probs are formed from the row maximum, (a - m) - log d,
    not as a - lse with lse rounded at 1e4, so the loss and gradient stay as close to float64 as
    eager fp32 torch's (which forms log_softmax the same way). The rows span several blocks."""
    n, v = 3, 9001
    s = randn((n, v), torch.float32, shift=offsets[0])
    t = randn((n, v), torch.float32, scale=2.0, shift=offsets[1])
    grad = torch.empty_like(s)
    loss = jsd_rows(s, t, grad, beta, temperature)
    s64 = s.double().requires_grad_()
    ref = jsd_rows_ref(s64, t.double(), beta, temperature)
    (ref_grad,) = torch.autograd.grad(ref.sum(), s64)
    s32 = s.clone().requires_grad_()
    eager = jsd_rows_ref(s32, t, beta, temperature)
    (eager_grad,) = torch.autograd.grad(eager.sum(), s32)
    for name, ours, theirs, exact in (("loss", loss, eager, ref), ("grad", grad, eager_grad, ref_grad)):
        err, eager_err = rel_err(ours, exact), rel_err(theirs, exact)
        assert err <= max(4 * eager_err, 1e-5), f"{name}: relative error {err:.3g}, eager fp32 torch {eager_err:.3g}"


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf - inf
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_jsd_kernel_masked_vocabulary(temperature):
    """Forward KL over logits whose whole first block (8192 wide) is -inf (a masked vocabulary):
    row 0 the student's only, row 1 both, row 2 neither. The gradient (P - Q) / T is finite and
    torch's (the online log-sum-exp once formed exp(-inf + inf): a NaN row); the loss is torch's,
    +inf in row 0 (row 1's is NaN in torch too: 0 * (-inf + inf), so not compared)."""
    n, v = 3, 9001
    s = randn((n, v), torch.float32, scale=2.0)
    t = randn((n, v), torch.float32, scale=2.0)
    s[:2, :8192] = float("-inf")
    t[1, :8192] = float("-inf")
    grad = torch.empty_like(s)
    loss = jsd_rows(s, t, grad, 0.0, temperature)
    s64 = s.double().requires_grad_()
    ref = jsd_rows_ref(s64, t.double(), 0.0, temperature)
    (ref_grad,) = torch.autograd.grad(ref.sum(), s64)
    assert ref_grad.isfinite().all() and not grad.isnan().any()
    assert rel_err(grad, ref_grad) <= 1e-5
    assert loss[0] == ref[0] == float("inf")
    assert rel_err(loss[2], ref[2]) <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compute_grad", [True, False])
def test_linear_jsd_opcheck(bias, compute_grad):
    """torch.library.opcheck of tigon::linear_jsd: schema, autograd registration, fake tensor
    (both outputs) and AOT dispatch with dynamic shapes, gradients included."""
    n, hs, ht, v = 7, 12, 10, 37
    x = randn((n, hs), torch.float32, requires_grad=compute_grad)
    w = randn((v, hs), torch.float32, scale=hs**-0.5 * 3, requires_grad=compute_grad)
    b = randn((v,), torch.float32, scale=0.5, requires_grad=compute_grad) if bias else None
    tx, tw = randn((n, ht), torch.float32), randn((v, ht), torch.float32, scale=ht**-0.5 * 3)
    tb = randn((v,), torch.float32, scale=0.5) if bias else None
    for beta, temperature in ((0.0, 1.0), (0.3, 2.0)):
        result = torch.library.opcheck(torch.ops.tigon.linear_jsd.default,
                                       (x, w, b, tx, tw, tb, beta, temperature, compute_grad))
        assert set(result.values()) == {"SUCCESS"}, result


def test_linear_jsd_compiles_without_graph_breaks():
    """torch.compile (aot_eager, dynamic shapes) traces linear_jsd in one graph with eager's
    values and gradients, for two batch sizes."""
    hs, ht, v = 12, 10, 37

    def fn(x, w, b, tx, tw, scale):
        return (TF.linear_jsd(x, w, tx, tw, b, beta=0.4, temperature=2.0) * scale).sum()

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (5, 8):
        x = randn((rows, hs), torch.float32, requires_grad=True)
        w = randn((v, hs), torch.float32, scale=hs**-0.5 * 3, requires_grad=True)
        b = randn((v,), torch.float32, scale=0.5, requires_grad=True)
        tx, tw = randn((rows, ht), torch.float32), randn((v, ht), torch.float32, scale=ht**-0.5 * 3)
        scale = torch.rand(rows, device=DEVICE) + 0.5
        explained = torch._dynamo.explain(fn)(x, w, b, tx, tw, scale)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        out = compiled(x, w, b, tx, tw, scale)
        grads = torch.autograd.grad(out, (x, w, b))
        ref = fn(x, w, b, tx, tw, scale)
        ref_grads = torch.autograd.grad(ref, (x, w, b))
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
