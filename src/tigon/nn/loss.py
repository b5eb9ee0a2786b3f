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


class TigonVocabParallelCrossEntropyLoss(nn.Module):
    """Cross entropy over a vocabulary split across the ranks of ``group`` (tensor parallel),
    called as ``loss_fn(logits, target)``: logits [..., V_r] this rank's shard (ids from
    ``vocab_start``; None: gathered from the shard widths), target [...] global ids. Every rank
    gets the whole loss. Options as ``TigonCrossEntropyLoss``; see
    ``tigon.functional.vocab_parallel_cross_entropy``."""

    def __init__(self, group=None, vocab_start: int | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, inplace: bool = False):
        super().__init__()
        self.group, self.vocab_start = group, vocab_start
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_z_loss = lse_square_scale, softcap, return_z_loss
        self.inplace = inplace

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return TF.vocab_parallel_cross_entropy(
            logits, target, group=self.group, vocab_start=self.vocab_start, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, return_z_loss=self.return_z_loss, inplace=self.inplace)

    def extra_repr(self) -> str:
        return (f"vocab_start={self.vocab_start}, ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, inplace={self.inplace}")


class TigonVocabParallelLinearCrossEntropyLoss(nn.Module):
    """Cross entropy of ``x @ weight.T + bias`` for an output head split over the vocabulary
    across ranks (tensor parallel), without the logits, called as ``loss_fn(x, weight, target,
    bias=None)``: x [..., H] and target [...] (global ids) the same on every rank, weight this
    rank's [V_r, H] shard (ids from ``vocab_start``; None: gathered) or a DTensor sharded over
    the vocabulary (torch's ColwiseParallel; group and start then from it). Every rank gets the
    whole loss. Options as ``TigonVocabParallelCrossEntropyLoss``, plus ``chunk_budget`` (bytes
    of logits a chunk may hold); see ``tigon.functional.vocab_parallel_linear_cross_entropy``."""

    def __init__(self, group=None, vocab_start: int | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, chunk_budget: int | None = None):
        super().__init__()
        self.group, self.vocab_start = group, vocab_start
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_z_loss = lse_square_scale, softcap, return_z_loss
        self.chunk_budget = chunk_budget

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None):
        return TF.vocab_parallel_linear_cross_entropy(
            x, weight, target, bias, group=self.group, vocab_start=self.vocab_start, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, return_z_loss=self.return_z_loss, chunk_budget=self.chunk_budget)

    def extra_repr(self) -> str:
        return (f"vocab_start={self.vocab_start}, ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, chunk_budget={self.chunk_budget}")


class TigonKLDivLoss(nn.Module):
    """``nn.KLDivLoss`` computed by tigon's kernel, called as ``loss_fn(input, target)``: input
    log-probabilities [..., V], target probabilities (log-probabilities with ``log_target``).
    Default reduction "batchmean" (Liger's; torch's is "mean"); see ``tigon.functional.kl_div``."""

    def __init__(self, reduction: str = "batchmean", log_target: bool = False):
        super().__init__()
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return TF.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"


class TigonTVDLoss(nn.Module):
    """Total variation distance (Liger's ``LigerTVDLoss``), called as ``loss_fn(p, q, labels=None)``
    with probabilities p, q [..., V] and labels [...]; see ``tigon.functional.tvd``."""

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return TF.tvd(p, q, labels, reduction=self.reduction, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}"
