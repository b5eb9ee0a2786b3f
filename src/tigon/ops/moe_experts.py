"""MoE experts: the routed experts of a sparse MoE layer as grouped GEMMs, forward and backward.

Hugging Face 5.x keeps a layer's experts stacked (``MixtralExperts`` and its kin): x [T, H],
top_k_index [T, K] (int), top_k_weights [T, K], gate_up_proj [E, 2I, H], down_proj [E, H, I]:

    out[t] = sum_k w[t, k] * (act(g) * u) @ down[e]^T (+ down_bias[e]),  e = top_k_index[t, k],
    g, u = the gate and up rows of x[t] @ gate_up[e]^T (+ gate_up_bias[e])

``layout``: "gate_up" (gate rows first, then up: Mixtral, Qwen-MoE, GLM4-MoE) or "interleaved"
(gate, up, gate, up, ...: gpt-oss); ``transposed``: the weights are stored [E, H, 2I] and
[E, I, H] (gpt-oss). act is one of tigon's GLU activations (``tigon.ops.glu``), or
"clamped_swiglu", gpt-oss's (up.clamp(-limit, limit) + 1) * g sigmoid(alpha g) with
g = gate.clamp(max=limit). Index E is HF's "no expert" (skipped, as HF's mask). Any other value
outside [0, E) is an error: in eager mode a ValueError after one host sync (the range check of
cross entropy's labels, skipped with TIGON_CHECK_LABELS=0), and where the host cannot read the
value (traced, captured) or the check is off, a device-side assert that fails the run.

How it runs, with no per-expert Python loop and no other host synchronisation:
- routing (torch ops on the device): the T*K (token, slot) pairs sorted by expert (stable),
  each expert's segment cut into blocks of BLOCK_M rows, and a table block -> (expert, first
  row, end row) for a fixed upper bound of blocks (TK // BLOCK_M + E + 1, the skipped pairs
  being one more "expert"); programs of blocks past the real count exit.
- forward: ``moe_gate_up_kernel`` gathers the rows of x and multiplies them by the expert's gate
  and up rows (two accumulators in one program), writes h = act(g) * u [TK, I] in sorted order,
  and, when a backward will follow, g and u [TK, 2I] (kept instead of h);
  ``moe_scatter_matmul_kernel`` forms w * (h @ down[e]^T + b) and stores each row at its pair's
  place, the sum over K is then a plain reduction (deterministic: no atomics).
- backward: dout's rows are copied once into sorted order (then, for dW_gate_up, x's), so that
  the row-contracting kernels read contiguous ranges. ``moe_down_backward_kernel`` forms
  dy = dout[t] @ down[e] per sorted row and, in its epilogue or (with many rows an expert) in
  ``moe_activation_backward_kernel`` over an fp32 dy, h (recomputed from g, u), the
  routing-weight gradient's partial sums over its columns, w * h (for dW_down) and dg, du
  through the activation's backward;
  ``moe_scatter_matmul_kernel`` again for dx = [dg | du] @ gate_up[e] (un-permuted, summed over
  K); ``moe_expert_grad_kernel`` for dW_gate_up[e] = [dg | du]^T x and dW_down[e] =
  dout^T (w h), a program per (expert, output tile) looping over the expert's rows (and the
  biases' gradients from the same loads).
All matmuls accumulate in fp32; fp32 inputs use tf32 only where torch's matmuls would
(``torch.backends.cuda.matmul.allow_tf32``).
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon import ambient
from tigon.ops._common import (
    capturing,
    cdiv,
    check_same_device,
    check_same_dtype,
    check_tensor,
    contiguous_or_none,
    custom_op,
    fake_grad,
    interpreter_enabled,
    matmul_dtype,
    new_output,
    or_empty,
    traced,
)
from tigon.ops._internals import assert_on_device, launch
from tigon.ops.glu import ACTIVATIONS, activation_name, glu_activation

# The kernels' activation codes: tigon's GLU activations, and gpt-oss's clamped SwiGLU (-1, a
# code the GLU vocabulary does not use: moe_activation tests for it).
CLAMPED_SWIGLU = "clamped_swiglu"
MOE_ACTIVATIONS = {**ACTIVATIONS, CLAMPED_SWIGLU: -1}
assert -1 not in ACTIVATIONS.values()
LAYOUTS = ("gate_up", "interleaved")
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha / swiglu_limit


# ---- launch shapes ----
#
# Rows per block (BLOCK_M) are shared by every kernel of a call (the routing table is cut in
# blocks of that size): 128 when experts average >= 256 rows, else 64, so that the last, ragged
# block of each expert wastes less. Tiles per kernel, (BLOCK_N, BLOCK_K, num_warps, num_stages);
# the expert-gradient kernel's (BLOCK_N, BLOCK_M2, rows per step, warps, stages). The activation's
# backward either runs in down_backward's epilogue (~6 fp32 tiles live: a narrow tile, and the
# GEMM runs at ~310 TFLOP/s on Mixtral's layer) or, split, as its own pass over an fp32 dy
# (BLOCK_R, BLOCK_N, warps): 2 bytes more an element of [TK, I] each way, and a GEMM free to take
# a wide tile. Both sets were found by benchmarks/tuning/tune_moe.py on the H100 (bf16, T 8192,
# forward + backward, one call: benchmarks/results/h100/moe/tune_moe.log): "many rows" on
# Mixtral-8x7B's layer (2048 rows an expert; split: 34.4 -> 31.6 ms), "few rows" on
# Qwen3-30B-A3B's (512 rows an expert: fused, 6.3 -> 6.0 ms; split there is 0.1 ms slower).
# TIGON_MOE_TILES (JSON, read at import) overrides them for a sweep:
# {"block_m": 128, "gate_up": [128, 64, 8, 3], "down": [...], "down_backward": [...],
#  "expert_grad": [128, 128, 64, 8, 3], "activation_backward": [16, 256, 4] or []}.
class Tiles(NamedTuple):
    gate_up: tuple
    down: tuple
    down_backward: tuple
    expert_grad: tuple
    activation_backward: tuple  # (BLOCK_R, BLOCK_N, warps) of the split pass; () fuses it into down_backward


GPU_TILES = {  # least rows an expert (on average) -> tiles
    1024: Tiles(gate_up=(128, 64, 8, 3), down=(256, 64, 8, 3), down_backward=(256, 32, 8, 4),
                expert_grad=(128, 256, 64, 8, 4), activation_backward=(16, 256, 4)),
    0: Tiles(gate_up=(128, 64, 8, 3), down=(256, 64, 8, 3), down_backward=(128, 64, 8, 4),
             expert_grad=(128, 256, 64, 8, 4), activation_backward=()),
}
# fp32 operands: twice the bytes a tile, and no tensor cores without tf32: smaller tiles that fit
# shared memory (227 KiB) and registers.
FP32_TILES = Tiles(gate_up=(64, 32, 4, 3), down=(64, 32, 4, 3), down_backward=(64, 32, 4, 3),
                   expert_grad=(64, 64, 32, 4, 3), activation_backward=())
# The interpreter: small blocks of rows (tl.dot's smallest, 16), so that small test shapes reach
# several blocks per expert and several row steps of the expert-gradient loop; 32 columns a tile
# (each program costs ~50 ms there: sizes above 32 reach several column tiles).
INTERPRETER_TILES = Tiles(gate_up=(32, 32, 1, 1), down=(32, 32, 1, 1), down_backward=(32, 32, 1, 1),
                          expert_grad=(32, 32, 16, 1, 1), activation_backward=(16, 32, 1))
INTERPRETER_BLOCK_M = 16
GROUP_M = 8  # row blocks per group of the grouped (L2-friendly) program order
# Triton's interpreter multiplies 16-bit float operands of tl.dot as integers (numpy has no
# bf16): the kernels upcast them to fp32 there (exact; the accumulation is fp32 anyway).
UPCAST_DOT = interpreter_enabled()


def _checked_overrides(table):
    unknown = set(table) - {"block_m", *Tiles._fields}
    if unknown:
        raise ValueError(f"TIGON_MOE_TILES names unknown entries {sorted(unknown)}; "
                         f"it takes block_m and {', '.join(Tiles._fields)}")
    return dict(table)


_OVERRIDES = _checked_overrides(json.loads(os.environ.get("TIGON_MOE_TILES") or "{}"))


def set_tile_overrides(table) -> None:
    """Replace the TIGON_MOE_TILES overrides (same form; {} for the defaults), for a sweep in
    one process. Not for use inside torch.compile'd code (compiled graphs keep the tiles they
    were traced with)."""
    global _OVERRIDES
    _OVERRIDES = _checked_overrides(table)


def moe_block_m(n_pairs, n_experts) -> int:
    """Rows per routing block for n_pairs (token, expert) pairs over n_experts experts."""
    if interpreter_enabled():
        return INTERPRETER_BLOCK_M
    if "block_m" in _OVERRIDES:
        return int(_OVERRIDES["block_m"])
    return 128 if n_pairs >= 256 * n_experts else 64


def moe_tiles(n_pairs, n_experts, dtype: torch.dtype) -> Tiles:
    """The kernels' tiles for n_pairs pairs over n_experts experts in ``dtype``."""
    if interpreter_enabled():
        tiles = INTERPRETER_TILES
    elif dtype == torch.float32:
        tiles = FP32_TILES
    else:
        tiles = GPU_TILES[max(k for k in GPU_TILES if n_pairs >= k * n_experts)]
    return tiles._replace(**{k: tuple(v) for k, v in _OVERRIDES.items() if k != "block_m"})


