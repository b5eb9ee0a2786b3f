"""What every cross-entropy op shares (cross entropy, the fused linear and vocabulary-parallel
versions, the linear-head log-probs): the options record (``CrossEntropyOptions``, in the order
the custom ops' schemas take them), the argument and label checks, the normalisers (with the
label-range statistics, one kernel), the reductions of per-row values, and the loss outputs of
the custom ops (their empty-tensor placeholders for what a call did not ask for)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tigon import ambient
from tigon.ambient import thread_flag
from tigon.ops._common import capturing, check_tensor, new_output, traced
from tigon.ops._internals import assert_on_device, launch

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
