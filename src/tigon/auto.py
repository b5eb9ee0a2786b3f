"""``tigon.AutoModelForCausalLM``: transformers' AutoModelForCausalLM, returning a patched model."""

from __future__ import annotations

_PATCH_OPTIONS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy", "cross_entropy", "chunk_budget")


def _split(kwargs):
    options = {k: kwargs.pop(k) for k in _PATCH_OPTIONS if k in kwargs}
    return options, kwargs


class AutoModelForCausalLM:
    """``from_pretrained`` / ``from_config`` as transformers', then ``tigon.patch(model, ...)``.
    Patch options (rope, rms_norm, swiglu, fused_linear_cross_entropy, cross_entropy, chunk_budget) may be
    passed among the keyword arguments; the PatchReport is on ``model.tigon_report``."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        from transformers import AutoModelForCausalLM as HFAuto

        options, kwargs = _split(kwargs)
        return _patched(HFAuto.from_pretrained(*args, **kwargs), options)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM as HFAuto

        options, kwargs = _split(kwargs)
        return _patched(HFAuto.from_config(config, **kwargs), options)


def _patched(model, options):
    from tigon.patching import patch

    model.tigon_report = patch(model, **options)
    return model
