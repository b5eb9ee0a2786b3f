"""tigon: fused Triton kernels for faster, lighter LLM training."""

from tigon.ambient import interpret_kernels_without_gpu

interpret_kernels_without_gpu()  # before any kernel is defined: without a GPU, Triton's interpreter

from tigon import functional, nn, ops  # noqa: E402
from tigon.api import PATCHERS, patch  # noqa: E402
from tigon.auto import AutoModelForCausalLM  # noqa: E402
from tigon.patching import FAMILIES, PatchOptions, PatchReport, TigonPatchError, patched, unpatch  # noqa: E402

globals().update(PATCHERS)  # patch_llama, patch_mistral, ... (tigon.api, over tigon.patching's)

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "FAMILIES", "PatchOptions", "PatchReport", "TigonPatchError", "functional", "nn",
           "ops", "patch", "patched", "unpatch", "__version__", *PATCHERS]
