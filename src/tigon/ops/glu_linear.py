"""GLU activation followed by the down projection, with the activation recomputed in backward.

out = (act(a) * b) @ down_weight^T (+ down_bias), for a, b [..., I] and down_weight [H, I].
Autograd would keep c = act(a) * b alive for the down projection's weight gradient; this
function keeps only a and b and recomputes c (one cheap elementwise pass) in the backward,
saving one [tokens, I] activation per MLP layer. The backward then writes da over dc and db
over the recomputed c, so it allocates no [tokens, I] buffer beyond those two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon.ops._common import as_rows, check_same_device, check_tensor
from tigon.ops.glu import check_glu_args, glu_backward, glu_forward


class GLUDownProjFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a, b, down_weight, down_bias=None, activation="silu"):
        check_glu_args(a, b, activation)
        check_tensor("down_weight", down_weight, ndim=2)
        if down_weight.shape[1] != a.shape[-1]:
            raise ValueError(
                f"down_weight has shape {tuple(down_weight.shape)}; its dim 1 must equal a's last dim {a.shape[-1]}"
            )
        if down_bias is not None:
            check_tensor("down_bias", down_bias, ndim=1)
            if down_bias.shape[0] != down_weight.shape[0]:
                raise ValueError(
                    f"down_bias has shape {tuple(down_bias.shape)} but down_weight has {down_weight.shape[0]} rows"
                )
        check_same_device(a=a, down_weight=down_weight, down_bias=down_bias)
        a2, b2 = as_rows(a), as_rows(b)
        c = glu_forward(a2, b2, activation)
        out = F.linear(c, down_weight, down_bias)  # autocast, if on, picks the matmul dtype
        ctx.save_for_backward(a2, b2, down_weight)
        ctx.activation = activation
        ctx.matmul_dtype = out.dtype
        ctx.bias_dtype = None if down_bias is None else down_bias.dtype
        return out.view(*a.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        a2, b2, w = ctx.saved_tensors
        mm = ctx.matmul_dtype
        dout2 = dout.reshape(-1, dout.shape[-1]).to(mm)
        c = glu_forward(a2, b2, ctx.activation)
        d_weight = d_bias = da = db = None
        if ctx.needs_input_grad[2]:
            d_weight = (dout2.t() @ c.to(mm)).to(w.dtype)
        if ctx.needs_input_grad[3]:
            d_bias = dout2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dc = dout2 @ w.to(mm)
            da_out = dc if dc.dtype == a2.dtype else None
            # c is dead once the weight gradient is formed: db is written over it.
            da, db = glu_backward(dc, a2, b2, ctx.activation, da_out=da_out, db_out=c)
            shape = dout.shape[:-1] + (a2.shape[-1],)
            da, db = da.view(shape), db.view(shape)
        return da, db, d_weight, d_bias, None
