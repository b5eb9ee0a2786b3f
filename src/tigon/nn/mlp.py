"""Gated MLPs shaped like HF's (gate_proj, up_proj, down_proj): the activation is one fused
kernel and is recomputed in the backward instead of stored. Inside torch.utils.checkpoint
(non-reentrant) without biases they keep only their input, as the patched HF MLPs do: the
path is chosen by ``tigon.ops.glu_mlp.gated_mlp``. Also Nemotron's ReLU² MLP, and the gated MLPs
in token shards for long sequences (``tigon.ops.tiled_mlp``)."""

from __future__ import annotations

from torch import nn

from tigon.ops.glu import activation_name
from tigon.ops.glu_mlp import gated_mlp
from tigon.ops.relu_squared import relu_squared_op as relu_squared
from tigon.ops.relu_squared_mlp import relu_squared_mlp
from tigon.ops.tiled_mlp import check_num_shards, tiled_mlp


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


class TigonReLUSquaredMLP(nn.Module):
    """Nemotron's MLP: down_proj(relu(up_proj(x))^2), state-dict compatible with transformers'
    ``NemotronMLP`` (``up_proj`` [I, H], ``down_proj`` [H, I], biases with ``bias=True``). With
    plain nn.Linear layers it is one op that keeps x and up_proj(x) only
    (``tigon.functional.relu_squared_mlp``); other layers (LoRA, quantised) run their own
    forward around the ReLU² kernel."""

    def __init__(self, hidden_size, intermediate_size, bias=False):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_config(cls, config):
        """From an HF config (``hidden_size``, ``intermediate_size``, ``mlp_bias``; ``hidden_act``
        must be "relu2")."""
        act = getattr(config, "hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"{cls.__name__} computes relu2, but the config's hidden_act is {act!r}")
        return cls(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, x):
        if type(self.up_proj) is nn.Linear and type(self.down_proj) is nn.Linear:
            return relu_squared_mlp(x, self.up_proj.weight, self.down_proj.weight, self.up_proj.bias,
                                    self.down_proj.bias)
        return self.down_proj(relu_squared(self.up_proj(x)))


class _TiledGLUMLP:
    """The gated MLP run by ``tigon.functional.tiled_mlp``: in ``num_shards`` shards of the token
    axis (None: ceil(T / H)), recomputed shard by shard in the backward (see tigon.ops.tiled_mlp).
    Same constructor as the untiled class plus ``num_shards``, same parameters and state dict."""

    def __init__(self, config=None, intermediate_size=None, *, num_shards=None, **kwargs):
        check_num_shards(num_shards)
        super().__init__(config, intermediate_size, **kwargs)
        self.num_shards = num_shards

    def forward(self, x):
        # Plain nn.Linear layers draw no random numbers: no RNG state to save per shard.
        plain = all(type(m) is nn.Linear for m in (self.gate_proj, self.up_proj, self.down_proj))
        return tiled_mlp(super().forward, x, self.num_shards, preserve_rng_state=not plain)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_shards={self.num_shards}"


class TigonTiledSwiGLUMLP(_TiledGLUMLP, TigonSwiGLUMLP):
    """TigonSwiGLUMLP in token shards (as Liger's ``LigerTiledSwiGLUMLP(config, num_shards)``)."""


class TigonTiledGeGLUMLP(_TiledGLUMLP, TigonGeGLUMLP):
    """TigonGeGLUMLP in token shards (as Liger's ``LigerTiledGEGLUMLP(config, num_shards)``)."""
