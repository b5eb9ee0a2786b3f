"""The RMSNorm and LayerNorm forwards the patcher installs on HF's norm modules (they read the
modules' own weights)."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF
from tigon.patching.errors import TigonPatchError

# tigon's ops are torch.library custom ops: torch.compile traces each as one node (no graph break).
_rms_norm = TF.rms_norm
_layer_norm = TF.layer_norm


# ---- RMSNorm ----

def norm_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    raise TigonPatchError(f"{type(module).__name__} has no variance_epsilon / eps attribute")


def make_rms_norm_forward(casting: str, offset: float):
    def forward(self, hidden_states):  # a norm without weight: no scaling (Gemma 4's with_scale=False, L2 norms)
        return _rms_norm(hidden_states, getattr(self, "weight", None), norm_eps(self), offset, casting)

    forward._tigon = f"rms_norm(casting={casting}, offset={offset:g})"
    return forward


# ---- LayerNorm ----

def make_layer_norm_forward(offset: float):
    """F.layer_norm(x, weight + offset, bias, eps) as Nemotron's LayerNorm1P computes it: under
    (CUDA) autocast, x, weight and bias are cast to the autocast dtype first."""
    def forward(self, x):
        weight, bias = self.weight, self.bias
        if weight is not None and offset:
            weight = weight + offset
        if torch.is_autocast_enabled() and x.is_floating_point():
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight, bias = (None if t is None else t.to(dtype) for t in (x, weight, bias))
        return _layer_norm(x, weight, bias, self.eps)

    forward._tigon = f"layer_norm(offset={offset:g})"
    return forward


def make_torch_layer_norm_forward():
    """torch's nn.LayerNorm (vision towers, projectors) on tigon's LayerNorm; under autocast in
    fp32, as autocast runs torch's layer_norm."""
    def forward(self, x):
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled() and x.is_floating_point():
            x, weight, bias = (None if t is None else t.float() for t in (x, weight, bias))
        return _layer_norm(x, weight, bias, self.eps)

    forward._tigon = "layer_norm (nn.LayerNorm)"
    return forward
