"""Liger's ``nn.Module`` classes of ``liger_kernel.transformers`` on tigon's modules and
functions: Liger's constructor arguments (names, order, defaults), parameter names and shapes
(state dicts load either way) and forward signatures."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as TF
from tigon.compat.liger.transformers.functional import (
    _jsd,
    _kl_div,
    _linear_jsd,
    casting,
    liger_cross_entropy,
    liger_fused_linear_cross_entropy,
)
from tigon.nn import (
    TigonDyT,
    TigonFusedAddRMSNorm,
    TigonGeGLUMLP,
    TigonRMSNorm,
    TigonSoftmax,
    TigonSparsemax,
    TigonSwiGLUMLP,
    TigonTiledGeGLUMLP,
    TigonTiledSwiGLUMLP,
)
from tigon.ops.glu import activation_name

SILU = ("silu", "swish")


def check_init_fn(init_fn) -> None:
    if init_fn not in ("ones", "zeros"):
        raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")


def check_activation(cls: str, act, allowed=SILU, field: str = "hidden_act") -> None:
    if act not in allowed:
        raise ValueError(f"{cls} computes {' / '.join(allowed)}, but config.{field} is {act!r}")


# ---- norms ----

class _LigerNormAttributes:
    """Liger's attribute names over tigon's: ``variance_epsilon`` (eps) and ``casting_mode`` (casting)."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    @property
    def casting_mode(self) -> str:
        return self.casting

    @casting_mode.setter
    def casting_mode(self, value) -> None:
        self.casting = casting(value)


def _liger_rms_init(module, hidden_size, eps, offset, casting_mode, init_fn, elementwise_affine, base):
    check_init_fn(init_fn)
    base.__init__(module, hidden_size, eps, offset, casting(casting_mode), elementwise_affine=elementwise_affine)
    if module.weight is not None:
        with torch.no_grad():
            module.weight.fill_(1.0 if init_fn == "ones" else 0.0)


class LigerRMSNorm(_LigerNormAttributes, TigonRMSNorm):
    """Liger's ``LigerRMSNorm`` (weight initialised by ``init_fn``; ``offset=1.0`` applies
    ``1 + weight``): tigon.nn.TigonRMSNorm. ``in_place`` and ``row_mode`` choose among Liger's
    kernels and have no effect (tigon's backward never writes over the incoming gradient)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=True,
                 row_mode=None, elementwise_affine=True):
        _liger_rms_init(self, hidden_size, eps, offset, casting_mode, init_fn, elementwise_affine, TigonRMSNorm)
        self.in_place, self.row_mode, self.elementwise_affine = in_place, row_mode, elementwise_affine

    def forward(self, hidden_states):
        return super().forward(hidden_states)


class LigerFusedAddRMSNorm(_LigerNormAttributes, TigonFusedAddRMSNorm):
    """Liger's ``LigerFusedAddRMSNorm``: ``forward(hidden_states, residual)`` -> (rms_norm(h + r),
    h + r), tigon.nn.TigonFusedAddRMSNorm (``in_place``: no effect)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=False):
        _liger_rms_init(self, hidden_size, eps, offset, casting_mode, init_fn, True, TigonFusedAddRMSNorm)
        self.in_place = in_place

    def forward(self, hidden_states, residual):
        return super().forward(hidden_states, residual)


class LigerRMSNormForMuseGlimmer(LigerRMSNorm):
    """Liger's ``LigerRMSNormForMuseGlimmer``: fp32 (gemma casting), weight as is; ``with_scale=False``: no weight."""

    def __init__(self, dim=None, eps=1e-6, offset=0.0, casting_mode="gemma", init_fn="ones", in_place=False,
                 with_scale=True):
        super().__init__(dim, eps, offset, casting_mode, init_fn, in_place, elementwise_affine=with_scale)
        self.with_scale = with_scale


