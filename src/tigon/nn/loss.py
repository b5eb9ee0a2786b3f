"""Loss modules."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF


class TigonCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` computed by tigon's kernel (gradient formed in the forward pass),
    called as ``loss_fn(logits, target)`` with logits [..., V] (classes last) and target [...].

    Extra options: ``lse_square_scale`` (z-loss), ``softcap`` (tanh logit capping),
    ``use_token_scaling``, ``return_z_loss`` / ``return_token_accuracy`` /
    ``return_predicted_tokens``, ``inplace`` (gradient written over the logits; off by default,
    as torch leaves its input alone).
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 use_token_scaling: bool = False, return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False, inplace: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.use_token_scaling = lse_square_scale, softcap, use_token_scaling
        self.return_z_loss, self.return_token_accuracy = return_z_loss, return_token_accuracy
        self.return_predicted_tokens, self.inplace = return_predicted_tokens, inplace

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return TF.cross_entropy(
            logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, weight=self.weight, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, use_token_scaling=self.use_token_scaling, return_z_loss=self.return_z_loss,
            return_token_accuracy=self.return_token_accuracy, return_predicted_tokens=self.return_predicted_tokens,
            inplace=self.inplace)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, inplace={self.inplace}")


class TigonFusedLinearCrossEntropyLoss(nn.Module):
    """Cross entropy of ``x @ weight.T + bias`` without the logits, called as
    ``loss_fn(x, weight, target, bias=None)``: x [..., H], weight [V, H] (the lm_head's, which
    the module does not own), target [...]. Options as ``TigonCrossEntropyLoss`` (``ce_weight``
    is the class weight), plus ``chunk_budget`` (bytes of logits a chunk may hold; default
    512 MiB) and ``accum_dtype`` (``torch.float32`` accumulates dW in fp32)."""

    def __init__(self, ce_weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 use_token_scaling: bool = False, return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False, chunk_budget: int | None = None,
                 accum_dtype: torch.dtype | None = None):
        super().__init__()
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.use_token_scaling = lse_square_scale, softcap, use_token_scaling
        self.return_z_loss, self.return_token_accuracy = return_z_loss, return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.chunk_budget, self.accum_dtype = chunk_budget, accum_dtype

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None):
        return TF.fused_linear_cross_entropy(
            x, weight, target, bias, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, ce_weight=self.ce_weight, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, use_token_scaling=self.use_token_scaling, return_z_loss=self.return_z_loss,
            return_token_accuracy=self.return_token_accuracy, return_predicted_tokens=self.return_predicted_tokens,
            chunk_budget=self.chunk_budget, accum_dtype=self.accum_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, chunk_budget={self.chunk_budget}")
