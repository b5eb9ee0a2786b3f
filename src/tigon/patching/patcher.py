"""Apply a family row to the HF classes (before a model is built) or to a built model.

Class patching sets the forwards on the HF classes (models built before or after use them);
instance patching binds them to the modules of one model only. RoPE is a module-level
function in HF's modeling files, so it is always replaced module-wide. Every patch is recorded
so ``unpatch`` can restore what was there.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from tigon.patching.families import BY_MODEL_TYPE, FAMILIES, Family
from tigon.patching.forwards import (
    TigonPatchError,
    identify_activation,
    make_causal_lm_forward,
    make_experts_forward,
    make_find_packed_sequence_indices,
    make_mlp_forward,
    make_rms_norm_forward,
    norm_eps,
    tigon_apply_gate,
    tigon_apply_rotary_pos_emb,
)

log = logging.getLogger("tigon")

# (owner, attribute) -> what was there before tigon (owner: a class, module or instance).
_ORIGINALS: dict[tuple[int, str], tuple[object, str, object, bool]] = {}


def _is_shared(owner) -> bool:
    return isinstance(owner, (type, types.ModuleType))


def _assign(owner, name, value):
    """owner.name = value; on an instance, straight into its __dict__ (nn.Module.__setattr__
    would register modules)."""
    if _is_shared(owner):
        setattr(owner, name, value)
    else:
        owner.__dict__[name] = value


def _set(owner, name, value):
    """owner.name = value, remembering the first original for unpatch."""
    key = (id(owner), name)
    if key not in _ORIGINALS:
        own = vars(owner)
        _ORIGINALS[key] = (owner, name, own.get(name), name in own)
    _assign(owner, name, value)


def unpatch(keep: int = 0) -> int:
    """Undo every tigon patch (classes, module functions, instances), or all but the first
    ``keep`` recorded ones. Returns how many were undone."""
    entries = list(_ORIGINALS.items())[keep:]
    for key, (owner, name, value, had) in reversed(entries):
        del _ORIGINALS[key]
        if had:
            _assign(owner, name, value)
        elif name in vars(owner):
            delattr(owner, name) if _is_shared(owner) else vars(owner).pop(name)
    return len(entries)


@contextlib.contextmanager
def patched(model: nn.Module | None = None, family: str | None = None, **options):
    """``with tigon.patched(model): ...`` patches ``model`` (or, with ``family="llama"`` and no
    model, that family's classes) for the block and undoes exactly those patches after it.
    Yields the PatchReport."""
    keep = len(_ORIGINALS)
    try:
        if model is not None:
            yield patch(model, **options)
        elif family is not None:
            yield apply_family(FAMILIES[family], **options)
        else:
            raise ValueError("give a model, or a family name")
    finally:
        unpatch(keep)


@dataclass
class PatchReport:
    """What a patch call replaced (piece, HF name, how many instances or 'class') and skipped."""

    family: str
    target: str
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def pieces(self) -> set[str]:
        return {piece for piece, _, _ in self.replaced}

    def __str__(self) -> str:
        lines = [f"tigon patched {self.target} ({self.family}):"]
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
    obj = getattr(module, name, None)
    if obj is None:
        raise TigonPatchError(f"{family.name}: transformers {_transformers_version()} has no {name} in "
                              f"{module.__name__} (needed by the {piece} patch)")
    return obj


def _check_rope_signature(fn, family):
    params = list(inspect.signature(fn).parameters)
    if params[:4] != ["q", "k", "cos", "sin"]:
        raise TigonPatchError(f"{family.name}: {fn.__module__}.{fn.__name__} takes {params}, not (q, k, cos, sin, ...)"
                              " as tigon's RoPE expects")


def _instances(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) is cls]


def apply_family(family: Family, *, rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                 cross_entropy=False, model: nn.Module | None = None, chunk_budget: int | None = None) -> PatchReport:
    """Patch the classes of ``family`` (model None) or the modules of ``model``; see patch_<family>."""
    if fused_linear_cross_entropy and cross_entropy:
        raise ValueError("pass at most one of fused_linear_cross_entropy and cross_entropy")
    mod = _modeling(family)
    report = PatchReport(family.name, type(model).__name__ if model is not None else f"{family.module} classes")
    # Resolve every piece first: a missing one raises before anything is changed.
    norm_classes = [_hf(mod, family, n, "rms_norm") for n in family.rms_norms] if rms_norm else []
    mlp_classes = [_hf(mod, family, n, "swiglu") for n in family.mlps] if swiglu else []
    experts_class = _hf(mod, family, family.experts, "swiglu") if swiglu and family.experts else None
    lm_class = _hf(mod, family, family.causal_lm, "loss") if (fused_linear_cross_entropy or cross_entropy) else None
    rope_fn = None
    if rope and family.rope:
        rope_fn = _hf(mod, family, family.rope, "rope")
        _check_rope_signature(rope_fn, family)
    elif rope:
        report.skipped.append(("rope", family.note or "no RoPE patch for this family"))
    if model is not None and lm_class is not None and not isinstance(model, lm_class):
        if not any(type(m) is lm_class for m in model.modules()):
            report.skipped.append(("loss", f"the model is not a {family.causal_lm}"))
            lm_class = None
    if experts_class is not None:
        for attr in ("gate_up_proj", "down_proj"):
            if model is not None:
                for e in _instances(model, experts_class):
                    if getattr(e, attr, None) is None or getattr(e, attr).ndim != 3:
                        raise TigonPatchError(f"{family.name}: {experts_class.__name__}.{attr} is not a stacked "
                                              "[experts, out, in] parameter in this transformers version")

    def put(owner_cls, name, fn, piece, what):
        if model is None:
            _set(owner_cls, name, fn)
            report.replaced.append((piece, what, "class"))
            return
        found = _instances(model, owner_cls)
        for inst in found:
            _set(inst, name, types.MethodType(fn, inst))
        if found:
            report.replaced.append((piece, what, str(len(found))))

    for cls in norm_classes:
        put(cls, "forward", make_rms_norm_forward(family.rms_casting, family.rms_offset), "rms_norm",
            f"{cls.__name__} (casting={family.rms_casting}, offset={family.rms_offset:g})")
    for cls in mlp_classes:
        if model is not None:
            for inst in _instances(model, cls):
                act = getattr(inst, "act_fn", None) or getattr(inst, "activation_fn", None)
                if identify_activation(act) is None:
                    raise TigonPatchError(f"{family.name}: {cls.__name__} uses activation {act!r}, which tigon "
                                          "does not fuse (SiLU, GELU tanh, GELU erf); pass swiglu=False")
        recompute = not family.mlp_output_saved and family.mlp_layout == "gate_up_down"
        put(cls, "forward", make_mlp_forward(family.mlp_layout, recompute), "swiglu",
            f"{cls.__name__} ({family.mlp_layout}{'; only its input kept under checkpointing' if recompute else ''})")
    if experts_class is not None:
        put(experts_class, "forward", make_experts_forward(experts_class.forward), "swiglu",
            f"{experts_class.__name__} (eager loop)")
        put(experts_class, "_apply_gate", tigon_apply_gate, "swiglu", f"{experts_class.__name__}._apply_gate")
    if rope_fn is not None and getattr(rope_fn, "_tigon", None) is None:
        _set(mod, family.rope, tigon_apply_rotary_pos_emb)
        report.replaced.append(("rope", f"{mod.__name__}.{family.rope}", "module-wide"))
    elif rope_fn is not None:
        report.replaced.append(("rope", f"{mod.__name__}.{family.rope}", "already"))
    if lm_class is not None:
        mode = "flce" if fused_linear_cross_entropy else "cross_entropy"
        original = lm_class.forward
        original = getattr(original, "_tigon_original", original)
        fwd = make_causal_lm_forward(original, softcap_attr=family.logit_softcap, divisor_attr=family.logit_divisor,
                                     mode=mode, chunk_budget=chunk_budget)
        fwd._tigon_original = original
        put(lm_class, "forward", fwd, "loss", f"{lm_class.__name__} ({fwd._tigon})")
        _patch_packed_sequence_check(report)
    log.info("%s", report)
    return report


def _patch_packed_sequence_check(report):
    """Module-wide, like RoPE: HF's packed-sequence check answers without a host sync during
    patched causal-LM forwards on generated positions (see make_find_packed_sequence_indices)."""
    try:
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError:
        return
    fn = getattr(masking_utils, "find_packed_sequence_indices", None)
    if fn is None:
        return  # a transformers without the check: nothing to skip
    if getattr(fn, "_tigon", None) is None:
        _set(masking_utils, "find_packed_sequence_indices", make_find_packed_sequence_indices(fn))
    report.replaced.append(("packed_check", "transformers.masking_utils.find_packed_sequence_indices",
                            "module-wide"))


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


def _patch_by_structure(model, report, rms_norm=True, swiglu=True):
    seen_rms, seen_mlp = {}, {}
    for m in model.modules():
        name = type(m).__name__
        if rms_norm and "RMSNorm" in name:
            key = (type(m), str(m.weight.dtype) if hasattr(m, "weight") else "")
            if key not in seen_rms:
                seen_rms[key] = _identify_rms_norm(m)
            found = seen_rms[key]
            if found is None:
                report.skipped.append(("rms_norm", f"{name}: its forward matched no known RMSNorm formula"))
                continue
            _set(m, "forward", types.MethodType(make_rms_norm_forward(*found), m))
            report.replaced.append(("rms_norm", f"{name} (casting={found[0]}, offset={found[1]:g})", "1"))
        elif swiglu and all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")):
            act = getattr(m, "act_fn", None)
            if identify_activation(act) is None:
                report.skipped.append(("swiglu", f"{name}: activation {act!r} not fused by tigon"))
                continue
            if type(m) not in seen_mlp:
                seen_mlp[type(m)] = _mlp_matches_formula(m)
            if not seen_mlp[type(m)]:
                report.skipped.append(("swiglu", f"{name}: forward is not down(act(gate(x)) * up(x))"))
                continue
            _set(m, "forward", types.MethodType(make_mlp_forward("gate_up_down"), m))
            report.replaced.append(("swiglu", f"{name} (gate_up_down)", "1"))
    report.replaced = _merge_counts(report.replaced)
    report.skipped = sorted(set(report.skipped))


def _mlp_matches_formula(m) -> bool:
    try:
        w = m.gate_proj.weight
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        with torch.no_grad():
            ref = m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))
            return torch.allclose(m(x).float(), ref.float(), rtol=1e-3, atol=1e-4)
    except Exception:  # likewise
        return False


def _merge_counts(items):
    counts: dict[tuple[str, str], int] = {}
    for piece, what, count in items:
        counts[(piece, what)] = counts.get((piece, what), 0) + int(count)
    return [(piece, what, str(n)) for (piece, what), n in counts.items()]


def patch(model: nn.Module, *, rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
          cross_entropy=False, chunk_budget: int | None = None) -> PatchReport:
    """Patch a built HF model in place. Known families (by ``config.model_type``) get their
    row of the family table; others get what tigon recognises by structure (RMSNorm-like
    modules whose output matches a known formula, gate/up/down MLPs with a fused activation)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = BY_MODEL_TYPE.get(model_type)
    if family is not None:
        return apply_family(family, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                            fused_linear_cross_entropy=fused_linear_cross_entropy, cross_entropy=cross_entropy,
                            model=model, chunk_budget=chunk_budget)
    report = PatchReport(f"unknown model_type {model_type!r}, by structure", type(model).__name__)
    _patch_by_structure(model, report, rms_norm, swiglu)
    if rope:
        report.skipped.append(("rope", "only patched for the families in tigon.FAMILIES"))
    if fused_linear_cross_entropy or cross_entropy:
        report.skipped.append(("loss", "only patched for the families in tigon.FAMILIES"))
    log.info("%s", report)
    return report


def _make_family_patcher(family: Family):
    def patch_family(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False,
                     model=None, chunk_budget=None) -> PatchReport:
        return apply_family(family, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                            fused_linear_cross_entropy=fused_linear_cross_entropy, cross_entropy=cross_entropy,
                            model=model, chunk_budget=chunk_budget)

    patch_family.__name__ = f"patch_{family.name}"
    patch_family.__doc__ = (
        f"Patch {family.name} ({', '.join(family.model_types)}): the classes in {family.module} before a model is "
        "built, or the modules of an already-built ``model`` in place (weights kept). Returns a PatchReport.\n\n"
        "rope: HF's apply_rotary_pos_emb (module-wide); rms_norm: every RMSNorm; swiglu: the gated MLP "
        "activation (and MoE experts); fused_linear_cross_entropy: the training loss without the logits; "
        "cross_entropy: the loss with tigon's cross entropy over materialised logits (instead of FLCE); "
        "chunk_budget: bytes of logits an FLCE chunk may hold (default 512 MiB; less memory, a little slower)."
    )
    return patch_family


PATCHERS = {f"patch_{name}": _make_family_patcher(family) for name, family in FAMILIES.items()}
