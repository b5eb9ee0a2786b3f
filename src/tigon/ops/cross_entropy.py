"""Cross entropy over logits [N, V] with the gradient computed in the forward pass.

One program per row: a first pass over the row computes the row maximum and the sum of
exponentials online (and, as asked, the smoothing sum, the argmax for token accuracy and
predicted tokens); a second pass writes d loss / d logits, into a new buffer or, with
``inplace`` (what FLCE and the patched models use on logits they own), over the logits
themselves (no [N, V] allocation). The first pass asks L2 to keep the row (evict_last), so
the second pass mostly reads it from L2 rather than HBM.

Loss per non-ignored row i, with class weights w (ones if none), smoothing eps, z = logits
(after tanh soft-capping if ``softcap``), lse = logsumexp(z):
    ce_i = (1 - eps) w[y_i] (lse - z[y_i]) + eps / V * sum_j w_j (lse - z_j)   (as torch)
    zl_i = lse_square_scale * lse^2                                              (z-loss)
With ``use_token_scaling`` both are multiplied by p_i(y_i) (detached; Liger's option).
"mean" divides the ce terms by sum_i w[y_i] and the z-loss terms by the number of
non-ignored rows; "sum" adds; "none" returns per-row values. An all-ignored batch gives a
loss of 0 and a zero gradient. ``ignore_index`` may be any int, inside [0, V) or not.

The gradient is formed once, for grad_output = 1; the backward scales it by grad_output, in
place when autograd frees the graph after that backward, into a new buffer when the graph is
retained (so a second backward over it is exact) or when torch.compile traces the backward.

Custom ops: ``torch.ops.tigon.cross_entropy`` returns that gradient as an extra output, saved
for its registered backward; ``tigon::cross_entropy_`` writes it over the logits (eager
``inplace=True``, with ``CrossEntropyOverLogits`` as its autograd).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon import ambient
from tigon.ambient import thread_flag
from tigon.ops._common import (
    capturing,
    cdiv,
    check_same_device,
    check_tensor,
    custom_op,
    fake_grad,
    kernel_op,
    new_output,
    next_pow2,
    or_empty,
    traced,
)
from tigon.ops._internals import assert_on_device, graph_retained, launch
from tigon.ops._jit_math import tanh_and_sech2

REDUCTIONS = ("mean", "sum", "none")

@contextlib.contextmanager
def labels_checked(target, n_classes, ignore_index):
    """Check target's labels against [0, n_classes) now, once for a whole batch (one host sync),
    and skip the per-call check of the linear_token_logps calls inside the block: a chunked
    loss calls it once or twice a chunk, and each check would make the host wait for the GPU,
    which then idles while the host prepares the next chunk. A traced target (torch.compile) is
    not checked here, and the calls check as usual."""
    if traced(target) or torch.compiler.is_compiling():
        yield
        return
    check_label_range(target, n_classes, ignore_index)
    with thread_flag(ambient.LABELS_CHECKED):
        yield


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), and its derivative 1 - tanh(x / cap)^2."""
    t, sech2 = tanh_and_sech2(x / cap)
    return cap * t, sech2


@triton.jit
def safe_max(m):
    """m, or 0 where m is -inf: what an online log-sum-exp subtracts before exp. While every logit
    seen is -inf (a masked vocabulary) exp(x - m) would be exp(-inf + inf) = NaN; against 0 the
    sum stays 0 and exp(m - 0) rescales it by 0. One scalar select a block (H100: no measurable
    cost)."""
    return tl.where(m > -float("inf"), m, 0.0)


