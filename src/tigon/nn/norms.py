"""Norm modules. Parameter names match HF's (``weight``, ``bias``) so weights load unchanged."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF
from tigon.ops.rms_norm import check_casting, warn_inplace_ignored


class TigonRMSNorm(nn.Module):
    """RMSNorm over the last dim.

    ``casting="llama"`` (LlamaRMSNorm, Mistral, Qwen, ...), ``"gemma"`` (fp32 throughout) or
    ``"none"`` (in x's dtype, as Liger's "none"); ``offset=1.0`` stores Gemma's weight as ``w``
    and applies ``1 + w`` (zero-initialised then). ``elementwise_affine=False``: no weight
    (``self.weight`` is None), as torch's nn.RMSNorm. ``inplace`` is deprecated and ignored
    (True warns; see ``tigon.functional.rms_norm``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama",
                 inplace: bool = False, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        check_casting(casting)
        warn_inplace_ignored(inplace, type(self).__name__)
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        elif offset:
            raise ValueError(f"offset={offset} applies to the weight, but elementwise_affine=False has none")
        else:
            self.register_parameter("weight", None)
        self.hidden_size = hidden_size
        self.eps, self.offset, self.casting = eps, offset, casting

    @property
    def variance_epsilon(self) -> float:  # HF's LlamaRMSNorm name for eps
        return self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.rms_norm(x, self.weight, self.eps, self.offset, self.casting)

    def extra_repr(self) -> str:
        affine = "" if self.weight is not None else ", elementwise_affine=False"
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}{affine}"


class TigonFusedAddRMSNorm(TigonRMSNorm):
    """``forward(x, residual) -> (rms_norm(x + residual), x + residual)`` in one kernel."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        return TF.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)


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


class TigonGroupNorm(nn.GroupNorm):
    """nn.GroupNorm (x [N, C, *]) computed by tigon's kernels (same parameters and options)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"x must be [N, {self.num_channels}, *] for this GroupNorm, got shape {tuple(x.shape)}")
        return TF.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class TigonDyT(nn.Module):
    """Dynamic Tanh, ``gamma * tanh(alpha * x) + beta`` over the last dim (a norm's stand-in);
    parameters ``alpha`` [1], ``gamma`` [hidden_size], ``beta`` [hidden_size] (None with
    ``beta=False``), as Liger's LigerDyT."""

    def __init__(self, hidden_size: int, init_alpha: float = 0.5, beta: bool = True, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.init_alpha = hidden_size, init_alpha
        self.alpha = nn.Parameter(torch.full((1,), float(init_alpha), device=device, dtype=dtype))
        self.gamma = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if beta:
            self.beta = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("beta", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.dyt(x, self.alpha, self.gamma, self.beta)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, init_alpha={self.init_alpha}, beta={self.beta is not None}"


class TigonPolyNorm(nn.Module):
    """PolyNorm over the last dim: ``weight`` [3] (1/3 each) and ``bias`` [1] (0), as PolyCom's
    reference module (and Motif's), whose state dict loads unchanged."""

    def __init__(self, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.poly_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
