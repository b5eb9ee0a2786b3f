"""tigon: fused Triton kernels for faster, lighter LLM training."""

from tigon import functional, nn, ops
from tigon.api import PATCHERS, patch
from tigon.auto import AutoModelForCausalLM
from tigon.patching import FAMILIES, PatchOptions, PatchReport, TigonPatchError, patched, unpatch

globals().update(PATCHERS)  # patch_llama, patch_mistral, ... (tigon.api, over tigon.patching's)

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "FAMILIES", "PatchOptions", "PatchReport", "TigonPatchError", "functional", "nn",
           "ops", "patch", "patched", "unpatch", "__version__", *PATCHERS]
