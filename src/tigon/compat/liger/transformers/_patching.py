"""Liger's model patching (``apply_liger_kernel_to_<family>``, ``_apply_liger_kernel``,
``_apply_liger_kernel_to_instance``, ``AutoLigerKernelForCausalLM``) on tigon's patcher.

Each ``apply_liger_kernel_to_<family>`` has Liger 0.8.5's signature (its flags, their order and
defaults, ``model``, and ``**kwargs`` where Liger's takes them) and calls ``tigon.patch_<row>``
of tigon's family row(s) with the flags as ``tigon.PatchOptions``:

- ``rope``, ``rms_norm``, ``layer_norm``, ``cross_entropy``, ``fused_linear_cross_entropy``:
  the options of the same names; ``swiglu`` / ``geglu`` / ``relu_squared``: ``swiglu`` (tigon's
  one option for the MLPs' activation, gated or not, and MoE experts). A piece Liger's function
  has no flag for is patched as ``tigon.patch`` patches it.
- ``model=None``: the family's classes (every model of the family in the process, as Liger's
  class patch); a built ``model``: that model only (Liger also patches the classes then; tigon's
  instance patch leaves every other model alone). Returns the ``tigon.PatchReport`` (Liger
  returns None).
- A piece tigon's row leaves to Hugging Face is listed in the report and logged (as Liger logs
  the pieces it skips); pieces tigon adds where Liger refuses (Granite's fused loss, Qwen 3.5's
  RoPE) are patched.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass

from torch import nn

from tigon.api import PATCHERS
from tigon.extras import require_extra
from tigon.patching import BY_MODEL_TYPE, PatchReport

log = logging.getLogger("tigon.compat.liger")

# Liger's patch flags -> tigon's PatchOptions field
FLAG_TO_OPTION = {"rope": "rope", "rms_norm": "rms_norm", "layer_norm": "layer_norm", "cross_entropy": "cross_entropy",
                  "fused_linear_cross_entropy": "fused_linear_cross_entropy", "swiglu": "swiglu", "geglu": "swiglu",
                  "relu_squared": "swiglu"}
_LOSS_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}


@dataclass(frozen=True)
class FamilyFunction:
    """One ``apply_liger_kernel_to_<name>``: its parameters (Liger's order and defaults), whether it
    takes ``**kwargs``, tigon's rows for a built model (picked by the model's model_type; the first
    otherwise) and for the class patch (the first with its loss, the others without)."""

    name: str
    params: tuple[tuple[str, object], ...]
    rows: tuple[str, ...]
    class_rows: tuple[str, ...] = ()
    var_kwargs: bool = False

    def signature(self) -> inspect.Signature:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter(n, kind, default=d) for n, d in self.params]
        if self.var_kwargs:
            params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
        return inspect.Signature(params)


def _std(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, mlp="swiglu", mlp_on=True):
    """Liger's usual parameters: (rope, cross_entropy, fused_linear_cross_entropy, rms_norm, <mlp>, model)."""
    return (("rope", rope), ("cross_entropy", cross_entropy),
            ("fused_linear_cross_entropy", fused_linear_cross_entropy), ("rms_norm", True), (mlp, mlp_on),
            ("model", None))


