"""Apply a family row to the HF classes (before a model is built) or to a built model.

Class patching (``patch_llama()``) sets the forwards on the HF classes and replaces the
modeling module's RoPE function: every model of the family in the process, built before or
after, uses tigon. Instance patching (``tigon.patch(model)``, ``patch_llama(model)``) changes
that model only: its modules get their own forwards (``_InstancePatch``), and the module-level
functions HF's modules call (RoPE, the packed-sequence check, the SDPA causal-mask decision)
become dispatchers that run tigon's version only inside the patched model's forward.

What happens to a patched model:
- ``copy.deepcopy`` gives a patched copy, which ``unpatch()`` unpatches too.
- Pickling (``torch.save(model)``) stores it unpatched: it loads with HF's forwards and a
  warning saying so (patch it again after loading). State dicts are unaffected by patching.
- ``unpatch()`` undoes every patch (classes, module functions, every patched instance and its
  copies); ``unpatch(model)`` the instance patches inside ``model``; ``with patched(...)``
  exactly the patches its block made. Nothing is left on the modules afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import logging
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from tigon.ops._common import chunk_budget_bytes
from tigon.ops._internals import PRIVATE_APIS
from tigon.patching.families import BY_MODEL_TYPE, FAMILIES, Family
from tigon.patching.forwards import (
    IGNORE_CAUSAL_MASK_PARAMS,
    MOE_EXPERTS,
    TigonPatchError,
    activation_module,
    captures_loss,
    check_relu_squared_activation,
    fused_activation,
    fused_experts_blocker,
    hf_default_gate,
    identify_activation,
    make_capturing_head_forward,
    make_causal_lm_forward,
    make_experts_forward,
    make_find_packed_sequence_indices,
    make_ignore_causal_mask_sdpa,
    make_layer_norm_forward,
    make_mlp_forward,
    make_rms_norm_forward,
    make_rope_dispatcher,
    make_rope_scope,
    make_torch_layer_norm_forward,
    mlp_activation,
    mlp_multipliers,
    norm_eps,
    relu_squared_mlp_forward,
    rope_drop_in,
    tigon_apply_gate,
    tigon_apply_rotary_pos_emb,
)
from tigon.sizes import parse_bytes

log = logging.getLogger("tigon")


_NOT_FLAGS = ("chunk_budget", "checkpointing", "memory_budget")


@dataclass(frozen=True)
class PatchOptions:
    """What a patch replaces. rope: HF's apply_rotary_pos_emb; rms_norm: every RMSNorm;
    swiglu: the MLPs' activation (gated SwiGLU / GeGLU, non-gated ReLU²) and MoE experts
    (fused grouped GEMM); fused_linear_cross_entropy: the training loss from the last hidden
    state, without the logits; cross_entropy: the loss with tigon's cross entropy over
    materialised logits (instead of FLCE); chunk_budget: bytes of logits an FLCE chunk may
    hold (None: 512 MiB); layer_norm: the LayerNorms a family row names (Nemotron's
    LayerNorm1P); checkpointing: which decoder layers activation checkpointing recomputes
    ('auto': as few as the memory planner finds fit ``memory_budget``, chosen at the first
    training forward of each batch shape; 'none', 'all' or a number of layers; None: left to
    HF), a built model only (tigon.planning.checkpointing, installed by tigon.patch);
    memory_budget: the bytes (or a string such as '70GiB') a step's allocations may reach under
    'auto' (None: 92% of the GPU's memory)."""

    rope: bool = True
    rms_norm: bool = True
    swiglu: bool = True
    fused_linear_cross_entropy: bool = True
    cross_entropy: bool = False
    chunk_budget: int | None = None
    layer_norm: bool = True
    checkpointing: str | int | None = None
    memory_budget: int | str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _NOT_FLAGS and not isinstance(value, bool):
                raise TypeError(f"{f.name} must be True or False, got {value!r}")
        if self.chunk_budget is not None:
            chunk_budget_bytes(self.chunk_budget)
        check_checkpointing(self.checkpointing)
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "memory_budget")
            if self.checkpointing != "auto":
                raise ValueError("memory_budget is for checkpointing='auto' (got checkpointing="
                                 f"{self.checkpointing!r})")
        if self.fused_linear_cross_entropy and self.cross_entropy:
            raise ValueError("pass at most one of fused_linear_cross_entropy and cross_entropy "
                             "(cross_entropy=True needs fused_linear_cross_entropy=False)")

    @property
    def loss(self) -> bool:
        return self.fused_linear_cross_entropy or self.cross_entropy


