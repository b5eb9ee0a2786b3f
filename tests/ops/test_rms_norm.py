import warnings

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, ON_GPU, check_op, pick, randn, rel_err
from tigon import functional as TF
from tigon.nn import TigonRMSNorm
from tigon.reference import rms_norm_ref

SHAPES = pick(
    cpu=[(2, 3, 33), (7, 128), (1, 1000), (257, 40)],
    gpu=[(4, 1024, 4096), (8192, 5120), (3001, 8189), (65536, 896), (17, 16384)],
)
MODES = [("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("llama", 1.0), ("none", 0.0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", MODES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_rms_norm_matches_reference(shape, dtype, casting, offset, non_contiguous):
    x = randn(shape, dtype, non_contiguous=non_contiguous, requires_grad=True)
    w = randn(shape[-1:], dtype, scale=0.2, shift=1.0 - offset, requires_grad=True)
    check_op(lambda x, w: TF.rms_norm(x, w, 1e-6, offset, casting),
             lambda x, w: rms_norm_ref(x, w, 1e-6, offset, casting),
             [x, w], dtype=dtype, what=f"rms_norm[{casting}, offset={offset}]")


@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
def test_rms_norm_mixed_dtypes_bf16_input_fp32_weight(casting):
    """bf16 activations with an fp32 weight: llama / none casting promote the output to fp32 (as HF)."""
    x = randn(pick((5, 77), (4096, 4096)), torch.bfloat16, requires_grad=True)
    w = randn(x.shape[-1:], torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda x, w: TF.rms_norm(x, w, 1e-5, 0.0, casting),
             lambda x, w: rms_norm_ref(x, w, 1e-5, 0.0, casting), [x, w], dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_none_casting_rounds_as_eager_torch(dtype, offset):
    """casting="none" gives the eager expression's own rounding (x^2, mean, + eps, rsqrt, x * rstd,
    w + offset, the product, all in x's dtype): bit for bit but for reduction order. The other
    modes round once at the end and differ from it on about a quarter of the elements."""
    x = randn(pick((64, 200), (4096, 4096)), dtype, scale=3.0)
    w = randn(x.shape[-1:], dtype, scale=0.2, shift=1.0 - offset)
    ours = TF.rms_norm(x, w, 1e-6, offset, "none")
    eager = rms_norm_ref(x, w, 1e-6, offset, "none")
    assert ours.dtype == eager.dtype == dtype
    ulp = torch.finfo(dtype).eps
    assert ((ours.float() - eager.float()).abs() <= ulp * eager.float().abs()).all()
    assert (ours == eager).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
def test_rms_norm_without_weight(dtype, casting):
    """weight=None (elementwise_affine=False): no scaling, output in x's dtype, x's gradient only."""
    x = randn((9, 70), dtype, requires_grad=True)
    check_op(lambda x: TF.rms_norm(x, None, 1e-6, 0.0, casting), lambda x: rms_norm_ref(x, None, 1e-6, 0.0, casting),
             [x], dtype=dtype, what=f"rms_norm[{casting}, no weight]")
    assert TF.rms_norm(x, None, casting=casting).dtype == dtype
    with pytest.raises(ValueError, match="offset=1.0 .* weight is None"):
        TF.rms_norm(x, None, 1e-6, 1.0, casting)


def residual_add_gradients(norm, x, w, z, g):
    """Gradients (x, w, z) of r + norm(x, w) with r = 3 z, under the cotangent g. The add hands one
    tensor (g itself) to both summands' nodes; r's node, made before the norm's, runs after it."""
    r = z * 3.0
    return torch.autograd.grad(r + norm(x, w), (x, w, z), g)


def test_rms_norm_inplace_leaves_a_shared_gradient_alone():
    """The incoming gradient is autograd's to share: out = r + rms_norm(x) (a residual add, as
    after Gemma's and OLMo 2's post-norms) gives the same tensor, here the caller's own
    grad_outputs, to the norm and to r. inplace=True (deprecated) must not write dx over it:
    every gradient is torch's and the caller's cotangent is unchanged. An expanded cotangent
    (stride 0, as y.sum() gives) is read where it lies, no copy written over."""
    x = randn((6, 40), torch.float32, requires_grad=True)
    w = randn((40,), torch.float32, shift=1.0, requires_grad=True)
    z = randn((6, 40), torch.float32, requires_grad=True)
    x64, w64, z64 = (t.detach().double().requires_grad_() for t in (x, w, z))
    for g in (randn((6, 40), torch.float32), randn((1, 40), torch.float32).expand(6, 40)):
        kept = g.clone()
        want = residual_add_gradients(rms_norm_ref, x64, w64, z64, g.double())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = residual_add_gradients(lambda x, w: TF.rms_norm(x, w, inplace=True), x, w, z, g)
        for name, a, b in zip("xwz", got, want):
            assert rel_err(a, b) < 1e-5, f"the gradient of {name}"
        assert torch.equal(g, kept)


def test_rms_norm_inplace_is_deprecated():
    x = randn((3, 16), torch.float32, requires_grad=True)
    w = randn((16,), torch.float32, shift=1.0)
    with pytest.warns(FutureWarning, match="inplace=True is deprecated and ignored"):
        y = TF.rms_norm(x, w, inplace=True)
    torch.testing.assert_close(y, TF.rms_norm(x, w), rtol=0, atol=0)
    with pytest.warns(FutureWarning, match="inplace=True is deprecated and ignored"):
        TigonRMSNorm(16, inplace=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TF.rms_norm(x, w, inplace=False)
        TigonRMSNorm(16)


def test_rms_norm_zero_stride_and_strided_inputs():
    """x expanded from one row ([1, N] leaf), a weight expanded from a scalar, a strided weight:
    the values and the gradients of the leaves (summed over the expansion by autograd) are
    torch's (the kernels read the weight with unit stride: it is made contiguous first)."""
    base = randn((1, 37), torch.float32, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda b, s: TF.rms_norm(b.expand(5, 37), s.expand(37)),
             lambda b, s: rms_norm_ref(b.expand(5, 37), s.expand(37)), [base, scale], dtype=torch.float32)
    wide = randn((74,), torch.float32, requires_grad=True)
    x = randn((5, 37), torch.float32, requires_grad=True)
    check_op(lambda x, w: TF.rms_norm(x, w[::2]), lambda x, w: rms_norm_ref(x, w[::2]), [x, wide],
             dtype=torch.float32)


@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_second_backward_over_retained_graph(weight):
    x = randn((7, 48), torch.float32, requires_grad=True)
    w = randn((48,), torch.float32, shift=1.0, requires_grad=True) if weight else None
    c = randn((7, 48), torch.float32)
    loss = 0.5 * (TF.rms_norm(x, w) * c).sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in (x, w) if t is not None]
    loss.backward()
    for t, g in zip([t for t in (x, w) if t is not None], once):
        assert torch.equal(t.grad, 2 * g)


def test_rms_norm_frozen_weight_and_empty_batch():
    x = randn((6, 40), torch.float32, requires_grad=True)
    w = randn((40,), torch.float32, shift=1.0)  # no grad: the kernel skips dW
    check_op(TF.rms_norm, rms_norm_ref, [x, w], dtype=torch.float32)
    empty = randn((0, 40), torch.float32, requires_grad=True)
    w2 = randn((40,), torch.float32, requires_grad=True)
    y = TF.rms_norm(empty, w2)
    y.sum().backward()
    assert y.shape == (0, 40) and torch.equal(w2.grad, torch.zeros_like(w2))


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), (0, 0), (0, 5), (2, 0, 5)])
@pytest.mark.parametrize("casting", ["llama", "none"])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_empty_rows_or_hidden_size(shape, casting, weight):
    """As torch.nn.functional.rms_norm: an empty output, empty (or zero) gradients, no error."""
    x = randn(shape, torch.float32, requires_grad=True)
    w = randn(shape[-1:], torch.float32, requires_grad=True) if weight else None
    y = TF.rms_norm(x, w, casting=casting)
    theirs = torch.nn.functional.rms_norm(x, shape[-1:], w)
    assert y.shape == theirs.shape and y.dtype == theirs.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    if weight:
        assert torch.equal(w.grad, torch.zeros_like(w))


