"""The MLP forwards the patcher installs: the gated MLP, the non-gated ReLU² MLP and the stacked
MoE experts, with the activation each module computes identified by evaluating it."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tigon import ambient
from tigon import functional as TF
from tigon.ambient import planning
from tigon.ops.glu import TORCH_ACTIVATIONS
from tigon.ops.glu_down import glu_down
from tigon.ops.glu_mlp import gated_mlp
from tigon.ops.moe_experts import CLAMPED_SWIGLU
from tigon.patching.errors import TigonPatchError

# tigon's ops are torch.library custom ops: torch.compile traces each as one node (no graph break).
_glu = TF.glu
_glu_down = glu_down
_gated_mlp = gated_mlp
_relu_squared = TF.relu_squared
_relu_squared_mlp = TF.relu_squared_mlp


# ---- gated MLP ----

_PROBE = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
# Activation found per kind of activation module (its class, and GELU's approximation), in a
# plain dict: the lookup in the patched forwards is what torch.compile traces (a weak dict of
# modules there gives guards on its changing contents), and unpatch leaves nothing on modules.
_ACTIVATION_OF: dict = {}


def identify_activation(act: nn.Module | None) -> str | None:
    """Which of tigon's GLU activations ``act`` computes (a name of tigon.ops.glu.ACTIVATIONS),
    found by evaluating it (names vary between HF versions; the function does not)."""
    if act is None:
        return None
    try:
        with torch.no_grad():
            y = act(_PROBE.to(torch.float32)).to(torch.float64)
    except Exception:  # an activation we cannot evaluate is one we do not know
        return None
    for name, ref in TORCH_ACTIVATIONS.items():
        if torch.allclose(y, ref(_PROBE), atol=1e-5, rtol=1e-5):
            return name
    return None


def activation_module(module: nn.Module):
    return getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)


def fused_activation(module: nn.Module) -> str | None:
    """The module's activation (``act_fn``) as a tigon name, or None for one tigon does not fuse;
    found once per kind of activation."""
    act = activation_module(module)
    key = (type(act), getattr(act, "approximate", None))
    if key not in _ACTIVATION_OF:
        _ACTIVATION_OF[key] = identify_activation(act)
    return _ACTIVATION_OF[key]


def mlp_activation(module: nn.Module) -> str:
    """fused_activation, an error if unsupported (MoE experts take None: they run HF's code)."""
    name = fused_activation(module)
    if name is None:
        raise TigonPatchError(f"{type(module).__name__}: activation {activation_module(module)!r} is not one tigon "
                              f"fuses (SiLU, GELU tanh, GELU erf); patch with swiglu=False")
    return name


def mlp_multipliers(module: nn.Module) -> tuple[float, float]:
    """(gate, down) multipliers of a gated MLP (Falcon-H1 has them; 1 for everyone else)."""
    return float(getattr(module, "gate_multiplier", 1.0)), float(getattr(module, "down_multiplier", 1.0))


def make_mlp_forward(layout: str, keep_input_only: bool = False):
    """The gated MLP's forward. ``keep_input_only`` (the family's layers save nothing after the
    MLP): in a checkpointed layer it keeps only its input (tigon.ops.glu_mlp.gated_mlp)."""
    if layout == "gate_up_down":
        def forward(self, x):
            gate_multiplier, down_multiplier = mlp_multipliers(self)
            checkpointed = ambient.CHECKPOINTED_LAYERS.on if torch.compiler.is_compiling() else None
            return _gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, mlp_activation(self),
                              keep_input_only=keep_input_only, gate_multiplier=gate_multiplier,
                              down_multiplier=down_multiplier, checkpointed=checkpointed)
    elif layout == "fused_gate_up":
        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            gate_multiplier, down_multiplier = mlp_multipliers(self)
            return _glu_down(gate, up, self.down_proj, mlp_activation(self), gate_multiplier, down_multiplier)
    else:
        raise ValueError(f"unknown MLP layout {layout!r}")
    forward._tigon = f"gated MLP ({layout}{', input-only under checkpointing' if keep_input_only else ''})"
    return forward


def check_relu_squared_activation(module: nn.Module) -> None:
    """The MLP's activation is relu(x)^2 (found by evaluating it), else an error."""
    act = activation_module(module)
    key = (type(act), "relu2")
    if key not in _ACTIVATION_OF:
        try:
            with torch.no_grad():
                ok = torch.allclose(act(_PROBE.to(torch.float32)).to(torch.float64), torch.relu(_PROBE) ** 2,
                                    atol=1e-5, rtol=1e-5)
        except (RuntimeError, TypeError, ValueError):  # an activation we cannot evaluate is one we do not know
            ok = False
        if not ok:
            raise TigonPatchError(f"{type(module).__name__}: activation {act!r} is not ReLU², which tigon fuses in "
                                  "this MLP; patch with swiglu=False")
        _ACTIVATION_OF[key] = "relu2"


def relu_squared_mlp_forward(self, x):
    """down_proj(relu(up_proj(x))^2), non-gated (Nemotron): one op for plain nn.Linear layers
    (tigon.ops.relu_squared_mlp), else the layers' own forwards around tigon's ReLU²."""
    up, down = self.up_proj, self.down_proj
    if type(up) is nn.Linear and type(down) is nn.Linear:
        return _relu_squared_mlp(x, up.weight, down.weight, up.bias, down.bias)
    return down(_relu_squared(up(x)))


relu_squared_mlp_forward._tigon = "ReLU² MLP"


# ---- MoE experts ----

