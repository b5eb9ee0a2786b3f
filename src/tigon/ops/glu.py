"""Gated linear unit activations: c = act(a * gate_multiplier) * b * out_multiplier, elementwise.

a, b [..., I]. act is SiLU (SwiGLU), or GELU with the tanh approximation or the exact erf
form (GeGLU); the two multipliers are 1 except in models that scale the gate or the MLP's
output (Falcon-H1's ``mlp_multipliers``). Arithmetic in fp32, one rounding to the input dtype. a and b may be
row-strided views (for example the two halves of a fused gate_up projection): they are read
in place, not copied.

This file also owns tigon's activation vocabulary: ``ACTIVATIONS`` are the names every layer
of tigon uses, ``ACTIVATION_ALIASES`` the names configs use for them.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    as_rows,
    cdiv,
    check_same_device,
    check_same_dtype,
    check_tensor,
    kernel_op,
    new_output,
    next_pow2,
)
from tigon.ops._internals import interpreter_enabled, launch

# tigon's activation names -> the kernels' code.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu_erf": 2}
# The same activations in torch (what a module's act_fn is compared with, and the references).
TORCH_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_erf": F.gelu,
}
# Other names for them: HF configs' ``hidden_act`` (transformers' ACT2FN keys).
ACTIVATION_ALIASES = {
    "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu": "gelu_erf",
}
# torch's F.gelu(approximate=...) values.
GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu_erf"}


def activation_name(name: str) -> str:
    """tigon's name for an activation named ``name`` (tigon's own, or an alias)."""
    if name in ACTIVATIONS:
        return name
    if name in ACTIVATION_ALIASES:
        return ACTIVATION_ALIASES[name]
    raise ValueError(f"activation {name!r} is not one tigon fuses; it fuses {sorted(ACTIVATIONS)} "
                     f"(also named {sorted(ACTIVATION_ALIASES)})")


def glu_launch_config(n_cols: int) -> tuple[int, int]:
    """(elements per program, warps) for rows of n_cols (the intermediate size I, also when the
    rows are walked as one: a size that does not change with the batch, which a compiled graph
    may not specialise on). On an H100 (benchmarks/tuning/tune_kernels.py, bf16) blocks of 4096
    with 16 warps ran at 94-98% of copy bandwidth; short rows take one block of the row's size
    with a warp per 256 elements. Triton's interpreter: blocks of 4096 always (its cost is per
    program, nearly not per element)."""
    block = 4096 if interpreter_enabled() else min(4096, next_pow2(n_cols))
    return block, max(2, min(16, block // 256))


def _glu_rows(*tensors):
    """[M, I] views as (rows, row length, row strides): one long row when all are contiguous,
    so no program is spent on a row's ragged tail."""
    n_rows, n_cols = tensors[0].shape
    if all(t.stride(0) == n_cols for t in tensors):
        return 1, n_rows * n_cols, [0] * len(tensors)
    return n_rows, n_cols, [t.stride(0) for t in tensors]


@triton.jit
def glu_activation(a, ACTIVATION: tl.constexpr):
    """(act(a), act'(a)) in fp32 for a fp32 tensor a."""
    if ACTIVATION == 0:
        sig = tl.sigmoid(a)
        act = a * sig
        dact = sig * (1.0 + a * (1.0 - sig))
    elif ACTIVATION == 1:
        # tanh(u) = 2 sigmoid(2u) - 1: exact, and free of libdevice (runs in the interpreter).
        k0 = 0.7978845608028654  # sqrt(2 / pi)
        k1 = 0.044715
        a2 = a * a
        t = 2.0 * tl.sigmoid(2.0 * k0 * a * (1.0 + k1 * a2)) - 1.0
        act = 0.5 * a * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * a2)
    else:
        cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))
        act = a * cdf
        dact = cdf + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)
    return act, dact