class LigerRMSNormForMuseGlimmerTextCentered(LigerRMSNorm):
    """Liger's ``LigerRMSNormForMuseGlimmerTextCentered``: Gemma's ``(1 + weight)``, fp32, zero-initialised."""

    def __init__(self, hidden_size, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False,
                 row_mode=None):
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class LigerLayerNorm(nn.Module):
    """Liger's ``LigerLayerNorm(hidden_size, eps, bias, init_fn)``: ``weight`` and ``bias``
    [hidden_size] (the bias random with ``bias=True``, zeros otherwise, as Liger's), over the last
    dim: tigon.functional.layer_norm. ``impl`` / ``mode`` / ``backend``: no effect."""

    def __init__(self, hidden_size, eps=1e-6, bias=False, init_fn="ones", impl=None, mode=None, backend=None):
        super().__init__()
        check_init_fn(init_fn)
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size) if init_fn == "ones" else torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.randn(hidden_size) if bias else torch.zeros(hidden_size))
        self.variance_epsilon = eps
        self.impl, self.mode = impl if impl is not None else backend, mode

    @property
    def backend(self):
        return self.impl

    @backend.setter
    def backend(self, value):
        self.impl = value

    def forward(self, hidden_states):
        return TF.layer_norm(hidden_states, self.weight, self.bias, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LigerGroupNorm(nn.Module):
    """Liger's ``LigerGroupNorm(num_channels, num_groups, eps, bias, init_fn)`` (x [N, C, *]):
    tigon.functional.group_norm. (Liger 0.8.5 has it in liger_kernel.transformers.group_norm.)"""

    def __init__(self, num_channels, num_groups, eps=1e-6, bias=False, init_fn="ones"):
        super().__init__()
        check_init_fn(init_fn)
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self.num_channels, self.num_groups, self.eps = num_channels, num_groups, eps
        self.weight = nn.Parameter(torch.ones(num_channels) if init_fn == "ones" else torch.zeros(num_channels))
        self.bias = nn.Parameter(torch.randn(num_channels) if bias else torch.zeros(num_channels))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        if hidden_states.ndim < 3 or hidden_states.shape[1] != self.num_channels:
            raise ValueError(f"hidden_states must be [N, {self.num_channels}, *] (3 dims or more), got shape "
                             f"{tuple(hidden_states.shape)}")
        return TF.group_norm(hidden_states, self.num_groups, self.weight, self.bias, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}, num_groups={self.num_groups}, eps={self.eps}"


class LigerDyT(TigonDyT):
    """Liger's ``LigerDyT(hidden_size, beta=True, init_alpha=0.5)``: tigon.nn.TigonDyT."""

    def __init__(self, hidden_size, beta=True, init_alpha=0.5):
        super().__init__(hidden_size, init_alpha=init_alpha, beta=beta)


class LigerPolyNorm(nn.Module):
    """Liger's ``LigerPolyNorm(eps, in_place)``: ``weight`` [3] (1/3 each) and ``bias`` a scalar
    (1.0), as Liger's; tigon.functional.poly_norm (``in_place``: no effect)."""

    def __init__(self, eps=1e-6, in_place=True):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0))
        self.bias = nn.Parameter(torch.tensor(1.0))
        self.variance_epsilon, self.in_place = eps, in_place

    def forward(self, hidden_states):
        return TF.poly_norm(hidden_states, self.weight, self.bias, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"eps={self.variance_epsilon}"


# ---- activations ----

class LigerSoftmax(TigonSoftmax):
    """Liger's ``LigerSoftmax()``: softmax over the last dim, tigon.nn.TigonSoftmax."""

    def __init__(self):
        super().__init__(-1)


class LigerSparsemax(TigonSparsemax):
    """Liger's ``LigerSparsemax(dim=-1)``: tigon.nn.TigonSparsemax."""


class LigerReLUSquared(nn.Module):
    """Liger's ``LigerReLUSquared()``: relu(x)^2, tigon.functional.relu_squared."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return TF.relu_squared(x)


# ---- MLPs ----

class LigerSwiGLUMLP(TigonSwiGLUMLP):
    """Liger's ``LigerSwiGLUMLP(config, intermediate_size=None)``: gate / up / down without biases,
    ``config.hidden_act`` silu or swish; tigon.nn.TigonSwiGLUMLP."""

    def __init__(self, config, intermediate_size=None):
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        super().__init__(config, intermediate_size, bias=False, activation="silu", gate_multiplier=1.0,
                         down_multiplier=1.0)


class LigerQwen3MoeSwiGLUMLP(LigerSwiGLUMLP):
    """Liger's ``LigerQwen3MoeSwiGLUMLP(config, intermediate_size=None)``: as LigerSwiGLUMLP."""


class LigerSwiGLUMLPForMuseGlimmer(TigonSwiGLUMLP):
    """Liger's ``LigerSwiGLUMLPForMuseGlimmer(config)``: as LigerSwiGLUMLP, the activation read from
    ``config.hidden_activation`` (or ``hidden_act``)."""

    def __init__(self, config):
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        check_activation(type(self).__name__, act, field="hidden_activation")
        super().__init__(config, bias=False, activation="silu", gate_multiplier=1.0, down_multiplier=1.0)


class LigerFalconH1SwiGLUMLP(TigonSwiGLUMLP):
    """Liger's ``LigerFalconH1SwiGLUMLP(config)``: down(silu(gate(x) * g) * up(x)) * d with
    ``config.mlp_multipliers`` (g, d) and ``config.mlp_bias``; tigon.nn.TigonSwiGLUMLP."""

    def __init__(self, config):
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        gate_multiplier, down_multiplier = config.mlp_multipliers
        super().__init__(config, bias=bool(getattr(config, "mlp_bias", False)), activation="silu",
                         gate_multiplier=float(gate_multiplier), down_multiplier=float(down_multiplier))


def _gelu_of(config) -> str:
    """The GELU of a config (tigon's name); Liger's default, the tanh approximation, when it names none."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    try:
        name = activation_name(act)
    except (KeyError, ValueError, TypeError):
        return "gelu_tanh"
    return name if name in ("gelu_tanh", "gelu_erf") else "gelu_tanh"


class LigerGEGLUMLP(TigonGeGLUMLP):
    """Liger's ``LigerGEGLUMLP(config)``: down(gelu(gate(x)) * up(x)) without biases;
    tigon.nn.TigonGeGLUMLP. The GELU is the config's (exact for "gelu"), where Liger always takes
    the tanh approximation."""

    def __init__(self, config):
        super().__init__(config, bias=False, activation=_gelu_of(config), gate_multiplier=1.0, down_multiplier=1.0)


class LigerPhi3SwiGLUMLP(nn.Module):
    """Liger's ``LigerPhi3SwiGLUMLP(config)``: Phi-3's fused ``gate_up_proj`` [2I, H] (gate rows,
    then up rows) and ``down_proj``; tigon.functional.swiglu."""

    def __init__(self, config):
        super().__init__()
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        self.config = config
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(TF.swiglu(gate, up))


class LigerBlockSparseTop2MLP(nn.Module):
    """Liger's ``LigerBlockSparseTop2MLP(config)``: Mixtral's expert MLP w2(silu(w1(x)) * w3(x));
    tigon.functional.swiglu."""

    def __init__(self, config):
        super().__init__()
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        self.ffn_dim, self.hidden_dim = config.intermediate_size, config.hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(TF.swiglu(self.w1(x), self.w3(x)))


class LigerMLP(nn.Module):
    """Liger's ``LigerMLP(config)``: the SwiGLU MLP as one op keeping only x (gate and up are
    recomputed in the backward), tigon.functional.glu_mlp."""

    def __init__(self, config):
        super().__init__()
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        self.config = config
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.gate_multiplier, self.down_multiplier = 1.0, 1.0

    def forward(self, x):
        return TF.glu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, "silu",
                          gate_multiplier=float(self.gate_multiplier), down_multiplier=float(self.down_multiplier))


class LigerFalconH1MLP(LigerMLP):
    """Liger's ``LigerFalconH1MLP(config)``: LigerMLP with ``config.mlp_multipliers`` (no biases)."""

    def __init__(self, config):
        if getattr(config, "mlp_bias", False):
            raise ValueError("LigerFalconH1MLP does not support biases (config.mlp_bias=True): use "
                             "LigerFalconH1SwiGLUMLP")
        super().__init__(config)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers


