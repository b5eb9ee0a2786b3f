"""tigon in torchtune: ``patch(model)`` patches a built torchtune ``TransformerDecoder`` in place,
``loss_for(model)`` gives the loss its recipes call.

Patched: every ``RMSNorm`` and Gemma's ``GemmaRMSNorm`` (tigon's kernel; fp32 throughout, as
torchtune's; Gemma's scales by 1 + weight), every rotary
embedding of torchtune's own kinds (``RotaryPositionalEmbeddings`` and Llama 3.1's
``Llama3ScaledRoPE``, which rotate interleaved pairs, and Qwen2's, which rotates halves), every
gated ``FeedForward`` (SiLU or GELU, with an up projection: tigon's fused MLP, which keeps only its
input inside activation checkpointing), and the output: in training mode the patched decoder
returns its final normed hidden state [b, s, d] instead of logits, and the loss of ``loss_for``
multiplies it by the output projection (``nn.Linear`` or ``TiedLinear``) chunk by chunk inside
tigon's fused linear cross entropy, so the [b, s, vocab] logits never exist. In eval mode the
decoder returns logits as before. torchtune is an optional dependency
(``pip install tigon[torchtune]``); this module imports it only when called.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from tigon import ambient
from tigon import functional as TF
from tigon.ambient import deferred_label_checks, thread_flag
from tigon.extras import require_extra
from tigon.ops.glu_mlp import gated_mlp
from tigon.patching.mlp import identify_activation

# Instance attributes ``patch`` sets (functions marked ``_tigon``), removed by ``unpatch``.
_PATCHED_ATTRS = ("forward", "unembed")


def _bind(fn, module):
    fn._tigon = True
    return types.MethodType(fn, module)


def _torchtune_modules():
    try:
        from torchtune.modules import FeedForward, TiedLinear, TransformerDecoder
    except ImportError:  # only then: a compiled forward calls this, and the check is no graph to trace
        require_extra("torchtune", "tigon.torchtune")
        raise
    return FeedForward, TiedLinear, TransformerDecoder


def _norm_offsets() -> dict:
    """torchtune's RMSNorm classes tigon patches -> the offset added to their weight."""
    from torchtune.models.gemma.rms_norm import GemmaRMSNorm
    from torchtune.modules import RMSNorm

    return {RMSNorm: 0.0, GemmaRMSNorm: 1.0}


def _rope_kinds() -> dict:
    """torchtune's rotary embedding classes tigon patches -> whether they rotate interleaved pairs."""
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    return {RotaryPositionalEmbeddings: True, Llama3ScaledRoPE: True, Qwen2RotaryPositionalEmbeddings: False}


@dataclass
class TorchtunePatchReport:
    """What ``patch`` changed: modules patched per kind, and what it left alone and why."""

    patched: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)

    def __str__(self):
        done = ", ".join(f"{n} {kind}" for kind, n in self.patched.items()) or "nothing"
        lines = [f"tigon patched a torchtune TransformerDecoder: {done}"]
        lines += [f"  not patched: {why}" for why in self.skipped]
        return "\n".join(lines)


def _make_rms_norm_forward(offset: float):
    def forward(self, x):
        # torchtune's norms compute in fp32 (x, and the weight promoted; Gemma's 1 + weight) and
        # cast to x's dtype at the end: tigon's casting "gemma".
        return TF.rms_norm(x, self.scale, eps=self.eps, offset=offset, casting="gemma")
    return forward


def _make_rope_forward(interleaved: bool):
    def forward(self, x, *, input_pos=None):
        """x [b, s, n_h, h_d] rotated at positions input_pos [b, s] (or 0..s-1)."""
        if getattr(self, "is_cache_built", True) is False:
            raise RuntimeError("RoPE cache is not built. Please call rope_init() first.")
        # The rows of this call's positions, as torchtune takes them ([s, ...] or [b, s, ...]): a
        # gather of b*s rows, not a copy of the whole cache (131072 rows for Llama 3.2), and no
        # host sync (a position table would check its range on the host).
        rows = self.cache[: x.shape[1]] if input_pos is None else self.cache[input_pos]
        if interleaved:  # rows [.., h_d / 2, 2]: (cos, sin) of each pair's angle
            cos, sin = rows.movedim(-1, 0).contiguous().unbind(0)
        else:  # Qwen2's rows [.., 2 h_d]: cos then sin, each over both halves
            cos, sin = rows.chunk(2, dim=-1)
        # tigon's RoPE rotates q and k in one launch; torchtune calls it per tensor: no k heads.
        no_heads = x.new_empty((x.shape[0], x.shape[1], 0, x.shape[3]))
        return TF.apply_rotary_pos_emb(x, no_heads, cos, sin, unsqueeze_dim=2, interleaved=interleaved)[0]
    return forward