# HF 5.x stacked experts (MixtralExperts and kin, wrapped by transformers' use_experts_implementation,
# which sets has_gate, has_bias, is_transposed, is_concatenated, and in newer versions
# has_post_expert_norm and _is_expert_parallel on each instance; read with the defaults older
# versions imply) run on tigon's fused op whatever config._experts_implementation says ("eager",
# "grouped_mm", ...), when the op computes what HF's forward would; otherwise HF's forward runs.
_moe_experts = TF.moe_experts
_MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def hf_default_gate(cls: type) -> bool:
    """cls gates as HF's default ``_apply_gate`` (act_fn(gate) * up of the halves), or tigon's
    replacement of it; False for a class with a gate of its own (gpt-oss's clamped SwiGLU)."""
    gate = getattr(cls, "_apply_gate", None)
    if gate is None or gate is tigon_apply_gate:  # transformers without _apply_gate: the eager loop's formula
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return gate is _default_apply_gate


def _plain_weight(module: nn.Module, name: str, ndim: int) -> bool:
    p = getattr(module, name, None)
    return (type(p) in _PLAIN_TENSORS and p.ndim == ndim and p.dtype in _MOE_DTYPES
            and (p.device.type != "meta" or planning()))


def experts_has_bias(module: nn.Module) -> bool:
    return bool(getattr(module, "has_bias", getattr(module, "gate_up_proj_bias", None) is not None))


def fused_experts_blocker(module: nn.Module, activation: str | None, own_gate: bool = False) -> str | None:
    """Why tigon's fused op cannot run ``module``'s experts as HF would, or None when it can.
    ``activation``: the gate's activation (None: one tigon does not fuse); ``own_gate``: it is
    the class's own ``_apply_gate`` named by the family row (else HF's default gate)."""
    if not getattr(module, "has_gate", True):
        return "experts without a gate (has_gate=False)"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm)"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallel (HF's sentinel routing)"
    if not own_gate and not getattr(module, "is_concatenated", True):
        return "interleaved gate / up columns with HF's default gate"
    if own_gate and not all(hasattr(module, flag) for flag in ("is_concatenated", "is_transposed")):
        return "its own gate, without is_concatenated / is_transposed to say its weights' layout"
    names = ("gate_up_proj", "down_proj")
    for name in names:
        if not _plain_weight(module, name, 3):
            return f"{name} is not a plain 3-D fp32 / bf16 / fp16 tensor"
    if experts_has_bias(module):
        for name in names:
            if not _plain_weight(module, f"{name}_bias", 2):
                return f"{name}_bias is not a plain 2-D fp32 / bf16 / fp16 tensor"
    n_experts = module.gate_up_proj.shape[0]
    if getattr(module, "num_experts", n_experts) != n_experts:
        return f"num_experts ({module.num_experts}) is not gate_up_proj's {n_experts} experts"
    if activation is None:
        return f"activation {activation_module(module)!r} is not one tigon fuses"
    return None


def experts_options(module: nn.Module, activation: str) -> dict:
    """tigon.functional.moe_experts' options for HF experts ``module`` (see fused_experts_blocker)."""
    transposed = getattr(module, "is_transposed", getattr(module, "experts_are_transposed", False))
    options = {"activation": activation, "transposed": bool(transposed),
               "layout": "gate_up" if getattr(module, "is_concatenated", True) else "interleaved"}
    if experts_has_bias(module):
        options.update(gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias)
    if activation == CLAMPED_SWIGLU:
        options.update(alpha=float(module.alpha), limit=float(module.limit))
    return options


def tigon_apply_gate(self, gate_up_out):
    """HF's default MoE ``_apply_gate``: act(gate) * up of a [S, 2I] gate/up projection, fused
    (HF's formula for an activation tigon does not fuse)."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    activation = fused_activation(self)
    if activation is None:
        return self.act_fn(gate) * up
    return _glu(gate, up, activation)


MOE_EXPERTS = "MoE experts (tigon fused grouped GEMM)"


def make_experts_forward(original, activation: str | None = None):
    """The stacked experts' forward(hidden_states [T, H], top_k_index [T, K], top_k_weights
    [T, K]) on tigon's fused op (tigon.ops.moe_experts), whatever config._experts_implementation
    names; ``original`` (HF's forward, which dispatches on it) where the op would not compute
    what HF does (fused_experts_blocker). ``activation``: the class's own gate as the op names it
    (gpt-oss: "clamped_swiglu"); None: HF's default gate on the module's act_fn."""
    original = getattr(original, "_tigon_original", original)
    try:
        names = tuple(inspect.signature(original).parameters)[2:4]
    except (TypeError, ValueError):
        names = ()
    if len(names) != 2:
        names = ("top_k_index", "top_k_weights")

    def forward(self, hidden_states, *args, **kwargs):
        # The routing arguments bound by name with plain dict operations (what torch.compile traces).
        call = dict(zip(names, args))
        bound = len(args) <= 2 and not any(k in call for k in kwargs)
        call.update(kwargs)
        act = activation or fused_activation(self)
        if not bound or len(call) != 2 or any(k not in call for k in names) or \
                fused_experts_blocker(self, act, own_gate=activation is not None) is not None:
            return original(self, hidden_states, *args, **kwargs)
        return _moe_experts(hidden_states, call[names[0]], call[names[1]], self.gate_up_proj, self.down_proj,
                            **experts_options(self, act))

    forward._tigon = MOE_EXPERTS
    forward._tigon_original = original
    return forward
