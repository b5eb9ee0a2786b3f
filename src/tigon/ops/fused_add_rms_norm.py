"""Fused residual add + RMSNorm: s = x + residual; y = rms_norm(s). Returns (y, s).

One pass reads x and residual and writes s and y; the backward adds the gradient arriving on
s to the norm's input gradient in the same kernel. Uses the RMSNorm kernels (casting modes and
``weight=None`` as in ``rms_norm.py``).
"""

from __future__ import annotations

import torch

from tigon.ops._common import as_rows
from tigon.ops.rms_norm import check_norm_args, rms_norm_backward, rms_norm_forward


class FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps=1e-6, offset=0.0, casting="llama", inplace=False):
        weight = check_norm_args(x, weight, casting, offset, residual=residual)
        x2, r2 = as_rows(x), as_rows(residual)
        y, rstd, s = rms_norm_forward(x2, weight, float(eps), float(offset), casting, residual2=r2)
        ctx.save_for_backward(s, rstd)
        ctx.weight = weight  # a parameter: kept, not saved (see the note in tigon.ops._common)
        ctx.offset, ctx.casting, ctx.inplace = float(offset), casting, inplace
        shape = x.shape
        return y.view(*shape[:-1], y.shape[-1]), s.view(shape)

    @staticmethod
    def backward(ctx, dy, ds):
        s2, rstd = ctx.saved_tensors
        dy2 = as_rows(dy)
        ds2 = as_rows(ds) if ds is not None else None
        dsum, dw = rms_norm_backward(
            dy2, s2, ctx.weight, rstd, ctx.offset, ctx.casting,
            compute_dw=ctx.needs_input_grad[2], inplace=ctx.inplace, ds2=ds2,
        )
        dsum = dsum.view(dy.shape[:-1] + (s2.shape[-1],))
        # d(x + residual) reaches both summands unchanged; like torch's add, one tensor serves both.
        return dsum, dsum, dw, None, None, None, None
