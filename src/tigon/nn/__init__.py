"""nn.Module versions of the tigon ops, state-dict compatible with the HF modules they replace."""

from tigon.nn.loss import TigonCrossEntropyLoss, TigonFusedLinearCrossEntropyLoss
from tigon.nn.mlp import TigonGeGLUMLP, TigonSwiGLUMLP
from tigon.nn.norms import TigonFusedAddRMSNorm, TigonLayerNorm, TigonRMSNorm

__all__ = [
    "TigonCrossEntropyLoss", "TigonFusedLinearCrossEntropyLoss",
    "TigonFusedAddRMSNorm", "TigonGeGLUMLP", "TigonLayerNorm", "TigonRMSNorm", "TigonSwiGLUMLP"]
