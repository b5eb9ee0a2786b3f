import pytest
import torch

from tests.helpers import DTYPES, check_op, pick, randn, up
from tigon import functional as F

SHAPES = pick(
    cpu=[(2, 3, 33), (7, 128), (257, 40)],
    gpu=[(4, 1024, 4096), (16384, 4096), (3001, 8189), (65536, 768)],
)


def ref_layer_norm(x, w, b, eps=1e-5):
    y = torch.nn.functional.layer_norm(up(x), x.shape[-1:], None if w is None else up(w),
                                       None if b is None else up(b), eps)
    return y.to(x.dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_layer_norm_matches_reference(shape, dtype, affine, non_contiguous):
    # A large common offset: catches one-pass variance formulas that cancel catastrophically.
    x = randn(shape, dtype, non_contiguous=non_contiguous, shift=8.0, requires_grad=True)
    w = randn(shape[-1:], dtype, shift=1.0, requires_grad=True) if affine != "none" else None
    b = randn(shape[-1:], dtype, requires_grad=True) if affine == "weight+bias" else None
    check_op(lambda x, w, b: F.layer_norm(x, w, b), ref_layer_norm, [x, w, b], dtype=dtype,
             what=f"layer_norm[{affine}]")


def test_layer_norm_frozen_parameters():
    x = randn((5, 70), torch.float32, requires_grad=True)
    w = randn((70,), torch.float32, shift=1.0)
    b = randn((70,), torch.float32, requires_grad=True)
    check_op(lambda x, w, b: F.layer_norm(x, w, b), ref_layer_norm, [x, w, b], dtype=torch.float32)


def test_layer_norm_bad_inputs():
    x = randn((4, 16), torch.float32)
    with pytest.raises(ValueError, match="bias has shape"):
        F.layer_norm(x, randn((16,), torch.float32), randn((17,), torch.float32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        F.layer_norm([1.0, 2.0], None, None)
