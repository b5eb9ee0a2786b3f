"""Apply a family row to the HF classes (before a model is built) or to a built model:
``apply_family``, ``patch``, ``patch_<family>`` (``family_patcher``) and ``patched``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import warnings

from torch import nn

from tigon.ops._internals import PRIVATE_APIS
from tigon.patching.causal_lm import captures_loss, make_capturing_head_forward, make_causal_lm_forward
from tigon.patching.errors import TigonPatchError
from tigon.patching.families import BY_MODEL_TYPE, FAMILIES, Family
from tigon.patching.hf_masks import (
    IGNORE_CAUSAL_MASK_PARAMS,
    make_find_packed_sequence_indices,
    make_ignore_causal_mask_sdpa,
)
from tigon.patching.install import (
    _MISSING,
    _forward_before_tigon,
    _instances,
    _set_instance,
    _set_shared,
    _undo,
)
from tigon.patching.mlp import fused_activation
from tigon.patching.options import PatchOptions, PatchReport, _refuse_checkpointing, patch_options
from tigon.patching.pieces import PIECES, _hf, _modeling
from tigon.patching.rope import make_rope_dispatcher, make_rope_scope, rope_drop_in, tigon_apply_rotary_pos_emb
from tigon.patching.structure import _patch_by_structure

# Class patching (``patch_llama()``) sets the forwards on the HF classes and replaces the
# modeling module's RoPE function: every model of the family in the process, built before or
# after, uses tigon. Instance patching (``tigon.patch(model)``, ``patch_llama(model)``) changes
# that model only: its modules get their own forwards (``_InstancePatch``), and the module-level
# functions HF's modules call (RoPE, the packed-sequence check, the SDPA causal-mask decision)
# become dispatchers that run tigon's version only inside the patched model's forward.

log = logging.getLogger("tigon")


def _family_by_name(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; tigon knows {sorted(FAMILIES)}")
    return FAMILIES[name]


@contextlib.contextmanager
def patched(model: nn.Module | None = None, family: str | None = None, **options):
    """``with tigon.patched(model): ...`` patches ``model`` (or, with ``family="llama"`` and no
    model, that family's classes) for the block and undoes exactly those patches after it.
    Yields the PatchReport."""
    if model is None and family is None:
        raise ValueError("give a model, or a family name (one of tigon.FAMILIES)")
    report = patch(model, **options) if model is not None else apply_family(_family_by_name(family),
                                                                             patch_options(**options))
    try:
        yield report
    finally:
        _undo(report.undo)


def _check_rope_signature(fn, family, form):
    """fn's leading parameters are those of tigon's drop-in for RoPE form ``form``."""
    ours = [p.name for p in inspect.signature(rope_drop_in(form)).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][:4]
    params = list(inspect.signature(fn).parameters)
    if params[:len(ours)] != ours:
        raise TigonPatchError(f"{family.name}: {fn.__module__}.{fn.__name__} takes {params}, "
                              f"not ({', '.join(ours)}, ...) as tigon's RoPE expects")


def _calls_function(cls: type, fn_name: str) -> bool:
    """cls.forward calls the module-level function ``fn_name`` of its modeling file."""
    fwd = inspect.unwrap(getattr(cls, "forward", None))
    code = getattr(fwd, "__code__", None)
    return code is not None and fn_name in code.co_names


def _capture_head(lm: nn.Module, undo: list | None = None) -> None:
    """The output head of ``lm`` computes the patched forward's fused loss from its input
    (make_capturing_head_forward): set once on the instance, never swapped per call."""
    head = lm.get_output_embeddings()
    if isinstance(head, nn.Module) and not captures_loss(head):
        _set_instance(head, "forward", make_capturing_head_forward(_forward_before_tigon(head)),
                      [] if undo is None else undo)


def _init_preparing(lm_class: type, init, mlp_classes: tuple, mode: str):
    """``lm_class.__init__`` (``init``: its own, or _MISSING for the inherited one), then the built
    model prepared for a class patch: its MLPs' activations identified, and with mode "flce" its
    head's loss capture set."""
    def __init__(self, *args, **kwargs):
        if init is _MISSING:
            super(lm_class, self).__init__(*args, **kwargs)
        else:
            init(self, *args, **kwargs)
        for module in self.modules():
            if isinstance(module, mlp_classes):
                fused_activation(module)
        if mode == "flce":
            _capture_head(self)

    __init__._tigon = "builds the model, then prepares it for tigon's class patch"
    __init__._tigon_original = init
    return __init__


def apply_family(family: Family, options: PatchOptions | None = None, model: nn.Module | None = None) -> PatchReport:
    """Patch the classes of ``family`` (model None) or the modules of ``model``; see patch_<family>.
    A vision-language row's sub-models get their own rows too (``_sub_families``), without their
    loss: the row's *ForConditionalGeneration owns it. On an error nothing stays changed."""
    opts = patch_options(options)
    report = _apply_row(family, opts, model)
    rows = _sub_families(family, model, report)
    if rows:
        sub_opts = dataclasses.replace(opts, fused_linear_cross_entropy=False, cross_entropy=False)
        try:
            for row in rows:
                sub = _apply_row(row, sub_opts, model)
                report.replaced += sub.replaced
                report.skipped += [(piece, f"{row.name}: {why}") for piece, why in sub.skipped]
                report.undo += sub.undo
        except BaseException:
            _undo(report.undo)
            raise
        log.info("%s", report)
    return report


def _sub_families(family: Family, model: nn.Module | None, report: PatchReport) -> list[Family]:
    """The rows of a vision-language model's sub-models: for a built model, those of its
    sub-configs' model types (config.text_config, config.vision_config, ...), a sub-config of
    the row's own package being the row's; for class patches, the row's ``parts``."""
    if model is None:
        return [_family_by_name(name) for name in family.parts]
    config = getattr(model, "config", None)
    rows = []
    package = family.module.rsplit(".", 1)[0] + "."
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        model_type = getattr(sub, "model_type", None)
        if model_type is None:
            continue
        row = BY_MODEL_TYPE.get(model_type)
        if row is None:
            if not type(sub).__module__.startswith(package):
                why = f"{key} ({model_type}): no row in tigon.FAMILIES; only what {family.name}'s row names is patched"
                report.skipped.append(("sub-model", why))
        elif row is not family and row not in rows:
            rows.append(row)
    return rows


def _apply_row(family: Family, options: PatchOptions, model: nn.Module | None) -> PatchReport:
    """One row's patches (apply_family without the sub-models' rows)."""
    opts = patch_options(options)
    mod = _modeling(family)
    report = PatchReport(family.name, type(model).__name__ if model is not None else f"{family.module} classes")
    undo = report.undo
    # Resolve every piece first: a missing one raises before anything is changed.
    resolved = [(piece, piece.classes(family, opts, mod, report)) for piece in PIECES]
    # The causal LM and / or the image+text model: (class, is the image+text one)
    lm_classes = [(_hf(mod, family, name, "loss"), composite) for name, composite in
                  ((family.causal_lm, False), (family.conditional_generation, True)) if name] if opts.loss else []
    ropes = []  # (name, form, the module's function)
    if opts.rope and family.rope:
        for name, form in ((family.rope, family.rope_form), *family.more_ropes):
            fn = _hf(mod, family, name, "rope")
            _check_rope_signature(getattr(fn, "_tigon_original", fn), family, form)
            ropes.append((name, form, fn))
    elif opts.rope:
        report.skipped.append(("rope", family.note or "no RoPE patch for this family"))
    report.skipped += [(piece, why) for piece, why in family.left_to_hf if getattr(opts, piece, True)]
    if model is not None and lm_classes:
        present = [(cls, c) for cls, c in lm_classes if any(type(m) is cls for m in model.modules())]
        if not present:
            report.skipped.append(("loss", f"the model is not a {' or a '.join(c.__name__ for c, _ in lm_classes)}"))
        lm_classes = present
    if model is not None:
        for piece, classes in resolved:
            for cls in classes if piece.check is not None else ():
                for inst in _instances(model, cls):
                    piece.check(family, cls, inst, report)

    def put(owner_cls, name, fn, piece, what):
        if model is None:
            if not owner_cls.__module__.startswith("transformers."):  # torch's nn.LayerNorm: not process-wide
                why = f"{owner_cls.__module__}.{owner_cls.__qualname__} is not HF's class: patched in built models only"
                report.skipped.append((piece, why))
                return
            _set_shared(owner_cls, name, fn, undo)
            report.replaced.append((piece, what, "class"))
            return
        found = _instances(model, owner_cls)
        for inst in found:
            _set_instance(inst, name, fn, undo)
        if found:
            report.replaced.append((piece, what, str(len(found))))

    for piece, classes in resolved:
        for cls in classes:
            for name, fn, what in piece.forwards(family, cls):
                put(cls, name, fn, piece.option, what)
    if ropes:
        _patch_rope(mod, ropes, model, report)
    mode = "flce" if opts.fused_linear_cross_entropy else "cross_entropy"
    for lm_class, composite in lm_classes:
        original = lm_class.forward
        original = getattr(original, "_tigon_original", original)
        fwd = make_causal_lm_forward(original, softcap_attr=family.logit_softcap, divisor_attr=family.logit_divisor,
                                     mode=mode, chunk_budget=opts.chunk_budget,
                                     multiplier_attr=family.logit_multiplier, composite=composite,
                                     capture_head=_capture_head)
        fwd._tigon_original = original
        put(lm_class, "forward", fwd, "loss", f"{lm_class.__name__} ({fwd._tigon})")
        if model is not None and mode == "flce":
            for lm in _instances(model, lm_class):
                _capture_head(lm, undo)
        elif model is None and lm_class.__module__.startswith("transformers."):
            # A class patch: each model built while it holds is prepared as the instance patch
            # prepares one (its head's loss capture set, its MLPs' activations found), so that
            # its forward changes no module and evaluates no activation while torch.compile traces it.
            mlps = tuple(cls for piece, classes in resolved if piece.gated for cls in classes)
            init = vars(lm_class).get("__init__", _MISSING)
            init = getattr(init, "_tigon_original", init)
            _set_shared(lm_class, "__init__", _init_preparing(lm_class, init, mlps, mode), undo)
    if lm_classes:
        _patch_mask_helpers(report)
    log.info("%s", report)
    return report


def _patch_rope(mod, ropes, model, report):
    """Classes: the module's RoPE functions (``ropes``: (name, form, function)) become tigon's. A
    model: its attention modules run with tigon's RoPE (see make_rope_scope), and the functions
    become dispatchers (once)."""
    where = ", ".join(f"{mod.__name__}.{name}" for name, _, _ in ropes)
    if model is None:
        for name, form, fn in ropes:
            if fn is not rope_drop_in(form):
                _set_shared(mod, name, rope_drop_in(form), report.undo)
        report.replaced.append(("rope", where, "module-wide"))
        return
    attention = [m for m in model.modules()
                 if type(m).__module__ == mod.__name__ and any(_calls_function(type(m), n) for n, _, _ in ropes)]
    if not attention:
        report.skipped.append(("rope", f"no module of this model calls {where}"))
        return
    drop_ins = {}
    for name, form, fn in ropes:
        ours = rope_drop_in(form)
        drop_ins[name] = None if ours is tigon_apply_rotary_pos_emb else ours  # None: looked up when called
        if getattr(fn, "_tigon", None) is None:  # HF's own function: put the dispatcher in front of it
            _set_shared(mod, name, make_rope_dispatcher(fn, drop_ins[name]), report.undo)
    for inst in attention:
        _set_instance(inst, "forward", make_rope_scope(_forward_before_tigon(inst), drop_ins), report.undo)
    report.replaced.append(("rope", f"{where} in {type(attention[0]).__name__}", str(len(attention))))


def _patch_mask_helpers(report):
    """Two of HF's mask helpers, module-wide but changed only during patched causal-LM forwards
    on positions HF generates itself (no attention mask, positions or cache given):
    ``find_packed_sequence_indices`` answers "not packed" without its host sync
    (make_find_packed_sequence_indices), and ``_ignore_causal_mask_sdpa`` lets SDPA use
    ``is_causal`` under torch.compile as it does in eager (make_ignore_causal_mask_sdpa)."""
    try:
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError:
        return
    fn = getattr(masking_utils, "find_packed_sequence_indices", None)
    if fn is not None:  # else a transformers without the check: nothing to skip
        if getattr(fn, "_tigon", None) is None:
            _set_shared(masking_utils, "find_packed_sequence_indices", make_find_packed_sequence_indices(fn),
                        report.undo)
        report.replaced.append(("packed_check", "transformers.masking_utils.find_packed_sequence_indices",
                                "inside patched forwards"))
    fn = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if fn is None:
        return
    if not PRIVATE_APIS:
        report.skipped.append(("causal_mask", "TIGON_PRIVATE_APIS=0 (a private function of transformers)"))
        return
    if getattr(fn, "_tigon", None) is None:
        params = tuple(inspect.signature(fn).parameters)[:len(IGNORE_CAUSAL_MASK_PARAMS)]
        if params != IGNORE_CAUSAL_MASK_PARAMS:
            report.skipped.append(("causal_mask", f"transformers.masking_utils._ignore_causal_mask_sdpa takes "
                                                  f"{params}, not {IGNORE_CAUSAL_MASK_PARAMS}"))
            return
        _set_shared(masking_utils, "_ignore_causal_mask_sdpa", make_ignore_causal_mask_sdpa(fn), report.undo)
    report.replaced.append(("causal_mask", "transformers.masking_utils._ignore_causal_mask_sdpa",
                            "inside patched forwards"))


# ---- tigon.patch(model): by model_type, else by structure ----

def patch(model: nn.Module, options: PatchOptions | None = None, **kwargs) -> PatchReport:
    """Patch a built HF model in place (this model only; weights kept) and return a PatchReport.
    Known families (by ``config.model_type``) get their row of the family table; others get
    what tigon recognises by structure (RMSNorm-like modules whose output matches a known
    formula, gate/up/down MLPs with a fused activation). Options: a PatchOptions and/or its
    fields as keywords (rope, rms_norm, swiglu, fused_linear_cross_entropy, cross_entropy,
    chunk_budget, layer_norm). Warns when nothing was patched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a built model), got {type(model).__name__}; "
                        "to patch a family's classes use tigon.patch_<family>()")
    opts = patch_options(options, **kwargs)
    _refuse_checkpointing(opts, "tigon.patching.patch")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = BY_MODEL_TYPE.get(model_type)
    if family is not None:
        report = apply_family(family, opts, model)
    else:
        report = PatchReport(f"unknown model_type {model_type!r}, by structure", type(model).__name__)
        _patch_by_structure(model, opts, report)
        if opts.rope:
            report.skipped.append(("rope", "only patched for the families in tigon.FAMILIES"))
        if opts.loss:
            report.skipped.append(("loss", "only patched for the families in tigon.FAMILIES"))
        log.info("%s", report)
    if not report.replaced:
        warnings.warn(f"tigon.patch found nothing to patch in {type(model).__name__}:\n{report}", stacklevel=3)
    return report


def family_patcher(name: str):
    """``patch_<name>(model=None, options=None, **options)``: the classes of the family before a
    model is built (model None), or the modules of an already-built ``model`` in place."""
    family = FAMILIES[name]

    def patch_family(model: nn.Module | None = None, options: PatchOptions | None = None, **kwargs) -> PatchReport:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"patch_{name}'s first argument is the model to patch (or None for the classes), got "
                            f"{type(model).__name__}; options are keyword-only")
        opts = patch_options(options, **kwargs)
        _refuse_checkpointing(opts, f"tigon.patching.patch_{name}")
        return apply_family(family, opts, model)

    patch_family.__name__ = patch_family.__qualname__ = f"patch_{name}"
    patch_family.__doc__ = (
        f"Patch {name} ({', '.join(family.model_types)}): the classes in {family.module} before a model is "
        "built (model None: every model of the family in this process), or the modules of an already-built "
        "``model`` in place (that model only; weights kept). Options are keyword-only (rope, rms_norm, swiglu, "
        "fused_linear_cross_entropy, cross_entropy, chunk_budget, layer_norm: see tigon.PatchOptions) or "
        "options=PatchOptions(...). Returns a PatchReport."
    )
    return patch_family