def test_rms_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    w = randn((16,), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        TF.rms_norm(x, randn((15,), torch.float32))
    for casting in ("bert", None, "Llama", ["llama"]):
        with pytest.raises(ValueError, match="casting must be one of 'llama', 'gemma', 'none'"):
            TF.rms_norm(x, w, casting=casting)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        TF.rms_norm(torch.ones(4, 16, dtype=torch.int64, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must have 1 dimensions"):
        TF.rms_norm(x, randn((1, 16), torch.float32))
    with pytest.raises(ValueError, match="hidden size"):
        TF.rms_norm(randn((1, 70000), torch.float32), randn((70000,), torch.float32))
    with pytest.raises(TypeError, match="in_place"):
        TF.rms_norm(x, w, in_place=True)  # the option is called inplace
    if ON_GPU:
        with pytest.raises(ValueError, match="weight is on"):
            TF.rms_norm(x, torch.ones(16))


@pytest.mark.gpu
def test_rms_norm_past_2_31_elements():
    """Row offsets are int64: rows past element 2^31 are normalised correctly."""
    n = 4096
    rows = 2**31 // n + 64
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = TF.rms_norm(x, w)
    tail = slice(rows - 128, rows)
    torch.testing.assert_close(y[tail].float(), rms_norm_ref(x[tail].double(), w.double()).float(),
                               atol=2e-2, rtol=2e-2)