@triton.jit
def online_lse_update(m, s, x, block_max):
    """One block x (block_max = its maximum) into a row's running maximum m and s = sum exp(z - m):
    -> (new m, new s). Rows (or leading blocks) of only -inf stay (-inf, 0), never NaN."""
    new_m = tl.maximum(m, block_max)
    shift = safe_max(new_m)
    return new_m, s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def store_ignored_row(LOSS, Z_LOSS, grad_row, row, n_cols, HAS_Z_LOSS: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """A row whose target is ignore_index (cross_entropy_kernel, vocab_parallel_ce_kernel): loss
    and z-loss 0, its gradient row (grad_row, n_cols wide) zeros; the logits are not read."""
    tl.store(LOSS + row, 0.0)
    if HAS_Z_LOSS:
        tl.store(Z_LOSS + row, 0.0)
    if COMPUTE_GRAD:
        offs = tl.arange(0, BLOCK_V)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            tl.store(grad_row + cols, tl.zeros([BLOCK_V], dtype=grad_row.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def finish_gradient(g, p, sech2, bad, ce_scale, z_scale, lse, lse_square_scale, HAS_Z_LOSS: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    """A block of a row's gradient (cross_entropy_kernel, vocab_parallel_ce_kernel) from g, its
    cross-entropy part: times ce_scale, plus the z-loss's 2 lse_square_scale lse p times z_scale,
    through the softcap (sech2 = its derivative, None without it); NaN on a bad row."""
    g = g * ce_scale
    if HAS_Z_LOSS:
        g += 2.0 * lse_square_scale * lse * p * z_scale
    if HAS_SOFTCAP:
        g = g * sech2
    return tl.where(bad, float("nan"), g)


@triton.jit
def cross_entropy_kernel(
    LOGITS, stride_logits, GRAD, stride_grad, TARGET, WEIGHT, NORMS,
    LOSS, Z_LOSS, PREDICTED,
    n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, COMPUTE_ARGMAX: tl.constexpr,
    TOKEN_SCALING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row: LOSS[row] (ce, unnormalised), Z_LOSS[row], PREDICTED[row] (argmax, -1 where
    ignored); GRAD row (normalised by NORMS = [ce_norm, z_norm, sum of class weights], as for
    grad_output = 1). GRAD may alias LOGITS. Each program walks rows pid, pid + programs, ...:
    a grid smaller than n_rows bounds the rows in flight (and so the L2 footprint between a
    row's two passes).

    Numerics: with m the row maximum and s = sum exp(z - m), the loss is (m - z_y) + log s and
    the probabilities exp(z - m) / s, never z - lse: lse rounded at the logits' magnitude (1e4
    in fp32) would cost the gradient its low bits. TOKEN_SCALING multiplies the row's loss,
    z-loss and gradient by p(target) (a constant: no gradient flows through it)."""
    # Inductor passes Python floats as fp64 scalars (Triton's own launch: fp32); fp64 would
    # promote the row's math to fp64.
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    lse_square_scale = tl.cast(lse_square_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    offs = tl.arange(0, BLOCK_V)
    for task in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(task, tl.int64)
        y = tl.load(TARGET + row).to(tl.int64)
        logits_row = LOGITS + row * stride_logits
        grad_row = GRAD + row * stride_grad
        if y == ignore_index:
            store_ignored_row(LOSS, Z_LOSS, grad_row, row, n_cols, HAS_Z_LOSS, COMPUTE_GRAD, BLOCK_V)
            if COMPUTE_ARGMAX:
                tl.store(PREDICTED + row, -1)
        else:
            # An out-of-range label (only reachable with the host check off) poisons the row.
            bad = (y < 0) | (y >= n_cols)
            y_safe = tl.where(bad, 0, y)
            m = -float("inf")
            s = 0.0
            # z[y] is picked up in pass 1 from the block holding it, not loaded on its own
            # afterwards: a separate load after pass 1 read the gradient pass 2 had already
            # written over it in place (wrong losses on the H100, depending on the launch).
            z_y = 0.0
            # The smoothing sum is taken relative to the first block's maximum (ref), so that
            # sum_j w_j (lse - z_j) keeps its precision when the logits are large.
            ref = 0.0
            sum_wz_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            best = -float("inf")
            best_idx = 0
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offs
                mask = cols < n_cols
                x = tl.load(logits_row + cols, mask=mask, other=-float("inf"), eviction_policy="evict_last")
                x = x.to(tl.float32)
                if HAS_SOFTCAP:
                    x, _ = soft_cap(x, softcap)
                    x = tl.where(mask, x, -float("inf"))
                block_max = tl.max(x, axis=0)
                if (y_safe >= start) & (y_safe < start + BLOCK_V):
                    z_y = tl.sum(tl.where(cols == y_safe, x, 0.0), axis=0)
                m, s = online_lse_update(m, s, x, block_max)
                if HAS_SMOOTHING:
                    if start == 0:
                        ref = safe_max(block_max)
                    if HAS_WEIGHT:
                        w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
                        sum_wz_acc += tl.where(mask, x - ref, 0.0) * w
                    else:
                        sum_wz_acc += tl.where(mask, x - ref, 0.0)
                if COMPUTE_ARGMAX:
                    block_arg = tl.argmax(x, axis=0)
                    take = block_max > best  # strict: the first maximum wins, as torch.argmax
                    best_idx = tl.where(take, start + block_arg, best_idx)
                    best = tl.where(take, block_max, best)
            log_s = tl.log(s)
            inv_s = 1.0 / s
            w_y = 1.0
            if HAS_WEIGHT:
                w_y = tl.load(WEIGHT + y_safe).to(tl.float32)
            loss = (1.0 - label_smoothing) * w_y * ((m - z_y) + log_s)
            weight_sum = n_cols * 1.0
            if HAS_WEIGHT and HAS_SMOOTHING:
                weight_sum = tl.load(NORMS + 2)
            if HAS_SMOOTHING:
                sum_wz = tl.sum(sum_wz_acc, axis=0)
                loss += label_smoothing / n_cols * (weight_sum * ((m - ref) + log_s) - sum_wz)
            token_scale = 1.0
            if TOKEN_SCALING:
                token_scale = tl.exp(z_y - m) * inv_s
            loss = tl.where(bad, float("nan"), loss * token_scale)
            tl.store(LOSS + row, loss)
            lse = m + log_s
            if HAS_Z_LOSS:
                tl.store(Z_LOSS + row, lse_square_scale * lse * lse * token_scale)
            if COMPUTE_ARGMAX:
                tl.store(PREDICTED + row, best_idx.to(tl.int64))
            if COMPUTE_GRAD:
                ce_scale = token_scale / tl.load(NORMS)
                z_scale = token_scale / tl.load(NORMS + 1)
                n_blocks = tl.cdiv(n_cols, BLOCK_V)
                for i in range(0, n_blocks):
                    # Backwards: the blocks pass 1 read last, most likely still in L2, are read
                    # first (H100: 5-7% faster than forwards; benchmarks/NOTES.md).
                    start = (n_blocks - 1 - i) * BLOCK_V
                    cols = start + offs
                    mask = cols < n_cols
                    x = tl.load(logits_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
                    x = x.to(tl.float32)
                    sech2 = None  # the softcap's derivative
                    if HAS_SOFTCAP:
                        x, sech2 = soft_cap(x, softcap)
                    p = tl.exp(x - m) * inv_s
                    g = (1.0 - label_smoothing) * w_y * (p - tl.where(cols == y, 1.0, 0.0))
                    if HAS_SMOOTHING:
                        if HAS_WEIGHT:
                            w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
                            g += label_smoothing / n_cols * (weight_sum * p - w)
                        else:
                            g += label_smoothing * (p - 1.0 / n_cols)
                    g = finish_gradient(g, p, sech2, bad, ce_scale, z_scale, lse, lse_square_scale, HAS_Z_LOSS,
                                        HAS_SOFTCAP)
                    tl.store(grad_row + cols, g.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def scale_row_block(X, Y, scale, cols, n_cols):
    mask = cols < n_cols
    x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + cols, (x * scale).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def scale_rows_kernel(X, stride_x, Y, stride_y, SCALE, stride_scale, n_cols, IN_PLACE: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Y[row] = X[row] * SCALE[row * stride_scale] (stride 0: one scalar). In place (Y is X), a
    row whose scale is exactly 1 is left untouched without reading it: the common
    grad_output = 1 costs a launch, not a pass over X."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    if IN_PLACE:
        if scale != 1.0:
            for start in range(0, n_cols, BLOCK):
                scale_row_block(X + row * stride_x, X + row * stride_x, scale, start + offs, n_cols)
    else:
        for start in range(0, n_cols, BLOCK):
            scale_row_block(X + row * stride_x, Y + row * stride_y, scale, start + offs, n_cols)


@triton.jit
def scale_kernel(X, Y, SCALE, n_elements, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """Y = X * SCALE[0] over contiguous X and Y; in place, nothing is read when SCALE is 1."""
    scale = tl.load(SCALE).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if IN_PLACE:
        if scale != 1.0:
            scale_row_block(X, X, scale, offs, n_elements)
    else:
        scale_row_block(X, Y, scale, offs, n_elements)


def scale_rows(x2, scale, out=None):
    """x2 [M, N] (unit last stride) * scale (a one-element tensor, or [M] per row), into ``out``
    (a new [M, N] buffer, or x2 itself: in place). Returns out."""
    out = x2 if out is None else out
    if not x2.numel():
        return out
    in_place = out is x2
    if scale.numel() == 1 and x2.is_contiguous() and out.is_contiguous():
        block = 4096
        launch(scale_kernel, (cdiv(x2.numel(), block),), x2, out, scale.reshape(1), x2.numel(),
               IN_PLACE=in_place, BLOCK=block, num_warps=8)
        return out
    stride = 0 if scale.numel() == 1 else scale.stride(0)
    block = min(4096, next_pow2(x2.shape[1]))
    launch(scale_rows_kernel, (x2.shape[0],), x2, x2.stride(0), out, out.stride(0), scale.reshape(-1), stride,
           x2.shape[1], IN_PLACE=in_place, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


def scaled_gradient(grad, scale):
    """A gradient formed in the forward pass, times grad_output ``scale`` (fp32, one element or
    one per row), for a backward. Eager: over ``grad`` itself when the graph is freed after this
    backward (no copy; autograd may adopt the buffer as .grad), else into a new buffer, so that
    ``grad`` is still exact for the next backward over the retained graph. Traced (see
    ``traced``): a new tensor from torch ops, the same fp32 product rounded to grad's dtype."""
    if traced(grad, scale):
        return (grad.float() * scale.reshape(-1, *(1,) * (grad.ndim - 1))).to(grad.dtype)
    if graph_retained():
        return scale_rows(grad, scale, out=torch.empty_like(grad))
    return scale_rows(grad, scale)


def ce_launch_config(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK_V, num_warps) for n_rows rows of n_cols logits.

    H100 sweep (benchmarks/tuning/tune_cross_entropy.py): one program a row, the second pass walking
    the row backwards, BLOCK_V 8192-16384 at a warp per 1K elements: 67-71% of the read-once
    floor at V = 128K-152K, 82% at V = 32K. Persistent grids of 1-4 programs an SM (fewer
    rows in flight, hoping the second pass hits L2) were no faster.
    """
    on_gpu = device.type == "cuda"
    # The interpreter's blocks are narrower, so that the small vocabularies of the CPU tests
    # (V 10007) still span several blocks and its programs walk several rows: the GPU's paths.
    block = min(16384 if on_gpu else 4096, next_pow2(n_cols))
    warps = max(4, min(16, block // 1024))
    programs = n_rows if on_gpu else min(n_rows, 3)
    return max(1, programs), block, warps


class CrossEntropyOptions(NamedTuple):
    """What a cross-entropy call computes besides the logits and the target (shared by cross
    entropy, the fused linear version and the linear-head log-probs). The fields are in the order
    the custom ops' schemas take them (``op(logits, target, *opts, ...)``), the class weight
    named ``class_weight`` there."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    weight: torch.Tensor | None = None  # class weights [V]
    lse_square_scale: float = 0.0  # z-loss
    softcap: float | None = None
    use_token_scaling: bool = False
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False
    defer_label_check: bool = False  # queue the label range check (CUDA) instead of syncing

    @property
    def compute_argmax(self) -> bool:
        return self.return_token_accuracy or self.return_predicted_tokens

    @property
    def returns_z_loss(self) -> bool:
        """The z-loss is returned when asked for and there is one (lse_square_scale != 0)."""
        return self.return_z_loss and bool(self.lse_square_scale)


def check_option_values(opts: CrossEntropyOptions) -> None:
    """The options that are not tensors (and the class weight's type), with a TypeError /
    ValueError naming the argument. Reads no tensor: the functional entries run it before an op
    call, whose schema would refuse a wrong type with a vaguer error."""
    if isinstance(opts.ignore_index, bool) or not isinstance(opts.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {opts.ignore_index!r}")
    if opts.weight is not None and not isinstance(opts.weight, torch.Tensor):
        raise TypeError(f"weight (class weights) must be a torch.Tensor or None, got {type(opts.weight).__name__}")
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {opts.reduction!r}")
    if not 0.0 <= opts.label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {opts.label_smoothing}")
    if opts.softcap is not None and not opts.softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {opts.softcap}")
    if not opts.lse_square_scale >= 0:
        raise ValueError(f"lse_square_scale must be >= 0, got {opts.lse_square_scale}")


def checked_cross_entropy_options(ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                                  lse_square_scale=0.0, softcap=None, use_token_scaling=False, return_z_loss=False,
                                  return_token_accuracy=False, return_predicted_tokens=False) -> CrossEntropyOptions:
    """The options checked (``check_option_values``) and typed as the ops' schemas take them;
    inside ``deferred_label_checks()`` the op is told to queue its label check. (An argument,
    not the flag read at run time: a compiled graph runs the op outside the block it traced.)"""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, weight, lse_square_scale, softcap)
    check_option_values(opts)
    return CrossEntropyOptions(ignore_index, reduction, float(label_smoothing), weight, float(lse_square_scale),
                               None if softcap is None else float(softcap), bool(use_token_scaling),
                               bool(return_z_loss), bool(return_token_accuracy), bool(return_predicted_tokens),
                               bool(ambient.DEFERRED_LABEL_CHECKS.on))


def check_target_and_class_weight(target, n_rows, n_classes, weight) -> None:
    """Metadata checks of target [n_rows] (integer class indices) and the class weights [n_classes]
    or None, for logits [n_rows, n_classes]: no data read (fake implementations run them too)."""
    check_tensor("target", target, ndim=1, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got {target.dtype}")
    if target.shape[0] != n_rows:
        raise ValueError(f"target has {target.shape[0]} rows but the logits have {n_rows} (logits [N, V], target [N])")
    if weight is not None:
        check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != n_classes:
            raise ValueError(f"weight has {weight.shape[0]} entries but the logits have {n_classes} classes")


def check_label_range(target, n_classes, ignore_index, defer=False) -> None:
    """Every label in [0, n_classes) or ignore_index: a host sync (tigon.ambient's label-check
    policy), or on CUDA with ``defer`` (the call was made inside ``deferred_label_checks()``) a queued check.
    Real implementations only (not on meta: a memory-planning trace has no labels to read)."""
    if ambient.CHECK_LABELS and target.numel() and not capturing() and not target.is_meta:
        bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
        if traced(target):  # a triton_op body traced by torch.compile: no host read possible
            assert_on_device(~bad.any(), f"target holds a label outside [0, {n_classes}) and not "
                                         f"ignore_index={ignore_index}")
        elif target.is_cuda and defer:
            lowest = torch.iinfo(torch.int64).min
            ambient.queue_label_check(torch.stack([bad.any().to(torch.int64),
                                            torch.where(bad, target.to(torch.int64), lowest).max()]),
                               n_classes, ignore_index)
        elif bool(bad.any()):
            _raise_bad_label(target[bad][0].item(), n_classes, ignore_index)


def _raise_bad_label(label, n_classes, ignore_index):
    raise ValueError(f"target holds {label}, outside [0, {n_classes}) and not ignore_index={ignore_index} "
                     "(set TIGON_CHECK_LABELS=0 to skip this check, which syncs with the GPU)")


def kernel_target_and_options(target, opts: CrossEntropyOptions):
    """(target, opts) as the kernel reads them, by index: the target and the class weights
    contiguous (a strided or expanded one is copied)."""
    if opts.weight is not None and not opts.weight.is_contiguous():
        opts = opts._replace(weight=opts.weight.contiguous())
    return target.contiguous(), opts


def check_cross_entropy_options(target, n_rows, n_classes, opts: CrossEntropyOptions):
    """Checks of a linear-head row op (linear_token_logps) for logits [n_rows, n_classes] and
    target [n_rows], the label range included unless inside ``labels_checked``. Returns (target,
    opts) as the kernel reads them (``kernel_target_and_options``)."""
    check_target_and_class_weight(target, n_rows, n_classes, opts.weight)
    check_option_values(opts)
    if not ambient.LABELS_CHECKED.on:
        check_label_range(target, n_classes, opts.ignore_index, opts.defer_label_check)
    return kernel_target_and_options(target, opts)


def cross_entropy_norms(target, opts: CrossEntropyOptions):
    """Device tensor [ce_norm, z_norm, weight_sum] (no host sync): what "mean" divides the ce
    and z-loss terms by (sum of target-class weights, number of non-ignored rows; ones for the
    other reductions), and the sum of the class weights (label smoothing). A zero norm (all
    rows ignored) becomes 1: the sums are then 0 and so is the loss."""
    weight = opts.weight
    weight_sum = weight.float().sum() if weight is not None else torch.zeros((), device=target.device)
    if opts.reduction != "mean":
        ones = torch.ones((), dtype=torch.float32, device=target.device)
        return torch.stack((ones, ones, weight_sum))
    valid = target != opts.ignore_index
    count = valid.sum().to(torch.float32)
    if weight is not None:
        w_y = weight.float()[torch.where(valid, target, 0)] * valid
        ce = w_y.sum()
    else:
        ce = count
    norms = torch.stack((ce, count))
    return torch.cat((torch.where(norms != 0, norms, torch.ones_like(norms)), weight_sum.reshape(1)))


@triton.jit
def norms_and_label_stats_kernel(
    TARGET, WEIGHT, NORMS, STATS, n_rows, n_classes, ignore_index,
    MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: NORMS fp32 [3] as ``cross_entropy_norms`` forms them, and STATS int64 [2] =
    (labels outside [0, n_classes) and not ignore_index, the largest of them) for the label check:
    one launch where the torch formulas take eight or more (host time at small batches)."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    n_bad = tl.zeros([BLOCK], dtype=tl.int32)
    worst = tl.full([BLOCK], -9223372036854775807 - 1, dtype=tl.int64)
    w_y = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        y = tl.load(TARGET + rows, mask=rows < n_rows, other=ignore_index).to(tl.int64)
        valid = (rows < n_rows) & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= n_classes))
        count += valid.to(tl.int32)
        n_bad += bad.to(tl.int32)
        worst = tl.maximum(worst, tl.where(bad, y, -9223372036854775807 - 1))
        if HAS_WEIGHT and MEAN:
            good = valid & ~bad
            w_y += tl.load(WEIGHT + tl.where(good, y, 0), mask=good, other=0.0).to(tl.float32)
    weight_sum = 0.0
    if HAS_WEIGHT:
        w_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_classes, BLOCK):
            cols = start + offs
            w_acc += tl.load(WEIGHT + cols, mask=cols < n_classes, other=0.0).to(tl.float32)
        weight_sum = tl.sum(w_acc, axis=0)
    if MEAN:
        z_norm = tl.sum(count, axis=0).to(tl.float32)
        ce_norm = tl.sum(w_y, axis=0) if HAS_WEIGHT else z_norm
        ce_norm = tl.where(ce_norm != 0.0, ce_norm, 1.0)  # all rows ignored: the sums are 0, so is the loss
        z_norm = tl.where(z_norm != 0.0, z_norm, 1.0)
    else:
        ce_norm = 1.0
        z_norm = 1.0
    tl.store(NORMS, ce_norm)
    tl.store(NORMS + 1, z_norm)
    tl.store(NORMS + 2, weight_sum)
    tl.store(STATS, tl.sum(n_bad, axis=0).to(tl.int64))
    tl.store(STATS + 1, tl.max(worst, axis=0))


NORMS_BLOCK = 1024  # one size for every batch: one compiled kernel (a loop over the rows, then the classes)


def checked_norms(target, n_classes, opts: CrossEntropyOptions):
    """The label check (``check_label_range``) and ``cross_entropy_norms`` of a cross-entropy
    op's body, for the kernel's contiguous target [N] and options: in eager calls one kernel
    forms both, and the check reads its two numbers (one host sync, or queued inside
    ``deferred_label_checks``); traced calls take the torch formulas (Inductor fuses them)."""
    if traced(target):
        check_label_range(target, n_classes, opts.ignore_index, opts.defer_label_check)
        return cross_entropy_norms(target, opts)
    device = target.device
    norms = new_output((3,), torch.float32, device)
    stats = new_output((2,), torch.int64, device)
    launch(norms_and_label_stats_kernel, (1,),
           target, opts.weight if opts.weight is not None else norms, norms, stats, target.shape[0], n_classes,
           opts.ignore_index, MEAN=opts.reduction == "mean", HAS_WEIGHT=opts.weight is not None,
           BLOCK=NORMS_BLOCK)
    if ambient.CHECK_LABELS and target.numel() and not capturing() and not target.is_meta:
        if target.is_cuda and opts.defer_label_check:
            ambient.queue_label_check(stats, n_classes, opts.ignore_index)
        else:
            n_bad, label = stats.tolist()
            if n_bad:
                _raise_bad_label(label, n_classes, opts.ignore_index)
    return norms


def cross_entropy_rows(logits2, target, norms, grad, opts: CrossEntropyOptions):
    """Launch on checked inputs (target and class weights contiguous): -> (loss_rows fp32 [N],
    z_rows fp32 [N] or None, predicted int64 [N] or None). grad (None: no gradient) receives
    d loss / d logits for grad_output = 1; it may be logits2."""
    n_rows, n_cols = logits2.shape
    device = logits2.device
    loss = new_output((n_rows,), torch.float32, device)
    z_rows = new_output((n_rows,), torch.float32, device) if opts.lse_square_scale else None
    predicted = torch.empty((n_rows,), dtype=torch.int64, device=device) if opts.compute_argmax else None
    programs, block, num_warps = ce_launch_config(n_rows, n_cols, device)
    weight = opts.weight
    if n_rows:
        launch(cross_entropy_kernel, (programs,),
            logits2, logits2.stride(0), grad if grad is not None else logits2,
            grad.stride(0) if grad is not None else 0,
            target, weight if weight is not None else norms, norms,
            loss, z_rows if z_rows is not None else loss, predicted if predicted is not None else target,
            n_rows, n_cols, opts.ignore_index, float(opts.label_smoothing), float(opts.lse_square_scale),
            float(opts.softcap) if opts.softcap else 1.0,
            HAS_WEIGHT=weight is not None, HAS_SOFTCAP=bool(opts.softcap), HAS_SMOOTHING=opts.label_smoothing > 0,
            HAS_Z_LOSS=bool(opts.lse_square_scale), COMPUTE_GRAD=grad is not None,
            COMPUTE_ARGMAX=opts.compute_argmax, TOKEN_SCALING=bool(opts.use_token_scaling),
            BLOCK_V=block, num_warps=num_warps,
        )
    return loss, z_rows, predicted


def reduce_rows(rows, norm, reduction):
    """Per-row values -> the reduction's result (rows already hold 0 for ignored rows)."""
    if rows is None:
        return None
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / norm if reduction == "mean" else total


def reduce_loss_rows(loss_rows, z_rows, predicted, norms, target, opts: CrossEntropyOptions):
    """Per-row ce, z-loss and predictions -> (loss including the z-loss, z_loss, token accuracy,
    predicted tokens), each None unless asked for (the loss always)."""
    loss = reduce_rows(loss_rows, norms[0], opts.reduction)
    z_loss = reduce_rows(z_rows, norms[1], opts.reduction)
    if z_loss is not None:
        loss = loss + z_loss
    accuracy = None
    if opts.return_token_accuracy:
        valid = target != opts.ignore_index
        correct = ((predicted == target) & valid).float()
        accuracy = correct if opts.reduction == "none" else correct.sum() / valid.sum().clamp_min(1)
    return (loss, z_loss if opts.return_z_loss else None, accuracy,
            predicted if opts.return_predicted_tokens else None)


def rows_alias(x2: torch.Tensor) -> bool:
    """True when rows of x2 [M, N] (unit last stride) share memory (an expanded or overlapping
    view): a gradient written over it would be written into memory every such row shares."""
    return x2.shape[0] > 1 and x2.shape[1] > 0 and x2.stride(0) < x2.shape[1]


# ---- custom ops: torch.ops.tigon.cross_entropy, and tigon::cross_entropy_ writing over the logits ----
#
# Schema: logits [N, V], target [N], then CrossEntropyOptions' fields in order, then what to
# compute. The loss outputs are fp32 (predicted tokens int64), one per row for reduction "none",
# else 0-dim; those a call did not ask for are empty tensors (custom ops cannot return None).

N_OPTIONS = len(CrossEntropyOptions._fields)


def op_loss_outputs(loss_rows, z_rows, predicted, norms, target, opts: CrossEntropyOptions, like):
    """reduce_loss_rows' results as the ops return them: (loss, z_loss, token_accuracy,
    predicted_tokens), an empty tensor (on ``like``'s device) for each one not asked for."""
    loss, z_loss, accuracy, predicted = reduce_loss_rows(loss_rows, z_rows, predicted, norms, target, opts)
    return (loss,
            z_loss if z_loss is not None else like.new_empty(0, dtype=torch.float32),
            accuracy if accuracy is not None else like.new_empty(0, dtype=torch.float32),
            predicted if predicted is not None else like.new_empty(0, dtype=torch.int64))


def fake_op_loss_outputs(n_rows, opts: CrossEntropyOptions, like):
    """The metadata of ``op_loss_outputs`` for n_rows rows (fake implementations)."""
    rows = (n_rows,) if opts.reduction == "none" else ()
    return (like.new_empty(rows, dtype=torch.float32),
            like.new_empty(rows if opts.returns_z_loss else (0,), dtype=torch.float32),
            like.new_empty(rows if opts.return_token_accuracy else (0,), dtype=torch.float32),
            like.new_empty((n_rows,) if opts.return_predicted_tokens else (0,), dtype=torch.int64))


def loss_scale(grad_loss, per_row: bool):
    """grad_output as scaled_gradient takes it: fp32, one per row (reduction "none") or one element."""
    return (grad_loss.reshape(-1) if per_row else grad_loss.reshape(1)).to(torch.float32)


def writable_rows(logits2) -> bool:
    """True when the gradient can be written over logits2 [N, V]: unit last stride, rows not
    sharing memory."""
    return logits2.stride(-1) == 1 and not rows_alias(logits2)


def _check_cross_entropy_args(logits, target, opts: CrossEntropyOptions) -> None:
    """Metadata checks of both ops, for their real and fake implementations. (Not the plain
    values, which a fake implementation may get as symbolic ints: the functional entries and
    the real implementations check those with ``check_option_values``.)"""
    check_tensor("logits", logits, ndim=2)
    check_target_and_class_weight(target, logits.shape[0], logits.shape[1], opts.weight)
    check_same_device(logits=logits, target=target, weight=opts.weight)


def _cross_entropy(logits2, target, opts: CrossEntropyOptions, grad):
    """Checked logits2 [N, V] (unit last stride) -> op_loss_outputs; d loss / d logits for
    grad_output 1 into ``grad`` (None: not computed; it may be logits2)."""
    target, opts = kernel_target_and_options(target, opts)
    norms = checked_norms(target, logits2.shape[1], opts)
    loss_rows, z_rows, predicted = cross_entropy_rows(logits2, target, norms, grad, opts)
    return op_loss_outputs(loss_rows, z_rows, predicted, norms, target, opts, logits2)


@kernel_op("tigon::cross_entropy", mutates_args=())
def cross_entropy_op(logits: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float,
                     class_weight: Optional[Tensor], lse_square_scale: float, softcap: Optional[float],
                     use_token_scaling: bool, return_z_loss: bool, return_token_accuracy: bool,
                     return_predicted_tokens: bool, defer_label_check: bool, compute_grad: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, z_loss, token_accuracy, predicted_tokens, grad) of logits [N, V] and target [N];
    grad: d loss / d logits for grad_output 1 ([N, V], logits' dtype) with ``compute_grad``,
    else empty. The backward scales it by grad_output."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, class_weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens,
                               defer_label_check)
    if not traced(logits):  # traced (a triton_op under torch.compile): the functional entry checked them
        check_option_values(opts)
    _check_cross_entropy_args(logits, target, opts)
    logits2 = logits if logits.stride(-1) == 1 else logits.contiguous()
    grad = new_output(logits2.shape, logits2.dtype, logits2.device) if compute_grad else None
    outputs = _cross_entropy(logits2, target, opts, grad)
    return (*outputs, or_empty(grad, logits))


@cross_entropy_op.register_fake
def _(logits, target, *args):
    opts, compute_grad = CrossEntropyOptions(*args[:N_OPTIONS]), args[N_OPTIONS]
    _check_cross_entropy_args(logits, target, opts)
    grad = fake_grad(logits, compute_grad, logits)
    return (*fake_op_loss_outputs(logits.shape[0], opts, logits), grad)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # the extras' gradients arrive as None
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(output[4])  # the gradient, formed in the forward pass
    ctx.per_row = inputs[3] == "none"
    ctx.has_grad = inputs[-1]


def _backward(ctx, grad_loss, *_grads_of_extras):
    grad_logits = None
    if grad_loss is not None and ctx.has_grad and ctx.needs_input_grad[0]:
        (grad,) = ctx.saved_tensors
        grad_logits = scaled_gradient(grad, loss_scale(grad_loss, ctx.per_row))
    return (grad_logits,) + (None,) * (2 + N_OPTIONS)


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


@custom_op("tigon::cross_entropy_", mutates_args=("logits",))
def cross_entropy_inplace_op(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                             label_smoothing: float, class_weight: Optional[Tensor], lse_square_scale: float,
                             softcap: Optional[float], use_token_scaling: bool, return_z_loss: bool,
                             return_token_accuracy: bool, return_predicted_tokens: bool, defer_label_check: bool
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """tigon::cross_entropy writing d loss / d logits (grad_output 1) over ``logits`` (see
    ``writable_rows``): no [N, V] gradient allocated. No autograd formula of its own (torch
    registers none for ops that mutate an input): ``CrossEntropyOverLogits`` is its autograd."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, class_weight, lse_square_scale, softcap,
                               use_token_scaling, return_z_loss, return_token_accuracy, return_predicted_tokens,
                               defer_label_check)
    check_option_values(opts)
    _check_writable_logits(logits, target, opts)
    return _cross_entropy(logits, target, opts, logits)


@cross_entropy_inplace_op.register_fake
def _(logits, target, *args):
    opts = CrossEntropyOptions(*args)
    _check_writable_logits(logits, target, opts)
    return fake_op_loss_outputs(logits.shape[0], opts, logits)


def _check_writable_logits(logits, target, opts):
    _check_cross_entropy_args(logits, target, opts)
    if not writable_rows(logits):
        raise ValueError(f"cross_entropy_ writes the gradient over logits: they need unit last stride and rows not "
                         f"sharing memory, got strides {logits.stride()} for shape {tuple(logits.shape)}")


class CrossEntropyOverLogits(torch.autograd.Function):
    """The autograd of tigon::cross_entropy_, for ``TF.cross_entropy(..., inplace=True)`` in eager
    mode only (under torch.compile the functional op runs instead). The op bumps the logits'
    version, so another saved use of them fails loudly. Their memory, now the gradient, is saved
    as a detached alias, which autograd can adopt as .grad without a copy (it copies tensors
    referenced elsewhere); the backward scales it by grad_output (``scaled_gradient``)."""

    @staticmethod
    def forward(ctx, logits, target, opts: CrossEntropyOptions):
        outputs = cross_entropy_inplace_op(logits, target, *opts)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(logits.detach())
        ctx.per_row = opts.reduction == "none"
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_grads_of_extras):
        if grad_loss is None:
            return None, None, None
        (grad,) = ctx.saved_tensors
        return scaled_gradient(grad, loss_scale(grad_loss, ctx.per_row)), None, None