class LigerTiledSwiGLUMLP(TigonTiledSwiGLUMLP):
    """Liger's ``LigerTiledSwiGLUMLP(config, num_shards=None)``: tigon.nn.TigonTiledSwiGLUMLP (no biases)."""

    def __init__(self, config, num_shards=None):
        if hasattr(config, "hidden_act"):
            check_activation(type(self).__name__, config.hidden_act)
        super().__init__(config, num_shards=num_shards, bias=False, activation="silu", gate_multiplier=1.0,
                         down_multiplier=1.0)


class LigerTiledGEGLUMLP(TigonTiledGeGLUMLP):
    """Liger's ``LigerTiledGEGLUMLP(config, num_shards=None)``: tigon.nn.TigonTiledGeGLUMLP (no
    biases; the GELU as LigerGEGLUMLP's)."""

    def __init__(self, config, num_shards=None):
        if hasattr(config, "hidden_act"):
            check_activation(type(self).__name__, config.hidden_act, ("gelu", "gelu_new", "gelu_pytorch_tanh"))
        super().__init__(config, num_shards=num_shards, bias=False, activation=_gelu_of(config),
                         gate_multiplier=1.0, down_multiplier=1.0)


class LigerExperts(nn.Module):
    """Liger's ``LigerExperts(config)``: MixtralExperts' stacked ``gate_up_proj`` [E, 2I, H] (gate
    rows, then up rows) and ``down_proj`` [E, H, I], ``forward(hidden_states, top_k_index,
    top_k_weights)``; tigon.functional.moe_experts."""

    def __init__(self, config):
        super().__init__()
        check_activation(type(self).__name__, getattr(config, "hidden_act", None))
        for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
            if hasattr(config, attr):
                self.num_experts = getattr(config, attr)
                break
        self.intermediate_dim = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.hidden_dim = config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return TF.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


