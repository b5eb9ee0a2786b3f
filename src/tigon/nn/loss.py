"""Loss modules."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as F


class TigonCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` computed by tigon's kernel (gradient formed in the forward pass).

    Extra options: ``lse_square_scale`` (z-loss), ``softcap`` (tanh logit capping),
    ``return_z_loss`` / ``return_token_accuracy``, ``inplace`` (gradient over the logits).
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, return_token_accuracy: bool = False, inplace: bool = True):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.inplace = lse_square_scale, softcap, inplace
        self.return_z_loss, self.return_token_accuracy = return_z_loss, return_token_accuracy

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return F.cross_entropy(logits, target, self.ignore_index, self.reduction, self.label_smoothing, self.weight,
                               self.lse_square_scale, self.softcap, self.return_z_loss, self.return_token_accuracy,
                               self.inplace)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}")


class TigonFusedLinearCrossEntropyLoss(nn.Module):
    """Cross entropy of ``x @ weight.T + bias`` without the logits, called as
    ``loss_fn(x, weight, target, bias=None)``: x [..., H], weight [V, H] (the lm_head's, which
    the module does not own), target [...]. Options as ``TigonCrossEntropyLoss`` (``ce_weight``
    is the class weight), plus ``chunk_budget`` (bytes of logits a chunk may hold; default
    512 MiB) and ``accum_dtype`` (``torch.float32`` accumulates dW in fp32)."""

    def __init__(self, ce_weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, return_token_accuracy: bool = False, chunk_budget: int | None = None,
                 accum_dtype: torch.dtype | None = None):
        super().__init__()
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap = lse_square_scale, softcap
        self.return_z_loss, self.return_token_accuracy = return_z_loss, return_token_accuracy
        self.chunk_budget, self.accum_dtype = chunk_budget, accum_dtype

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None):
        return F.fused_linear_cross_entropy(
            x, weight, target, bias, self.ignore_index, self.reduction, self.label_smoothing, self.ce_weight,
            self.lse_square_scale, self.softcap, self.return_z_loss, self.return_token_accuracy, self.chunk_budget,
            self.accum_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, chunk_budget={self.chunk_budget}")
