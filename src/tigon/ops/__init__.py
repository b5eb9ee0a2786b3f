"""One file per op: its Triton kernels, its custom ops (``torch.ops.tigon.*``) and their autograd."""

from tigon.ops.cross_entropy import CrossEntropyFunction
from tigon.ops.embedding import EmbeddingFunction, TiedGradSlot
from tigon.ops.fused_add_rms_norm import fused_add_rms_norm_op
from tigon.ops.fused_linear_cross_entropy import FusedLinearCrossEntropyFunction
from tigon.ops.glu import GLUFunction
from tigon.ops.glu_mlp import GLUDownProjFunction, GLUMLPFunction
from tigon.ops.jsd import JSDFunction, LinearJSDFunction
from tigon.ops.layer_norm import LayerNormFunction
from tigon.ops.linear_token_logps import LinearTokenLogpsFunction
from tigon.ops.rms_norm import rms_norm_op
from tigon.ops.rope import RoPEFunction

__all__ = [
    "CrossEntropyFunction",
    "EmbeddingFunction",
    "FusedLinearCrossEntropyFunction",
    "GLUDownProjFunction",
    "GLUFunction",
    "GLUMLPFunction",
    "JSDFunction",
    "LayerNormFunction",
    "LinearJSDFunction",
    "LinearTokenLogpsFunction",
    "RoPEFunction",
    "TiedGradSlot",
    "fused_add_rms_norm_op",
    "rms_norm_op",
]
