"""One file per op: its Triton kernels, its custom ops (``torch.ops.tigon.*``) and their autograd."""

from tigon.ops.cross_entropy import cross_entropy_inplace_op, cross_entropy_op
from tigon.ops.embedding import TiedGradSlot, embedding_backward_op, embedding_op
from tigon.ops.fused_add_rms_norm import fused_add_rms_norm_op
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_backward_op, fused_linear_cross_entropy_op
from tigon.ops.glu import glu_op
from tigon.ops.glu_down import glu_down_op
from tigon.ops.glu_mlp import glu_mlp_op
from tigon.ops.jsd import jsd_backward_op, jsd_op, linear_jsd_op
from tigon.ops.kl_div import kl_div_backward_op, kl_div_op
from tigon.ops.layer_norm import layer_norm_op
from tigon.ops.linear_token_logps import linear_token_logps_op
from tigon.ops.moe_experts import moe_experts_backward_op, moe_experts_op
from tigon.ops.relu_squared import relu_squared_op
from tigon.ops.relu_squared_mlp import relu_squared_mlp_op
from tigon.ops.rms_norm import rms_norm_op
from tigon.ops.rope import rope_op
from tigon.ops.softmax import softmax_backward_op, softmax_op
from tigon.ops.sparsemax import sparsemax_backward_op, sparsemax_op
from tigon.ops.tvd import tvd_backward_op, tvd_op
from tigon.ops.vocab_parallel_cross_entropy import (
    vocab_parallel_cross_entropy_inplace_op,
    vocab_parallel_cross_entropy_op,
    vocab_parallel_cross_entropy_stats_op,
)

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
    "kl_div_backward_op",
    "kl_div_op",
    "layer_norm_op",
    "linear_jsd_op",
    "linear_token_logps_op",
    "moe_experts_backward_op",
    "moe_experts_op",
    "relu_squared_mlp_op",
    "relu_squared_op",
    "rms_norm_op",
    "rope_op",
    "softmax_backward_op",
    "softmax_op",
    "sparsemax_backward_op",
    "sparsemax_op",
    "tvd_backward_op",
    "tvd_op",
    "vocab_parallel_cross_entropy_inplace_op",
    "vocab_parallel_cross_entropy_op",
    "vocab_parallel_cross_entropy_stats_op",
]
