import pytest
import torch

from tests.helpers import DEVICE, DTYPES, ON_GPU, check_op, pick, randn, up
from tigon import functional as F

SHAPES = pick(
    cpu=[(2, 3, 33), (7, 128), (1, 1000), (257, 40)],
    gpu=[(4, 1024, 4096), (8192, 5120), (3001, 8189), (65536, 896), (17, 16384)],
)
MODES = [("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("llama", 1.0)]


def ref_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"):
    """HF's LlamaRMSNorm (casting="llama") and GemmaRMSNorm (casting="gemma")."""
    xf = up(x)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        return (w + offset) * xn.to(x.dtype)
    return (xn * (offset + up(w))).to(x.dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", MODES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_rms_norm_matches_reference(shape, dtype, casting, offset, non_contiguous):
    x = randn(shape, dtype, non_contiguous=non_contiguous, requires_grad=True)
    w = randn(shape[-1:], dtype, scale=0.2, shift=1.0 - offset, requires_grad=True)
    check_op(lambda x, w: F.rms_norm(x, w, 1e-6, offset, casting),
             lambda x, w: ref_rms_norm(x, w, 1e-6, offset, casting),
             [x, w], dtype=dtype, what=f"rms_norm[{casting}, offset={offset}]")


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm_mixed_dtypes_bf16_input_fp32_weight(casting):
    """bf16 activations with an fp32 weight: llama casting promotes the output to fp32 (as HF)."""
    x = randn(pick((5, 77), (4096, 4096)), torch.bfloat16, requires_grad=True)
    w = randn(x.shape[-1:], torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda x, w: F.rms_norm(x, w, 1e-5, 0.0, casting),
             lambda x, w: ref_rms_norm(x, w, 1e-5, 0.0, casting), [x, w], dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_backward(dtype):
    x = randn(pick((9, 50), (4096, 4096)), dtype, requires_grad=True)
    w = randn(x.shape[-1:], dtype, shift=1.0, requires_grad=True)
    check_op(lambda x, w: F.rms_norm(x, w, in_place=True), ref_rms_norm, [x, w], dtype=dtype)


def test_rms_norm_frozen_weight_and_empty_batch():
    x = randn((6, 40), torch.float32, requires_grad=True)
    w = randn((40,), torch.float32, shift=1.0)  # no grad: the kernel skips dW
    check_op(F.rms_norm, ref_rms_norm, [x, w], dtype=torch.float32)
    empty = randn((0, 40), torch.float32, requires_grad=True)
    w2 = randn((40,), torch.float32, requires_grad=True)
    y = F.rms_norm(empty, w2)
    y.sum().backward()
    assert y.shape == (0, 40) and torch.equal(w2.grad, torch.zeros_like(w2))


def test_rms_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        F.rms_norm(x, randn((15,), torch.float32))
    with pytest.raises(ValueError, match="casting"):
        F.rms_norm(x, randn((16,), torch.float32), casting="bert")
    with pytest.raises(TypeError, match="x must be a floating-point"):
        F.rms_norm(torch.ones(4, 16, dtype=torch.int64, device=DEVICE), randn((16,), torch.float32))
    with pytest.raises(ValueError, match="weight must have 1 dimensions"):
        F.rms_norm(x, randn((1, 16), torch.float32))
    with pytest.raises(ValueError, match="hidden size"):
        F.rms_norm(randn((1, 70000), torch.float32), randn((70000,), torch.float32))
    if ON_GPU:
        with pytest.raises(ValueError, match="weight is on"):
            F.rms_norm(x, torch.ones(16))


@pytest.mark.gpu
def test_rms_norm_past_2_31_elements():
    """Row offsets are int64: rows past element 2^31 are normalised correctly."""
    n = 4096
    rows = 2**31 // n + 64
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = F.rms_norm(x, w)
    tail = slice(rows - 128, rows)
    torch.testing.assert_close(y[tail].float(), ref_rms_norm(x[tail].double(), w.double()).float(), atol=2e-2, rtol=2e-2)
