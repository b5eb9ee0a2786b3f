"""What the op suite's cases are made of: the op names, the Case record, and the input makers
and peer loaders the case lists share (tigon.bench.layer_cases, tigon.bench.loss_cases).

A case is one op at one shape: how to make its inputs, and the implementations timed on them:
"tigon", "torch eager" (tigon.reference's formula, as the model code runs it), "torch.compile"
of the eager one, and the peers installed (Liger-Kernel, Cut Cross-Entropy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tigon.bench.harness import generator

# The ops of the suite, in the order it runs them: the names `tigon bench` and --ops accept.
OP_NAMES = ("rms_norm", "layer_norm", "fused_add_rms_norm", "group_norm", "dyt", "poly_norm", "swiglu", "geglu",
            "rope", "swiglu_mlp", "cross_entropy",
            "relu_squared", "relu_squared_mlp", "tiled_mlp",
            "vocab_parallel_cross_entropy", "fused_linear_cross_entropy",
            "softmax", "sparsemax", "kl_div", "tvd", "moe_experts")


def unknown_op_error(names) -> str | None:
    """An argparse-style message for the names not in OP_NAMES (None when all are known)."""
    unknown = [name for name in names if name not in OP_NAMES]
    if not unknown:
        return None
    return (f"invalid choice: {', '.join(map(repr, unknown))} "
            f"(choose from {', '.join(map(repr, OP_NAMES))})")


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], list]
    impls: dict  # name -> fn(*inputs)
    bytes_full: int | None = None
    flops_full: int | None = None
    grad_output: float | None = None  # None: random cotangents; a loss's cases use 1 (loss.backward())
    size: tuple | None = None  # (axis name, value) when the case is a point of a size sweep (plotted)

    def __post_init__(self):
        if self.op not in OP_NAMES:
            raise ValueError(f"case op {self.op!r} is not in OP_NAMES {OP_NAMES}")


def liger_functional():
    """liger_kernel.transformers.functional, or None where Liger-Kernel does not import."""
    try:
        import liger_kernel.transformers.functional as LF

        return LF
    except Exception:
        return None


def cut_cross_entropy():
    """Cut Cross-Entropy's linear_cross_entropy, or None where it does not import."""
    try:
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy
    except Exception:
        return None


def compiled(fn):
    """torch.compile of a case's eager implementation. Every case's compiled function shares
    torch.compile's wrapper code, whose compiled entries dynamo caps at 8 by default (then it runs
    eager, silently but for a warning): a suite of cases needs more."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn, dynamic=False)


def randn(*shape, dtype=torch.bfloat16, scale=1.0, shift=0.0, grad=True):
    t = torch.randn(*shape, device="cuda", dtype=torch.float32, generator=generator()).mul_(scale).add_(shift)
    t = t.to(dtype)
    return t.requires_grad_(grad)


def randint(high, n):
    return torch.randint(0, high, (n,), device="cuda", generator=generator())
