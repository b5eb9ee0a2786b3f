"""tigon: fused Triton kernels for faster, lighter LLM training."""

from tigon import functional, nn, ops
from tigon.auto import AutoModelForCausalLM
from tigon.patching import FAMILIES, PATCHERS, PatchReport, TigonPatchError, patch, patched, unpatch

globals().update(PATCHERS)  # patch_llama, patch_mistral, ...

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "FAMILIES", "PatchReport", "TigonPatchError", "functional", "nn", "ops", "patch",
           "patched", "unpatch", "__version__", *PATCHERS]
