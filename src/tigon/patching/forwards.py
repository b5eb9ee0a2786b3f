"""The forwards the patcher installs on HF modules, shared by every family row.

Each ``make_*`` takes what it needs from the row and returns a plain function
``forward(self, ...)`` that can be set on a class or bound to one instance. Weights stay where
they are: the forwards read the HF module's own parameters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch
from torch import nn

from tigon import ambient
from tigon import functional as TF
from tigon.ambient import deferred_label_checks, planning, thread_flag
from tigon.ops import TiedGradSlot
from tigon.ops._common import is_dtensor
from tigon.ops.glu import TORCH_ACTIVATIONS
from tigon.ops.glu_mlp import gated_mlp, glu_down
from tigon.ops.moe_experts import CLAMPED_SWIGLU

# The patched forwards call tigon's ops, which are torch.library custom ops: torch.compile
# traces a patched model with each op as one node of its graph (no graph break).
_rms_norm = TF.rms_norm
_layer_norm = TF.layer_norm
_rope = TF.apply_rotary_pos_emb
_glu = TF.glu
_glu_down = glu_down
_gated_mlp = gated_mlp
_relu_squared = TF.relu_squared
_relu_squared_mlp = TF.relu_squared_mlp


def _deferring_label_checks(fn):
    """fn with its label checks queued instead of syncing the host each step (a bad label
    raises at a later step; see tigon.ops.cross_entropy), compiled or not: the op is told so
    by an argument."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with deferred_label_checks():
            return fn(*args, **kwargs)
    return call


_flce = _deferring_label_checks(TF.fused_linear_cross_entropy)
_cross_entropy = _deferring_label_checks(TF.cross_entropy)
_embedding = TF.embedding


class TigonPatchError(RuntimeError):
    """A patch cannot be applied as asked (missing HF piece, unsupported activation, ...)."""


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


# ---- gated MLP and MoE experts ----

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


# ---- RoPE ----

def tigon_apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
    """Drop-in for HF's ``apply_rotary_pos_emb(q, k, cos, sin, [position_ids,] unsqueeze_dim=1)``."""
    unsqueeze_dim = kwargs.pop("unsqueeze_dim", 1)
    position_ids = kwargs.pop("position_ids", None)
    if args:  # old signature (q, k, cos, sin, position_ids, unsqueeze_dim): HF ignored position_ids
        unsqueeze_dim = args[1] if len(args) > 1 else unsqueeze_dim
    if unsqueeze_dim == 0 and cos.ndim == 2:  # Pixtral: cos [T, R] shared by every image and head
        unsqueeze_dim = 1
    return _rope(q, k, cos, sin, position_ids, unsqueeze_dim)


tigon_apply_rotary_pos_emb._tigon = "rope"


def tigon_apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for GPT-OSS's ``apply_rotary_pos_emb``: halves rotate as with rotate_half, cos and
    sin [.., R/2] hold one angle per pair."""
    return _rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), None, unsqueeze_dim)


tigon_apply_rotary_pos_emb_half_angles._tigon = "rope (half_angles)"


def _pairs_to_halves(x):
    """x [..., D] with adjacent pairs (x[2j], x[2j+1]) laid out as halves: the even elements, then the odd."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def tigon_apply_rotary_pos_emb_pairs_to_halves(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Drop-in for DeepSeek-V3's ``apply_rotary_pos_emb_interleave``: adjacent pairs rotate, the
    result is laid out in halves (HF ignores position_ids). The pairs are gathered into halves
    (one copy of q and k) and rotated as rotate_half does, with HF's cos / sin [.., D] = cat(f, f)."""
    return _rope(_pairs_to_halves(q), _pairs_to_halves(k), cos, sin, None, unsqueeze_dim)


tigon_apply_rotary_pos_emb_pairs_to_halves._tigon = "rope (pairs_to_halves)"


def tigon_apply_rotary_emb_complex(xq, xk, freqs_cis):
    """Drop-in for DeepSeek-V2's ``apply_rotary_emb``: adjacent pairs of xq, xk [B, H, T, R] times
    freqs_cis [B, T, R/2] (complex) as complex numbers."""
    angles = torch.view_as_real(freqs_cis)
    return _rope(xq, xk, angles[..., 0], angles[..., 1], None, 1, interleaved=True)


tigon_apply_rotary_emb_complex._tigon = "rope (complex)"