@triton.jit
def glu_forward_kernel(
    A, stride_a, B, stride_b, C, stride_c, n_cols, blocks_per_row, gate_multiplier, out_multiplier,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    """1-D grid over (row, column block) pairs; contiguous inputs arrive as a single row."""
    # Inductor passes Python floats as fp64 scalars (Triton's own launch: fp32); fp64 would
    # promote the whole block's math to fp64 (the activation's exp among it).
    gate_multiplier = tl.cast(gate_multiplier, tl.float32)
    out_multiplier = tl.cast(out_multiplier, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(A + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = glu_activation(a * gate_multiplier, ACTIVATION)
    tl.store(C + row * stride_c + cols, (act * b * out_multiplier).to(C.dtype.element_ty), mask=mask)


@triton.jit
def glu_backward_kernel(
    DC, stride_dc, A, stride_a, B, stride_b, DA, stride_da, DB, stride_db, n_cols, blocks_per_row,
    gate_multiplier, out_multiplier, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    """With g = gate_multiplier, s = out_multiplier: da = dc s b act'(a g) g, db = dc s act(a g).
    DA / DB may alias DC or a dead buffer."""
    gate_multiplier = tl.cast(gate_multiplier, tl.float32)  # fp64 under Inductor: see glu_forward_kernel
    out_multiplier = tl.cast(out_multiplier, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dc = tl.load(DC + row * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = glu_activation(a * gate_multiplier, ACTIVATION)
    dc = dc * out_multiplier
    tl.store(DA + row * stride_da + cols, (dc * b * dact * gate_multiplier).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + row * stride_db + cols, (dc * act).to(DB.dtype.element_ty), mask=mask)


def check_activation(activation, **multipliers):
    """``activation`` is one of tigon's names; each multiplier (by its argument name) a number."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r} "
                         "(tigon.ops.glu.activation_name maps other names)")
    for name, value in multipliers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")


def check_glu_args(a, b, activation):
    """The op's own checks (fake-safe); the callers check the multipliers' types before it."""
    check_activation(activation)
    check_tensor("a", a, min_ndim=1)
    check_tensor("b", b, min_ndim=1)
    if a.shape != b.shape:
        raise ValueError(f"a has shape {tuple(a.shape)} but b has shape {tuple(b.shape)}")
    check_same_dtype(a=a, b=b)
    check_same_device(a=a, b=b)


def glu_forward(a2, b2, activation, out=None, gate_multiplier=1.0, out_multiplier=1.0):
    """a2, b2 [M, I] row-strided -> c [M, I] (written into `out` when given)."""
    c = out if out is not None else new_output(a2.shape, a2.dtype, a2.device)
    if a2.numel():
        n_rows, n_cols, (sa, sb, sc) = _glu_rows(a2, b2, c)
        block, num_warps = glu_launch_config(a2.shape[1])
        blocks_per_row = cdiv(n_cols, block)
        launch(glu_forward_kernel, (n_rows * blocks_per_row,),
            a2, sa, b2, sb, c, sc, n_cols, blocks_per_row, float(gate_multiplier), float(out_multiplier),
            ACTIVATION=ACTIVATIONS[activation], BLOCK=block, num_warps=num_warps,
        )
    return c


def glu_backward(dc2, a2, b2, activation, da_out=None, db_out=None, gate_multiplier=1.0, out_multiplier=1.0):
    """-> (da, db) [M, I]; da_out / db_out let the caller reuse dead buffers (e.g. dc2)."""
    da = da_out if da_out is not None else new_output(a2.shape, a2.dtype, a2.device)
    db = db_out if db_out is not None else new_output(a2.shape, a2.dtype, a2.device)
    if a2.numel():
        n_rows, n_cols, (sdc, sa, sb, sda, sdb) = _glu_rows(dc2, a2, b2, da, db)
        block, num_warps = glu_launch_config(a2.shape[1])
        blocks_per_row = cdiv(n_cols, block)
        launch(glu_backward_kernel, (n_rows * blocks_per_row,),
            dc2, sdc, a2, sa, b2, sb, da, sda, db, sdb, n_cols, blocks_per_row, float(gate_multiplier),
            float(out_multiplier),
            ACTIVATION=ACTIVATIONS[activation], BLOCK=block, num_warps=num_warps,
        )
    return da, db


# ---- custom ops: torch.ops.tigon.glu and its backward (see tigon.ops.rms_norm) ----
#
# The callers (tigon.functional.glu) check the multipliers before the op: its schema would
# refuse a non-number with an error that does not name them.


@kernel_op("tigon::glu", mutates_args=())
def glu_op(a: Tensor, b: Tensor, activation: str, gate_multiplier: float, out_multiplier: float) -> Tensor:
    """c = act(a * gate_multiplier) * b * out_multiplier, contiguous, of a, b [..., I]."""
    check_glu_args(a, b, activation)
    c = glu_forward(as_rows(a), as_rows(b), activation, gate_multiplier=gate_multiplier,
                    out_multiplier=out_multiplier)
    return c.view(a.shape)


@glu_op.register_fake
def _(a, b, activation, gate_multiplier, out_multiplier):
    check_glu_args(a, b, activation)
    return a.new_empty(a.shape)


@kernel_op("tigon::glu_backward", mutates_args=())
def glu_backward_op(dc: Tensor, a: Tensor, b: Tensor, activation: str, gate_multiplier: float,
                    out_multiplier: float) -> tuple[Tensor, Tensor]:
    """(da, db), contiguous, for the gradient dc of glu_op's output; act is recomputed."""
    da, db = glu_backward(as_rows(dc), as_rows(a), as_rows(b), activation, gate_multiplier=gate_multiplier,
                          out_multiplier=out_multiplier)
    return da.view(a.shape), db.view(a.shape)


@glu_backward_op.register_fake
def _(dc, a, b, activation, gate_multiplier, out_multiplier):
    return a.new_empty(a.shape), a.new_empty(a.shape)


def _setup_context(ctx, inputs, output):
    a, b, activation, gate_multiplier, out_multiplier = inputs
    ctx.save_for_backward(a, b)
    ctx.activation, ctx.multipliers = activation, (gate_multiplier, out_multiplier)


def _backward(ctx, dc):
    a, b = ctx.saved_tensors
    da, db = glu_backward_op(dc, a, b, ctx.activation, *ctx.multipliers)
    return da, db, None, None, None


glu_op.register_autograd(_backward, setup_context=_setup_context)
