"""Plain functions over the tigon ops (differentiable; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from tigon.ops import (
    FusedAddRMSNormFunction,
    GLUDownProjFunction,
    GLUFunction,
    LayerNormFunction,
    RMSNormFunction,
    RoPEFunction,
)

_GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu_erf"}


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama", in_place=False) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N]; see ``tigon.ops.rms_norm`` for the casting modes.

    ``offset=1.0`` with ``casting="gemma"`` is Gemma's ``(1 + weight)``. ``in_place`` lets the
    backward write dx over the incoming gradient (saves one buffer; the gradient must not be
    needed elsewhere).
    """
    return RMSNormFunction.apply(x, weight, eps, offset, casting, in_place)


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting="llama"):
    """(rms_norm(x + residual), x + residual) in one pass; x, residual [..., N], weight [N]."""
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting, False)


def layer_norm(x, weight, bias, eps=1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over the last dim; weight, bias [N] or None."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb`` in one kernel: returns (q_embed, k_embed).

    q [B, Hq, T, D], k [B, Hk, T, D] (or [B, T, H, D] with unsqueeze_dim=2); cos, sin
    [1|B, T, R] (R <= D, even). With position_ids [1|B, T], cos / sin are tables [P, R].
    """
    return RoPEFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def swiglu(a, b) -> torch.Tensor:
    """silu(a) * b, elementwise; a, b [..., I] of one dtype."""
    return GLUFunction.apply(a, b, "silu")


def geglu(a, b, approximate="tanh") -> torch.Tensor:
    """gelu(a) * b with ``approximate`` "tanh" (HF's gelu_pytorch_tanh) or "none" (exact erf)."""
    if approximate not in _GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return GLUFunction.apply(a, b, _GELU_APPROXIMATIONS[approximate])


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu") -> torch.Tensor:
    """(act(a) * b) @ down_weight.T + down_bias, keeping only a and b for the backward.

    activation: "silu", "gelu_tanh" or "gelu_erf".
    """
    return GLUDownProjFunction.apply(a, b, down_weight, down_bias, activation)