def tigon_apply_rotary_emb_complex_bthd(xq, xk, freqs_cis):
    """Drop-in for Llama 4's ``apply_rotary_emb``: as "complex" with xq, xk [B, T, H, R] and
    freqs_cis [B, T, R/2]."""
    angles = torch.view_as_real(freqs_cis)
    return _rope(xq, xk, angles[..., 0], angles[..., 1], None, 2, interleaved=True)


tigon_apply_rotary_emb_complex_bthd._tigon = "rope (complex_bthd)"


def tigon_apply_rotary_pos_emb_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for GLM-4V's ``apply_rotary_pos_emb``: adjacent pairs rotate (``rotate_half_llm``)
    and cos / sin [.., R] hold each pair's angle twice (``repeat_interleave(2)``); R <= D."""
    return _rope(q, k, cos[..., ::2], sin[..., ::2], None, unsqueeze_dim, interleaved=True)


tigon_apply_rotary_pos_emb_interleaved._tigon = "rope (interleaved)"


def tigon_apply_rotary_pos_emb_vision(q, k, cos, sin):
    """Drop-in for the Qwen-VL / GLM-4V vision towers' ``apply_rotary_pos_emb_vision``: q, k
    [T, H, D] (the images' patches in one sequence), cos, sin [T, D]; fp32 arithmetic, results
    in q's dtype as HF's."""
    q_out, k_out = _rope(q.unsqueeze(0), k.unsqueeze(0), cos, sin, None, 2)
    return q_out[0], k_out[0]


tigon_apply_rotary_pos_emb_vision._tigon = "rope (vision)"


def tigon_apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=1):
    """Drop-in for Gemma 3n's / Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)``:
    one tensor a call (q and k rotate in separate calls), halves as rotate_half. The op's k is an
    empty view of x (no heads: nothing read or written for it)."""
    return _rope(x, x.narrow(unsqueeze_dim, 0, 0), cos, sin, None, unsqueeze_dim)[0]


tigon_apply_rotary_pos_emb_single._tigon = "rope (single)"


# HF's RoPE forms (families.Family.rope_form) -> tigon's drop-in.
ROPE_FORMS = {
    "half": tigon_apply_rotary_pos_emb,
    "half_angles": tigon_apply_rotary_pos_emb_half_angles,
    "pairs_to_halves": tigon_apply_rotary_pos_emb_pairs_to_halves,
    "complex": tigon_apply_rotary_emb_complex,
    "complex_bthd": tigon_apply_rotary_emb_complex_bthd,
    "interleaved": tigon_apply_rotary_pos_emb_interleaved,
    "vision": tigon_apply_rotary_pos_emb_vision,
    "single": tigon_apply_rotary_pos_emb_single,
}


def rope_drop_in(form: str):
    """tigon's function for a RoPE form of ROPE_FORMS."""
    if form not in ROPE_FORMS:
        raise ValueError(f"unknown RoPE form {form!r}; the forms are {list(ROPE_FORMS)}")
    return ROPE_FORMS[form]


# RoPE is a module-level function of HF's modeling files, called by the attention modules. An
# instance patch must change one model only. A patched attention module runs a copy of its
# forward whose globals name tigon's RoPE (nothing changes while it runs: torch.compile traces it
# inside checkpointed layers, where a flag set during the call would be a side effect it refuses).
# Forwards that are not plain functions calling the RoPE by name fall back to a dispatcher: the
# module function runs tigon's RoPE while a patched attention module's forward is on this
# thread, HF's otherwise.


def make_rope_dispatcher(original, drop_in=None):
    """``drop_in``: tigon's function for the form of ``original`` (None: the "half" form's)."""
    def apply_rotary_pos_emb(*args, **kwargs):
        if ambient.ROPE_SCOPE.on:
            return (drop_in or tigon_apply_rotary_pos_emb)(*args, **kwargs)
        return original(*args, **kwargs)

    apply_rotary_pos_emb._tigon = "rope (inside patched models' attention only)"
    apply_rotary_pos_emb._tigon_original = original
    return apply_rotary_pos_emb