# ---- losses ----

def _check_ce_options(label_smoothing, reduction, softcap) -> None:
    """Liger's own checks of its cross-entropy modules' options."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")


class LigerCrossEntropyLoss(nn.Module):
    """Liger's ``LigerCrossEntropyLoss``: ``forward(_input, target)`` with logits [..., V] -> the
    loss, or a CrossEntropyOutput when extras are asked for; tigon.functional.cross_entropy with
    ``inplace=True`` (as Liger's kernel, the gradient is written over the logits in the forward
    pass)."""

    def __init__(self, weight=None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                 return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False):
        super().__init__()
        _check_ce_options(label_smoothing, reduction, softcap)
        self.weight, self.ignore_index, self.lse_square_scale = weight, ignore_index, lse_square_scale
        self.label_smoothing, self.reduction, self.softcap = label_smoothing, reduction, softcap
        self.return_z_loss, self.return_token_accuracy = return_z_loss, return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, _input, target):
        return liger_cross_entropy(_input, target, self.weight, ignore_index=self.ignore_index,
                                   reduction=self.reduction, label_smoothing=self.label_smoothing,
                                   lse_square_scale=self.lse_square_scale, softcap=self.softcap,
                                   return_z_loss=self.return_z_loss, return_token_accuracy=self.return_token_accuracy,
                                   return_predicted_tokens=self.return_predicted_tokens)


class LigerFusedLinearCrossEntropyLoss(nn.Module):
    """Liger's ``LigerFusedLinearCrossEntropyLoss``: ``forward(lin_weight, _input, target,
    bias=None)`` (the head's weight first) -> the loss, or a CrossEntropyOutput when extras are
    asked for; tigon.functional.fused_linear_cross_entropy."""

    def __init__(self, ce_weight=None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                 return_z_loss: bool = False, accum_dtype: torch.dtype | None = None, use_token_scaling: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
        super().__init__()
        _check_ce_options(label_smoothing, reduction, softcap)
        self.ce_weight, self.ignore_index, self.lse_square_scale = ce_weight, ignore_index, lse_square_scale
        self.label_smoothing, self.reduction, self.softcap = label_smoothing, reduction, softcap
        self.return_z_loss, self.accum_dtype, self.use_token_scaling = return_z_loss, accum_dtype, use_token_scaling
        self.return_token_accuracy, self.return_predicted_tokens = return_token_accuracy, return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        return liger_fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
            self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
            self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens)


class LigerJSD(nn.Module):
    """Liger's ``LigerJSD(beta, ignore_index)``: ``forward(log_q, log_p, shift_labels=None)``, the
    student's log-probs first; tigon.functional.jsd (loss in the inputs' dtype, as Liger's)."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, log_q, log_p, shift_labels=None):
        return _jsd(log_q, log_p, shift_labels, self.beta, self.ignore_index)


class LigerFusedLinearJSD(nn.Module):
    """Liger's ``LigerFusedLinearJSD(jsd_beta, ignore_index, temperature, accum_dtype)``:
    ``forward(student_input, student_weight, teacher_input, teacher_weight, shift_labels)``;
    tigon.losses.fused_linear_jsd's loss."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None):
        super().__init__()
        if temperature == 0:
            raise ValueError("temperature cannot be 0")
        self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype = (jsd_beta, ignore_index, temperature,
                                                                                accum_dtype)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        return _linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, self.jsd_beta,
                           self.ignore_index, self.temperature, self.accum_dtype)


class LigerKLDIVLoss(nn.KLDivLoss):
    """Liger's ``LigerKLDIVLoss(eps=1e-10, *args, **kwargs)`` (nn.KLDivLoss's arguments; its
    default reduction "mean"): ``forward(y_pred, y_true)``, tigon.functional.kl_div. eps other
    than 1e-10 is refused (tigon does not clamp the target at eps)."""

    def __init__(self, eps: float = 1e-10, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, y_pred, y_true):
        return _kl_div(y_pred, y_true, self.reduction, self.log_target, self.eps)


class LigerTVDLoss(nn.Module):
    """Liger's ``LigerTVDLoss(reduction="batchmean", ignore_index=-100)``: ``forward(p, q,
    shift_labels=None)``, tigon.functional.tvd."""

    def __init__(self, reduction="batchmean", ignore_index: int = -100):
        super().__init__()
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, p, q, shift_labels=None):
        return TF.tvd(p, q, shift_labels, reduction=self.reduction, ignore_index=self.ignore_index)


class LigerVocabParallelCrossEntropy(nn.Module):
    """Liger's ``LigerVocabParallelCrossEntropy``: ``forward(vocab_parallel_logits, target,
    tp_group=None)`` with logits [S, B, V_local] (this rank's vocabulary shard, in rank order) and
    global target ids [S, B] -> the per-token loss [S, B]. ``tp_group=None``: one rank
    (tigon.functional.cross_entropy); a group: tigon.functional.vocab_parallel_cross_entropy.
    Label smoothing is PyTorch's over the whole vocabulary (``label_smoothing_formula="pytorch"``,
    ``label_smoothing_mode="global"``); the others are refused with label smoothing on."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "none",
                 label_smoothing_formula: str = "pytorch", label_smoothing_mode: str = "global"):
        super().__init__()
        if reduction != "none":
            raise ValueError(f"vocab-parallel cross entropy returns the per-token loss: reduction must be 'none', got "
                             f"{reduction!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if label_smoothing_formula not in ("pytorch", "megatron"):
            raise ValueError("label_smoothing_formula must be 'pytorch' or 'megatron', got "
                             f"{label_smoothing_formula!r}")
        if label_smoothing_mode not in ("global", "partition"):
            raise ValueError(f"label_smoothing_mode must be 'global' or 'partition', got {label_smoothing_mode!r}")
        if label_smoothing and label_smoothing_formula == "megatron":
            raise NotImplementedError("label_smoothing_formula='megatron' is not supported: tigon smooths as PyTorch "
                                      "does (alpha / V over the whole vocabulary); pass 'pytorch'")
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.label_smoothing_formula, self.label_smoothing_mode = label_smoothing_formula, label_smoothing_mode

    def forward(self, vocab_parallel_logits, target, tp_group=None):
        if vocab_parallel_logits.ndim != 3:
            raise ValueError(f"vocab_parallel_logits must be [seq, batch, vocab], got shape "
                             f"{tuple(vocab_parallel_logits.shape)}")
        options = dict(ignore_index=self.ignore_index, reduction="none", label_smoothing=self.label_smoothing)
        if tp_group is None:
            return TF.cross_entropy(vocab_parallel_logits, target, **options)
        if self.label_smoothing and self.label_smoothing_mode == "partition" and \
                torch.distributed.get_world_size(tp_group) > 1:
            raise NotImplementedError("label_smoothing_mode='partition' is not supported on several ranks: tigon "
                                      "smooths over the whole vocabulary; pass 'global'")
        return TF.vocab_parallel_cross_entropy(vocab_parallel_logits, target, group=tp_group, **options)