def _make_feed_forward_forward(activation: str, ends_layer: bool):
    def forward(self, x):
        # Under torch.compile: the choice the decoder's forward left on this module when it ran
        # eagerly (layers compiled one by one, as the recipes do, are re-run by checkpoint's
        # recomputation after the decoder's forward has returned), else its flag (the decoder
        # compiled whole: checkpointed regions are traced, not re-run).
        checkpointed = None
        if torch.compiler.is_compiling():  # the flag read only without the attribute: no guard on it
            checkpointed = getattr(self, "_tigon_checkpointed", None)
            if checkpointed is None:
                checkpointed = ambient.CHECKPOINTED_LAYERS.on
        # The layer adds the MLP's output to the residual and saves nothing after it: the
        # MLP may keep only its input in a checkpointed layer. When its output goes straight into
        # the residual (no post-MLP norm, as Gemma 2's, which saves it) and torchtune
        # checkpoints layer by layer, it may also skip its matmuls when checkpoint recomputes a
        # layer compiled on its own (the recipes' compile). (checkpointed is None when eager.)
        last = ends_layer and bool(checkpointed)
        return gated_mlp(x, self.w1, self.w3, self.w2, activation, keep_input_only=True, checkpointed=checkpointed,
                         last_in_checkpoint=last)
    return forward


def _checkpointed_layers(model) -> bool:
    """The decoder's layers are wrapped for activation checkpointing (torchtune's
    set_activation_checkpointing). Read by the FeedForward only under torch.compile, which
    traces checkpointed regions without the hooks eager calls see (whether a checkpointed MLP
    keeps only its input also needs gradients on: tigon.ops.glu_mlp.gated_mlp)."""
    return any(type(layer).__name__ == "CheckpointWrapper" for layer in model.layers)


def _make_decoder_forward(original):
    def forward(self, *args, **kwargs):
        checkpointed = _checkpointed_layers(self)
        if not torch.compiler.is_compiling():
            for module in self._tigon_feed_forwards:
                if getattr(module, "_tigon_checkpointed", None) is not checkpointed:
                    module._tigon_checkpointed = checkpointed
        with thread_flag(ambient.CHECKPOINTED_LAYERS, checkpointed):
            return original(*args, **kwargs)
    return forward


def _make_unembed(original):
    def unembed(self, h):
        if self.training:  # the final hidden state, for the loss of tigon.torchtune.loss_for
            return self.norm(h)
        return original(h)
    return unembed


def output_weight(model) -> torch.Tensor:
    """The [vocab, d] weight of the decoder's output projection (tied to the embedding or not)."""
    _, TiedLinear, _ = _torchtune_modules()
    output = model.output
    if isinstance(output, TiedLinear):
        return output.tied_module.weight
    if type(output) is nn.Linear and output.bias is None:
        return output.weight
    raise TypeError(f"the decoder's output is {type(output).__name__}; tigon's loss takes an nn.Linear without "
                    "bias or a TiedLinear")


