"""Norm modules. Parameter names match HF's (``weight``, ``bias``) so weights load unchanged."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF
from tigon.ops.rms_norm import check_casting


class TigonRMSNorm(nn.Module):
    """RMSNorm over the last dim.

    ``casting="llama"`` (LlamaRMSNorm, Mistral, Qwen, ...), ``"gemma"`` (fp32 throughout) or
    ``"none"`` (in x's dtype, as Liger's "none"); ``offset=1.0`` stores Gemma's weight as ``w``
    and applies ``1 + w`` (zero-initialised then). ``elementwise_affine=False``: no weight
    (``self.weight`` is None), as torch's nn.RMSNorm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama",
                 inplace: bool = False, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        check_casting(casting)
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        elif offset:
            raise ValueError(f"offset={offset} applies to the weight, but elementwise_affine=False has none")
        else:
            self.register_parameter("weight", None)
        self.hidden_size = hidden_size
        self.eps, self.offset, self.casting, self.inplace = eps, offset, casting, inplace

    @property
    def variance_epsilon(self) -> float:  # HF's LlamaRMSNorm name for eps
        return self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.rms_norm(x, self.weight, self.eps, self.offset, self.casting, self.inplace)

    def extra_repr(self) -> str:
        affine = "" if self.weight is not None else ", elementwise_affine=False"
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}{affine}"


class TigonFusedAddRMSNorm(TigonRMSNorm):
    """``forward(x, residual) -> (rms_norm(x + residual), x + residual)`` in one kernel."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        return TF.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting, self.inplace)


class TigonLayerNorm(nn.LayerNorm):
    """nn.LayerNorm over the last dim, computed by tigon's kernel (same parameters and options)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"TigonLayerNorm normalises the last dim only; normalized_shape={self.normalized_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"x's last dim is {x.shape[-1]} but this LayerNorm has {self.normalized_shape[0]}")
        return TF.layer_norm(x, self.weight, self.bias, self.eps)
