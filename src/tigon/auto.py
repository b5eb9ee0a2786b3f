"""``tigon.AutoModelForCausalLM``: transformers' AutoModelForCausalLM, returning a patched model."""

from __future__ import annotations

from tigon.api import patch
from tigon.extras import require_extra
from tigon.patching import PATCH_OPTION_NAMES


def _split(kwargs):
    """(patch options, the rest for transformers) from one set of keyword arguments."""
    options = {k: kwargs.pop(k) for k in PATCH_OPTION_NAMES if k in kwargs}
    if "patch_options" in kwargs:
        options["options"] = kwargs.pop("patch_options")
    return options, kwargs


class AutoModelForCausalLM:
    """``from_pretrained`` / ``from_config`` as transformers', then ``tigon.patch(model, ...)``.
    Patch options (the fields of tigon.PatchOptions: rope, rms_norm, swiglu,
    fused_linear_cross_entropy, cross_entropy, chunk_budget, layer_norm) may be passed among the keyword
    arguments, or as ``patch_options=PatchOptions(...)``; the PatchReport is on
    ``model.tigon_report``."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        require_extra("hf", "tigon.AutoModelForCausalLM")
        from transformers import AutoModelForCausalLM as HFAuto

        options, kwargs = _split(kwargs)
        return _patched(HFAuto.from_pretrained(*args, **kwargs), options)

    @classmethod
    def from_config(cls, config, **kwargs):
        require_extra("hf", "tigon.AutoModelForCausalLM")
        from transformers import AutoModelForCausalLM as HFAuto

        options, kwargs = _split(kwargs)
        return _patched(HFAuto.from_config(config, **kwargs), options)


def _patched(model, options):
    model.tigon_report = patch(model, **options)
    return model
