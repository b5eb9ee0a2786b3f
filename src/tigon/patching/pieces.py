"""The pieces of a family row that replace methods of HF module classes (RMSNorms, LayerNorms,
gated, vision and ReLU² MLPs, MoE experts), one ``Piece`` each in ``PIECES``, and the lookup of
a row's HF classes."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tigon.patching.errors import TigonPatchError
from tigon.patching.families import Family
from tigon.patching.mlp import (
    MOE_EXPERTS,
    check_relu_squared_activation,
    fused_activation,
    fused_experts_blocker,
    hf_default_gate,
    make_experts_forward,
    make_mlp_forward,
    mlp_activation,
    relu_squared_mlp_forward,
    tigon_apply_gate,
)
from tigon.patching.norms import make_layer_norm_forward, make_rms_norm_forward, make_torch_layer_norm_forward
from tigon.patching.options import PatchOptions, PatchReport
from tigon.patching.structure import single_input_forward

# ---- a row's HF names ----

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


def _check_single_input(cls, family, piece):
    if not single_input_forward(cls):
        raise TigonPatchError(f"{family.name}: {cls.__name__}.forward takes {inspect.signature(cls.forward)}, not "
                              f"one input as tigon's {piece} forward does")


# ---- what each piece sets on an HF class: (attribute, function, the report's text) ----

def _rms_norm_forwards(family: Family, cls: type):
    return (("forward", make_rms_norm_forward(family.rms_casting, family.rms_offset),
             f"{cls.__name__} (casting={family.rms_casting}, offset={family.rms_offset:g})"),)


def _layer_norm_forwards(family: Family, cls: type):
    if cls is nn.LayerNorm:
        return (("forward", make_torch_layer_norm_forward(), "nn.LayerNorm"),)
    return (("forward", make_layer_norm_forward(family.layer_norm_offset),
             f"{cls.__name__} (offset={family.layer_norm_offset:g})"),)


def _mlp_forwards(family: Family, cls: type):
    keep_input_only = not family.mlp_output_saved and family.mlp_layout == "gate_up_down"
    return (("forward", make_mlp_forward(family.mlp_layout, keep_input_only),
             f"{cls.__name__} ({family.mlp_layout}"
             f"{'; only its input kept under checkpointing' if keep_input_only else ''})"),)


def _vision_mlp_forwards(family: Family, cls: type):
    # biases, non-Linear projections: the plain fused path (keeps gate / up)
    return (("forward", make_mlp_forward("gate_up_down", keep_input_only=False),
             f"{cls.__name__} (gate_up_down, vision tower)"),)


def _relu2_mlp_forwards(family: Family, cls: type):
    return (("forward", relu_squared_mlp_forward, f"{cls.__name__} (ReLU², non-gated)"),)


def _experts_forwards(family: Family, cls: type):
    gate = family.experts_activation
    forwards = [("forward", make_experts_forward(cls.forward, gate),
                 f"{cls.__name__}: {MOE_EXPERTS}{f' with its {gate} gate' if gate else ''}")]
    if gate is None:  # HF's default gate, which its other forwards call: fused too
        forwards.append(("_apply_gate", tigon_apply_gate, f"{cls.__name__}._apply_gate"))
    return forwards


def _experts_refusal(family: Family, cls: type) -> str | None:
    if family.experts_activation is None and not hf_default_gate(cls):
        return "a gate of its own (_apply_gate), which the row does not name (experts_activation)"
    return None


# ---- checks of a built model's instances, before anything is changed ----

def _check_layer_norm(family: Family, cls: type, inst: nn.Module, report: PatchReport) -> None:
    if len(inst.normalized_shape) != 1:
        raise TigonPatchError(f"{family.name}: {cls.__name__} normalises over {inst.normalized_shape}, "
                              "not the last dim only as tigon's layer_norm does")


def _check_gated_mlp(family: Family, cls: type, inst: nn.Module, report: PatchReport) -> None:
    """The activation found now, not at the first forward (which torch.compile may be tracing:
    evaluating the activation there would break its graph); raises for one tigon does not fuse."""
    mlp_activation(inst)


def _check_relu2_mlp(family: Family, cls: type, inst: nn.Module, report: PatchReport) -> None:
    check_relu_squared_activation(inst)


def _check_experts(family: Family, cls: type, inst: nn.Module, report: PatchReport) -> None:
    """Stacked 3-D weights, else an error. Experts the fused op cannot run (an activation tigon
    does not fuse, expert parallel, ...) run HF's forward: said in the report."""
    for attr in ("gate_up_proj", "down_proj"):
        if getattr(inst, attr, None) is None or getattr(inst, attr).ndim != 3:
            raise TigonPatchError(f"{family.name}: {cls.__name__}.{attr} is not a stacked "
                                  "3-D [experts, ., .] parameter in this transformers version")
    activation = family.experts_activation or fused_activation(inst)
    why = fused_experts_blocker(inst, activation, own_gate=family.experts_activation is not None)
    note = ("swiglu", f"{cls.__name__}: {why}; HF's forward runs")
    if why is not None and note not in report.skipped:
        report.skipped.append(note)


# ---- the table ----

@dataclass(frozen=True)
class Piece:
    """HF module classes a row names in ``family_attr`` (a tuple of names, or one name or None), patched
    under the option ``option`` (also the report's piece): ``forwards(family, cls)`` gives what
    is set on each class or instance, ``check(family, cls, instance, report)`` vets a built
    model's instances first, ``refuse(family, cls)`` says why a class is left to HF (or None)."""

    family_attr: str
    option: str
    forwards: Callable
    check: Callable | None = None
    refuse: Callable | None = None
    single_input: bool = True  # its forward takes the hidden states only
    gated: bool = False  # a gated MLP: its activation is identified when a class-patched model is built

    def classes(self, family: Family, opts: PatchOptions, module, report: PatchReport) -> list[type]:
        """The row's classes of this piece in the modeling ``module`` (none with the option off);
        raises for one missing, or one whose forward takes more than tigon's."""
        if not getattr(opts, self.option):
            return []
        names = getattr(family, self.family_attr)
        names = (names,) if isinstance(names, str) else names or ()
        classes = [_hf(module, family, name, self.option) for name in names]
        for cls in classes if self.single_input else ():
            _check_single_input(cls, family, self.option)
        kept = []
        for cls in classes:
            why = self.refuse(family, cls) if self.refuse is not None else None
            if why is None:
                kept.append(cls)
            else:
                report.skipped.append((self.option, f"{cls.__name__}: {why}"))
        return kept


# In the order of the report.
PIECES = (
    Piece("rms_norms", "rms_norm", _rms_norm_forwards),
    Piece("layer_norms", "layer_norm", _layer_norm_forwards, check=_check_layer_norm),
    Piece("mlps", "swiglu", _mlp_forwards, check=_check_gated_mlp, gated=True),
    Piece("vision_mlps", "swiglu", _vision_mlp_forwards, check=_check_gated_mlp, gated=True),
    Piece("relu2_mlps", "swiglu", _relu2_mlp_forwards, check=_check_relu2_mlp),
    Piece("experts", "swiglu", _experts_forwards, check=_check_experts, refuse=_experts_refusal, single_input=False),
)
