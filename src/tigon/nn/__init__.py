"""nn.Module versions of the tigon ops, state-dict compatible with the HF modules they replace."""

from tigon.nn.activations import TigonSoftmax, TigonSparsemax
from tigon.nn.loss import (
    TigonCrossEntropyLoss,
    TigonFusedLinearCrossEntropyLoss,
    TigonKLDivLoss,
    TigonTVDLoss,
    TigonVocabParallelCrossEntropyLoss,
    TigonVocabParallelLinearCrossEntropyLoss,
)
from tigon.nn.mlp import (
    TigonGeGLUMLP,
    TigonReLUSquaredMLP,
    TigonSwiGLUMLP,
    TigonTiledGeGLUMLP,
    TigonTiledSwiGLUMLP,
)
from tigon.nn.norms import (
    TigonDyT,
    TigonFusedAddRMSNorm,
    TigonGroupNorm,
    TigonLayerNorm,
    TigonPolyNorm,
    TigonRMSNorm,
)

__all__ = [
    "TigonKLDivLoss", "TigonSoftmax", "TigonSparsemax", "TigonTVDLoss",
    "TigonCrossEntropyLoss", "TigonFusedLinearCrossEntropyLoss", "TigonVocabParallelCrossEntropyLoss",
    "TigonVocabParallelLinearCrossEntropyLoss",
    "TigonFusedAddRMSNorm", "TigonGeGLUMLP", "TigonLayerNorm", "TigonRMSNorm", "TigonSwiGLUMLP",
    "TigonDyT", "TigonGroupNorm", "TigonPolyNorm",
    "TigonReLUSquaredMLP", "TigonTiledGeGLUMLP", "TigonTiledSwiGLUMLP"]
