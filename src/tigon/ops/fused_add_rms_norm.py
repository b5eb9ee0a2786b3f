"""Fused residual add + RMSNorm: s = x + residual; y = rms_norm(s). Returns (y, s).

One pass reads x and residual and writes s and y; the backward adds the gradient arriving on
s to the norm's input gradient in the same kernel. Uses the RMSNorm kernels (casting modes and
``weight=None`` as in ``rms_norm.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from tigon.ops._common import as_rows, kernel_op
from tigon.ops.rms_norm import _rms_norm_out_dtype, check_norm_args, rms_norm_forward, rms_norm_gradients


@kernel_op("tigon::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, offset: float,
                          casting: str) -> tuple[Tensor, Tensor, Tensor]:
    """(y, s = x + residual, rstd fp32 [rows]) for x, residual [..., N]."""
    weight = check_norm_args(x, weight, casting, offset, residual=residual)
    y, rstd, s = rms_norm_forward(as_rows(x), weight, eps, offset, casting, residual2=as_rows(residual))
    return y.view(x.shape[:-1] + y.shape[-1:]), s.view(x.shape), rstd


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    check_norm_args(x, weight, casting, offset, residual=residual)
    return (x.new_empty(x.shape, dtype=_rms_norm_out_dtype(x, weight, casting)), x.new_empty(x.shape),
            x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    _, _, weight, _, offset, casting = inputs
    _, s, rstd = output
    ctx.set_materialize_grads(False)  # ds is None when s is not used
    ctx.save_for_backward(s, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.weight = weight  # a parameter: kept, not saved (see the note in tigon.ops._common)
    ctx.offset, ctx.casting = offset, casting
    ctx.needs_weight_grad = ctx.needs_input_grad[2]


def _backward(ctx, dy, ds, _drstd):
    s, rstd = ctx.saved_tensors
    dsum, dw = rms_norm_gradients(ctx, dy, s, rstd, ds=ds)
    # d(x + residual) reaches both summands unchanged; like torch's add, one tensor serves both.
    return dsum, dsum, dw, None, None, None


fused_add_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)

