"""Gated MLPs shaped like HF's (gate_proj, up_proj, down_proj): the activation is one fused
kernel and is recomputed in the backward instead of stored. Inside torch.utils.checkpoint
(non-reentrant) without biases they keep only their input (GLUMLPFunction), as the patched HF
MLPs do."""

from __future__ import annotations

import torch
from torch import nn

from tigon.ops import GLUDownProjFunction, GLUMLPFunction
from tigon.ops._common import under_checkpoint

_SILU_NAMES = {"silu", "swish"}
_GELU_NAMES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu_erf"}


class _TigonGLUMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)).

    Built from an HF config (``hidden_size``, ``intermediate_size``, ``mlp_bias``, and the
    activation name in ``hidden_act`` / ``hidden_activation``, checked against this class),
    optionally with an ``intermediate_size`` override as HF's MoE expert MLPs take, or from
    explicit ``hidden_size`` / ``intermediate_size`` keywords.
    """

    def __init__(self, config=None, intermediate_size=None, *, hidden_size=None, bias=None, activation=None):
        super().__init__()
        if config is not None:
            hidden_size = hidden_size or config.hidden_size
            intermediate_size = intermediate_size or config.intermediate_size
            bias = getattr(config, "mlp_bias", False) if bias is None else bias
            act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            if activation is None and act_name is not None:
                activation = self._activation_from_name(act_name)
        if hidden_size is None or intermediate_size is None:
            raise ValueError("give a config, or hidden_size and intermediate_size")
        self.config = config
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation or self.default_activation
        bias = bool(bias)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        if self.gate_proj.bias is None and torch.is_grad_enabled() and under_checkpoint():
            return GLUMLPFunction.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                        self.activation)
        return GLUDownProjFunction.apply(
            self.gate_proj(x), self.up_proj(x), self.down_proj.weight, self.down_proj.bias, self.activation, True
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class TigonSwiGLUMLP(_TigonGLUMLP):
    """SwiGLU MLP (Llama, Mistral, Qwen, ...): down_proj(silu(gate_proj(x)) * up_proj(x))."""

    default_activation = "silu"

    @staticmethod
    def _activation_from_name(name):
        if name not in _SILU_NAMES:
            raise ValueError(f"TigonSwiGLUMLP computes SiLU, but the config's activation is {name!r}")
        return "silu"


class TigonGeGLUMLP(_TigonGLUMLP):
    """GeGLU MLP (Gemma): down_proj(gelu(gate_proj(x)) * up_proj(x)), tanh approximation by default."""

    default_activation = "gelu_tanh"

    @staticmethod
    def _activation_from_name(name):
        if name not in _GELU_NAMES:
            raise ValueError(f"TigonGeGLUMLP computes GELU, but the config's activation is {name!r}")
        return _GELU_NAMES[name]
