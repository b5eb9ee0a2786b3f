"""Cross entropy over a vocabulary split across the ranks of a process group (tensor parallel).

Each rank holds logits [N, V_r] for its shard of the vocabulary, the ids [vocab_start,
vocab_start + V_r) (shards may be uneven), and the same target [N] of global ids. Every rank
gets the whole loss (the same value on each) and d loss / d (its logits).

1. ``tigon::vocab_parallel_cross_entropy_stats``: one read of the shard; per row the shard's
   maximum m_r, s_r = sum exp(z - m_r), the target logit z_y and a hit flag when the target lies
   in the shard, and (label smoothing) sum (z - m_r). A last row holds the shard's width V_r.
2. One collective: an all-gather of these [N + 1, 5] fp32 stats (every rank then combines the
   same numbers in the same order: the loss is bitwise the same on every rank).
3. ``tigon::vocab_parallel_cross_entropy``: combines the ranks' stats per row (M = max m_r,
   S = sum s_r exp(m_r - M), lse = M + log S), writes the loss rows and, read once more, the
   shard's gradient for grad_output = 1, as tigon's cross_entropy does (its options, norms and
   reductions: ``CrossEntropyOptions``, ``cross_entropy_norms``, ``reduce_loss_rows``); the
   backward scales it by grad_output (``scaled_gradient``: in place unless the graph is retained).

A target in no shard (or in several: overlapping shards, a wrong ``vocab_start``) is refused
after the gather with a ValueError on every rank (one host sync; TIGON_CHECK_LABELS=0 or CUDA
graph capture skip it, and the row's loss is then NaN). ``vocab_start=None`` gathers the shard
widths first (one more collective and a host sync): pass it when known.

torch.compile traces the whole call: the all-gather is a functional collective
(``torch.distributed._functional_collectives``), which Inductor schedules like any other op; only
``vocab_start=None`` with several ranks breaks the graph (the widths are read on the host).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon import ambient
from tigon.ops._common import (
    capturing,
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
from tigon.ops._cross_entropy_common import (
    CrossEntropyOptions,
    check_option_values,
    check_target_and_class_weight,
    cross_entropy_norms,
    loss_scale,
    reduce_loss_rows,
    rows_alias,
    writable_rows,
)
from tigon.ops._gradient_scaling import scaled_gradient
from tigon.ops._internals import launch
from tigon.ops._jit_math import online_lse_update, safe_max, soft_cap
from tigon.ops.cross_entropy import finish_gradient, store_ignored_row

# Stats columns a row: the shard's max, sum exp(z - max), target logit, hit (1.0 when the target
# is in the shard), sum (z - max) (label smoothing; else 0). Row N: the shard's width, then zeros.
STATS = 5
HIT = 3


def launch_config(n_rows, n_cols: int, device: torch.device):
    """(programs, BLOCK_V, num_warps): ``ce_launch_config``'s shape (one program a row on the GPU,
    BLOCK_V up to 16K at a warp per 1K elements). The interpreter runs 3 programs over the rows and
    128-wide blocks, so small test rows span several blocks."""
    block = min(16384 if device.type == "cuda" else 128, next_pow2(n_cols))
    warps = max(4, min(16, block // 1024))
    programs = n_rows if device.type == "cuda" else torch.sym_min(n_rows, 3)
    return torch.sym_max(1, programs), block, warps


@triton.jit
def vocab_parallel_ce_stats_kernel(
    LOGITS, stride_logits, TARGET, STATS_OUT, n_rows, n_cols, vocab_start, ignore_index, softcap,
    HAS_SOFTCAP: tl.constexpr, SUM_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """STATS_OUT [n_rows + 1, 5] (see STATS); ignored rows get zeros without reading the logits."""
    softcap = tl.cast(softcap, tl.float32)  # Inductor passes Python floats as fp64
    offs = tl.arange(0, BLOCK_V)
    if tl.program_id(0) == 0:
        head = tl.arange(0, 8)
        tl.store(STATS_OUT + tl.cast(n_rows, tl.int64) * 5 + head, tl.where(head == 0, n_cols * 1.0, 0.0),
                 mask=head < 5)
    for task in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(task, tl.int64)
        y = tl.load(TARGET + row).to(tl.int64)
        logits_row = LOGITS + row * stride_logits
        m = -float("inf")
        s = 0.0
        z_y = 0.0
        hit = 0.0
        sum_z = 0.0
        if y == ignore_index:
            m = 0.0
        else:
            local = y - vocab_start
            in_shard = (local >= 0) & (local < n_cols)
            # The logits' sum is taken relative to the first block's maximum (ref), then moved to
            # the shard's maximum: no precision lost to large logits.
            ref = 0.0
            sum_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offs
                mask = cols < n_cols
                x = tl.load(logits_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
                if HAS_SOFTCAP:
                    x, _ = soft_cap(x, softcap)
                    x = tl.where(mask, x, -float("inf"))
                block_max = tl.max(x, axis=0)
                if in_shard & (local >= start) & (local < start + BLOCK_V):
                    z_y = tl.sum(tl.where(cols == local, x, 0.0), axis=0)
                # A shard (so far) all -inf (a padded vocabulary masked out) sums to 0, not NaN.
                m, s = online_lse_update(m, s, x, block_max)
                if SUM_LOGITS:
                    if start == 0:
                        ref = safe_max(block_max)
                    sum_acc += tl.where(mask, x - ref, 0.0)
            hit = tl.where(in_shard, 1.0, 0.0)
            if SUM_LOGITS:
                sum_z = tl.sum(sum_acc, axis=0) + n_cols * (ref - safe_max(m))
        out = STATS_OUT + row * 5
        tl.store(out, m)
        tl.store(out + 1, s)
        tl.store(out + 2, z_y)
        tl.store(out + 3, hit)
        tl.store(out + 4, sum_z)


@triton.jit
def vocab_parallel_ce_kernel(
    LOGITS, stride_logits, GRAD, stride_grad, TARGET, STATS_IN, stride_rank, NORMS, LOSS, Z_LOSS,
    n_rows, n_cols, world_size, vocab_start, ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row, from every rank's stats (STATS_IN: world_size blocks of [n_rows + 1, 5], stride_rank
    apart): LOSS[row] (ce, unnormalised; NaN when the target is in no shard or in several),
    Z_LOSS[row], and the shard's GRAD row for grad_output = 1 (NORMS as in cross_entropy). GRAD may
    alias LOGITS. With M the global max and S = sum exp(z - M): ce = (M - z_y) + log S, and with
    smoothing eps (1 - eps) ce + eps (log S - sum (z - M) / V), as cross_entropy_kernel."""
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    lse_square_scale = tl.cast(lse_square_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    offs = tl.arange(0, BLOCK_V)
    header = tl.cast(n_rows, tl.int64) * 5
    vocab = 0.0
    for r in range(world_size):
        vocab += tl.load(STATS_IN + tl.cast(r, tl.int64) * stride_rank + header)
    for task in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(task, tl.int64)
        y = tl.load(TARGET + row).to(tl.int64)
        logits_row = LOGITS + row * stride_logits
        grad_row = GRAD + row * stride_grad
        if y == ignore_index:
            store_ignored_row(LOSS, Z_LOSS, grad_row, row, n_cols, HAS_Z_LOSS, COMPUTE_GRAD, BLOCK_V)
        else:
            big_m = -float("inf")
            for r in range(world_size):
                big_m = tl.maximum(big_m, tl.load(STATS_IN + tl.cast(r, tl.int64) * stride_rank + row * 5))
            big_s = 0.0
            z_y = 0.0
            hits = 0.0
            sum_z = 0.0
            for r in range(world_size):
                stats = STATS_IN + tl.cast(r, tl.int64) * stride_rank
                m_r = tl.load(stats + row * 5)
                big_s += tl.load(stats + row * 5 + 1) * tl.exp(m_r - big_m)
                z_y += tl.load(stats + row * 5 + 2)
                hits += tl.load(stats + row * 5 + 3)
                if HAS_SMOOTHING:
                    sum_z += tl.load(stats + row * 5 + 4) + tl.load(stats + header) * (safe_max(m_r) - big_m)
            bad = hits != 1.0
            log_s = tl.log(big_s)
            inv_s = 1.0 / big_s
            loss = (1.0 - label_smoothing) * ((big_m - z_y) + log_s)
            if HAS_SMOOTHING:
                loss += label_smoothing * (log_s - sum_z / vocab)
            tl.store(LOSS + row, tl.where(bad, float("nan"), loss))
            lse = big_m + log_s
            if HAS_Z_LOSS:
                tl.store(Z_LOSS + row, lse_square_scale * lse * lse)
            if COMPUTE_GRAD:
                ce_scale = 1.0 / tl.load(NORMS)
                z_scale = 1.0 / tl.load(NORMS + 1)
                local = y - vocab_start
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offs
                    mask = cols < n_cols
                    x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
                    sech2 = None  # the softcap's derivative
                    if HAS_SOFTCAP:
                        x, sech2 = soft_cap(x, softcap)
                    p = tl.exp(x - big_m) * inv_s
                    g = (1.0 - label_smoothing) * (p - tl.where(cols == local, 1.0, 0.0))
                    if HAS_SMOOTHING:
                        g += label_smoothing * (p - 1.0 / vocab)
                    g = finish_gradient(g, p, sech2, bad, ce_scale, z_scale, lse, lse_square_scale, HAS_Z_LOSS,
                                        HAS_SOFTCAP)
                    tl.store(grad_row + cols, g.to(GRAD.dtype.element_ty), mask=mask)


# ---- launchers and the checks they need ----

def shard_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss):
    """The CrossEntropyOptions of a vocab-parallel call (no class weights, token scaling or argmax)."""
    return CrossEntropyOptions(ignore_index, reduction, label_smoothing, None, lse_square_scale, softcap,
                               return_z_loss=return_z_loss)


