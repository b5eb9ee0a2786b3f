"""tigon.functional.jsd: generalised JSD over log-probabilities (Liger's LigerJSD semantics)
against a float64 torch reference of the per-element formula, forward and backward."""


import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tigon import functional as TF
from tigon.reference import jsd_ref

# (leading shape, vocab): odd sizes; 9001 spans three of the kernel's 4096-wide blocks.
SHAPES = pick(cpu=[((13,), 301), ((2, 3), 9001)], gpu=[((2048,), 128256), ((3, 333), 32001)])


def logprobs(lead, v, dtype, *, non_contiguous=False, scale=2.0, requires_grad=False):
    """log_softmax rows of random logits, in dtype; non_contiguous: rows padded (row stride > V)."""
    lp = torch.log_softmax(randn((*lead, v), torch.float32, scale=scale), -1).to(dtype)
    if non_contiguous:
        wide = torch.full((*lead, v + 7), float("nan"), dtype=dtype, device=DEVICE)
        wide[..., :v] = lp
        lp = wide[..., :v]
        assert not lp.is_contiguous()
    return lp.requires_grad_(requires_grad)


def make_target(lead, v, ignore, ignore_index=-100):
    target = torch.randint(0, v, lead, device=DEVICE)
    flat = target.view(-1)
    if ignore == "some":
        flat[0] = ignore_index
        flat[-1] = ignore_index
        flat[flat.numel() // 2] = ignore_index
    elif ignore == "all":
        flat.fill_(ignore_index)
    return target


def floor(dtype):
    """The gradient is stored in the student's dtype in the forward and scaled by grad_output in
    the backward (as Liger's, and tigon's cross entropy): two bf16 roundings to eager's one."""
    return 2 * 2**-8 if dtype == torch.bfloat16 else None


def check_jsd(x, y, target, beta, dtype, what, ignore_index=-100):
    check_op(lambda x: TF.jsd(x, y, target, beta=beta, ignore_index=ignore_index),
             lambda x: jsd_ref(x, y.to(x.dtype), target, beta, ignore_index), [x], dtype=dtype, what=what,
             noise_floor=floor(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
@pytest.mark.parametrize("ignore", ["none", "some", "all", "no target"])
def test_jsd_matches_reference(shape, dtype, beta, ignore):
    lead, v = shape
    x = logprobs(lead, v, dtype, requires_grad=True)
    y = logprobs(lead, v, dtype, scale=3.0)
    target = None if ignore == "no target" else make_target(lead, v, ignore)
    check_jsd(x, y, target, beta, dtype, f"jsd[beta={beta}, {ignore}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_jsd_strided_expanded_and_mixed_dtype_inputs(dtype, beta):
    """Row-padded views, a teacher expanded from one row (stride 0), a student expanded from
    one row (its gradient sums over the rows), an fp32 teacher for a low-precision student."""
    (lead, v) = SHAPES[0]
    target = make_target(lead, v, "some")
    x = logprobs(lead, v, dtype, non_contiguous=True, requires_grad=True)
    y = logprobs(lead, v, dtype, non_contiguous=True, scale=3.0)
    check_jsd(x, y, target, beta, dtype, f"jsd strided[beta={beta}]")
    y_row = logprobs((1,), v, dtype).expand(*lead, v)
    check_jsd(x, y_row, target, beta, dtype, f"jsd teacher stride 0[beta={beta}]")
    x_row = logprobs((1,), v, dtype, requires_grad=True)
    check_op(lambda x_row: TF.jsd(x_row.expand(*lead, v), y, target, beta=beta),
             lambda x_row: jsd_ref(x_row.expand(*lead, v), y.to(x_row.dtype), target, beta), [x_row], dtype=dtype,
             what=f"jsd student stride 0[beta={beta}]", noise_floor=floor(dtype))
    y32 = logprobs(lead, v, torch.float32, scale=3.0)
    loss = TF.jsd(x, y32, target, beta=beta)
    (g,) = torch.autograd.grad(loss, x)
    x64 = x.detach().double().requires_grad_()
    ref = jsd_ref(x64, y32.double(), target, beta)
    (g_ref,) = torch.autograd.grad(ref, x64)
    assert torch.allclose(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(g.double(), g_ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_jsd_aliased_student_and_teacher():
    """The same tensor as student and (detached) teacher: a zero loss; the gradient is still
    the per-element formula's (-Q for beta 0, P for beta 1, 0 between), to the student only."""
    lead, v = SHAPES[0]
    x = logprobs(lead, v, torch.float32, requires_grad=True)
    for beta in (0.0, 0.5, 1.0):
        loss = TF.jsd(x, x, beta=beta)
        assert abs(loss.item()) < 1e-6
        (g,) = torch.autograd.grad(loss, x)
        x64 = x.detach().double().requires_grad_()
        (g_ref,) = torch.autograd.grad(jsd_ref(x64, x64.detach(), None, beta), x64)
        assert torch.allclose(g.double(), g_ref, rtol=1e-5, atol=1e-8)
        assert (g_ref != 0).all() if beta in (0.0, 1.0) else g_ref.abs().max() < 1e-12  # -Q, P, 0


def test_jsd_ignored_rows_are_not_read_and_all_ignored_gives_zero():
    lead, v = SHAPES[0]
    ignore_index = 3  # a label value like any other: rows whose target is 3 are ignored
    target = torch.randint(0, 7, lead, device=DEVICE)
    target[0] = target[-1] = ignore_index
    x = logprobs(lead, v, torch.float32)
    y = logprobs(lead, v, torch.float32)
    keep = target != ignore_index
    x[~keep] = float("nan")  # padding rows may hold anything
    y[~keep] = float("inf")
    x.requires_grad_()
    for beta in (0.0, 1.0, 0.5):
        loss = TF.jsd(x, y, target, beta=beta, ignore_index=ignore_index)
        (g,) = torch.autograd.grad(loss, x)
        x64 = x.detach().double().requires_grad_()
        ref = jsd_ref(x64, y.double(), target, beta, ignore_index)
        (g_ref,) = torch.autograd.grad(ref, x64)
        assert torch.allclose(loss.double(), ref, rtol=1e-5), (loss, ref)
        assert torch.isfinite(g).all() and torch.equal(g[~keep], torch.zeros_like(g[~keep]))
        assert torch.allclose(g.double(), g_ref, rtol=1e-5, atol=1e-8)
        strided = torch.stack((target, target + 1), -1)[..., 0]  # the same labels, read with a stride
        assert not strided.is_contiguous() and torch.equal(TF.jsd(x, y, strided, beta=beta, ignore_index=ignore_index),
                                                           loss)
        everything = torch.full_like(target, ignore_index)
        loss = TF.jsd(x, y, everything, beta=beta, ignore_index=ignore_index)
        (g,) = torch.autograd.grad(loss, x)
        assert loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_jsd_retained_graph_and_scaled_loss(dtype, beta):
    """backward(retain_graph=True) three times gives exactly 3x the gradient (the saved
    gradient is not handed to autograd, which would accumulate into it); 0.5 * loss gives
    exactly half; a last backward without retain_graph may reuse the buffer and is still right."""
    lead, v = SHAPES[0]
    target = make_target(lead, v, "some")
    x = logprobs(lead, v, dtype, requires_grad=True)
    y = logprobs(lead, v, dtype)
    TF.jsd(x, y, target, beta=beta).backward()
    single = x.grad.clone()
    assert torch.isfinite(single).all() and single.abs().sum() > 0
    x.grad = None
    loss = TF.jsd(x, y, target, beta=beta)
    for k in (1, 2, 3):
        loss.backward(retain_graph=True)
        assert torch.equal(x.grad, single * k), f"backward {k}: not {k}x the single gradient"
    loss.backward()  # graph freed after this one
    assert torch.equal(x.grad, single * 3 + single)
    x.grad = None
    (0.5 * TF.jsd(x, y, target, beta=beta)).backward()
    assert torch.equal(x.grad, single * 0.5)
    x.grad = None
    half = 0.5 * TF.jsd(x, y, target, beta=beta)
    half.backward(retain_graph=True)
    half.backward()
    assert torch.equal(x.grad, single)


def test_jsd_without_gradient():
    lead, v = SHAPES[0]
    x = logprobs(lead, v, torch.float32, requires_grad=True)
    y = logprobs(lead, v, torch.float32)
    with torch.no_grad():
        quiet = TF.jsd(x, y, beta=0.5)
    assert torch.allclose(quiet.double(), jsd_ref(x.detach().double(), y.double(), None, 0.5), rtol=1e-5)
    assert not quiet.requires_grad
    assert torch.equal(TF.jsd(x.detach(), y, beta=0.5), quiet)


def test_jsd_bad_inputs_are_clear_errors():
    lead, v = SHAPES[0]
    x, y = logprobs(lead, v, torch.float32), logprobs(lead, v, torch.float32)
    with pytest.raises(ValueError, match="beta"):
        TF.jsd(x, y, beta=1.5)
    with pytest.raises(TypeError, match="beta"):
        TF.jsd(x, y, beta="half")
    with pytest.raises(ValueError, match="teacher_logprobs"):
        TF.jsd(x, y[:, :-1])
    with pytest.raises(ValueError, match="target"):
        TF.jsd(x, y, torch.zeros(lead[0] + 1, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="target"):
        TF.jsd(x, y, torch.zeros(lead, device=DEVICE))
    with pytest.raises(TypeError, match="student_logprobs"):
        TF.jsd(x.double(), y)
    with pytest.raises(TypeError, match="ignore_index"):
        TF.jsd(x, y, ignore_index=None)


@pytest.mark.parametrize("ignore", ["no target", "some"])
@pytest.mark.parametrize("compute_grad", [True, False])
def test_jsd_opcheck(ignore, compute_grad):
    """torch.library.opcheck of tigon::jsd (a student with padded rows, odd sizes): schema,
    autograd registration, fake tensor and AOT dispatch with dynamic shapes, gradients included
    (a traced backward takes the out-of-place tigon::jsd_backward)."""
    lead, v = (2, 3), 37
    x = logprobs(lead, v, torch.float32, non_contiguous=True, requires_grad=compute_grad)
    y = logprobs(lead, v, torch.float32)
    target = None if ignore == "no target" else make_target(lead, v, ignore)
    for beta in (0.0, 0.5, 1.0):
        result = torch.library.opcheck(torch.ops.tigon.jsd.default, (x, y, target, beta, -100, compute_grad))
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("dtype", DTYPES)
def test_jsd_backward_opcheck(dtype):
    """tigon::jsd_backward (grad * grad_output into a new tensor; linear, so differentiable)."""
    grad = randn((2, 3, 37), dtype, requires_grad=True)
    scale = torch.tensor(0.7, device=DEVICE, requires_grad=True)
    result = torch.library.opcheck(torch.ops.tigon.jsd_backward.default, (grad, scale))
    assert set(result.values()) == {"SUCCESS"}, result
    out = torch.ops.tigon.jsd_backward(grad, scale)
    assert out.dtype == dtype and torch.equal(out, (grad.float() * scale.float()).to(dtype))


def test_jsd_compiles_without_graph_breaks():
    """torch.compile (aot_eager, dynamic shapes) traces jsd (behind a log_softmax, a scaled
    loss) in one graph and gives eager's loss and gradient, for two batch sizes."""
    v = 37

    def fn(x, y, target):
        return 3.0 * TF.jsd(torch.log_softmax(x, -1), y, target, beta=0.3)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (4, 6):
        x = randn((rows, v), torch.float32, requires_grad=True)
        y = logprobs((rows,), v, torch.float32)
        target = make_target((rows,), v, "some")
        explained = torch._dynamo.explain(fn)(x, y, target)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        out = compiled(x, y, target)
        (g,) = torch.autograd.grad(out, x)
        ref = fn(x, y, target)
        (g_ref,) = torch.autograd.grad(ref, x)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)
