"""tigon.functional.tvd (Liger's LigerTVDLoss semantics) against a float64 torch reference,
forward and backward (p and q), every reduction, ignored rows, strided / expanded / mixed-dtype
inputs, the gradient formed in the forward under retained graphs and scaled losses, ties and
non-finite values, bad arguments."""

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tigon import functional as TF
from tigon.reference import tvd_ref

REDUCTIONS = ["batchmean", "sum", "mean", "none"]
# (leading shape, V): 5001 spans three 2048-wide chunks; 37 puts 32 rows in a program (150: 5).
SHAPES = pick(cpu=[((2, 3), 5001), ((150,), 37)], gpu=[((2048,), 128256), ((3, 1001), 32001)])


def probs(lead, v, dtype, *, scale=2.0, non_contiguous=False, requires_grad=True):
    t = torch.softmax(randn((*lead, v), torch.float32, scale=scale), -1).to(dtype)
    if non_contiguous:
        t = torch.cat([t, t[..., :7]], -1)[..., :v]
        assert not t.is_contiguous()
    return t.requires_grad_(requires_grad)


def make_labels(lead, v, ignore, ignore_index=-100):
    labels = torch.randint(0, v, lead, device=DEVICE)
    flat = labels.view(-1)
    if ignore == "some":
        flat[0] = flat[-1] = flat[flat.numel() // 2] = ignore_index
    elif ignore == "all":
        flat.fill_(ignore_index)
    return labels


def floor(dtype):
    """The gradient is stored in p's dtype in the forward and scaled in the backward."""
    return 2 * 2**-8 if dtype == torch.bfloat16 else None


def check_tvd(p, q, labels, reduction, dtype, what, ignore_index=-100):
    check_op(lambda p, q: TF.tvd(p, q, labels, reduction=reduction, ignore_index=ignore_index),
             lambda p, q: tvd_ref(p, q, labels, reduction, ignore_index), [p, q], dtype=dtype, what=what,
             noise_floor=floor(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore", ["no labels", "some"])
def test_tvd_matches_reference(shape, dtype, reduction, ignore):
    lead, v = shape
    p, q = probs(lead, v, dtype), probs(lead, v, dtype, scale=3.0)
    labels = None if ignore == "no labels" else make_labels(lead, v, ignore)
    check_tvd(p, q, labels, reduction, dtype, f"tvd[{reduction}, {ignore}]{shape}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tvd_all_ignored_gives_zero(reduction):
    lead, v = SHAPES[1]
    p, q = probs(lead, v, torch.float32), probs(lead, v, torch.float32)
    labels = make_labels(lead, v, "all")
    loss = TF.tvd(p, q, labels, reduction=reduction)
    gp, gq = torch.autograd.grad(loss, [p, q], torch.ones_like(loss))
    assert not loss.any() and not gp.any() and not gq.any()


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_tvd_strided_expanded_flat_labels_and_mixed_dtypes(reduction):
    """Row-padded views; q expanded from one row (stride 0; its gradient sums over the rows);
    labels flat, and read with a stride; a bf16 p with an fp32 q."""
    lead, v = SHAPES[0]
    labels = make_labels(lead, v, "some")
    p, q = probs(lead, v, torch.float32, non_contiguous=True), probs(lead, v, torch.float32, non_contiguous=True)
    check_tvd(p, q, labels, reduction, torch.float32, f"tvd strided[{reduction}]")
    row = probs((1,), v, torch.float32)
    check_op(lambda p, row: TF.tvd(p, row.expand(*lead, v), labels.reshape(-1), reduction=reduction),
             lambda p, row: tvd_ref(p, row.expand(*lead, v), labels, reduction), [p, row], dtype=torch.float32,
             what=f"tvd q stride 0[{reduction}]")
    strided = torch.stack((labels, labels + 1), -1)[..., 0]
    assert not strided.is_contiguous()
    check_tvd(p, q, strided, reduction, torch.float32, f"tvd strided labels[{reduction}]")
    p16, q32 = probs(lead, v, torch.bfloat16), probs(lead, v, torch.float32)
    check_tvd(p16, q32, labels, reduction, torch.bfloat16, f"tvd bf16 p, fp32 q[{reduction}]")


def test_tvd_ignored_rows_are_not_read_and_ties_get_no_gradient():
    """Ignored rows may hold anything (NaN, inf): a finite loss and zero gradients there; where
    p == q the gradient is 0 (torch's abs); ignore_index may be any label value."""
    lead, v = SHAPES[1]
    ignore_index = 3
    labels = torch.randint(0, 7, lead, device=DEVICE)
    labels[0] = labels[-1] = ignore_index
    p, q = probs(lead, v, torch.float32, requires_grad=False), probs(lead, v, torch.float32, requires_grad=False)
    keep = labels != ignore_index
    p[~keep] = float("nan")
    q[~keep] = float("inf")
    q[keep, :5] = p[keep, :5]
    p.requires_grad_()
    q.requires_grad_()
    for reduction in REDUCTIONS:
        loss = TF.tvd(p, q, labels, reduction=reduction, ignore_index=ignore_index)
        gp, gq = torch.autograd.grad(loss, [p, q], torch.ones_like(loss))
        assert torch.isfinite(loss).all() and not gp[~keep].any() and not gq[~keep].any()
        assert not gp[keep, :5].any() and torch.equal(gq, -gp)
        p64, q64 = p.detach().double().requires_grad_(), q.detach().double()
        want = tvd_ref(p64, q64, labels, reduction, ignore_index)
        (wp,) = torch.autograd.grad(want, [p64], torch.ones_like(want))
        torch.testing.assert_close(loss.double(), want.nan_to_num(0.0), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gp[keep].double(), wp[keep])


def test_tvd_nan_in_a_kept_row():
    """A NaN in a kept row makes the loss NaN; its gradient there is 0, as torch's abs gives."""
    p, q = probs((4,), 9, torch.float32, requires_grad=False), probs((4,), 9, torch.float32)
    p[1, 2] = float("nan")
    p.requires_grad_()
    loss = TF.tvd(p, q, reduction="sum")
    gp, gq = torch.autograd.grad(loss, [p, q])
    want = tvd_ref(p.detach(), q.detach(), None, "sum")
    assert loss.isnan() and want.isnan() and gp[1, 2] == 0 and gq[1, 2] == 0 and torch.isfinite(gp).all()


@pytest.mark.parametrize("reduction", ["batchmean", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tvd_retained_graph_and_scaled_loss(reduction, dtype):
    lead, v = SHAPES[0]
    labels = make_labels(lead, v, "some")
    p, q = probs(lead, v, dtype), probs(lead, v, dtype)
    TF.tvd(p, q, labels, reduction=reduction).backward()
    single = [p.grad.clone(), q.grad.clone()]
    assert single[0].abs().sum() > 0
    p.grad = q.grad = None
    loss = TF.tvd(p, q, labels, reduction=reduction)
    for k in (1, 2, 3):
        loss.backward(retain_graph=True)
        assert torch.equal(p.grad, single[0] * k) and torch.equal(q.grad, single[1] * k), f"backward {k}"
    loss.backward()
    assert torch.equal(p.grad, single[0] * 4) and torch.equal(q.grad, single[1] * 4)
    p.grad = q.grad = None
    (0.5 * TF.tvd(p, q, labels, reduction=reduction)).backward()
    assert torch.equal(p.grad, single[0] * 0.5) and torch.equal(q.grad, single[1] * 0.5)


def test_tvd_only_p_requires_grad_and_no_grad():
    lead, v = SHAPES[1]
    p, q = probs(lead, v, torch.float32), probs(lead, v, torch.float32, requires_grad=False)
    (g,) = torch.autograd.grad(TF.tvd(p, q), [p])
    p64 = p.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(tvd_ref(p64, q.double(), None, "batchmean"), [p64])
    torch.testing.assert_close(g.double(), want)
    with torch.no_grad():
        quiet = TF.tvd(p, q)
    assert not quiet.requires_grad and torch.equal(quiet, TF.tvd(p.detach(), q))


def test_tvd_module():
    from tigon.nn import TigonTVDLoss

    lead, v = SHAPES[1]
    labels = make_labels(lead, v, "some", ignore_index=-1)
    p, q = probs(lead, v, torch.float32), probs(lead, v, torch.float32)
    ours = TigonTVDLoss(reduction="mean", ignore_index=-1)
    check_op(lambda p, q: ours(p, q, labels), lambda p, q: tvd_ref(p, q, labels, "mean", -1), [p, q],
             dtype=torch.float32)
    assert "ignore_index=-1" in repr(ours) and TigonTVDLoss().reduction == "batchmean"


def test_tvd_bad_inputs():
    lead, v = (4,), 16
    p, q = probs(lead, v, torch.float32), probs(lead, v, torch.float32)
    with pytest.raises(ValueError, match="q has shape"):
        TF.tvd(p, q[:, :-1])
    with pytest.raises(TypeError, match="p has dtype torch.float64"):
        TF.tvd(p.double(), q)
    with pytest.raises(ValueError, match="labels has shape"):
        TF.tvd(p, q, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="labels must hold integer labels"):
        TF.tvd(p, q, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="reduction must be one of"):
        TF.tvd(p, q, reduction="avg")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        TF.tvd(p, q, ignore_index=None)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        TF.tvd(p, q, [1, 2, 3, 4])


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_tvd_custom_ops_pass_opcheck(reduction):
    from tigon.ops.tvd import tvd_backward_op, tvd_op

    lead, v = (3, 5), 37
    p, q = probs(lead, v, torch.float32, non_contiguous=True), probs(lead, v, torch.float32)
    labels = make_labels(lead, v, "some")
    checks = torch.library.opcheck(tvd_op.library_op, (p, q, labels, reduction, -100, True, True))
    assert set(checks.values()) == {"SUCCESS"}
    dy = randn((*lead, v), torch.float32)
    args = (dy, p.detach(), q.detach(), labels, -100, True, True)
    assert set(torch.library.opcheck(tvd_backward_op.library_op, args).values()) == {"SUCCESS"}