def _unit_stride(logits):
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def check_vocab_start(vocab_start) -> None:
    if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)
                                    or vocab_start < 0):
        raise ValueError(f"vocab_start must be a non-negative int (this rank's first vocabulary id) or None, "
                         f"got {vocab_start!r}")


def _check_stats_args(logits, target):
    check_tensor("logits", logits, ndim=2)
    check_target_and_class_weight(target, logits.shape[0], logits.shape[1], None)
    check_same_device(logits=logits, target=target)


def shard_stats(logits2, target, vocab_start, ignore_index, softcap, sum_logits):
    """Checked logits2 [N, V_r] (unit last stride), target [N] -> stats fp32 [N + 1, 5] (STATS)."""
    n_rows, n_cols = logits2.shape
    stats = new_output((n_rows + 1, STATS), torch.float32, logits2.device)
    programs, block, num_warps = launch_config(n_rows, n_cols, logits2.device)
    # Launched even without rows: program 0 writes the width row.
    launch(vocab_parallel_ce_stats_kernel, (programs,),
           logits2, logits2.stride(0), target.contiguous(), stats, n_rows, n_cols, vocab_start, ignore_index,
           float(softcap) if softcap else 1.0,
           HAS_SOFTCAP=bool(softcap), SUM_LOGITS=sum_logits, BLOCK_V=block, num_warps=num_warps)
    return stats


