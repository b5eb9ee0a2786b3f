"""Row-wise activation modules: softmax and sparsemax over one dim."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF


class TigonSoftmax(nn.Module):
    """``nn.Softmax(dim)`` computed by tigon's kernels (output in x's dtype, fp32 arithmetic)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class TigonSparsemax(nn.Module):
    """Sparsemax over ``dim`` (Martins & Astudillo 2016): see ``tigon.functional.sparsemax``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.sparsemax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
