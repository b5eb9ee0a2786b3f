"""tigon: fused Triton kernels for faster, lighter LLM training."""

from tigon import functional, nn, ops

__version__ = "0.1.0"
__all__ = ["functional", "nn", "ops", "__version__"]