def shard_hit_counts(stats, n_rows: int, world_size: int):
    """fp32 [n_rows]: in how many ranks' shards each row's target lies, from the gathered stats
    [world_size * (n_rows + 1), 5]."""
    return stats.view(world_size, n_rows + 1, STATS)[:, :n_rows, HIT].sum(0)


def hit_check_wanted(*tensors) -> bool:
    """Whether the shard-hit check runs: not with TIGON_CHECK_LABELS=0, during CUDA graph capture
    or while traced (it reads the hits on the host)."""
    return ambient.CHECK_LABELS and not capturing() and not traced(*tensors)


def check_hit_counts(hits, target, ignore_index) -> None:
    """Every non-ignored target in exactly one rank's shard, given ``hits`` [N] (see
    ``shard_hit_counts``): a ValueError otherwise (one host sync)."""
    bad = (target != ignore_index) & (hits != 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        label, count = int(target[i]), int(hits[i])
        where = ("in no rank's vocabulary shard" if count == 0 else
                 f"in {count} ranks' vocabulary shards (they overlap: check vocab_start)")
        raise ValueError(f"target holds {label}, which is not ignore_index={ignore_index} and lies {where} "
                         "(set TIGON_CHECK_LABELS=0 to skip this check, which syncs with the GPU)")


def check_shard_hits(stats, target, world_size, ignore_index) -> None:
    """Every non-ignored target in exactly one rank's shard (one host sync; see the module
    docstring for when it is skipped). Real implementations only."""
    n = target.shape[0]
    if n and hit_check_wanted(stats, target):
        check_hit_counts(shard_hit_counts(stats, n, world_size), target, ignore_index)


def _check_loss_args(logits, target, stats, world_size):
    _check_stats_args(logits, target)
    check_tensor("stats", stats, ndim=2)
    check_same_device(logits=logits, stats=stats)
    if stats.dtype != torch.float32 or stats.shape[1] != STATS or stats.shape[0] != world_size * (target.shape[0] + 1):
        raise ValueError(f"stats must be float32 [world_size * (N + 1), {STATS}] = [{world_size} * "
                         f"{target.shape[0] + 1}, {STATS}] (every rank's vocab_parallel_cross_entropy_stats), "
                         f"got {stats.dtype} {tuple(stats.shape)}")


def sharded_loss_rows(logits2, target, stats, world_size, vocab_start, opts: CrossEntropyOptions, norms, grad):
    """Launch on checked inputs (target contiguous) -> (loss rows fp32 [N], z-loss rows fp32 [N] or
    None), not reduced; grad (None: not computed; it may be logits2) receives the rows' d loss /
    d logits2 for grad_output = 1, normalised by ``norms`` (``cross_entropy_norms``; a chunked
    caller passes those of its whole call)."""
    n_rows, n_cols = logits2.shape
    device = logits2.device
    loss = new_output((n_rows,), torch.float32, device)
    z_rows = new_output((n_rows,), torch.float32, device) if opts.lse_square_scale else None
    programs, block, num_warps = launch_config(n_rows, n_cols, device)
    if n_rows:
        launch(vocab_parallel_ce_kernel, (programs,),
               logits2, logits2.stride(0), grad if grad is not None else logits2,
               grad.stride(0) if grad is not None else 0, target, stats, (n_rows + 1) * STATS, norms,
               loss, z_rows if z_rows is not None else loss,
               n_rows, n_cols, world_size, vocab_start, opts.ignore_index, float(opts.label_smoothing),
               float(opts.lse_square_scale), float(opts.softcap) if opts.softcap else 1.0,
               HAS_SOFTCAP=bool(opts.softcap), HAS_SMOOTHING=opts.label_smoothing > 0,
               HAS_Z_LOSS=bool(opts.lse_square_scale), COMPUTE_GRAD=grad is not None,
               BLOCK_V=block, num_warps=num_warps)
    return loss, z_rows


def sharded_rows(logits2, target, stats, world_size, vocab_start, opts: CrossEntropyOptions, grad):
    """Launch on checked inputs -> (loss, z_loss or None), reduced as opts say; grad (None: not
    computed; it may be logits2) receives d loss / d logits2 for grad_output = 1."""
    check_option_values(opts)
    check_shard_hits(stats, target, world_size, opts.ignore_index)
    target = target.contiguous()
    norms = cross_entropy_norms(target, opts)
    loss, z_rows = sharded_loss_rows(logits2, target, stats, world_size, vocab_start, opts, norms, grad)
    loss, z_loss, _, _ = reduce_loss_rows(loss, z_rows, None, norms, target, opts)
    return loss, z_loss


def _fake_losses(n_rows, opts: CrossEntropyOptions, like):
    rows = (n_rows,) if opts.reduction == "none" else ()
    return (like.new_empty(rows, dtype=torch.float32),
            like.new_empty(rows if opts.returns_z_loss else (0,), dtype=torch.float32))


# ---- custom ops ----
#
# tigon::vocab_parallel_cross_entropy_stats: the first pass (no autograd: its output is a
# constant of the loss's gradient). tigon::vocab_parallel_cross_entropy: (loss, z_loss, grad)
# from the gathered stats, the loss differentiable (backward: grad scaled by grad_output).
# tigon::vocab_parallel_cross_entropy_ writes the gradient over the logits (eager inplace=True only,
# with ShardedCrossEntropyOverLogits as its autograd; a plain custom op, as cross_entropy_).


@kernel_op("tigon::vocab_parallel_cross_entropy_stats", mutates_args=())
def vocab_parallel_cross_entropy_stats_op(logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int,
                                          softcap: Optional[float], sum_logits: bool) -> Tensor:
    """stats fp32 [N + 1, 5] of this rank's logits [N, V_r] (ids from vocab_start) and target [N]."""
    _check_stats_args(logits, target)
    return shard_stats(_unit_stride(logits), target, vocab_start, ignore_index, softcap, sum_logits)


@vocab_parallel_cross_entropy_stats_op.register_fake
def _(logits, target, vocab_start, ignore_index, softcap, sum_logits):
    _check_stats_args(logits, target)
    return logits.new_empty((logits.shape[0] + 1, STATS), dtype=torch.float32)


@kernel_op("tigon::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_cross_entropy_op(logits: Tensor, target: Tensor, stats: Tensor, world_size: int,
                                    vocab_start: int, ignore_index: int, reduction: str, label_smoothing: float,
                                    lse_square_scale: float, softcap: Optional[float], return_z_loss: bool,
                                    compute_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, z_loss, grad) of this rank's logits [N, V_r] and target [N] (global ids), from stats
    [world_size * (N + 1), 5] (every rank's stats, in rank order); z_loss empty unless asked for;
    grad: d loss / d logits for grad_output 1 ([N, V_r], logits' dtype) with ``compute_grad``."""
    opts = shard_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
    _check_loss_args(logits, target, stats, world_size)
    logits2 = _unit_stride(logits)
    grad = new_output(logits2.shape, logits2.dtype, logits2.device) if compute_grad else None
    loss, z_loss = sharded_rows(logits2, target, stats, world_size, vocab_start, opts, grad)
    return loss, or_empty(z_loss, loss), or_empty(grad, logits)


@vocab_parallel_cross_entropy_op.register_fake
def _(logits, target, stats, world_size, vocab_start, ignore_index, reduction, label_smoothing, lse_square_scale,
      softcap, return_z_loss, compute_grad):
    opts = shard_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
    _check_loss_args(logits, target, stats, world_size)
    return (*_fake_losses(logits.shape[0], opts, logits), fake_grad(logits, compute_grad, logits))


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[2])  # the gradient, formed in the forward pass
    ctx.per_row = inputs[6] == "none"
    ctx.has_grad = inputs[-1]


def _backward(ctx, grad_loss, _grad_z_loss, _grad_grad):
    grad_logits = None
    if grad_loss is not None and ctx.has_grad and ctx.needs_input_grad[0]:
        (grad,) = ctx.saved_tensors
        grad_logits = scaled_gradient(grad, loss_scale(grad_loss, ctx.per_row))
    return (grad_logits,) + (None,) * 11


vocab_parallel_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


@custom_op("tigon::vocab_parallel_cross_entropy_", mutates_args=("logits",))
def vocab_parallel_cross_entropy_inplace_op(logits: Tensor, target: Tensor, stats: Tensor, world_size: int,
                                            vocab_start: int, ignore_index: int, reduction: str,
                                            label_smoothing: float, lse_square_scale: float,
                                            softcap: Optional[float], return_z_loss: bool) -> tuple[Tensor, Tensor]:
    """(loss, z_loss) as tigon::vocab_parallel_cross_entropy, d loss / d logits (grad_output 1)
    written over ``logits`` (unit last stride, rows not sharing memory)."""
    opts = shard_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
    _check_writable(logits, target, stats, world_size)
    loss, z_loss = sharded_rows(logits, target, stats, world_size, vocab_start, opts, logits)
    return loss, or_empty(z_loss, loss)


@vocab_parallel_cross_entropy_inplace_op.register_fake
def _(logits, target, stats, world_size, vocab_start, ignore_index, reduction, label_smoothing, lse_square_scale,
      softcap, return_z_loss):
    opts = shard_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
    _check_writable(logits, target, stats, world_size)
    return _fake_losses(logits.shape[0], opts, logits)


def _check_writable(logits, target, stats, world_size):
    _check_loss_args(logits, target, stats, world_size)
    if not writable_rows(logits):
        raise ValueError(f"vocab_parallel_cross_entropy_ writes the gradient over logits: they need unit last stride "
                         f"and rows not sharing memory, got strides {logits.stride()} for shape {tuple(logits.shape)}")


class ShardedCrossEntropyOverLogits(torch.autograd.Function):
    """The autograd of tigon::vocab_parallel_cross_entropy_ (eager ``inplace=True``), as
    ``CrossEntropyOverLogits``: the logits' memory, now the gradient, is saved and scaled by
    grad_output in the backward."""

    @staticmethod
    def forward(ctx, logits, target, stats, world_size, vocab_start, opts: CrossEntropyOptions):
        loss, z_loss = vocab_parallel_cross_entropy_inplace_op(
            logits, target, stats, world_size, vocab_start, opts.ignore_index, opts.reduction, opts.label_smoothing,
            opts.lse_square_scale, opts.softcap, opts.return_z_loss)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss)
        ctx.save_for_backward(logits.detach())
        ctx.per_row = opts.reduction == "none"
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss):
        if grad_loss is None:
            return (None,) * 6
        (grad,) = ctx.saved_tensors
        return (scaled_gradient(grad, loss_scale(grad_loss, ctx.per_row)),) + (None,) * 5


