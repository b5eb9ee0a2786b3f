"""tigon.functional.kl_div against torch.nn.functional.kl_div in float64, forward and backward
(input and target), every reduction, log_target, strided / expanded / mixed-dtype inputs, the
gradient formed in the forward under retained graphs and scaled losses, zeros in the target,
empty inputs, bad arguments."""


import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn
from tigon import functional as TF
from tigon.reference import kl_div_ref

REDUCTIONS = ["batchmean", "sum", "mean", "none"]
# (leading shape, V): 5001 spans three 2048-wide chunks; 37 puts 32 rows in a program (150: 5).
SHAPES = pick(cpu=[((2, 3), 5001), ((150,), 37)], gpu=[((2048,), 128256), ((3, 1001), 32001)])


def inputs(lead, v, dtype, log_target, *, target_dtype=None, non_contiguous=False, grad_target=True):
    x = torch.log_softmax(randn((*lead, v), torch.float32, scale=2.0), -1).to(dtype)
    t = randn((*lead, v), torch.float32, scale=2.0)
    t = (torch.log_softmax(t, -1) if log_target else torch.softmax(t, -1)).to(target_dtype or dtype)
    if non_contiguous:
        x, t = (torch.cat([a, a[..., :7]], -1)[..., :v] for a in (x, t))
        assert not x.is_contiguous()
    return x.requires_grad_(), t.requires_grad_(grad_target)


def floor(dtype):
    """A reduction's gradient is stored in the input's dtype in the forward and scaled by
    grad_output in the backward (as tigon's cross entropy): two bf16 roundings to eager's one."""
    return 2 * 2**-8 if dtype == torch.bfloat16 else None