def make_rope_scope(forward, drop_ins: dict):
    """An attention module's forward that runs ``forward`` with tigon's RoPE (see above).
    ``drop_ins``: HF's RoPE function names -> tigon's functions (None: the "half" form's)."""
    if isinstance(forward, types.FunctionType) and any(n in forward.__code__.co_names for n in drop_ins):
        ours = {name: fn or tigon_apply_rotary_pos_emb for name, fn in drop_ins.items()}
        scoped = types.FunctionType(forward.__code__, {**forward.__globals__, **ours},
                                    forward.__name__, forward.__defaults__, forward.__closure__)
        scoped.__kwdefaults__ = forward.__kwdefaults__
        scoped.__qualname__, scoped.__module__ = forward.__qualname__, forward.__module__
        scoped._tigon = "attention with tigon's RoPE"
        return scoped

    def scoped_forward(self, *args, **kwargs):
        with thread_flag(ambient.ROPE_SCOPE):
            return forward(self, *args, **kwargs)

    scoped_forward._tigon = "attention with tigon's RoPE"
    return scoped_forward


# ---- causal-LM loss ----

def checkpointed_layers(model: nn.Module) -> bool:
    """A training call of ``model`` under torch.compile runs its layers as checkpointed regions
    (HF gradient checkpointing on its decoder)."""
    if not (torch.compiler.is_compiling() and model.training and torch.is_grad_enabled()):
        return False
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return bool(getattr(decoder, "gradient_checkpointing", False))


def shifted_labels(labels, shift_labels, ignore_index):
    """HF's ForCausalLMLoss targets: labels shifted left by one, ignore_index appended."""
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


CAPTURING_HEAD = "output head (computes the causal-LM loss from its input, no logits)"


def _captured(into: dict, head: nn.Module, hidden):
    """The head's part of the causal-LM loss, run inside the head's forward: ``into["loss_of"](head,
    hidden)`` lands in ``into["loss"]``, and the head returns an empty [..., 0] tensor in place of
    its logits (softcap / scaling on it cost nothing). Inside the forward, FSDP2 and DeepSpeed
    ZeRO-3 have gathered the head's sharded weight (their module hooks run around it), and the
    loss's gradient reaches the weight through the head's own call."""
    into["loss"] = into["loss_of"](head, hidden)
    return hidden.new_empty(*hidden.shape[:-1], 0)


def make_capturing_head_forward(forward):
    """The output head's forward of an instance-patched model: inside the patched causal-LM
    forward's FLCE call it computes the loss from its input, the last hidden state (``_captured``);
    elsewhere ``forward``. Set once at patch time, so that the forward changes nothing on modules while
    it runs (what torch.compile traces; class patches, whose heads are not known in advance,
    swap the head's forward for the call instead)."""
    def head_forward(self, hidden):
        into = ambient.HEAD_CAPTURE.value
        return forward(self, hidden) if into is None else _captured(into, self, hidden)

    head_forward._tigon = CAPTURING_HEAD
    return head_forward


def captures_loss(head) -> bool:
    """Whether ``head``'s forward is the capturing one (make_capturing_head_forward)."""
    return getattr(head.forward, "_tigon", None) == CAPTURING_HEAD


@contextlib.contextmanager
def _capturing_head(head: nn.Module, captured: dict):
    """The head computes ``captured["loss_of"]`` of its input into ``captured["loss"]`` for the
    block (``_captured``), by the head's capturing
    forward when the patcher set one, else by a forward swapped in for the block."""
    if captures_loss(head):
        with ambient.thread_value(ambient.HEAD_CAPTURE, captured):
            yield
        return

    with _instance_forward(head, functools.partial(_captured, captured, head)):
        yield


@contextlib.contextmanager
def _instance_forward(module: nn.Module | None, forward):
    """module.forward = forward for the block (nothing when module is None), then whatever
    instance-level forward was there before."""
    if module is None:
        yield
        return
    own = vars(module)
    had, before = "forward" in own, own.get("forward")
    own["forward"] = forward
    try:
        yield
    finally:
        if had:
            own["forward"] = before
        else:
            own.pop("forward", None)


