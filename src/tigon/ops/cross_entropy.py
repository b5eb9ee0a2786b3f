"""Cross entropy over logits [N, V] with the gradient computed in the forward pass.

One program per row: a first pass over the row computes the log-sum-exp online (and, as
asked, the smoothing sum, the argmax for token accuracy); a second pass writes
d loss / d logits, by default over the logits themselves (the logits buffer becomes the
gradient: no [N, V] allocation, no fp32 copy). The first pass asks L2 to keep the row
(evict_last), so the second pass mostly reads it from L2 rather than HBM.

Loss per non-ignored row i, with class weights w (ones if none), smoothing eps, z = logits
(after tanh soft-capping if ``softcap``), lse = logsumexp(z):
    ce_i = (1 - eps) w[y_i] (lse - z[y_i]) + eps / V * sum_j w_j (lse - z_j)   (as torch)
    zl_i = lse_square_scale * lse^2                                              (z-loss)
"mean" divides the ce terms by sum_i w[y_i] and the z-loss terms by the number of
non-ignored rows; "sum" adds; "none" returns per-row values. An all-ignored batch gives a
loss of 0 and a zero gradient.
"""

from __future__ import annotations

import collections
import os
import threading

import torch
import triton
import triton.language as tl

from tigon.ops._common import (
    capturing,
    cdiv,
    check_same_device,
    check_tensor,
    launch,
    new_output,
    next_pow2,
    thread_flag,
)

REDUCTIONS = ("mean", "sum", "none")

# Label range check: one host sync per call (a clear error instead of a kernel reading
# outside the row). TIGON_CHECK_LABELS=0 skips it, as does CUDA-graph capture; out-of-range
# labels then give a NaN loss. Inside ``deferred_label_checks()`` (the patched HF models' loss)
# a CUDA call does not wait: it queues the check and a later call raises once the result has
# arrived; the call with the bad label gives a NaN loss meanwhile.
CHECK_LABELS = os.environ.get("TIGON_CHECK_LABELS", "1") != "0"
_DEFERRAL = threading.local()
_PENDING_LABEL_CHECKS: collections.deque = collections.deque()
MAX_PENDING_LABEL_CHECKS = 8  # beyond this the oldest check waits for its result


def deferred_label_checks():
    """Inside the block, label checks on CUDA do not sync the host with the GPU (see above)."""
    return thread_flag(_DEFERRAL)


def resolve_label_checks(wait: bool = False) -> None:
    """Raise for a queued label check that found a bad label: those whose result has arrived,
    or all of them with ``wait=True``."""
    while _PENDING_LABEL_CHECKS and (wait or _PENDING_LABEL_CHECKS[0][0].query()):
        event, found, n_classes, ignore_index = _PENDING_LABEL_CHECKS.popleft()
        event.synchronize()
        if found[0]:
            _PENDING_LABEL_CHECKS.clear()
            raise ValueError(f"target held {int(found[1])}, outside [0, {n_classes}) and not ignore_index="
                             f"{ignore_index}, in an earlier call (checked without waiting for the GPU; that "
                             "call's loss was NaN)")


