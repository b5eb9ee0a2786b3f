"""The causal-LM forward the patcher installs: the loss from the last hidden state inside the
output head's call (fused linear cross entropy, no logits) or with tigon's cross entropy, and
the tied input embedding sharing the head's gradient."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch
from torch import nn

from tigon import ambient
from tigon import functional as TF
from tigon.ambient import deferred_label_checks, thread_flag
from tigon.ops import TiedGradSlot
from tigon.ops._common import is_dtensor


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