def tied_input_embedding(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The model's input embedding when it shares ``head``'s weight and tigon can run it
    (an nn.Embedding without max_norm / scale_grad_by_freq / sparse, optionally times an
    ``embed_scale`` as Gemma's), else None."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embed, nn.Embedding) or embed.weight is not getattr(head, "weight", None):
        return None
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return None
    if type(embed).forward is not nn.Embedding.forward and not hasattr(embed, "embed_scale"):
        return None  # a subclass doing something tigon does not know
    return embed


def make_tied_embedding_forward(embed: nn.Embedding, slot: TiedGradSlot):
    """embed's forward on tigon's embedding op, sharing ``slot`` with the head's FLCE."""
    def forward(input_ids):
        out = _embedding(input_ids, embed.weight, embed.padding_idx, slot)
        scale = getattr(embed, "embed_scale", None)
        if scale is not None:
            out = out * (scale.to(out.dtype) if torch.is_tensor(scale) else scale)
        return out

    return forward


# ---- HF's packed-sequence check ----



def make_find_packed_sequence_indices(original):
    """HF's ``masking_utils.find_packed_sequence_indices`` (which reads the GPU: a host sync
    every forward), answering "not packed" without looking while a patched causal-LM forward
    runs on positions HF generates itself (no position_ids, attention mask or cache given: a
    plain arange, so nothing is packed). Without the sync the host can queue the next step
    while the GPU finishes the last one."""
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if ambient.GENERATED_POSITIONS.on:
            return None
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._tigon = "packed-sequence check skipped on generated positions"
    return find_packed_sequence_indices


# ---- HF's SDPA causal-mask decision ----

IGNORE_CAUSAL_MASK_PARAMS = ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset",
                             "local_attention_size")


def make_ignore_causal_mask_sdpa(original):
    """HF's ``masking_utils._ignore_causal_mask_sdpa`` (may SDPA run with ``is_causal=True``
    instead of a materialised [B, 1, T, T] mask?), answering yes also while torch.compile traces,
    when a patched causal-LM forward runs without attention mask, positions or cache: the answer
    eager HF gives there. HF answers no whenever it traces (with torch < 2.14 it cannot tell
    compile from export), and SDPA with an explicit mask runs slower attention kernels (on the
    H100, Qwen2.5-0.5B at batch 128: cuDNN's backward 1.40 ms a call against 0.75 with is_causal)."""
    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset=0, kv_offset=0,
                                 local_attention_size=None, *args, **kwargs):
        if (ambient.GENERATED_POSITIONS.on and padding_mask is None and not torch.is_tensor(q_offset)
                and q_offset == 0 and kv_offset == 0 and q_length == kv_length
                and (local_attention_size is None or kv_length < local_attention_size)):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size,
                        *args, **kwargs)

    _ignore_causal_mask_sdpa._tigon = "is_causal SDPA also under torch.compile on generated positions"
    return _ignore_causal_mask_sdpa


def forward_reads(fn, name: str) -> bool:
    """Whether ``fn``'s code names ``name`` (an attribute read or a getattr string, nested code
    included): which of a row's logit transforms the installed HF version of the forward applies
    (PaliGemma's soft-caps its logits from transformers 5.2x on, not in 5.17)."""
    def names(code):
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, str):
                yield const
            elif isinstance(const, types.CodeType):
                yield from names(const)

    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is None or name in set(names(code))