# ---- the collectives around the ops ----

def process_group(group):
    """(group, world size): ``group`` checked, or the default group when torch.distributed is
    initialised, else (None, 1)."""
    import torch.distributed as dist

    if group is not None:
        if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        return group, dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size()
    return None, 1


def gather_rows(t, group):
    """Every rank's t [R, C], concatenated in rank order: [world * R, C]. A functional collective:
    torch.compile traces it (eager: it waits for the result)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.13: the latter
    return funcol.wait_tensor(gather(t, 0, group))


def shard_widths(n_cols: int, group, device) -> list[int]:
    """Every rank's shard width, in rank order: an all-gather and a host sync."""
    return gather_rows(torch.tensor([[n_cols]], dtype=torch.int64, device=device), group).view(-1).tolist()


@torch.compiler.disable
def shard_start(n_cols: int, group, device) -> int:
    """This rank's first vocabulary id: the widths of the shards of lower ranks (``shard_widths``;
    under torch.compile, a graph break)."""
    import torch.distributed as dist

    return sum(shard_widths(n_cols, group, device)[:dist.get_rank(group)])


def sharded_cross_entropy(logits2, target, group, world_size, vocab_start, opts: CrossEntropyOptions,
                          compute_grad: bool, inplace: bool = False):
    """(loss, z_loss or empty) of this rank's logits2 [N, V_r] and target [N] over ``group``
    (None: world_size 1, no collective). vocab_start None: gathered. ``inplace``: the gradient is
    written over logits2 (rows sharing memory excepted; eager only)."""
    logits2 = _unit_stride(logits2)  # once, for both passes
    if vocab_start is None:
        vocab_start = shard_start(logits2.shape[1], group, logits2.device) if world_size > 1 else 0
    stats = vocab_parallel_cross_entropy_stats_op(logits2.detach(), target, vocab_start, opts.ignore_index,
                                                  opts.softcap, opts.label_smoothing > 0)
    if world_size > 1:
        stats = gather_rows(stats, group)
    args = (target, stats, world_size, vocab_start)
    if inplace and compute_grad and not torch.compiler.is_compiling() and not rows_alias(logits2):
        return ShardedCrossEntropyOverLogits.apply(logits2, *args, opts)
    loss, z_loss, _ = vocab_parallel_cross_entropy_op(
        logits2, *args, opts.ignore_index, opts.reduction, opts.label_smoothing, opts.lse_square_scale, opts.softcap,
        opts.return_z_loss, compute_grad)
    return loss, z_loss