def check_kl(x, t, reduction, log_target, dtype, what):
    check_op(lambda x, t: TF.kl_div(x, t, reduction=reduction, log_target=log_target),
             lambda x, t: kl_div_ref(x, t, reduction, log_target), [x, t], dtype=dtype, what=what,
             noise_floor=floor(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_matches_torch(shape, dtype, reduction, log_target):
    x, t = inputs(*shape, dtype, log_target)
    check_kl(x, t, reduction, log_target, dtype, f"kl_div[{reduction}, log_target={log_target}]{shape}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_div_strided_expanded_mixed_dtypes_and_one_dim(reduction):
    """Row-padded views; a target expanded from one row (stride 0; its gradient sums over the
    rows); a bf16 input with an fp32 target; a 1-D input ("batchmean" divides by V, as torch)."""
    lead, v = SHAPES[0]
    x, t = inputs(lead, v, torch.float32, False, non_contiguous=True)
    check_kl(x, t, reduction, False, torch.float32, f"kl_div strided[{reduction}]")
    row = torch.softmax(randn((1, v), torch.float32), -1).requires_grad_()
    check_op(lambda x, row: TF.kl_div(x, row.expand(*lead, v), reduction=reduction),
             lambda x, row: kl_div_ref(x, row.expand(*lead, v), reduction, False), [x, row], dtype=torch.float32,
             what=f"kl_div target stride 0[{reduction}]")
    x, t = inputs(lead, v, torch.bfloat16, True, target_dtype=torch.float32)
    check_kl(x, t, reduction, True, torch.bfloat16, f"kl_div bf16 input, fp32 target[{reduction}]")
    x, t = inputs((), 301, torch.float32, False)
    check_kl(x, t, reduction, False, torch.float32, f"kl_div 1-D[{reduction}]")


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_div_retained_graph_and_scaled_loss(reduction, dtype):
    """backward(retain_graph=True) three times gives exactly 3x the gradients formed in the
    forward (the saved buffers are left alone); 0.5 * loss gives exactly half."""
    lead, v = SHAPES[0]
    x, t = inputs(lead, v, dtype, False)
    TF.kl_div(x, t, reduction=reduction).backward()
    single = [x.grad.clone(), t.grad.clone()]
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in single)
    x.grad = t.grad = None
    loss = TF.kl_div(x, t, reduction=reduction)
    for k in (1, 2, 3):
        loss.backward(retain_graph=True)
        assert torch.equal(x.grad, single[0] * k) and torch.equal(t.grad, single[1] * k), f"backward {k}"
    loss.backward()  # graph freed after this one: the saved gradients may be scaled in place
    assert torch.equal(x.grad, single[0] * 4) and torch.equal(t.grad, single[1] * 4)
    x.grad = t.grad = None
    (0.5 * TF.kl_div(x, t, reduction=reduction)).backward()
    assert torch.equal(x.grad, single[0] * 0.5) and torch.equal(t.grad, single[1] * 0.5)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_kl_div_zero_and_negative_targets_as_torch(reduction):
    """t == 0 contributes 0 to the loss (torch's xlogy) and its target gradient is NaN (torch's
    too); t < 0 gives NaN; -inf input where t == 0 gives NaN (0 * -inf), as torch."""
    x, t = inputs((4,), 9, torch.float32, False)
    t = t.detach().clone()
    t[0, :3] = 0.0
    t[1, 2] = -0.5
    x = x.detach().clone()
    x[2, 4] = float("-inf")
    t[2, 4] = 0.0
    got, want = [], []
    for fn, out in ((TF.kl_div, got), (torch.nn.functional.kl_div, want)):
        xs, ts = x.clone().requires_grad_(), t.clone().requires_grad_()
        loss = fn(xs, ts, reduction=reduction)
        out += [loss, *torch.autograd.grad(loss, [xs, ts], torch.ones_like(loss))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
    if reduction == "none":
        assert (got[0][0, :3] == 0).all() and got[2][0, :3].isnan().all()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_div_empty(shape, reduction):
    """As torch: "sum" 0; "mean" and a batchmean over no rows NaN; gradients empty."""
    x = randn(shape, torch.float32, requires_grad=True)
    t = randn(shape, torch.float32).abs().requires_grad_()
    loss = TF.kl_div(x, t, reduction=reduction)
    want = kl_div_ref(x.detach(), t.detach(), reduction, False)
    assert loss.shape == want.shape
    torch.testing.assert_close(loss, want, equal_nan=True)
    loss.sum().backward()
    assert x.grad.shape == shape and t.grad.shape == shape


def test_kl_div_without_gradient():
    lead, v = SHAPES[0]
    x, t = inputs(lead, v, torch.float32, False)
    with torch.no_grad():
        quiet = TF.kl_div(x, t)
    assert not quiet.requires_grad
    assert torch.equal(TF.kl_div(x.detach(), t.detach()), quiet)
    torch.testing.assert_close(quiet, kl_div_ref(x.detach(), t.detach(), "batchmean", False))


def test_kl_div_module():
    from tigon.nn import TigonKLDivLoss

    x, t = inputs(*SHAPES[0], torch.float32, True)
    ours = TigonKLDivLoss(reduction="sum", log_target=True)
    check_op(ours, torch.nn.KLDivLoss(reduction="sum", log_target=True), [x, t], dtype=torch.float32)
    assert "log_target=True" in repr(ours) and TigonKLDivLoss().reduction == "batchmean"


def test_kl_div_bad_inputs():
    x, t = inputs((4,), 16, torch.float32, False)
    with pytest.raises(ValueError, match="target has shape"):
        TF.kl_div(x, t[:, :-1])
    with pytest.raises(TypeError, match="input has dtype torch.float64"):
        TF.kl_div(x.double(), t)
    with pytest.raises(TypeError, match="target must be a floating-point tensor"):
        TF.kl_div(x, t.long())
    with pytest.raises(ValueError, match="reduction must be one of"):
        TF.kl_div(x, t, reduction="avg")
    with pytest.raises(TypeError, match="log_target must be a bool"):
        TF.kl_div(x, t, log_target="yes")
    with pytest.raises(TypeError, match="target must be a torch.Tensor"):
        TF.kl_div(x, [0.5, 0.5])
    with pytest.raises(ValueError, match="input must have at least 1 dimension"):
        TF.kl_div(x[0, 0], t[0, 0])


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_kl_div_custom_ops_pass_opcheck(reduction):
    from tigon.ops.kl_div import kl_div_backward_op, kl_div_op

    x, t = inputs((3, 5), 37, torch.float32, False, non_contiguous=True)
    args = (x, t, reduction, False, True, True)
    assert set(torch.library.opcheck(kl_div_op.library_op, args).values()) == {"SUCCESS"}
    dy = randn((3, 5, 37), torch.float32)
    args = (dy, x.detach(), t.detach(), True, True, True)
    assert set(torch.library.opcheck(kl_div_backward_op.library_op, args).values()) == {"SUCCESS"}