_GEGLU = dict(mlp="geglu")
SPECS = {s.name: s for s in (
    FamilyFunction("deepseek_v2", _std(rope=False), ("deepseek_v2",)),
    FamilyFunction("deepseek_v3", _std(rope=False), ("deepseek_v3",)),
    FamilyFunction("exaone4", _std(), ("exaone4",)),
    FamilyFunction("falcon_h1", _std(), ("falcon_h1",)),
    FamilyFunction("gemma", _std(**_GEGLU), ("gemma",)),
    FamilyFunction("gemma2", _std(**_GEGLU), ("gemma2",)),
    FamilyFunction("gemma3", (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                              ("layer_norm", True), ("rms_norm", True), ("geglu", True), ("model", None)),
                   ("gemma3_vl", "gemma3")),
    FamilyFunction("gemma3_text", _std(**_GEGLU), ("gemma3",)),
    FamilyFunction("gemma4", (("rope", False), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                              ("layer_norm", False), ("rms_norm", True), ("geglu", True), ("model", None)),
                   ("gemma4_vl", "gemma4")),
    FamilyFunction("gemma4_text", _std(rope=False, **_GEGLU), ("gemma4",)),
    FamilyFunction("glm4", _std(rope=False), ("glm4",)),
    FamilyFunction("glm4v", _std(rope=False), ("glm4v",)),
    FamilyFunction("glm4v_moe", _std(rope=False), ("glm4v_moe",)),
    FamilyFunction("gpt_oss", _std(mlp_on=False), ("gpt_oss",)),
    FamilyFunction("granite", _std(cross_entropy=True, fused_linear_cross_entropy=False), ("granite",)),
    FamilyFunction("hunyuan_v1_dense", _std(), ("hunyuan_v1_dense",)),
    FamilyFunction("hunyuan_v1_moe", _std(), ("hunyuan_v1_moe",)),
    FamilyFunction("internvl", (("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
                                ("layer_norm", True), ("model", None)), ("internvl",), var_kwargs=True),
    FamilyFunction("llama", _std(), ("llama",)),
    FamilyFunction("llama4", (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                              ("rms_norm", True), ("swiglu", True), ("model", None), ("layer_norm", True)),
                   ("llama4_vl", "llama4")),
    FamilyFunction("llava", (("cross_entropy", False), ("fused_linear_cross_entropy", True), ("model", None)),
                   ("llava",), var_kwargs=True),
    FamilyFunction("ministral", _std(), ("ministral",)),
    FamilyFunction("mistral", _std(), ("mistral",)),
    FamilyFunction("mixtral", _std(), ("mixtral",)),
    FamilyFunction("mllama", (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                              ("layer_norm", True), ("rms_norm", True), ("swiglu", True), ("model", None)),
                   ("mllama",)),
    FamilyFunction("nemotron", (("relu_squared", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                                ("model", None)), ("nemotron",), var_kwargs=True),
    FamilyFunction("olmo2", _std(), ("olmo2",)),
    FamilyFunction("olmo3", _std(), ("olmo3",)),
    # Liger's class patch of PaliGemma also patches the Gemma and Gemma 2 classes (its language models).
    FamilyFunction("paligemma", (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                                 ("layer_norm", True), ("rms_norm", True), ("geglu", True), ("model", None)),
                   ("paligemma",), class_rows=("paligemma", "gemma", "gemma2")),
    FamilyFunction("phi3", _std(), ("phi3",)),
    FamilyFunction("pixtral", (("rope", True), ("rms_norm", True), ("swiglu", True), ("model", None)), ("pixtral",)),
    FamilyFunction("qwen2", _std(), ("qwen2",)),
    FamilyFunction("qwen2_5_vl", _std(), ("qwen2_5_vl",)),
    FamilyFunction("qwen2_vl", (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                                ("rms_norm", True), ("layer_norm", True), ("swiglu", True), ("model", None)),
                   ("qwen2_vl",)),
    FamilyFunction("qwen3", _std(), ("qwen3",)),
    FamilyFunction("qwen3_5", _std(rope=False), ("qwen3_5",)),
    FamilyFunction("qwen3_5_moe", _std(rope=False), ("qwen3_5_moe",)),
    FamilyFunction("qwen3_moe", _std(), ("qwen3_moe",)),
    FamilyFunction("qwen3_next", _std(rope=False), ("qwen3_next",)),
    FamilyFunction("qwen3_vl", _std(mlp_on=False), ("qwen3_vl",)),
    FamilyFunction("qwen3_vl_moe", _std(), ("qwen3_vl_moe",)),
    FamilyFunction("smollm3", _std(), ("smollm3",)),
    FamilyFunction("smolvlm", (("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
                               ("layer_norm", True), ("model", None)), ("smolvlm",), var_kwargs=True),
)}

# config.model_type -> the function Liger's _apply_liger_kernel[_to_instance] calls for it
MODEL_TYPES = {
    **{name: name for name in SPECS},
    "llama4_text": "llama4", "mllama_text_model": "mllama", "qwen2_vl_text": "qwen2_vl",
    "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe",
}
# Model types Liger 0.8.5 patches and tigon has no row for: nothing is patched (with a warning).
LIGER_ONLY_MODEL_TYPES = ("deepseek_v4", "muse_glimmer")
_warned: set[tuple[str, str]] = set()


def _patch_options(name: str, flags: dict) -> dict:
    """tigon's patch options from Liger's flags (checked: bools, not both losses, no unknown name)."""
    unknown = sorted(set(flags) - set(FLAG_TO_OPTION))
    if unknown:
        raise TypeError(f"apply_liger_kernel_to_{name} got unknown keyword argument(s) {unknown}; Liger's flags are "
                        f"{sorted(FLAG_TO_OPTION)}")
    options: dict[str, bool] = {}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply_liger_kernel_to_{name}: {flag} must be True or False, got {value!r}")
        option = FLAG_TO_OPTION[flag]
        options[option] = options.get(option, True) and value  # swiglu / geglu / relu_squared: all must be on
    if options.get("cross_entropy") and options.get("fused_linear_cross_entropy"):
        raise ValueError(f"apply_liger_kernel_to_{name}: cross_entropy and fused_linear_cross_entropy cannot both be "
                         "True (pass fused_linear_cross_entropy=False with cross_entropy=True)")
    return options


def _row_for(model: nn.Module, rows: tuple[str, ...]) -> str:
    """The row of ``rows`` for this model's model_type (the first when it is none of them)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    row = BY_MODEL_TYPE.get(model_type)
    return row.name if row is not None and row.name in rows else rows[0]


def _merge(reports: list[PatchReport]) -> PatchReport:
    report = reports[0]
    for other in reports[1:]:
        report.replaced += other.replaced
        report.skipped += [(piece, f"{other.family}: {why}") for piece, why in other.skipped]
        report.undo += other.undo
    return report


def _log_skipped(name: str, report: PatchReport, options: dict) -> None:
    """Log, once per function and piece, what a flag asked for and tigon's row leaves to HF."""
    for piece, why in report.skipped:
        asked = options.get(piece, True) if piece != "loss" else (
            options.get("fused_linear_cross_entropy", True) or options.get("cross_entropy", False))
        if asked and (name, piece) not in _warned:
            _warned.add((name, piece))
            log.warning("apply_liger_kernel_to_%s: %s not patched by tigon: %s", name, piece, why)


def apply_family(spec: FamilyFunction, model, flags: dict) -> PatchReport:
    """What ``apply_liger_kernel_to_<spec.name>(..., model=model)`` does on tigon."""
    options = _patch_options(spec.name, flags)
    if model is None:
        rows = spec.class_rows or spec.rows[:1]
        report = _merge([PATCHERS[f"patch_{row}"](None, **(options if i == 0 else {**options, **_LOSS_OFF}))
                         for i, row in enumerate(rows)])
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"apply_liger_kernel_to_{spec.name}: model must be a built model (an nn.Module) or None "
                            f"for the classes, got {type(model).__name__}")
        report = PATCHERS[f"patch_{_row_for(model, spec.rows)}"](model, **options)
    _log_skipped(spec.name, report, options)
    return report


def family_function(name: str):
    """``apply_liger_kernel_to_<name>`` with Liger 0.8.5's signature, on tigon (see the module's docstring)."""
    spec = SPECS[name]
    signature = spec.signature()

    def apply_liger_kernel_to_family(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop("kwargs", {})
        model = arguments.pop("model")
        return apply_family(spec, model, {**arguments, **extra})

    fn = apply_liger_kernel_to_family
    fn.__signature__ = signature
    fn.__name__ = fn.__qualname__ = f"apply_liger_kernel_to_{name}"
    fn.__module__ = "tigon.compat.liger.transformers"
    rows = ", ".join(f"tigon.patch_{row}" for row in dict.fromkeys(spec.rows + spec.class_rows))
    fn.__doc__ = (f"Liger-Kernel's ``apply_liger_kernel_to_{name}{signature}`` on tigon ({rows}). model None: the "
                  "family's classes; a built model: that model only. Flags map onto tigon.PatchOptions (swiglu / "
                  "geglu / relu_squared -> swiglu). Returns the tigon.PatchReport. See tigon.compat.liger.NAME_MAP.")
    return fn


def _apply_liger_kernel(model_type: str, **kwargs) -> PatchReport | None:
    """Liger's ``_apply_liger_kernel(model_type, **kwargs)``: the class patch of the function for
    ``model_type``, with the keyword arguments that function's signature takes (the others are
    dropped, as Liger drops them). Unknown model types patch nothing (logged)."""
    fn = _function_for(model_type)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _apply_liger_kernel_to_instance(model: nn.Module, **kwargs) -> PatchReport | None:
    """Liger's ``_apply_liger_kernel_to_instance(model, **kwargs)`` (what HF Trainer's
    ``use_liger_kernel=True`` calls with ``liger_kernel_config``): the function for the model's
    ``config.model_type`` on this model, with the keyword arguments its signature takes. A model
    without a known model type is left alone (logged)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = _function_for(model_type)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    return fn(model=model, **{k: v for k, v in kwargs.items() if k in params and k != "model"})


def _function_for(model_type):
    if not model_type:
        log.info("no model type given: no tigon kernels applied")
        return None
    name = MODEL_TYPES.get(model_type)
    if name is None:
        if model_type in LIGER_ONLY_MODEL_TYPES:
            log.warning("Liger-Kernel 0.8.5 patches model type %r, tigon has no family row for it: nothing patched "
                        "(tigon.patch(model) patches what it recognises by structure)", model_type)
        else:
            log.info("no tigon kernels for model type %r", model_type)
        return None
    return FUNCTIONS[name]


def is_transformers_available() -> bool:
    """Liger's ``is_transformers_available()``: whether Hugging Face transformers is installed."""
    return importlib.util.find_spec("transformers") is not None


class AutoLigerKernelForCausalLM:
    """Liger's ``AutoLigerKernelForCausalLM``: ``from_pretrained`` / ``from_config`` as
    transformers' AutoModelForCausalLM, then the model patched by tigon with Liger's flags found
    among the keyword arguments (``rope=False``, ...; the others go to transformers). Liger patches
    the family's classes before loading; here the loaded model is patched (that model only). The
    PatchReport is on ``model.tigon_report``."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        require_extra("hf", "AutoLigerKernelForCausalLM")
        from transformers import AutoModelForCausalLM

        flags = {k: kwargs.pop(k) for k in FLAG_TO_OPTION if k in kwargs}
        return _patched(AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs),
                        flags)

    @classmethod
    def from_config(cls, config, **kwargs):
        require_extra("hf", "AutoLigerKernelForCausalLM")
        from transformers import AutoModelForCausalLM

        flags = {k: kwargs.pop(k) for k in FLAG_TO_OPTION if k in kwargs}
        return _patched(AutoModelForCausalLM.from_config(config, **kwargs), flags)


def _patched(model, flags):
    report = _apply_liger_kernel_to_instance(model, **flags)
    if report is not None:
        model.tigon_report = report
    return model


apply_liger_kernel_to_deepseek_v2 = family_function("deepseek_v2")
apply_liger_kernel_to_deepseek_v3 = family_function("deepseek_v3")
apply_liger_kernel_to_exaone4 = family_function("exaone4")
apply_liger_kernel_to_falcon_h1 = family_function("falcon_h1")
apply_liger_kernel_to_gemma = family_function("gemma")
apply_liger_kernel_to_gemma2 = family_function("gemma2")
apply_liger_kernel_to_gemma3 = family_function("gemma3")
apply_liger_kernel_to_gemma3_text = family_function("gemma3_text")
apply_liger_kernel_to_gemma4 = family_function("gemma4")
apply_liger_kernel_to_gemma4_text = family_function("gemma4_text")
apply_liger_kernel_to_glm4 = family_function("glm4")
apply_liger_kernel_to_glm4v = family_function("glm4v")
apply_liger_kernel_to_glm4v_moe = family_function("glm4v_moe")
apply_liger_kernel_to_gpt_oss = family_function("gpt_oss")
apply_liger_kernel_to_granite = family_function("granite")
apply_liger_kernel_to_hunyuan_v1_dense = family_function("hunyuan_v1_dense")
apply_liger_kernel_to_hunyuan_v1_moe = family_function("hunyuan_v1_moe")
apply_liger_kernel_to_internvl = family_function("internvl")
apply_liger_kernel_to_llama = family_function("llama")
apply_liger_kernel_to_llama4 = family_function("llama4")
apply_liger_kernel_to_llava = family_function("llava")
apply_liger_kernel_to_ministral = family_function("ministral")
apply_liger_kernel_to_mistral = family_function("mistral")
apply_liger_kernel_to_mixtral = family_function("mixtral")
apply_liger_kernel_to_mllama = family_function("mllama")
apply_liger_kernel_to_nemotron = family_function("nemotron")
apply_liger_kernel_to_olmo2 = family_function("olmo2")
apply_liger_kernel_to_olmo3 = family_function("olmo3")
apply_liger_kernel_to_paligemma = family_function("paligemma")
apply_liger_kernel_to_phi3 = family_function("phi3")
apply_liger_kernel_to_pixtral = family_function("pixtral")
apply_liger_kernel_to_qwen2 = family_function("qwen2")
apply_liger_kernel_to_qwen2_5_vl = family_function("qwen2_5_vl")
apply_liger_kernel_to_qwen2_vl = family_function("qwen2_vl")
apply_liger_kernel_to_qwen3 = family_function("qwen3")
apply_liger_kernel_to_qwen3_5 = family_function("qwen3_5")
apply_liger_kernel_to_qwen3_5_moe = family_function("qwen3_5_moe")
apply_liger_kernel_to_qwen3_moe = family_function("qwen3_moe")
apply_liger_kernel_to_qwen3_next = family_function("qwen3_next")
apply_liger_kernel_to_qwen3_vl = family_function("qwen3_vl")
apply_liger_kernel_to_qwen3_vl_moe = family_function("qwen3_vl_moe")
apply_liger_kernel_to_smollm3 = family_function("smollm3")
apply_liger_kernel_to_smolvlm = family_function("smolvlm")

FUNCTIONS = {name: globals()[f"apply_liger_kernel_to_{name}"] for name in SPECS}