PATCH_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PatchOptions))
CHECKPOINTING_CHOICES = ("auto", "none", "all")


def check_checkpointing(value) -> None:
    """Raise naming the option when ``value`` is not a checkpointing setting."""
    if value is None or value in CHECKPOINTING_CHOICES:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"checkpointing must be 'auto', 'none', 'all', a number of decoder layers or None, "
                         f"got {value!r}")


def kernels_only(opts: PatchOptions) -> PatchOptions:
    """``opts`` without the checkpointing options: what this package's patch functions take
    (``tigon.patch`` installs checkpointing after them, tigon.planning.checkpointing)."""
    return dataclasses.replace(opts, checkpointing=None, memory_budget=None)


def _refuse_checkpointing(opts: PatchOptions, caller: str) -> None:
    if opts.checkpointing is not None:
        raise ValueError(f"{caller} patches kernels only: checkpointing={opts.checkpointing!r} is installed by "
                         "tigon.patch / tigon.patch_<family> (with the memory planner)")


def patch_options(options: PatchOptions | None = None, **kwargs) -> PatchOptions:
    """A PatchOptions from an existing one and/or keyword options, with a clear error for an
    unknown name."""
    unknown = sorted(set(kwargs) - set(PATCH_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown patch option(s) {unknown}; the options are {list(PATCH_OPTION_NAMES)}")
    base = options if options is not None else PatchOptions()
    if not isinstance(base, PatchOptions):
        raise TypeError(f"options must be a tigon.PatchOptions, got {type(base).__name__}")
    return dataclasses.replace(base, **kwargs) if kwargs else base


# ---- the record of what was patched ----

_MISSING = object()
# Shared owners (classes, modules): (id(owner), name) -> (owner, name, value before tigon).
_SHARED_ORIGINALS: dict[tuple[int, str], tuple[object, str, object]] = {}
# Instances with an _InstancePatch in their __dict__ (weakly: a patched model can be freed).
_PATCHED_INSTANCES: weakref.WeakSet = weakref.WeakSet()


def _warn_loaded_unpatched(name, before):
    warnings.warn("tigon: this model was pickled while patched by tigon and loads unpatched (HF's forwards); "
                  "call tigon.patch(model) again after loading", stacklevel=2)
    return before


class _InstancePatch:
    """One module's own ``forward`` (or other attribute) set by tigon: calls ``fn(module, ...)``
    and remembers what the module's __dict__ held before. It refers to the module weakly (no
    reference cycle), follows it into deep copies (the copy is patched, and known to
    ``unpatch``), and pickles as what was there before (loading gives an unpatched module)."""

    __slots__ = ("fn", "name", "before", "_owner", "__weakref__")

    def __init__(self, fn, owner, name, before):
        self.fn, self.name, self.before = fn, name, before
        self._owner = weakref.ref(owner)
        _PATCHED_INSTANCES.add(owner)

    @property
    def owner(self):
        return self._owner()

    def __call__(self, *args, **kwargs):
        return self.fn(self._owner(), *args, **kwargs)

    def __deepcopy__(self, memo):
        owner = self._owner()
        new_owner = memo.get(id(owner), owner)
        return _InstancePatch(self.fn, new_owner, self.name, copy.deepcopy(self.before, memo))

    def __reduce__(self):
        if self.before is _MISSING:
            owner = self._owner()
            # What the module did before tigon: the class's own attribute, bound to it.
            return _warn_loaded_unpatched, (self.name, types.MethodType(getattr(type(owner), self.name), owner))
        return _warn_loaded_unpatched, (self.name, self.before)

    @property
    def _tigon(self):
        return getattr(self.fn, "_tigon", "tigon")

    @property
    def __signature__(self):
        """fn's signature without its first parameter, as a bound method's (HF's Trainer reads
        ``model.forward``'s parameters to pick the batch's columns)."""
        signature = inspect.signature(self.fn)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


def _hooked_name(inst, name):
    """accelerate's hooks (device_map with offload / several devices) wrap ``forward`` and call
    ``_old_forward``: patch that one, so the hook keeps running."""
    if name == "forward" and "_old_forward" in vars(inst) and hasattr(inst, "_hf_hook"):
        return "_old_forward"
    return name


def _set_shared(owner, name, value, undo):
    key = (id(owner), name)
    before = vars(owner).get(name, _MISSING)
    if key not in _SHARED_ORIGINALS:
        _SHARED_ORIGINALS[key] = (owner, name, before)
    undo.append((owner, name, before))
    setattr(owner, name, value)


def set_instance_attribute(inst, name: str, fn, report: PatchReport) -> None:
    """``inst.<name>`` set to call ``fn(inst, ...)``, recorded in ``report`` for unpatch (the seam
    through which tigon.planning installs checkpointing on a patched model)."""
    _set_instance(inst, name, fn, report.undo)


def _set_instance(inst, name, fn, undo):
    name = _hooked_name(inst, name)
    own = vars(inst)
    before = own.get(name, _MISSING)
    original = before.before if isinstance(before, _InstancePatch) else before
    undo.append((inst, name, before))
    own[name] = _InstancePatch(fn, inst, name, original)


def _restore(owner, name, value):
    own = vars(owner)
    if value is _MISSING:
        if name in own:
            if isinstance(owner, (type, types.ModuleType)):
                delattr(owner, name)
            else:
                del own[name]
    elif isinstance(owner, (type, types.ModuleType)):
        setattr(owner, name, value)
    else:
        own[name] = value


def _unpatch_instance(inst) -> int:
    count = 0
    for name, value in list(vars(inst).items()):
        if isinstance(value, _InstancePatch):
            _restore(inst, name, value.before)
            count += 1
    _PATCHED_INSTANCES.discard(inst)
    return count


def unpatch(model: nn.Module | None = None) -> int:
    """Undo tigon's patches: all of them (classes, module functions, every patched instance and
    its deep copies), or with ``model`` the instance patches of the modules inside it (the
    module-level dispatchers stay: they only act inside patched models). Returns how many
    attributes were restored."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        return sum(_unpatch_instance(m) for m in model.modules())
    count = sum(_unpatch_instance(m) for m in list(_PATCHED_INSTANCES))
    for owner, name, before in reversed(list(_SHARED_ORIGINALS.values())):
        _restore(owner, name, before)
        count += 1
    _SHARED_ORIGINALS.clear()
    return count


def _undo(undo) -> None:
    """Undo exactly the changes recorded in ``undo`` (one patch call's), latest first."""
    for owner, name, before in reversed(undo):
        _restore(owner, name, before)
        if isinstance(owner, (type, types.ModuleType)):
            key = (id(owner), name)
            if key in _SHARED_ORIGINALS and _SHARED_ORIGINALS[key][2] is before:
                del _SHARED_ORIGINALS[key]
        elif not any(isinstance(v, _InstancePatch) for v in vars(owner).values()):
            _PATCHED_INSTANCES.discard(owner)


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


@dataclass
class PatchReport:
    """What a patch call replaced (piece, HF name, how many instances or 'class') and skipped."""

    family: str
    target: str
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    undo: list = field(default_factory=list, repr=False)  # (owner, name, value before), for patched()

    def pieces(self) -> set[str]:
        return {piece for piece, _, _ in self.replaced}

    def __str__(self) -> str:
        lines = [f"tigon patched {self.target} ({self.family}):"]
        if not self.replaced:
            lines.append("  nothing")
        lines += [f"  {piece:<26} {what} [{count}]" for piece, what, count in self.replaced]
        lines += [f"  {piece:<26} not patched: {why}" for piece, why in self.skipped]
        return "\n".join(lines)


def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError as exc:
        raise TigonPatchError("tigon's model patches need transformers (pip install transformers)") from exc


def _modeling(family: Family):
    version = _transformers_version()
    try:
        return importlib.import_module(family.module)
    except ImportError as exc:
        raise TigonPatchError(f"{family.name}: transformers {version} has no module {family.module}") from exc


def _hf(module, family: Family, name: str, piece: str):
    obj = module
    for part in name.split("."):  # "nn.LayerNorm": torch's class, as the modeling file names it
        obj = getattr(obj, part, None)
    if obj is None:
        raise TigonPatchError(f"{family.name}: transformers {_transformers_version()} has no {name} in "
                              f"{module.__name__} (needed by the {piece} patch)")
    return obj


def _check_rope_signature(fn, family, form):
    """fn's leading parameters are those of tigon's drop-in for RoPE form ``form``."""
    ours = [p.name for p in inspect.signature(rope_drop_in(form)).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][:4]
    params = list(inspect.signature(fn).parameters)
    if params[:len(ours)] != ours:
        raise TigonPatchError(f"{family.name}: {fn.__module__}.{fn.__name__} takes {params}, "
                              f"not ({', '.join(ours)}, ...) as tigon's RoPE expects")


def single_input_forward(cls) -> bool:
    """cls.forward takes one input besides self (``forward(self, hidden_states)``): a gated
    norm's ``forward(self, hidden_states, gate=None)`` is not one tigon's forwards replace."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_single_input(cls, family, piece):
    if not single_input_forward(cls):
        raise TigonPatchError(f"{family.name}: {cls.__name__}.forward takes {inspect.signature(cls.forward)}, not "
                              f"one input as tigon's {piece} forward does")


def _instances(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) is cls]


def _calls_function(cls: type, fn_name: str) -> bool:
    """cls.forward calls the module-level function ``fn_name`` of its modeling file."""
    fwd = inspect.unwrap(getattr(cls, "forward", None))
    code = getattr(fwd, "__code__", None)
    return code is not None and fn_name in code.co_names


def _forward_before_tigon(inst):
    """What ``inst.forward`` ran before any tigon instance patch, as a function of (self, ...)."""
    own = vars(inst).get(_hooked_name(inst, "forward"), _MISSING)
    if isinstance(own, _InstancePatch):
        own = own.before
    if own is _MISSING:
        return type(inst).forward
    return lambda _self, *args, **kwargs: own(*args, **kwargs)


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
    norm_classes = [_hf(mod, family, n, "rms_norm") for n in family.rms_norms] if opts.rms_norm else []
    for cls in norm_classes:
        _check_single_input(cls, family, "rms_norm")
    layer_norm_classes = [_hf(mod, family, n, "layer_norm") for n in family.layer_norms] if opts.layer_norm else []
    for cls in layer_norm_classes:
        _check_single_input(cls, family, "layer_norm")
    mlp_classes = [_hf(mod, family, n, "swiglu") for n in family.mlps] if opts.swiglu else []
    for cls in mlp_classes:
        _check_single_input(cls, family, "swiglu")
    relu2_classes = [_hf(mod, family, n, "swiglu") for n in family.relu2_mlps] if opts.swiglu else []
    for cls in relu2_classes:
        _check_single_input(cls, family, "swiglu")
    experts_class = _hf(mod, family, family.experts, "swiglu") if opts.swiglu and family.experts else None
    if experts_class is not None and family.experts_activation is None and not hf_default_gate(experts_class):
        why = "a gate of its own (_apply_gate), which the row does not name (experts_activation)"
        report.skipped.append(("swiglu", f"{experts_class.__name__}: {why}"))
        experts_class = None
    # The causal LM and / or the image+text model: (class, is the image+text one)
    lm_classes = [(_hf(mod, family, name, "loss"), composite) for name, composite in
                  ((family.causal_lm, False), (family.conditional_generation, True)) if name] if opts.loss else []
    vision_mlp_classes = [_hf(mod, family, n, "swiglu") for n in family.vision_mlps] if opts.swiglu else []
    for cls in vision_mlp_classes:
        _check_single_input(cls, family, "swiglu")
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
    if experts_class is not None and model is not None:
        for e in _instances(model, experts_class):
            for attr in ("gate_up_proj", "down_proj"):
                if getattr(e, attr, None) is None or getattr(e, attr).ndim != 3:
                    raise TigonPatchError(f"{family.name}: {experts_class.__name__}.{attr} is not a stacked "
                                          "3-D [experts, ., .] parameter in this transformers version")
    if model is not None:
        for cls in layer_norm_classes:
            for inst in _instances(model, cls):
                if len(inst.normalized_shape) != 1:
                    raise TigonPatchError(f"{family.name}: {cls.__name__} normalises over {inst.normalized_shape}, "
                                          "not the last dim only as tigon's layer_norm does")
        # Found now, not at the first forward (which torch.compile may be tracing: evaluating
        # the activation there would break its graph); raises for an activation tigon does not fuse.
        for cls in mlp_classes + vision_mlp_classes:
            for inst in _instances(model, cls):
                mlp_activation(inst)
        # Experts the fused op cannot run (an activation tigon does not fuse, expert parallel, ...)
        # run HF's forward: said in the report.
        for inst in _instances(model, experts_class) if experts_class is not None else ():
            activation = family.experts_activation or fused_activation(inst)
            why = fused_experts_blocker(inst, activation, own_gate=family.experts_activation is not None)
            note = ("swiglu", f"{experts_class.__name__}: {why}; HF's forward runs")
            if why is not None and note not in report.skipped:
                report.skipped.append(note)
        for cls in relu2_classes:
            for inst in _instances(model, cls):
                check_relu_squared_activation(inst)

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

    for cls in norm_classes:
        put(cls, "forward", make_rms_norm_forward(family.rms_casting, family.rms_offset), "rms_norm",
            f"{cls.__name__} (casting={family.rms_casting}, offset={family.rms_offset:g})")
    for cls in layer_norm_classes:
        if cls is nn.LayerNorm:
            put(cls, "forward", make_torch_layer_norm_forward(), "layer_norm", "nn.LayerNorm")
            continue
        put(cls, "forward", make_layer_norm_forward(family.layer_norm_offset), "layer_norm",
            f"{cls.__name__} (offset={family.layer_norm_offset:g})")
    for cls in mlp_classes:
        keep_input_only = not family.mlp_output_saved and family.mlp_layout == "gate_up_down"
        put(cls, "forward", make_mlp_forward(family.mlp_layout, keep_input_only), "swiglu",
            f"{cls.__name__} ({family.mlp_layout}"
            f"{'; only its input kept under checkpointing' if keep_input_only else ''})")
    for cls in vision_mlp_classes:  # biases, non-Linear projections: the plain fused path (keeps gate / up)
        put(cls, "forward", make_mlp_forward("gate_up_down", keep_input_only=False), "swiglu",
            f"{cls.__name__} (gate_up_down, vision tower)")
    for cls in relu2_classes:
        put(cls, "forward", relu_squared_mlp_forward, "swiglu", f"{cls.__name__} (ReLU², non-gated)")
    if experts_class is not None:
        gate = family.experts_activation
        put(experts_class, "forward", make_experts_forward(experts_class.forward, gate), "swiglu",
            f"{experts_class.__name__}: {MOE_EXPERTS}{f' with its {gate} gate' if gate else ''}")
        if gate is None:  # HF's default gate, which its other forwards call: fused too
            put(experts_class, "_apply_gate", tigon_apply_gate, "swiglu", f"{experts_class.__name__}._apply_gate")
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
            mlps = tuple(mlp_classes + vision_mlp_classes)
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

def _rms_candidates():
    for casting in ("llama", "gemma"):
        for offset in (0.0, 1.0):
            yield casting, offset


def _rms_reference(x, weight, eps, casting, offset):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        return (weight + offset) * normed.to(x.dtype) if offset else weight * normed.to(x.dtype)
    return (normed * (weight.float() + offset)).to(x.dtype)


def _identify_rms_norm(module) -> tuple[str, float] | None:
    """(casting, offset) whose torch formula reproduces module(x), or None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        return None
    try:
        eps = norm_eps(module)
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(4, weight.shape[0], generator=gen).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            y = module(x).float()
            for casting, offset in _rms_candidates():
                ref = _rms_reference(x, weight, eps, casting, offset).float()
                if torch.allclose(y, ref, rtol=1e-3, atol=1e-5):
                    return casting, offset
    except Exception:  # a module we cannot evaluate is one we leave alone
        return None
    return None


def _mlp_matches_formula(m) -> bool:
    """m(x) == down(act(gate(x) * g) * up(x)) * d, with its multipliers (Falcon-H1) or 1."""
    try:
        w = m.gate_proj.weight
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        gate_multiplier, down_multiplier = mlp_multipliers(m)
        with torch.no_grad():
            ref = m.down_proj(m.act_fn(m.gate_proj(x) * gate_multiplier) * m.up_proj(x)) * down_multiplier
            return torch.allclose(m(x).float(), ref.float(), rtol=1e-3, atol=1e-4)
    except Exception:  # likewise
        return False


def _patch_by_structure(model, opts: PatchOptions, report):
    seen_rms, seen_mlp = {}, {}
    for m in model.modules():
        cls = type(m)
        name = cls.__name__
        if opts.rms_norm and "RMSNorm" in name:
            if not single_input_forward(cls):
                report.skipped.append(("rms_norm", f"{name}: forward{inspect.signature(cls.forward)} takes more "
                                                   "than the hidden states (a gated norm)"))
                continue
            key = (cls, str(m.weight.dtype) if hasattr(m, "weight") else "")
            if key not in seen_rms:
                seen_rms[key] = _identify_rms_norm(m)
            found = seen_rms[key]
            if found is None:
                report.skipped.append(("rms_norm", f"{name}: its forward matched no known RMSNorm formula"))
                continue
            _set_instance(m, "forward", make_rms_norm_forward(*found), report.undo)
            report.replaced.append(("rms_norm", f"{name} (casting={found[0]}, offset={found[1]:g})", "1"))
        elif opts.swiglu and all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj",
                                                                                       "down_proj")):
            act = activation_module(m)
            if identify_activation(act) is None:
                report.skipped.append(("swiglu", f"{name}: activation {act!r} not fused by tigon"))
                continue
            if not single_input_forward(cls):
                report.skipped.append(("swiglu", f"{name}: forward{inspect.signature(cls.forward)} takes more "
                                                 "than the hidden states"))
                continue
            if cls not in seen_mlp:
                seen_mlp[cls] = _mlp_matches_formula(m)
            if not seen_mlp[cls]:
                report.skipped.append(("swiglu", f"{name}: forward is not down(act(gate(x)) * up(x))"))
                continue
            _set_instance(m, "forward", make_mlp_forward("gate_up_down"), report.undo)
            report.replaced.append(("swiglu", f"{name} (gate_up_down)", "1"))
    report.replaced = _merge_counts(report.replaced)
    report.skipped = sorted(set(report.skipped))


def _merge_counts(items):
    counts: dict[tuple[str, str], int] = {}
    for piece, what, count in items:
        counts[(piece, what)] = counts.get((piece, what), 0) + int(count)
    return [(piece, what, str(n)) for (piece, what), n in counts.items()]


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
