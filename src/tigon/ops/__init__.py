"""One file per op: its Triton kernels, its custom ops (``torch.ops.tigon.*``) and their autograd."""

from tigon.ops.cross_entropy import cross_entropy_inplace_op, cross_entropy_op
from tigon.ops.embedding import TiedGradSlot, embedding_backward_op, embedding_op
from tigon.ops.fused_add_rms_norm import fused_add_rms_norm_op
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_backward_op, fused_linear_cross_entropy_op
from tigon.ops.glu import glu_op
from tigon.ops.glu_mlp import glu_down_op, glu_mlp_op
from tigon.ops.jsd import jsd_backward_op, jsd_op, linear_jsd_op
from tigon.ops.layer_norm import layer_norm_op
from tigon.ops.linear_token_logps import linear_token_logps_op
from tigon.ops.rms_norm import rms_norm_op
from tigon.ops.rope import rope_op

__all__ = [
    "TiedGradSlot",
    "cross_entropy_inplace_op",
    "cross_entropy_op",
    "embedding_backward_op",
    "embedding_op",
    "fused_add_rms_norm_op",
    "fused_linear_cross_entropy_backward_op",
    "fused_linear_cross_entropy_op",
    "glu_down_op",
    "glu_mlp_op",
    "glu_op",
    "jsd_backward_op",
    "jsd_op",
    "layer_norm_op",
    "linear_jsd_op",
    "linear_token_logps_op",
    "rms_norm_op",
    "rope_op",
]