def _queue_label_check(bad, target, n_classes, ignore_index):
    resolve_label_checks()
    lowest = torch.iinfo(torch.int64).min
    stats = torch.stack([bad.any().to(torch.int64), torch.where(bad, target.to(torch.int64), lowest).max()])
    found = torch.empty(2, dtype=torch.int64, pin_memory=True)
    found.copy_(stats, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _PENDING_LABEL_CHECKS.append((event, found, n_classes, ignore_index))
    if len(_PENDING_LABEL_CHECKS) > MAX_PENDING_LABEL_CHECKS:
        _PENDING_LABEL_CHECKS[0][0].synchronize()
        resolve_label_checks()


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), and tanh itself (for the derivative), via sigmoid (no libdevice)."""
    t = 2.0 * tl.sigmoid(2.0 * x / cap) - 1.0
    return cap * t, t


@triton.jit
def cross_entropy_kernel(
    LOGITS, stride_logits, GRAD, stride_grad, TARGET, WEIGHT, NORMS,
    LOSS, Z_LOSS, CORRECT,
    n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, COMPUTE_ACCURACY: tl.constexpr,
    BLOCK_V: tl.constexpr, REVERSE: tl.constexpr = True,
):
    """Per row: LOSS[row] (ce, unnormalised), Z_LOSS[row], CORRECT[row]; GRAD row (normalised
    by NORMS = [ce_norm, z_norm, sum of class weights], as for grad_output = 1). GRAD may
    alias LOGITS. Each program walks rows pid, pid + programs, ...: a grid smaller than n_rows
    bounds the rows in flight (and so the L2 footprint between a row's two passes)."""
    offs = tl.arange(0, BLOCK_V)
    for task in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(task, tl.int64)
        y = tl.load(TARGET + row).to(tl.int64)
        logits_row = LOGITS + row * stride_logits
        grad_row = GRAD + row * stride_grad
        if y == ignore_index:
            tl.store(LOSS + row, 0.0)
            if HAS_Z_LOSS:
                tl.store(Z_LOSS + row, 0.0)
            if COMPUTE_ACCURACY:
                tl.store(CORRECT + row, 0.0)
            if COMPUTE_GRAD:
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offs
                    tl.store(grad_row + cols, tl.zeros([BLOCK_V], dtype=GRAD.dtype.element_ty), mask=cols < n_cols)
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
                new_m = tl.maximum(m, block_max)
                s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
                m = new_m
                if HAS_SMOOTHING:
                    if HAS_WEIGHT:
                        w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
                        sum_wz_acc += tl.where(mask, x, 0.0) * w
                    else:
                        sum_wz_acc += tl.where(mask, x, 0.0)
                if COMPUTE_ACCURACY:
                    block_arg = tl.argmax(x, axis=0)
                    take = block_max > best  # strict: the first maximum wins, as torch.argmax
                    best_idx = tl.where(take, start + block_arg, best_idx)
                    best = tl.where(take, block_max, best)
            lse = m + tl.log(s)
            sum_wz = tl.sum(sum_wz_acc, axis=0)
            w_y = 1.0
            if HAS_WEIGHT:
                w_y = tl.load(WEIGHT + y_safe).to(tl.float32)
            loss = (1.0 - label_smoothing) * w_y * (lse - z_y)
            weight_sum = n_cols * 1.0
            if HAS_WEIGHT and HAS_SMOOTHING:
                weight_sum = tl.load(NORMS + 2)
            if HAS_SMOOTHING:
                loss += label_smoothing / n_cols * (weight_sum * lse - sum_wz)
            loss = tl.where(bad, float("nan"), loss)
            tl.store(LOSS + row, loss)
            if HAS_Z_LOSS:
                tl.store(Z_LOSS + row, lse_square_scale * lse * lse)
            if COMPUTE_ACCURACY:
                tl.store(CORRECT + row, tl.where(best_idx == y, 1.0, 0.0))
            if COMPUTE_GRAD:
                ce_scale = 1.0 / tl.load(NORMS)
                z_scale = 1.0 / tl.load(NORMS + 1)
                n_blocks = tl.cdiv(n_cols, BLOCK_V)
                for i in range(0, n_blocks):
                    # REVERSE: the blocks pass 1 read last, most likely still in L2, are read first.
                    start = (n_blocks - 1 - i) * BLOCK_V if REVERSE else i * BLOCK_V
                    cols = start + offs
                    mask = cols < n_cols
                    x = tl.load(logits_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
                    x = x.to(tl.float32)
                    if HAS_SOFTCAP:
                        x, t = soft_cap(x, softcap)
                    p = tl.exp(x - lse)
                    g = (1.0 - label_smoothing) * w_y * (p - tl.where(cols == y, 1.0, 0.0))
                    if HAS_SMOOTHING:
                        if HAS_WEIGHT:
                            w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
                            g += label_smoothing / n_cols * (weight_sum * p - w)
                        else:
                            g += label_smoothing * (p - 1.0 / n_cols)
                    g = g * ce_scale
                    if HAS_Z_LOSS:
                        g += 2.0 * lse_square_scale * lse * p * z_scale
                    if HAS_SOFTCAP:
                        g = g * (1.0 - t * t)
                    g = tl.where(bad, float("nan"), g)
                    tl.store(grad_row + cols, g.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def scale_rows_kernel(X, stride_x, SCALE, stride_scale, n_cols, BLOCK: tl.constexpr):
    """X[row] *= SCALE[row * stride_scale] (stride 0: one scalar), in place. A row whose
    scale is exactly 1 is left untouched without reading it: the common grad_output = 1
    costs a launch, not a pass over X."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
    if scale != 1.0:
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(X + row * stride_x + cols, (x * scale).to(X.dtype.element_ty), mask=mask)


@triton.jit
def scale_kernel(X, SCALE, n_elements, BLOCK: tl.constexpr):
    """X *= SCALE[0] over a contiguous X, in place; nothing is read when SCALE is exactly 1."""
    scale = tl.load(SCALE).to(tl.float32)
    if scale != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(X + offs, (x * scale).to(X.dtype.element_ty), mask=mask)


def scale_rows_(x2, scale):
    """x2 [M, N] (unit last stride) *= scale (a one-element tensor, or [M] per row), in place."""
    if not x2.numel():
        return x2
    if scale.numel() == 1 and x2.is_contiguous():
        block = 4096
        launch(scale_kernel, (cdiv(x2.numel(), block),), x2, scale.reshape(1), x2.numel(), BLOCK=block, num_warps=8)
        return x2
    stride = 0 if scale.numel() == 1 else scale.stride(0)
    block = min(4096, next_pow2(x2.shape[1]))
    launch(scale_rows_kernel, (x2.shape[0],), x2, x2.stride(0), scale.reshape(-1), stride, x2.shape[1],
           BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return x2


def ce_launch_config(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK_V, num_warps) for n_rows rows of n_cols logits.

    H100 sweep (benchmarks/tune_cross_entropy.py): one program a row, the second pass walking
    the row backwards, BLOCK_V 8192-16384 at a warp per 1K elements: 67-71% of the read-once
    floor at V = 128K-152K, 82% at V = 32K. Persistent grids of 1-4 programs an SM (fewer
    rows in flight, hoping the second pass hits L2) were no faster.
    """
    block = min(16384, next_pow2(n_cols))
    warps = max(4, min(16, block // 1024))
    programs = n_rows if device.type == "cuda" else min(n_rows, 3)  # interpreter: programs walk several rows
    return max(1, programs), block, warps


def check_cross_entropy_options(target, n_rows, n_classes, weight, reduction, label_smoothing, softcap,
                                ignore_index):
    """Checks shared by cross entropy and the fused linear version, for logits [n_rows, n_classes]."""
    check_tensor("target", target, ndim=1, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got {target.dtype}")
    if target.shape[0] != n_rows:
        raise ValueError(f"target has {target.shape[0]} rows but the logits have {n_rows} (logits [N, V], target [N])")
    if weight is not None:
        check_tensor("weight", weight, ndim=1)
        if weight.shape[0] != n_classes:
            raise ValueError(f"weight has {weight.shape[0]} entries but the logits have {n_classes} classes")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if CHECK_LABELS and target.numel() and not capturing():
        bad = ((target < 0) & (target != ignore_index)) | (target >= n_classes)
        if target.is_cuda and getattr(_DEFERRAL, "on", False):
            _queue_label_check(bad, target, n_classes, ignore_index)
        elif bool(bad.any()):
            first = target[bad][0].item()
            raise ValueError(f"target holds {first}, outside [0, {n_classes}) and not ignore_index={ignore_index} "
                             "(set TIGON_CHECK_LABELS=0 to skip this check, which syncs with the GPU)")


def check_cross_entropy_args(logits, target, weight, reduction, label_smoothing, softcap, ignore_index):
    check_tensor("logits", logits, ndim=2)
    check_cross_entropy_options(target, logits.shape[0], logits.shape[1], weight, reduction, label_smoothing,
                                softcap, ignore_index)
    check_same_device(logits=logits, target=target, weight=weight)


def cross_entropy_norms(target, weight, ignore_index, reduction):
    """Device tensor [ce_norm, z_norm, weight_sum] (no host sync): what "mean" divides the ce
    and z-loss terms by (sum of target-class weights, number of non-ignored rows; ones for the
    other reductions), and the sum of the class weights (label smoothing). A zero norm (all
    rows ignored) becomes 1: the sums are then 0 and so is the loss."""
    weight_sum = weight.float().sum() if weight is not None else torch.zeros((), device=target.device)
    if reduction != "mean":
        ones = torch.ones((), dtype=torch.float32, device=target.device)
        return torch.stack((ones, ones, weight_sum))
    valid = target != ignore_index
    count = valid.sum().to(torch.float32)
    if weight is not None:
        w_y = weight.float()[torch.where(valid, target, 0)] * valid
        ce = w_y.sum()
    else:
        ce = count
    norms = torch.stack((ce, count))
    return torch.cat((torch.where(norms != 0, norms, torch.ones_like(norms)), weight_sum.reshape(1)))


def cross_entropy_rows(logits2, target, weight, norms, grad, ignore_index, label_smoothing, lse_square_scale,
                       softcap, compute_accuracy):
    """Launch on checked inputs: -> (loss_rows, z_rows or None, correct_rows or None), fp32 [N].
    grad (None: no gradient) receives d loss / d logits for grad_output = 1; it may be logits2."""
    n_rows, n_cols = logits2.shape
    device = logits2.device
    loss = new_output((n_rows,), torch.float32, device)
    z_rows = new_output((n_rows,), torch.float32, device) if lse_square_scale else None
    correct = new_output((n_rows,), torch.float32, device) if compute_accuracy else None
    programs, block, num_warps = ce_launch_config(n_rows, n_cols, device)
    if n_rows:
        launch(cross_entropy_kernel, (programs,),
            logits2, logits2.stride(0), grad if grad is not None else logits2,
            grad.stride(0) if grad is not None else 0,
            target, weight if weight is not None else norms, norms,
            loss, z_rows if z_rows is not None else loss, correct if correct is not None else loss,
            n_rows, n_cols, ignore_index, float(label_smoothing), float(lse_square_scale),
            float(softcap) if softcap else 1.0,
            HAS_WEIGHT=weight is not None, HAS_SOFTCAP=bool(softcap), HAS_SMOOTHING=label_smoothing > 0,
            HAS_Z_LOSS=bool(lse_square_scale), COMPUTE_GRAD=grad is not None, COMPUTE_ACCURACY=compute_accuracy,
            BLOCK_V=block, num_warps=num_warps,
        )
    return loss, z_rows, correct


def reduce_rows(rows, norm, reduction):
    """Per-row values -> the reduction's result (rows already hold 0 for ignored rows)."""
    if rows is None:
        return None
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / norm if reduction == "mean" else total


def reduce_loss_rows(loss_rows, z_rows, correct, norms, target, ignore_index, reduction):
    """Per-row ce, z-loss and correctness -> (loss including the z-loss, z_loss, token accuracy)."""
    loss = reduce_rows(loss_rows, norms[0], reduction)
    z_loss = reduce_rows(z_rows, norms[1], reduction)
    if z_loss is not None:
        loss = loss + z_loss
    accuracy = None
    if correct is not None:
        accuracy = correct if reduction == "none" else correct.sum() / (target != ignore_index).sum().clamp_min(1)
    return loss, z_loss, accuracy


class CrossEntropyFunction(torch.autograd.Function):
    """(loss, z_loss, token_accuracy); the last two are None unless asked for. With
    inplace=True (default) the logits buffer is overwritten by its gradient when logits
    require grad; its version counter is bumped so any other saved use of it fails loudly."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                lse_square_scale=0.0, softcap=None, return_z_loss=False, return_token_accuracy=False,
                inplace=True, grad_enabled=True):
        check_cross_entropy_args(logits, target, weight, reduction, label_smoothing, softcap, ignore_index)
        logits2 = logits if logits.stride(-1) == 1 else logits.contiguous()
        # forward runs with grad mode off: the caller's mode arrives as grad_enabled.
        needs_grad = ctx.needs_input_grad[0] and grad_enabled
        norms = cross_entropy_norms(target, weight, ignore_index, reduction)
        grad = None
        if needs_grad:
            # A detached alias, not logits itself: autograd can then adopt the buffer as the
            # gradient without copying it (it copies tensors that are referenced elsewhere).
            grad = logits2.detach() if inplace else new_output(logits2.shape, logits2.dtype, logits2.device)
        loss_rows, z_rows, correct = cross_entropy_rows(
            logits2, target, weight, norms, grad, ignore_index, label_smoothing, lse_square_scale, softcap,
            return_token_accuracy)
        if needs_grad and inplace and logits2 is logits:
            torch.autograd.graph.increment_version(logits)
        loss, z_loss, accuracy = reduce_loss_rows(loss_rows, z_rows, correct, norms, target, ignore_index, reduction)
        ctx.save_for_backward(grad)
        ctx.has_grad = grad is not None
        extras = [t for t in (z_loss if return_z_loss else None, accuracy) if t is not None]
        ctx.mark_non_differentiable(*extras)
        return loss, (z_loss if return_z_loss else None), accuracy

    @staticmethod
    def backward(ctx, grad_loss, _grad_z, _grad_accuracy):
        (grad,) = ctx.saved_tensors
        if not ctx.has_grad:
            return (None,) * 12
        scale = grad_loss.reshape(-1) if grad_loss.numel() > 1 else grad_loss.reshape(1)
        scale_rows_(grad, scale.to(torch.float32))
        return (grad,) + (None,) * 11
