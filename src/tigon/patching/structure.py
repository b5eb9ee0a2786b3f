"""Patching by structure, for a model of no family row: the RMSNorms and gated MLPs whose output
matches a formula tigon computes, found by evaluating them."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tigon.patching.install import _set_instance
from tigon.patching.mlp import activation_module, identify_activation, make_mlp_forward, mlp_multipliers
from tigon.patching.norms import make_rms_norm_forward, norm_eps
from tigon.patching.options import PatchOptions


def single_input_forward(cls) -> bool:
    """cls.forward takes one input besides self (``forward(self, hidden_states)``): a gated
    norm's ``forward(self, hidden_states, gate=None)`` is not one tigon's forwards replace."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


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