def patch(model, *, rms_norm: bool = True, rope: bool = True, feed_forward: bool = True,
          output: bool = True) -> TorchtunePatchReport:
    """Patch a built torchtune ``TransformerDecoder`` in place (see the module docstring). Patch
    before ``torch.compile`` and before wrapping for FSDP; activation checkpointing may be
    applied before or after. With ``output=True`` train with ``loss_for(model)``."""
    FeedForward, _, TransformerDecoder = _torchtune_modules()
    if not isinstance(model, TransformerDecoder):
        raise TypeError(f"model must be a torchtune TransformerDecoder, got {type(model).__name__}")
    if getattr(model, "_tigon_patched", False):
        raise RuntimeError("this model is already patched by tigon.torchtune (unpatch it first)")
    report = TorchtunePatchReport()
    count = dict.fromkeys(("RMSNorm", "RoPE", "FeedForward"), 0)
    feed_forwards = []
    rope_kinds = _rope_kinds() if rope else {}
    norm_offsets = _norm_offsets() if rms_norm else {}
    # FeedForwards whose output a layer adds to its residual as it is (torchtune's mlp_scale).
    ends_layer = {id(m.mlp) for m in model.modules() if isinstance(getattr(m, "mlp_scale", None), nn.Identity)}
    for name, module in model.named_modules():
        if type(module) in rope_kinds:
            module.forward = _bind(_make_rope_forward(rope_kinds[type(module)]), module)
            count["RoPE"] += 1
        elif type(module) in norm_offsets:
            module.forward = _bind(_make_rms_norm_forward(norm_offsets[type(module)]), module)
            count["RMSNorm"] += 1
        elif feed_forward and isinstance(module, FeedForward):
            activation = identify_activation(module.activation)
            if module.w3 is None or activation is None:
                why = "no up projection (w3)" if module.w3 is None else f"activation {module.activation!r}"
                report.skipped.append(f"{name}: FeedForward with {why}")
                continue
            module.forward = _bind(_make_feed_forward_forward(activation, id(module) in ends_layer), module)
            feed_forwards.append(module)
            count["FeedForward"] += 1
    if output and type(model.norm) not in _norm_offsets():
        # Gemma 2's final norm also soft-caps the logits, which this loss does not do.
        report.skipped.append(f"output: the final norm is {type(model.norm).__name__}, not a plain RMSNorm; the "
                              "decoder keeps returning logits (train with the recipe's own loss)")
    elif output:
        output_weight(model)  # the error now, not at the first loss
        model.unembed = _bind(_make_unembed(type(model).unembed.__get__(model)), model)
        model._tigon_output = True
        report.patched["output (hidden states to the loss)"] = 1
    model._tigon_feed_forwards = feed_forwards
    model.forward = _bind(_make_decoder_forward(type(model).forward.__get__(model)), model)
    report.patched.update({k: v for k, v in count.items() if v})
    model._tigon_patched = True
    return report


def unpatch(model) -> None:
    """Undo ``patch`` on this model (the instance attributes it set)."""
    for module in model.modules():
        for attr in _PATCHED_ATTRS:
            bound = vars(module).get(attr)
            if isinstance(bound, types.MethodType) and getattr(bound.__func__, "_tigon", False):
                delattr(module, attr)
    for module in vars(model).pop("_tigon_feed_forwards", ()):
        vars(module).pop("_tigon_checkpointed", None)
    vars(model).pop("_tigon_patched", None)
    vars(model).pop("_tigon_output", None)


class FusedLinearCrossEntropyLoss(nn.Module):
    """Cross entropy of ``hidden @ W^T`` against labels, W the patched decoder's output weight,
    without forming the logits (tigon.functional.fused_linear_cross_entropy); the mean over the
    tokens whose label is not ``ignore_index``, as torchtune's CEWithChunkedOutputLoss and
    nn.CrossEntropyLoss. Called as the recipes call their loss: ``loss(hidden, labels)`` with
    hidden [b, s, d] or [b * s, d] (or a list of chunks along s) and labels [b, s] or [b * s].
    ``num_output_chunks`` is kept for recipes that read it; tigon chunks by its own budget
    (``chunk_budget`` bytes of logits)."""

    def __init__(self, model, ignore_index: int = -100, chunk_budget: int | None = None):
        super().__init__()
        self._weight_of = lambda: output_weight(model)  # not a submodule: the model is not the loss's
        self.ignore_index = ignore_index
        self.chunk_budget = chunk_budget
        self.num_output_chunks = 0

    def forward(self, hidden, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(hidden, (list, tuple)):
            hidden = torch.cat(list(hidden), dim=-2)
        if hidden.shape[:-1].numel() != labels.numel():
            raise ValueError(f"hidden has {hidden.shape[:-1].numel()} tokens (shape {tuple(hidden.shape)}) but labels "
                             f"has {labels.numel()} (shape {tuple(labels.shape)}); in training mode the patched "
                             "decoder returns hidden states [b, s, d]")
        with deferred_label_checks():  # a bad label raises at a later step instead of syncing this one
            return TF.fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self._weight_of(),
                                                 labels.reshape(-1), ignore_index=self.ignore_index,
                                                 chunk_budget=self.chunk_budget)


def loss_for(model, ignore_index: int = -100, chunk_budget: int | None = None) -> FusedLinearCrossEntropyLoss:
    """The loss a decoder patched with ``output=True`` trains with (in place of the recipe's
    ``CEWithChunkedOutputLoss``)."""
    if not getattr(model, "_tigon_output", False):
        raise ValueError("loss_for(model) needs a decoder patched by tigon.torchtune.patch with output=True (its "
                         "training forward then returns hidden states); see the patch report")
    output_weight(model)
    return FusedLinearCrossEntropyLoss(model, ignore_index=ignore_index, chunk_budget=chunk_budget)