def moe_n_blocks(n_pairs, n_experts, block_m):
    """Upper bound of routing blocks: sum over the E + 1 buckets of ceil(rows / BLOCK_M), and no
    more than one per pair (symbolic-safe)."""
    return torch.sym_max(1, torch.sym_min(n_pairs, n_pairs // block_m + n_experts + 1))


def routing_size(n_pairs, n_experts, block_m):
    """Length of the int32 routing table: order [TK], per block expert / first row / end row
    [3 x G], bucket starts [E + 2]."""
    return n_pairs + 3 * moe_n_blocks(n_pairs, n_experts, block_m) + n_experts + 2


def _dot_precision(dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


# ---- kernels ----


@triton.jit
def _grouped_tile(pid, n_blocks, n_tiles, GROUP: tl.constexpr):
    """(row block, column tile) of program pid, GROUP row blocks sweeping each column tile in
    turn: consecutive programs share the weight tile and a few row blocks (L2 reuse)."""
    per_group = GROUP * n_tiles
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_blocks - first, GROUP)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def moe_activation(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """(h, dh/dg, dh/du) in fp32 of the gate g and up u (fp32)."""
    if ACTIVATION == -1:  # gpt-oss's clamped SwiGLU; g sigmoid(alpha g) = silu(alpha g) / alpha
        gc = tl.where(g > limit, limit, g)  # where, not minimum: NaN stays NaN, as torch.clamp
        uc = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        act, dact = glu_activation(gc * alpha, 0)
        act = act / alpha
        h = (uc + 1.0) * act
        dg = tl.where(g <= limit, (uc + 1.0) * dact, 0.0)  # torch.clamp's gradient mask
        du = tl.where((u >= -limit) & (u <= limit), act, 0.0)
    else:
        act, dact = glu_activation(g, ACTIVATION)
        h = act * u
        dg = dact * u
        du = act
    return h, dg, du


@triton.jit
def _block_rows(pid_m, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END, BLOCK_M: tl.constexpr):
    """(expert, sorted rows [BLOCK_M] int64, their mask, their pairs int64) of routing block pid_m."""
    e = tl.load(BLOCK_EXPERT + pid_m)
    row0 = tl.load(BLOCK_ROW + pid_m).to(tl.int64)
    row_end = tl.load(BLOCK_END + pid_m)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    pairs = tl.load(ORDER + rows, mask=row_mask, other=0).to(tl.int64)
    return e, rows, row_mask, pairs


@triton.jit
def moe_gate_up_kernel(
    X, stride_xt, stride_xh, W, stride_we, stride_wg, stride_wk, up_shift, BIAS, bias_step, bias_up,
    GU, HOUT, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END,
    n_blocks, n_experts, top_k, hidden, inter, alpha, limit,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_GU: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """h [TK, I] = act(g) * u for the sorted rows, g / u = x[token] @ W[e]^T's gate / up columns
    (W's gate column j at j * stride_wg, its up column at up_shift further). With STORE_GU, g and u
    (rounded, bias added) go to GU [TK, 2I] as [g | u]; h is formed from the rounded values."""
    alpha = tl.cast(alpha, tl.float32)  # Inductor passes Python floats as fp64
    limit = tl.cast(limit, tl.float32)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_blocks, tl.cdiv(inter, BLOCK_N), GROUP)
    e, rows, row_mask, pairs = _block_rows(pid_m, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END, BLOCK_M)
    if e >= n_experts:  # the skipped pairs' bucket, or a block past the real count
        return
    tokens = pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = X + tokens[:, None] * stride_xt + ks[None, :] * stride_xh
    g_ptrs = W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wg + ks[:, None] * stride_wk
    u_ptrs = g_ptrs + up_shift
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = ks < hidden - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 as integers: fp32 operands there
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_ptrs = BIAS + e.to(tl.int64) * (2 * inter) + cols * bias_step
        acc_g += tl.load(b_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + bias_up, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    g = acc_g.to(HOUT.dtype.element_ty)
    u = acc_u.to(HOUT.dtype.element_ty)
    if STORE_GU:
        gu_ptrs = GU + rows[:, None] * (2 * inter) + cols[None, :]
        tl.store(gu_ptrs, g, mask=mask)
        tl.store(gu_ptrs + inter, u, mask=mask)
    h, _, _ = moe_activation(g.to(tl.float32), u.to(tl.float32), alpha, limit, ACTIVATION)
    tl.store(HOUT + rows[:, None] * inter + cols[None, :], h.to(HOUT.dtype.element_ty), mask=mask)


@triton.jit
def moe_scatter_matmul_kernel(
    A, stride_ar, stride_ak, W, stride_we, stride_wn, stride_wk, a_part2, w_part2, BIAS, SCALE,
    OUT, stride_or, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END,
    n_blocks, n_experts, n_out, k_len,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, TWO_PARTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """OUT[pair] = SCALE[pair] * (A[r] @ W[e]^T + BIAS[e]) for each sorted row r (pair = ORDER[r])
    of expert e; zeros for the skipped pairs' rows. W[e]'s output column n sits at n * stride_wn,
    its contraction index k at k * stride_wk. With TWO_PARTS the contraction also runs over A's
    columns [a_part2, a_part2 + k_len) against W's k at w_part2 + k * stride_wk (the up half)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_blocks, tl.cdiv(n_out, BLOCK_N), GROUP)
    e, rows, row_mask, pairs = _block_rows(pid_m, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END, BLOCK_M)
    if e > n_experts:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    out_ptrs = OUT + pairs[:, None] * stride_or + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if e == n_experts:  # pairs routed to no expert contribute nothing
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=OUT.dtype.element_ty), mask=mask)
        return
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    for part in tl.static_range(2 if TWO_PARTS else 1):
        a_ptrs = A + rows[:, None] * stride_ar + (part * a_part2 + ks)[None, :] * stride_ak
        w_ptrs = w_base + part * w_part2 + ks[:, None] * stride_wk
        for k0 in range(0, k_len, BLOCK_K):
            k_mask = ks < k_len - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(BIAS + e.to(tl.int64) * n_out + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(SCALE + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def moe_down_backward_kernel(
    DOUT, stride_dt, stride_dh, W, stride_we, stride_wk, stride_wn,
    GU, DGU, HW, TOPW, DW_PART, DY, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END,
    n_blocks, n_experts, n_pairs, hidden, inter, alpha, limit,
    ACTIVATION: tl.constexpr, STORE_DGU: tl.constexpr, STORE_HW: tl.constexpr,
    STORE_DW: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """For each sorted row r (pair p, weight w) of expert e and columns n of I: dy = DOUT[r] @ W[e]
    (DOUT: dout's rows in sorted order; W[e]'s H index at k * stride_wk, its I index at n *
    stride_wn); h, dh/dg, dh/du recomputed from GU; DW_PART[pid_n, p] = sum_n dy h; HW = w h;
    DGU = [w dy dh/dg | w dy dh/du]. The skipped pairs get zeros in DW_PART (their other rows are
    never read). With SPLIT only dy goes to DY [TK, I] fp32 (sorted rows):
    ``moe_activation_backward_kernel`` does the rest. (The down bias's share of the routing
    weights' gradient, dout . bias[e], is not summed here: reducing DOUT's tile in the loop beside
    the dot made triton 3.6 on the H100 return a wrong dy with 128 x 64 tiles.)"""
    alpha = tl.cast(alpha, tl.float32)
    limit = tl.cast(limit, tl.float32)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_blocks, tl.cdiv(inter, BLOCK_N), GROUP)
    e, rows, row_mask, pairs = _block_rows(pid_m, ORDER, BLOCK_EXPERT, BLOCK_ROW, BLOCK_END, BLOCK_M)
    if e > n_experts or (SPLIT and e == n_experts):
        return
    if e == n_experts:
        if STORE_DW:
            tl.store(DW_PART + pid_n.to(tl.int64) * n_pairs + pairs, tl.zeros((BLOCK_M,), dtype=tl.float32),
                     mask=row_mask)
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = DOUT + rows[:, None] * stride_dt + ks[None, :] * stride_dh
    w_ptrs = W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = ks < hidden - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_dh
        w_ptrs += BLOCK_K * stride_wk
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        tl.store(DY + rows[:, None] * inter + cols[None, :], acc.to(DY.dtype.element_ty), mask=mask)
    else:
        _activation_backward(acc, rows, row_mask, pairs, cols, col_mask, pid_n, GU, DGU, HW, TOPW, DW_PART,
                             n_pairs, inter, alpha, limit, ACTIVATION, STORE_DGU, STORE_HW, STORE_DW)


@triton.jit
def _activation_backward(dy, rows, row_mask, pairs, cols, col_mask, pid_n, GU, DGU, HW, TOPW, DW_PART,
                         n_pairs, inter, alpha, limit, ACTIVATION: tl.constexpr, STORE_DGU: tl.constexpr,
                         STORE_HW: tl.constexpr, STORE_DW: tl.constexpr):
    """The down-projection backward's activation part for sorted rows x columns of I, from dy
    (fp32): DW_PART, HW and DGU as ``moe_down_backward_kernel`` describes them."""
    mask = row_mask[:, None] & col_mask[None, :]
    gu_ptrs = GU + rows[:, None] * (2 * inter) + cols[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    h, dh_dg, dh_du = moe_activation(g, u, alpha, limit, ACTIVATION)
    h = h.to(GU.dtype.element_ty).to(tl.float32)  # the forward's h, rounded as the down matmul read it
    w = tl.load(TOPW + pairs, mask=row_mask, other=0.0).to(tl.float32)
    if STORE_DW:
        part = tl.sum(tl.where(mask, dy * h, 0.0), axis=1)
        tl.store(DW_PART + pid_n.to(tl.int64) * n_pairs + pairs, part, mask=row_mask)
    if STORE_HW:
        tl.store(HW + rows[:, None] * inter + cols[None, :], (h * w[:, None]).to(HW.dtype.element_ty), mask=mask)
    if STORE_DGU:
        dh = dy * w[:, None]
        dgu_ptrs = DGU + rows[:, None] * (2 * inter) + cols[None, :]
        tl.store(dgu_ptrs, (dh * dh_dg).to(DGU.dtype.element_ty), mask=mask)
        tl.store(dgu_ptrs + inter, (dh * dh_du).to(DGU.dtype.element_ty), mask=mask)


@triton.jit
def moe_activation_backward_kernel(
    DY, GU, DGU, HW, TOPW, DW_PART, ORDER, BUCKET_START,
    n_experts, n_pairs, inter, alpha, limit,
    ACTIVATION: tl.constexpr, STORE_DGU: tl.constexpr, STORE_HW: tl.constexpr,
    STORE_DW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The second half of a SPLIT ``moe_down_backward_kernel``, over [BLOCK_R sorted rows,
    BLOCK_N columns of I] tiles: dy from DY (fp32); zeros in DW_PART for the skipped pairs' rows
    (those past the routed ones), whose other rows are never read."""
    alpha = tl.cast(alpha, tl.float32)
    limit = tl.cast(limit, tl.float32)
    pid_n = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_routed = tl.load(BUCKET_START + n_experts)
    in_table = rows < n_pairs
    routed = rows < n_routed
    pairs = tl.load(ORDER + rows, mask=in_table, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    dy = tl.load(DY + rows[:, None] * inter + cols[None, :], mask=routed[:, None] & col_mask[None, :],
                 other=0.0).to(tl.float32)
    if STORE_DW:  # the skipped pairs' partial sums: zeros
        tl.store(DW_PART + pid_n.to(tl.int64) * n_pairs + pairs, tl.zeros((BLOCK_R,), dtype=tl.float32),
                 mask=in_table & ~routed)
    _activation_backward(dy, rows, routed, pairs, cols, col_mask, pid_n, GU, DGU, HW, TOPW, DW_PART,
                         n_pairs, inter, alpha, limit, ACTIVATION, STORE_DGU, STORE_HW, STORE_DW)


@triton.jit
def moe_expert_grad_kernel(
    A, stride_ar, stride_an, B, stride_br, stride_bm, SCALE, OUT, stride_oe, stride_on, stride_om, out_part2,
    DBIAS, bias_step, bias_part2, ORDER, BUCKET_START,
    n_experts, n_len, m_len,
    TWO_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """OUT[e] = sum over expert e's sorted rows r of A[r]^T B[r], A and B both in sorted row order
    (contiguous row ranges: plain strided loads the compiler pipelines), [n_len (x 2 with
    TWO_PARTS), m_len] per expert. A's column n of part q lands in OUT's row n * stride_on + q *
    out_part2. With HAS_BIAS the programs of column tile 0 also write DBIAS[e] = sum_r
    (SCALE[ORDER[r]] with SCALE_BIAS) A[r]. An expert with no rows gets zeros."""
    n_tiles_part = tl.cdiv(n_len, BLOCK_N)
    n_tiles = n_tiles_part * (2 if TWO_PARTS else 1)
    m_tiles = tl.cdiv(m_len, BLOCK_M)
    pid = tl.program_id(0)
    e = pid // (n_tiles * m_tiles)
    tile_n, tile_m = _grouped_tile(pid % (n_tiles * m_tiles), n_tiles, m_tiles, GROUP)
    part = tile_n // n_tiles_part
    ns = (tile_n % n_tiles_part) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < n_len
    ms = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < m_len
    start = tl.load(BUCKET_START + e)
    end = tl.load(BUCKET_START + e + 1)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    bias_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # A's tile loaded transposed, [BLOCK_N, BLOCK_K]: a column-major operand of the dot.
    a_ptrs = A + (start + ks.to(tl.int64))[None, :] * stride_ar + (part * n_len + ns)[:, None] * stride_an
    b_ptrs = B + (start + ks.to(tl.int64))[:, None] * stride_br + ms[None, :] * stride_bm
    for r0 in range(start, end, BLOCK_K):
        row_mask = ks < end - r0
        a_t = tl.load(a_ptrs, mask=n_mask[:, None] & row_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=row_mask[:, None] & m_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a_t.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a_t.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            af = a_t.to(tl.float32)
            if SCALE_BIAS:
                pairs = tl.load(ORDER + r0 + ks, mask=row_mask, other=0).to(tl.int64)
                af *= tl.load(SCALE + pairs, mask=row_mask, other=0.0).to(tl.float32)[None, :]
            bias_acc += tl.sum(af, axis=1)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
    e64 = e.to(tl.int64)
    out_rows = ns.to(tl.int64) * stride_on + part * out_part2
    tl.store(OUT + e64 * stride_oe + out_rows[:, None] + ms[None, :] * stride_om, acc.to(OUT.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])
    if HAS_BIAS and tile_m == 0:
        tl.store(DBIAS + e64 * (n_len * (2 if TWO_PARTS else 1)) + ns * bias_step + part * bias_part2,
                 bias_acc.to(DBIAS.dtype.element_ty), mask=n_mask)


# ---- launchers ----


class Geometry(NamedTuple):
    """Where gate_up_proj keeps its gate and up rows: gate j at row j * gate_step, up j at row
    up_row + j * gate_step (rows along the 2I axis, whatever its stride)."""
    gate_step: int
    up_row: int


def _geometry(layout, inter) -> Geometry:
    return Geometry(2, 1) if layout == "interleaved" else Geometry(1, inter)


def _gate_up_axes(gate_up_proj, transposed):
    """(stride along the 2I rows, stride along H) of gate_up_proj."""
    return (gate_up_proj.stride(2), gate_up_proj.stride(1)) if transposed else \
        (gate_up_proj.stride(1), gate_up_proj.stride(2))


def _down_axes(down_proj, transposed):
    """(stride along H, stride along I) of down_proj."""
    return (down_proj.stride(2), down_proj.stride(1)) if transposed else (down_proj.stride(1), down_proj.stride(2))


def _routing_views(routing, n_pairs, n_blocks):
    """(order, block_expert, block_row, block_end, bucket_start) of the packed routing table."""
    g = n_blocks
    order = routing[:n_pairs]
    block = routing[n_pairs:n_pairs + 3 * g]
    return order, block[:g], block[g:2 * g], block[2 * g:], routing[n_pairs + 3 * g:]


def moe_routing(top_k_index, n_experts, block_m):
    """The packed int32 routing table (see ``routing_size``) of top_k_index [T, K], built on the
    device (the index range check aside: see the module docstring). Pairs are sorted by expert,
    stably (token order within an expert); indices outside [0, E) form bucket E (skipped)."""
    ids = top_k_index.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    n_pairs = ids.shape[0]
    device = ids.device
    # As cross entropy's labels (one switch, TIGON_CHECK_LABELS): a host check, which syncs, in
    # eager mode; a device-side assert where the host cannot read the value (traced, captured)
    # or the check is switched off (it fails the run: the CUDA context is lost).
    in_range = ((ids >= 0) & (ids <= n_experts)).all()
    message = f"top_k_index must lie in [0, {n_experts}] ({n_experts}: no expert)"
    if ids.is_meta:  # a memory-planning trace: no values to check
        pass
    elif ambient.CHECK_LABELS and not traced(ids) and not capturing():
        if not bool(in_range):
            raise ValueError(message + " (set TIGON_CHECK_LABELS=0 to skip this check, which syncs with the GPU)")
    else:
        assert_on_device(in_range, message)
    ids = torch.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    sorted_ids, order = torch.sort(ids, stable=True)
    bucket_start = torch.searchsorted(sorted_ids, torch.arange(n_experts + 2, device=device, dtype=ids.dtype))
    counts = bucket_start[1:] - bucket_start[:-1]  # [E + 1]
    n_blocks_of = (counts + (block_m - 1)) // block_m
    block_end = torch.cumsum(n_blocks_of, 0)
    n_blocks = moe_n_blocks(n_pairs, n_experts, block_m)
    blocks = torch.arange(n_blocks, device=device)
    block_expert = torch.searchsorted(block_end, blocks, right=True)  # E + 1: past the real blocks
    bucket = block_expert.clamp(max=n_experts)
    block_row = bucket_start[bucket] + (blocks - (block_end - n_blocks_of)[bucket]) * block_m
    block_row_end = bucket_start[bucket + 1]
    return torch.cat([order, block_expert, block_row, block_row_end, bucket_start]).to(torch.int32)


def _launch_scatter_matmul(a, a_strides, w, w_strides, a_part2, w_part2, bias, scale, out, routing_views, n_blocks,
                           n_experts, n_out, k_len, two_parts, block_m, tiles, precision):
    order, block_expert, block_row, block_end, _ = routing_views
    block_n, block_k, num_warps, num_stages = tiles.down
    launch(moe_scatter_matmul_kernel, (n_blocks * cdiv(n_out, block_n),),
           a, *a_strides, w, *w_strides, a_part2, w_part2,
           bias if bias is not None else w, scale if scale is not None else w,
           out, out.stride(0), order, block_expert, block_row, block_end,
           n_blocks, n_experts, n_out, k_len,
           HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, TWO_PARTS=two_parts, DOT_PRECISION=precision,
           UPCAST=UPCAST_DOT,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M, num_warps=num_warps,
           num_stages=num_stages)


def _sum_over_slots(pair_rows, n_tokens, top_k, out=None):
    """[T * K, N] rows in pair order summed over K -> [T, N] (fp32 accumulation, one rounding)."""
    return torch.sum(pair_rows.view(n_tokens, top_k, -1), dim=1, out=out)


def moe_experts_forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                        layout, transposed, alpha, limit, compute_grad):
    """-> (out [T, H], g|u [TK, 2I] or None, routing int32) for checked arguments, top_k_weights
    and the biases contiguous."""
    n_tokens, hidden = x.shape
    top_k = top_k_index.shape[1]
    n_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    n_pairs = n_tokens * top_k
    block_m = moe_block_m(n_pairs, n_experts)
    tiles = moe_tiles(n_pairs, n_experts, x.dtype)
    n_blocks = moe_n_blocks(n_pairs, n_experts, block_m)
    routing = moe_routing(top_k_index, n_experts, block_m)
    gu = new_output((n_pairs, 2 * inter), x.dtype, x.device) if compute_grad else None
    if not (n_pairs and hidden):  # nothing to multiply: zeros
        return x.new_zeros((n_tokens, hidden)), gu.zero_() if gu is not None else None, routing
    views = _routing_views(routing, n_pairs, n_blocks)
    order, block_expert, block_row, block_end, _ = views
    precision = _dot_precision(x.dtype)
    geo = _geometry(layout, inter)
    h = new_output((n_pairs, inter), x.dtype, x.device)
    rows_stride, h_stride = _gate_up_axes(gate_up_proj, transposed)
    block_n, block_k, num_warps, num_stages = tiles.gate_up
    launch(moe_gate_up_kernel, (n_blocks * cdiv(inter, block_n),),
           x, x.stride(0), x.stride(1), gate_up_proj, gate_up_proj.stride(0), geo.gate_step * rows_stride, h_stride,
           geo.up_row * rows_stride, gate_up_bias if gate_up_bias is not None else x, geo.gate_step, geo.up_row,
           gu if gu is not None else h, h, order, block_expert, block_row, block_end,
           n_blocks, n_experts, top_k, hidden, inter, alpha, limit,
           ACTIVATION=MOE_ACTIVATIONS[activation], HAS_BIAS=gate_up_bias is not None, STORE_GU=gu is not None,
           DOT_PRECISION=precision, UPCAST=UPCAST_DOT, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
           num_warps=num_warps, num_stages=num_stages)
    # With one slot a token, its pair's row is its output row; else rows in pair order, summed over K.
    pair_rows = new_output((n_pairs, hidden), x.dtype, x.device)
    h_axis, i_axis = _down_axes(down_proj, transposed)
    _launch_scatter_matmul(h, (h.stride(0), 1), down_proj, (down_proj.stride(0), h_axis, i_axis), 0, 0, down_bias,
                           top_k_weights, pair_rows, views, n_blocks, n_experts, hidden, inter, False, block_m, tiles,
                           precision)
    out = pair_rows if top_k == 1 else _sum_over_slots(pair_rows, n_tokens, top_k)
    return out, gu, routing


def moe_experts_backward(dout, x, top_k_weights, gu, routing, gate_up_proj, down_proj, gate_up_bias, down_bias,
                         activation, layout, transposed, alpha, limit, needs):
    """Gradients (dx, dtop_k_weights, dgate_up_proj, ddown_proj, dgate_up_bias, ddown_bias), None
    where ``needs`` (six bools, in that order; a bias's only when the bias is given) is False."""
    need_x, need_w, need_gu, need_down, need_gub, need_db = needs
    n_tokens, hidden = x.shape
    top_k = top_k_weights.shape[1]
    n_experts = gate_up_proj.shape[0]
    inter = gu.shape[1] // 2
    n_pairs = n_tokens * top_k
    if not (n_pairs and hidden):  # an empty output: zero gradients
        return tuple(t.new_zeros(t.shape) if need else None for t, need in zip(
            (x, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias), needs))
    block_m = moe_block_m(n_pairs, n_experts)
    tiles = moe_tiles(n_pairs, n_experts, x.dtype)
    n_blocks = moe_n_blocks(n_pairs, n_experts, block_m)
    views = _routing_views(routing, n_pairs, n_blocks)
    order, block_expert, block_row, block_end, bucket_start = views
    precision = _dot_precision(x.dtype)
    geo = _geometry(layout, inter)
    dx = dw = dgate_up = ddown = dgate_up_bias = ddown_bias = None

    # The weight gradients contract over each expert's rows: dout's and x's rows are copied once
    # into sorted order (a gather the size of dout, then of x), so that every kernel below reads
    # contiguous row ranges; the dx kernel's rows are sorted already.
    sorted_tokens = order.to(torch.int64) // top_k
    dout_sorted = dout.index_select(0, sorted_tokens)

    # dout @ down[e] and the activation's backward: d[g | u], w h, the routing weights' partial sums.
    store_dgu = need_x or need_gu or need_gub
    store_hw = need_down or need_db
    dgu = new_output((n_pairs, 2 * inter), x.dtype, x.device) if store_dgu else None
    hw = new_output((n_pairs, inter), x.dtype, x.device) if store_hw else None
    block_n, block_k, num_warps, num_stages = tiles.down_backward
    n_tiles_i = cdiv(inter, block_n)
    split = bool(tiles.activation_backward)
    if split:  # dy [TK, I] in fp32 (the routing weights' gradient sums dy h: no rounding before it)
        block_r, block_n_act, num_warps_act = tiles.activation_backward
        n_tiles_i = cdiv(inter, block_n_act)
        dy = new_output((n_pairs, inter), torch.float32, x.device)
    dw_part = new_output((n_tiles_i, n_pairs), torch.float32, x.device) if need_w else None
    h_axis, i_axis = _down_axes(down_proj, transposed)
    launch(moe_down_backward_kernel, (n_blocks * cdiv(inter, block_n),),
           dout_sorted, dout_sorted.stride(0), dout_sorted.stride(1), down_proj, down_proj.stride(0), h_axis, i_axis,
           gu, dgu if dgu is not None else gu, hw if hw is not None else gu, top_k_weights,
           dw_part if dw_part is not None else gu, dy if split else gu, order, block_expert, block_row, block_end,
           n_blocks, n_experts, n_pairs, hidden, inter, alpha, limit,
           ACTIVATION=MOE_ACTIVATIONS[activation], STORE_DGU=store_dgu,
           STORE_HW=store_hw, STORE_DW=need_w, SPLIT=split, DOT_PRECISION=precision, UPCAST=UPCAST_DOT,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M, num_warps=num_warps,
           num_stages=num_stages)
    if split:
        launch(moe_activation_backward_kernel, (cdiv(n_pairs, block_r), n_tiles_i),
               dy, gu, dgu if dgu is not None else gu, hw if hw is not None else gu, top_k_weights,
               dw_part if dw_part is not None else gu, order, bucket_start, n_experts, n_pairs, inter, alpha, limit,
               ACTIVATION=MOE_ACTIVATIONS[activation], STORE_DGU=store_dgu,
               STORE_HW=store_hw, STORE_DW=need_w, BLOCK_R=block_r, BLOCK_N=block_n_act, num_warps=num_warps_act)
        dy = None
    if need_w:  # partial sums over I's column tiles, in pair order: a fixed-order sum
        dw = dw_part.sum(0).view(n_tokens, top_k)
        if down_bias is not None:  # + dout[t] . down_bias[e] (0 for the skipped pairs), from [T, E + 1]
            rows = torch.arange(n_pairs, device=x.device, dtype=bucket_start.dtype)
            pair_expert = torch.empty(n_pairs, device=x.device, dtype=torch.int64)
            pair_expert[order.long()] = torch.searchsorted(bucket_start[1:], rows, right=True)
            bias_dot = dout.float() @ torch.nn.functional.pad(down_bias.float(), (0, 0, 0, 1)).T
            dw = dw + bias_dot.gather(1, pair_expert.view(n_tokens, top_k))
        dw = dw.to(top_k_weights.dtype)

    block_n, block_m2, block_k, num_warps, num_stages = tiles.expert_grad
    if need_down or need_db:  # dW_down[e] = dout^T (w h) over the expert's rows; its bias: sums of w dout
        ddown = new_output(down_proj.shape, down_proj.dtype, x.device)
        ddown_bias = new_output(down_bias.shape, down_bias.dtype, x.device) if need_db else None
        out_h, out_i = _down_axes(ddown, transposed)
        launch(moe_expert_grad_kernel, (n_experts * cdiv(hidden, block_n) * cdiv(inter, block_m2),),
               dout_sorted, dout_sorted.stride(0), dout_sorted.stride(1), hw, hw.stride(0), 1, top_k_weights, ddown,
               ddown.stride(0), out_h, out_i, 0, ddown_bias if need_db else ddown, 1, 0, order, bucket_start,
               n_experts, hidden, inter,
               TWO_PARTS=False, HAS_BIAS=need_db, SCALE_BIAS=True,
               DOT_PRECISION=precision, UPCAST=UPCAST_DOT, BLOCK_N=block_n, BLOCK_M=block_m2, BLOCK_K=block_k,
               GROUP=GROUP_M, num_warps=num_warps, num_stages=num_stages)
        if not need_down:
            ddown = None
    dout_sorted = hw = None  # freed before dx's [TK, H] rows are allocated: a lower peak

    if need_x:  # d[g | u] @ gate_up[e], un-permuted and summed over K
        rows_stride, h_stride = _gate_up_axes(gate_up_proj, transposed)
        pair_rows = new_output((n_pairs, hidden), x.dtype, x.device)
        _launch_scatter_matmul(dgu, (dgu.stride(0), 1), gate_up_proj,
                               (gate_up_proj.stride(0), h_stride, geo.gate_step * rows_stride), inter,
                               geo.up_row * rows_stride, None, None, pair_rows, views, n_blocks, n_experts, hidden,
                               inter, True, block_m, tiles, precision)
        dx = pair_rows if top_k == 1 else _sum_over_slots(pair_rows, n_tokens, top_k)
        pair_rows = None

    if need_gu or need_gub:  # dW_gate_up[e] = d[g | u]^T x over the expert's rows; its bias: column sums
        x_sorted = x.index_select(0, sorted_tokens)
        dgate_up = new_output(gate_up_proj.shape, gate_up_proj.dtype, x.device)
        dgate_up_bias = new_output(gate_up_bias.shape, gate_up_bias.dtype, x.device) if need_gub else None
        out_rows, out_h = _gate_up_axes(dgate_up, transposed)
        launch(moe_expert_grad_kernel, (n_experts * 2 * cdiv(inter, block_n) * cdiv(hidden, block_m2),),
               dgu, dgu.stride(0), 1, x_sorted, x_sorted.stride(0), x_sorted.stride(1), x, dgate_up,
               dgate_up.stride(0), geo.gate_step * out_rows, out_h, geo.up_row * out_rows,
               dgate_up_bias if need_gub else dgate_up, geo.gate_step, geo.up_row, order, bucket_start,
               n_experts, inter, hidden,
               TWO_PARTS=True, HAS_BIAS=need_gub, SCALE_BIAS=False,
               DOT_PRECISION=precision, UPCAST=UPCAST_DOT, BLOCK_N=block_n, BLOCK_M=block_m2, BLOCK_K=block_k,
               GROUP=GROUP_M, num_warps=num_warps, num_stages=num_stages)
        if not need_gu:
            dgate_up = None
    return dx, dw, dgate_up, ddown, dgate_up_bias, ddown_bias


# ---- argument checks ----


def moe_options(activation, layout, transposed, alpha, limit):
    """(activation, layout, transposed, alpha, limit) checked; activation as tigon names it (HF
    aliases accepted), alpha / limit gpt-oss's defaults for "clamped_swiglu" (only it takes them)."""
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {activation!r}")
    if activation != CLAMPED_SWIGLU:
        activation = activation_name(activation)
        for name, value in (("alpha", alpha), ("limit", limit)):
            if value is not None:
                raise ValueError(f"{name} applies to activation={CLAMPED_SWIGLU!r} only, not {activation!r}")
        alpha, limit = 1.0, 0.0
    else:
        alpha = GPT_OSS_ALPHA if alpha is None else alpha
        limit = GPT_OSS_LIMIT if limit is None else limit
        for name, value in (("alpha", alpha), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
        if alpha == 0:
            raise ValueError("alpha must not be 0")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed must be a bool, got {transposed!r}")
    return activation, layout, transposed, float(alpha), float(limit)


def check_moe_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
                   layout, transposed):
    """The op's tensor checks (fake-safe): shapes, dtypes, devices."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_tensor("hidden_states", x, ndim=2)
    check_tensor("top_k_index", top_k_index, ndim=2, floating=False)
    if top_k_index.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"top_k_index must be an integer tensor of expert indices, got dtype {top_k_index.dtype}")
    check_tensor("top_k_weights", top_k_weights, ndim=2)
    check_tensor("gate_up_proj", gate_up_proj, ndim=3)
    check_tensor("down_proj", down_proj, ndim=3)
    n_tokens, hidden = x.shape
    if top_k_index.shape[0] != n_tokens:
        raise ValueError(f"top_k_index has shape {tuple(top_k_index.shape)}; for hidden_states "
                         f"{tuple(x.shape)} it must be [{n_tokens}, K]")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights has shape {tuple(top_k_weights.shape)} but top_k_index has "
                         f"{tuple(top_k_index.shape)}")
    n_experts = gate_up_proj.shape[0]
    rows, cols = (gate_up_proj.shape[2], gate_up_proj.shape[1]) if transposed else gate_up_proj.shape[1:]
    form = "[E, H, 2I] (transposed)" if transposed else "[E, 2I, H]"
    if n_experts == 0 or cols != hidden or rows == 0 or rows % 2:
        raise ValueError(f"gate_up_proj has shape {tuple(gate_up_proj.shape)}; it must be {form} with E >= 1, "
                         f"H = {hidden} (hidden_states' last dim) and an even 2I > 0")
    inter = rows // 2
    want = (n_experts, inter, hidden) if transposed else (n_experts, hidden, inter)
    if tuple(down_proj.shape) != want:
        raise ValueError(f"down_proj has shape {tuple(down_proj.shape)}; for gate_up_proj "
                         f"{tuple(gate_up_proj.shape)} it must be {list(want)}")
    for name, bias, size in (("gate_up_bias", gate_up_bias, 2 * inter), ("down_bias", down_bias, hidden)):
        if bias is not None:
            check_tensor(name, bias, ndim=2)
            if tuple(bias.shape) != (n_experts, size):
                raise ValueError(f"{name} has shape {tuple(bias.shape)}; it must be [{n_experts}, {size}]")
    check_same_dtype(hidden_states=x, gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_bias=gate_up_bias,
                     down_bias=down_bias)
    check_same_device(hidden_states=x, top_k_index=top_k_index, top_k_weights=top_k_weights,
                      gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_bias=gate_up_bias, down_bias=down_bias)


# ---- custom ops: torch.ops.tigon.moe_experts and its backward (see tigon.ops.rms_norm) ----
#
# The forward returns (out, g|u, routing): the last two are what its backward reads (g|u empty
# without compute_grad), marked non-differentiable. The caller (tigon.functional.moe_experts)
# checks the options before the op: its schema's errors would not name them.


# Plain custom ops, not kernel_op's triton_op: Inductor's pattern matcher fails an assertion on
# this op's traced body (torch 2.11, H100), so torch.compile keeps it one opaque node.
@custom_op("tigon::moe_experts", mutates_args=())
def moe_experts_op(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                   down_proj: Tensor, gate_up_bias: Tensor | None, down_bias: Tensor | None, activation: str,
                   layout: str, transposed: bool, alpha: float, limit: float,
                   compute_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out [T, H] in hidden_states' dtype, g|u [T*K, 2I] (empty without compute_grad), routing
    int32) of hidden_states [T, H] routed by top_k_index / top_k_weights [T, K]."""
    check_moe_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                   activation, layout, transposed)
    out, gu, routing = moe_experts_forward(
        hidden_states, top_k_index, top_k_weights.contiguous(), gate_up_proj, down_proj,
        contiguous_or_none(gate_up_bias), contiguous_or_none(down_bias), activation, layout, transposed, alpha, limit,
        compute_grad)
    return out, or_empty(gu, hidden_states), routing


@moe_experts_op.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, layout,
      transposed, alpha, limit, compute_grad):
    check_moe_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                   activation, layout, transposed)
    n_pairs = hidden_states.shape[0] * top_k_index.shape[1]
    n_experts = gate_up_proj.shape[0]
    inter = (down_proj.shape[1] if transposed else down_proj.shape[2])
    gu_shape = (n_pairs, 2 * inter) if compute_grad else (0,)
    block_m = moe_block_m(n_pairs, n_experts)
    return (hidden_states.new_empty(hidden_states.shape), hidden_states.new_empty(gu_shape),
            top_k_index.new_empty(routing_size(n_pairs, n_experts, block_m), dtype=torch.int32))


@custom_op("tigon::moe_experts_backward", mutates_args=())
def moe_experts_backward_op(grad_out: Tensor, hidden_states: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                            routing: Tensor, gate_up_proj: Tensor, down_proj: Tensor, gate_up_bias: Tensor | None,
                            down_bias: Tensor | None, activation: str, layout: str, transposed: bool, alpha: float,
                            limit: float, need_hidden_states: bool, need_top_k_weights: bool, need_gate_up_proj: bool,
                            need_down_proj: bool, need_gate_up_bias: bool,
                            need_down_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of moe_experts_op's output: (hidden_states, top_k_weights, gate_up_proj,
    down_proj, gate_up_bias, down_bias), contiguous, each empty where not asked for."""
    params = (hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    needs = _needs(params, need_hidden_states, need_top_k_weights, need_gate_up_proj, need_down_proj,
                   need_gate_up_bias, need_down_bias)
    grads = moe_experts_backward(grad_out, hidden_states, top_k_weights.contiguous(), gate_up, routing, gate_up_proj,
                                 down_proj, contiguous_or_none(gate_up_bias), contiguous_or_none(down_bias), activation,
                                 layout, transposed, alpha, limit, needs)
    return tuple(or_empty(g, hidden_states) for g in grads)


@moe_experts_backward_op.register_fake
def _(grad_out, hidden_states, top_k_weights, gate_up, routing, gate_up_proj, down_proj, gate_up_bias, down_bias,
      activation, layout, transposed, alpha, limit, *need):
    params = (hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    return tuple(fake_grad(p, n, hidden_states) for p, n in zip(params, _needs(params, *need)))


def _needs(params, *need):
    return tuple(bool(n) and p is not None for p, n in zip(params, need))


def _setup_context(ctx, inputs, output):
    x, _, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias = inputs[:7]
    ctx.set_materialize_grads(False)  # the saved outputs' gradients arrive as None
    _, gu, routing = output
    ctx.mark_non_differentiable(gu, routing)
    ctx.save_for_backward(x, top_k_weights, gu, routing)
    ctx.params = (gate_up_proj, down_proj, gate_up_bias, down_bias)  # parameters: kept, not saved
    ctx.options = tuple(inputs[7:12])
    ctx.compute_grad = inputs[12]


def _backward(ctx, grad_out, _grad_gu, _grad_routing):
    if grad_out is None:
        return (None,) * 13
    if not ctx.compute_grad:
        raise RuntimeError("moe_experts ran with compute_grad=False (it kept nothing for a backward)")
    x, top_k_weights, gu, routing = ctx.saved_tensors
    n = ctx.needs_input_grad
    need = (n[0], n[2], n[3], n[4], n[5], n[6])
    grads = moe_experts_backward_op(grad_out, x, top_k_weights, gu, routing, *ctx.params, *ctx.options, *need)
    dx, dw, dgu, ddown, dgub, ddb = (g if want else None for g, want in zip(grads, need))
    return dx, None, dw, dgu, ddown, dgub, ddb, None, None, None, None, None, None


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias=None,
                down_bias=None, activation="silu", layout="gate_up", transposed=False, alpha=None, limit=None):
    """``tigon.functional.moe_experts`` (see there): options checked, leading dims flattened,
    autocast's dtype applied (the output in hidden_states' dtype, as HF's experts)."""
    options = moe_options(activation, layout, transposed, alpha, limit)
    check_tensor("hidden_states", hidden_states, min_ndim=1)  # before matmul_dtype: a float64 x named as such
    check_tensor("top_k_weights", top_k_weights, min_ndim=1)
    check_tensor("top_k_index", top_k_index, min_ndim=1, floating=False)
    if top_k_index.shape[:-1] != hidden_states.shape[:-1]:
        raise ValueError(f"top_k_index has shape {tuple(top_k_index.shape)}; for hidden_states "
                         f"{tuple(hidden_states.shape)} it must be [*hidden_states.shape[:-1], K]")
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    index = top_k_index.reshape(-1, top_k_index.shape[-1])
    weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
    dtype = matmul_dtype(x, gate_up_proj=gate_up_proj, down_proj=down_proj)
    params = [gate_up_proj, down_proj, gate_up_bias, down_bias]
    if x.dtype != dtype or any(p is not None and p.dtype != dtype for p in params):  # autocast
        x = x.to(dtype)
        params = [p if p is None or not p.is_floating_point() else p.to(dtype) for p in params]
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                           for t in (x, weights, *params))
    out = moe_experts_op(x, index, weights, *params, *options, grad)[0]
    return out.to(hidden_states.dtype).view(hidden_states.shape)
