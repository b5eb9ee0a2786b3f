import warnings

import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn, rel_err
from tigon import functional as TF
from tigon.nn import TigonFusedAddRMSNorm
from tigon.reference import fused_add_rms_norm_ref

SHAPES = pick(cpu=[(3, 5, 33), (200, 24)], gpu=[(4, 2048, 4096), (3001, 8189)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_fused_add_rms_norm_matches_reference(shape, dtype, casting, offset, non_contiguous):
    x = randn(shape, dtype, non_contiguous=non_contiguous, requires_grad=True)
    r = randn(shape, dtype, scale=2.0, requires_grad=True)
    w = randn(shape[-1:], dtype, scale=0.2, shift=1.0 - offset, requires_grad=True)
    check_op(lambda x, r, w: TF.fused_add_rms_norm(x, r, w, 1e-6, offset, casting),
             lambda x, r, w: fused_add_rms_norm_ref(x, r, w, 1e-6, offset, casting),
             [x, r, w], dtype=dtype, what=f"fused_add_rms_norm[{casting}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
def test_fused_add_rms_norm_without_weight(dtype, casting):
    x = randn((5, 3, 40), dtype, requires_grad=True)
    r = randn((5, 3, 40), dtype, requires_grad=True)
    check_op(lambda x, r: TF.fused_add_rms_norm(x, r, None, 1e-6, 0.0, casting),
             lambda x, r: fused_add_rms_norm_ref(x, r, None, 1e-6, 0.0, casting), [x, r], dtype=dtype,
             what=f"fused_add_rms_norm[{casting}, no weight]")
    with pytest.raises(ValueError, match="weight is None"):
        TF.fused_add_rms_norm(x, r, None, 1e-6, 1.0, casting)


def test_fused_add_rms_norm_only_normed_output_used():
    """When the new residual is unused its gradient is zero; gradients still match."""
    x = randn((6, 48), torch.float32, requires_grad=True)
    r = randn((6, 48), torch.float32, requires_grad=True)
    w = randn((48,), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda x, r, w: TF.fused_add_rms_norm(x, r, w)[0],
             lambda x, r, w: fused_add_rms_norm_ref(x, r, w)[0], [x, r, w], dtype=torch.float32)


def test_fused_add_rms_norm_inplace_leaves_a_shared_gradient_alone():
    """y + 3 z hands the caller's cotangent to the norm and to z's node (made first, run after the
    norm's); s gets its own. inplace=True (deprecated) must not write the input gradient over
    it: every gradient is torch's and the caller's tensors are unchanged."""
    x, r, z = (randn((6, 40), torch.float32, requires_grad=True) for _ in range(3))
    w = randn((40,), torch.float32, shift=1.0, requires_grad=True)
    gy, gs = randn((6, 40), torch.float32), randn((6, 40), torch.float32)
    kept = gy.clone(), gs.clone()

    def gradients(fn, x, r, w, z):
        zz = z * 3.0
        y, s = fn(x, r, w)
        return torch.autograd.grad((y + zz, s), (x, r, w, z), (gy.to(x.dtype), gs.to(x.dtype)))

    want = gradients(fused_add_rms_norm_ref, *(t.detach().double().requires_grad_() for t in (x, r, w, z)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = gradients(lambda x, r, w: TF.fused_add_rms_norm(x, r, w, inplace=True), x, r, w, z)
    for name, a, b in zip(("x", "residual", "weight", "z"), got, want):
        assert rel_err(a, b) < 1e-5, f"the gradient of {name}"
    assert torch.equal(gy, kept[0]) and torch.equal(gs, kept[1])


def test_fused_add_rms_norm_inplace_is_deprecated():
    x, r = randn((3, 16), torch.float32), randn((3, 16), torch.float32)
    w = randn((16,), torch.float32, shift=1.0)
    with pytest.warns(FutureWarning, match="inplace=True is deprecated and ignored"):
        y, s = TF.fused_add_rms_norm(x, r, w, inplace=True)
    want = TF.fused_add_rms_norm(x, r, w)
    assert torch.equal(y, want[0]) and torch.equal(s, want[1])
    with pytest.warns(FutureWarning, match="inplace=True is deprecated and ignored"):
        TigonFusedAddRMSNorm(16, inplace=True)


def test_fused_add_rms_norm_zero_stride_inputs():
    """x and residual expanded from [1, N] leaves, the weight from a scalar: torch's values and
    gradients (both outputs used)."""
    xb = randn((1, 29), torch.float32, requires_grad=True)
    rb = randn((1, 29), torch.float32, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda xb, rb, s: TF.fused_add_rms_norm(xb.expand(6, 29), rb.expand(6, 29), s.expand(29)),
             lambda xb, rb, s: fused_add_rms_norm_ref(xb.expand(6, 29), rb.expand(6, 29), s.expand(29)),
             [xb, rb, scale], dtype=torch.float32)


def test_fused_add_rms_norm_second_backward_over_retained_graph():
    x = randn((7, 48), torch.float32, requires_grad=True)
    r = randn((7, 48), torch.float32, requires_grad=True)
    w = randn((48,), torch.float32, shift=1.0, requires_grad=True)
    c1, c2 = randn((7, 48), torch.float32), randn((7, 48), torch.float32)
    y, s = TF.fused_add_rms_norm(x, r, w)
    loss = 0.5 * ((y * c1).sum() + (s * c2).sum())
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in (x, r, w)]
    loss.backward()
    for t, g in zip((x, r, w), once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), (0, 5)])
def test_fused_add_rms_norm_empty_rows_or_hidden_size(shape):
    """As torch: empty outputs and gradients (zero for the weight), no error."""
    x = randn(shape, torch.float32, requires_grad=True)
    r = randn(shape, torch.float32, requires_grad=True)
    w = randn(shape[-1:], torch.float32, requires_grad=True)
    y, s = TF.fused_add_rms_norm(x, r, w)
    assert y.shape == s.shape == shape
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == r.grad.shape == shape and torch.equal(w.grad, torch.zeros_like(w))


def test_fused_add_rms_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    w = randn((16,), torch.float32)
    with pytest.raises(ValueError, match="residual has shape"):
        TF.fused_add_rms_norm(x, randn((4, 15), torch.float32), w)
    with pytest.raises(TypeError, match="residual has dtype"):
        TF.fused_add_rms_norm(x, randn((4, 16), torch.bfloat16), w)
    with pytest.raises(ValueError, match="casting must be one of"):
        TF.fused_add_rms_norm(x, x, w, casting=None)