def make_causal_lm_forward(original, *, softcap_attr=None, divisor_attr=None, mode="flce", chunk_budget=None,
                           multiplier_attr=None, composite=False, capture_head=None):
    """Wrap a *ForCausalLM.forward. With labels and the model in training (or ``skip_logits=True``),
    mode "flce" computes the loss from the last hidden state and the lm_head weight without the
    logits (``logits`` is None in the output); mode "cross_entropy" computes the logits as HF
    does and the loss with tigon's cross entropy. Without labels, or in eval, HF's forward runs
    unchanged. Honours num_items_in_batch, shift_labels, ignore_index, logits_to_keep, Gemma's
    final_logit_softcapping, Granite's logits_scaling, Falcon-H1's lm_head_multiplier
    (``multiplier_attr``) and MoE auxiliary losses. The loss runs inside the head's forward
    (``_captured``), where FSDP2 and DeepSpeed ZeRO-3 have gathered its weight; a head whose weight
    is a vocabulary-sharded DTensor there (tensor parallel: ColwiseParallel) runs
    ``vocab_parallel_linear_cross_entropy``. ``chunk_budget``:
    bytes of logits an FLCE chunk may hold (None: FLCE's default, 512 MiB). With tied input and
    output embeddings, the embedding runs on tigon's op during the call and the two share one
    [V, H] gradient buffer (see tigon.ops.embedding). ``composite``: an image+text
    *ForConditionalGeneration, whose logit transforms and auxiliary-loss coefficient are read from
    its text config, and whose positions HF may build itself (multimodal RoPE, image-token masks:
    the generated-positions shortcuts stay off). ``capture_head(model)``: sets the head's loss
    capture on a model that lacks it (built before a class patch), at its first eager call, so that
    later calls, compiled ones among them, change no module while they run."""
    # The arguments are bound by name with plain dict operations (inspect.Signature.bind breaks
    # torch.compile's graph): HF's forwards take named parameters, then **kwargs.
    # A transform the wrapped forward does not apply (another HF version) is not applied either.
    softcap_attr, divisor_attr, multiplier_attr = (
        attr if attr and forward_reads(original, attr) else None
        for attr in (softcap_attr, divisor_attr, multiplier_attr))
    params = list(inspect.signature(original).parameters.values())[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(names)} positional arguments, got {len(args)}")
        call = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in call:
                raise TypeError(f"{type(self).__name__}.forward got multiple values for argument {name!r}")
            call[name] = value
        labels = call.get("labels")
        if skip_logits is None:
            skip_logits = labels is not None and self.training
        if labels is None or not skip_logits and mode == "flce":
            return original(self, **call)
        return_dict = call.pop("return_dict", None)
        call["labels"] = None
        head = self.get_output_embeddings()
        if mode == "flce" and capture_head is not None and not torch.compiler.is_compiling():
            capture_head(self)  # once: a no-op on a model whose head already captures

        generated = not composite and all(call.get(name) is None for name in (
            "position_ids", "attention_mask", "past_key_values", "cache", "inputs_embeds"))
        slot = embed = None
        if (mode == "flce" and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and not is_dtensor(head.weight)):
            # One [V, H] gradient for the tied head and embedding: eager only (see tigon.ops.embedding).
            embed = tied_input_embedding(self, head)
            slot = TiedGradSlot() if embed is not None else None
        ignore_index = call.get("ignore_index", -100)
        target = shifted_labels(labels, call.get("shift_labels"), ignore_index)
        num_items = call.get("num_items_in_batch")
        reduction = "sum" if num_items is not None else "mean"
        config = self.config.get_text_config() if composite else self.config
        softcap = getattr(config, softcap_attr, None) if softcap_attr else None

        def head_loss(head, hidden):  # runs inside the head's forward (see _captured)
            rows = target[..., -hidden.shape[-2]:]  # logits_to_keep: the kept positions' targets
            if divisor_attr and getattr(config, divisor_attr, None):
                hidden = hidden / getattr(config, divisor_attr)
            if multiplier_attr and getattr(config, multiplier_attr, None) is not None:
                hidden = hidden * getattr(config, multiplier_attr)
            if is_dtensor(head.weight):  # a tensor-parallel head (ColwiseParallel): a vocabulary shard a rank
                return TF.vocab_parallel_linear_cross_entropy(
                    hidden, head.weight, rows.to(hidden.device), head.bias, ignore_index=ignore_index,
                    reduction=reduction, softcap=softcap, chunk_budget=chunk_budget)
            return _flce(hidden, head.weight, rows.to(hidden.device), head.bias, ignore_index=ignore_index,
                         reduction=reduction, softcap=softcap, chunk_budget=chunk_budget, tied_slot=slot)

        captured = {"loss_of": head_loss}
        with (_capturing_head(head, captured) if mode == "flce" else contextlib.nullcontext()), \
                _instance_forward(embed, None if embed is None else make_tied_embedding_forward(embed, slot)), \
                thread_flag(ambient.GENERATED_POSITIONS, generated), \
                thread_flag(ambient.CHECKPOINTED_LAYERS, checkpointed_layers(self)):
            out = original(self, **call)
        if mode == "flce":
            if "loss" not in captured:
                raise RuntimeError(f"{type(self).__name__}.forward did not call its output head "
                                   f"({type(head).__name__}): tigon's fused loss runs inside the head's call")
            loss = captured["loss"]
            logits = None
        else:
            logits = out.logits
            if target.shape[-1] != logits.shape[-2]:
                target = target[..., -logits.shape[-2]:]
            loss = _cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(logits.device),
                                  ignore_index=ignore_index, reduction=reduction, inplace=False)
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        aux = getattr(out, "aux_loss", None)
        aux_coef = getattr(config if composite else self, "router_aux_loss_coef", None)
        if aux is not None and aux_coef:
            loss = loss + aux_coef * aux.to(loss.device)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        result = type(out)(loss=loss, logits=logits, **fields)
        return result.to_tuple() if return_dict is False else result

    loss = "fused linear cross entropy, no logits" if mode == "flce" else "cross entropy"
    forward._tigon = f"causal-LM loss ({loss})"
    return forward
