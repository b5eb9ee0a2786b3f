"""tigon's entry points ``patch`` and ``patch_<family>``: the kernel patch (tigon.patching) and then,
on a built model, the ``checkpointing`` option, whose "auto" asks the memory planner
(tigon.planning) which decoder layers to checkpoint."""

from __future__ import annotations

import functools

from torch import nn

from tigon import patching
from tigon.patching import PatchOptions, PatchReport, kernels_only
from tigon.patching.options import patch_options
from tigon.planning.checkpointing import install_checkpointing


def patch(model: nn.Module, options: PatchOptions | None = None, **kwargs) -> PatchReport:
    """Patch a built HF model in place (this model only; weights kept) and return a PatchReport.
    Known families (by ``config.model_type``) get their row of the family table; others get
    what tigon recognises by structure (RMSNorm-like modules whose output matches a known
    formula, gate/up/down MLPs with a fused activation). Options: a PatchOptions and/or its
    fields as keywords (rope, rms_norm, swiglu, fused_linear_cross_entropy, cross_entropy,
    chunk_budget, layer_norm, checkpointing, memory_budget). Warns when nothing was patched."""
    opts = patch_options(options, **kwargs)
    report = patching.patch(model, kernels_only(opts))
    install_checkpointing(model, opts, report)
    return report


def _with_checkpointing(kernel_patcher):
    """``patch_<family>(model=None, options=None, **options)`` of tigon.patching, plus the
    checkpointing option on a built model."""

    @functools.wraps(kernel_patcher)
    def patch_family(model: nn.Module | None = None, options: PatchOptions | None = None, **kwargs) -> PatchReport:
        opts = patch_options(options, **kwargs)
        if model is None and opts.checkpointing is not None:
            raise ValueError(f"checkpointing={opts.checkpointing!r} needs a built model: "
                             f"{kernel_patcher.__name__}(model, ...)")
        report = kernel_patcher(model, kernels_only(opts))
        if model is not None:
            install_checkpointing(model, opts, report)
        return report

    return patch_family


PATCHERS = {name: _with_checkpointing(kernel_patcher) for name, kernel_patcher in patching.PATCHERS.items()}
