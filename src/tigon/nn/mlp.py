"""Gated MLPs shaped like HF's (gate_proj, up_proj, down_proj): the activation is one fused
kernel and is recomputed in the backward instead of stored. Inside torch.utils.checkpoint
(non-reentrant) without biases they keep only their input, as the patched HF MLPs do: the
path is chosen by ``tigon.ops.glu_mlp.gated_mlp``."""

from __future__ import annotations

from torch import nn

from tigon.ops.glu import activation_name
from tigon.ops.glu_mlp import gated_mlp


class _TigonGLUMLP(nn.Module):
    """down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier.

    Built from an HF config (``hidden_size``, ``intermediate_size``, ``mlp_bias``, the
    activation name in ``hidden_act`` / ``hidden_activation``, checked against this class, and
    Falcon-H1's ``mlp_multipliers``), optionally with an ``intermediate_size`` override as HF's
    MoE expert MLPs take, or from explicit ``hidden_size`` / ``intermediate_size`` keywords.
    """

    default_activation: str
    family: tuple[str, ...]  # the tigon activation names this class computes

    def __init__(self, config=None, intermediate_size=None, *, hidden_size=None, bias=None, activation=None,
                 gate_multiplier=None, down_multiplier=None):
        super().__init__()
        multipliers = (1.0, 1.0)
        if config is not None:
            hidden_size = hidden_size or config.hidden_size
            intermediate_size = intermediate_size or config.intermediate_size
            bias = getattr(config, "mlp_bias", False) if bias is None else bias
            act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            if activation is None and act_name is not None:
                activation = act_name
            multipliers = tuple(getattr(config, "mlp_multipliers", None) or multipliers)
        if hidden_size is None or intermediate_size is None:
            raise ValueError("give a config, or hidden_size and intermediate_size")
        activation = activation_name(activation or self.default_activation)
        if activation not in self.family:
            raise ValueError(f"{type(self).__name__} computes {' / '.join(self.family)}, but the activation is "
                             f"{activation!r}")
        self.config = config
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.gate_multiplier = float(multipliers[0] if gate_multiplier is None else gate_multiplier)
        self.down_multiplier = float(multipliers[1] if down_multiplier is None else down_multiplier)
        bias = bool(bias)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.activation,
                         gate_multiplier=self.gate_multiplier, down_multiplier=self.down_multiplier)

    def extra_repr(self) -> str:
        scales = "" if (self.gate_multiplier, self.down_multiplier) == (1.0, 1.0) else \
            f", gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}"
        return f"activation={self.activation!r}{scales}"


class TigonSwiGLUMLP(_TigonGLUMLP):
    """SwiGLU MLP (Llama, Mistral, Qwen, Falcon-H1, ...): down_proj(silu(gate_proj(x)) * up_proj(x))."""

    default_activation = "silu"
    family = ("silu",)


class TigonGeGLUMLP(_TigonGLUMLP):
    """GeGLU MLP (Gemma): down_proj(gelu(gate_proj(x)) * up_proj(x)), tanh approximation by default."""

    default_activation = "gelu_tanh"
    family = ("gelu_tanh", "gelu_erf")
