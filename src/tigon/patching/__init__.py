"""Patch Hugging Face transformers models with tigon's kernels (see ``families.FAMILIES``)."""

from tigon.patching.families import BY_MODEL_TYPE, FAMILIES, Family
from tigon.patching.forwards import TigonPatchError
from tigon.patching.patcher import (
           PATCHERS,
           PatchReport,
           apply_family,
           patch,
           patched,
           unpatch,
)

globals().update(PATCHERS)

__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "PatchReport", "TigonPatchError", "apply_family", "patch",
           "patched", "unpatch", *PATCHERS]
