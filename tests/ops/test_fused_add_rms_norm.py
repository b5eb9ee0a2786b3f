import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn
from tests.ops.test_rms_norm import ref_rms_norm
from tigon import functional as F

SHAPES = pick(cpu=[(3, 5, 33), (200, 24)], gpu=[(4, 2048, 4096), (3001, 8189)])


def ref_fused_add_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama"):
    s = residual + x
    return ref_rms_norm(s, w, eps, offset, casting), s


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_fused_add_rms_norm_matches_reference(shape, dtype, casting, offset, non_contiguous):
    x = randn(shape, dtype, non_contiguous=non_contiguous, requires_grad=True)
    r = randn(shape, dtype, scale=2.0, requires_grad=True)
    w = randn(shape[-1:], dtype, scale=0.2, shift=1.0 - offset, requires_grad=True)
    check_op(lambda x, r, w: F.fused_add_rms_norm(x, r, w, 1e-6, offset, casting),
             lambda x, r, w: ref_fused_add_rms_norm(x, r, w, 1e-6, offset, casting),
             [x, r, w], dtype=dtype, what=f"fused_add_rms_norm[{casting}]")


def test_fused_add_rms_norm_only_normed_output_used():
    """When the new residual is unused its gradient is zero; gradients still match."""
    x = randn((6, 48), torch.float32, requires_grad=True)
    r = randn((6, 48), torch.float32, requires_grad=True)
    w = randn((48,), torch.float32, shift=1.0, requires_grad=True)
    check_op(lambda x, r, w: F.fused_add_rms_norm(x, r, w)[0],
             lambda x, r, w: ref_fused_add_rms_norm(x, r, w)[0], [x, r, w], dtype=torch.float32)


def test_fused_add_rms_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    w = randn((16,), torch.float32)
    with pytest.raises(ValueError, match="residual has shape"):
        F.fused_add_rms_norm(x, randn((4, 15), torch.float32), w)
    with pytest.raises(TypeError, match="residual has dtype"):
        F.fused_add_rms_norm(x, randn((4, 16), torch.bfloat16), w)
