"""Fused linear cross entropy over a vocabulary split across the ranks of a group (a
tensor-parallel output head): loss(x @ W^T + b, y) with no rank ever holding more than one
chunk of its shard's logits.

Each rank holds rows [vocab_start, vocab_start + V_r) of the [V, H] head weight (and of the
bias); x [..., H] and target [...] (global ids) are the same on every rank. The rows of x are
taken in chunks, as tigon's fused linear cross entropy takes them (``linear_loss_chunks``).
For each chunk:
1. logits_r = x_c @ W_r^T (+ b_r) into one reused [chunk, V_r] buffer;
2. the shard's row stats (``shard_stats``: max, sum exp, target logit, ...), all-gathered over
   the group (``gather_rows``), every rank then combining the same numbers in the same order;
3. the vocab-parallel cross-entropy kernel writes the rows' losses and, over the buffer,
   d loss / d logits_r for grad_output 1, normalised by the norms of the whole call ("mean":
   the non-ignored rows of all chunks, not of the chunk);
4. dx_c = dlogits @ W_r (this shard's part of it), dW_r += dlogits^T @ x_c, db_r += column sums.
After the chunks dx is all-reduced (sum) over the group: x is replicated, so every rank gets
its whole gradient. Every rank returns the same loss (bitwise). The backward only scales the
stored gradients by grad_output. Reduction "none" (a per-row grad_output): the forward computes
the losses only and keeps the gathered stats; the backward forms each chunk's logits again and,
from the kept stats (no gather), their gradient times the rows' grad_output (four matmuls), and
all-reduces dx there.

Collectives a call: an all-gather of [chunk + 1, 5] fp32 stats per chunk and an all-reduce of dx
[N, H]. The ranks must walk the same chunks, whose rows follow from the widest shard: for a
plain weight on several ranks the shard widths are all-gathered first (one more collective and
a host sync; they also give vocab_start when it is None); a DTensor weight's widths follow from
its global shape (no gather). Targets in no shard (or several) raise a ValueError on every rank
after the chunks (one host sync; skipped as for ``vocab_parallel_cross_entropy``).

Every rank must make the same call (shapes, options, chunk_budget, which inputs require grad)
and run its backward: every chunk is a collective.

Memory per rank: the [chunk, V_r] buffer (x's dtype), dx [N, H] (x's dtype), dW_r [V_r, H]
(W's dtype), db_r fp32 [V_r], hit counts fp32 [N]; "none" keeps world * (N + chunks) * 5 fp32
stats for the backward instead of the gradients.

torch.compile: the call is a graph break (``torch.compiler.disable``; it runs eagerly, between
compiled graphs), except with one rank and no vocab_start, where tigon.functional runs
``fused_linear_cross_entropy``, which compiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._common import as_rows, autocast_off, cdiv, is_dtensor
from tigon.ops._cross_entropy_common import (
    CrossEntropyOptions,
    check_option_values,
    check_target_and_class_weight,
    cross_entropy_norms,
    loss_scale,
    reduce_loss_rows,
)
from tigon.ops._gradient_scaling import scaled_gradient
from tigon.ops.fused_linear_cross_entropy import (
    check_flce_args,
    chunk_rows_for_budget,
    fused_linear_cross_entropy_op,
    joined_rows,
    linear_loss_chunks,
)
from tigon.ops.vocab_parallel_cross_entropy import (
    check_hit_counts,
    check_vocab_start,
    gather_rows,
    hit_check_wanted,
    process_group,
    shard_hit_counts,
    shard_stats,
    shard_widths,
    sharded_loss_rows,
)

VOCAB_SHARDED = "placements (Shard(0),) over a 1-D DeviceMesh, as torch's ColwiseParallel shards nn.Linear's weight"


class ShardLayout(NamedTuple):
    """Where this rank's vocabulary shard lies, and what every rank agrees on."""

    group: object  # the torch.distributed ProcessGroup; None with one rank
    world_size: int
    vocab_start: int  # this rank's first vocabulary id
    widest: int  # the widest shard's V_r: chunks are sized by it, so every rank walks the same rows


def plain_layout(width: int, group, vocab_start, device) -> ShardLayout:
    """The layout of a plain [V_r, H] shard over ``group`` (None: the default group, or one rank
    when torch.distributed is not initialised). With several ranks the widths are all-gathered
    (a collective and a host sync)."""
    group, world_size = process_group(group)
    if world_size == 1:
        return ShardLayout(None, 1, vocab_start or 0, width)
    import torch.distributed as dist

    widths = shard_widths(width, group, device)
    if vocab_start is None:
        vocab_start = sum(widths[:dist.get_rank(group)])
    return ShardLayout(group, world_size, vocab_start, max(widths))


def dtensor_layout(weight) -> tuple[ShardLayout, int]:
    """(layout, this rank's V_r) of a DTensor weight [V, H] sharded over the vocabulary, split as
    DTensor splits it (torch.chunk's rule: ceil(V / ranks) rows a rank, fewer or none at the end)."""
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard() or placements[0].dim not in (0, -2):
        raise ValueError(f"weight is a DTensor with placements {placements} over a mesh of shape {tuple(mesh.shape)}; "
                         f"vocab_parallel_linear_cross_entropy takes one sharded over the vocabulary: {VOCAB_SHARDED}")
    world_size, vocab = mesh.size(), weight.shape[0]
    widest = cdiv(vocab, world_size)
    start = min(mesh.get_local_rank() * widest, vocab)
    group = mesh.get_group() if world_size > 1 else None
    return ShardLayout(group, world_size, start, widest), min(widest, vocab - start)


def _replicated_local(name: str, t, mesh=None):
    """t's local tensor when t is a DTensor replicated over its mesh (``mesh`` when given), else t."""
    if not is_dtensor(t):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise ValueError(f"{name} is a DTensor with placements {tuple(t.placements)}; it must be the same on every "
                         "rank: a plain tensor, or a DTensor with Replicate() placements")
    if mesh is not None and t.device_mesh != mesh:
        raise ValueError(f"{name} is a DTensor over another mesh ({t.device_mesh}) than weight's ({mesh})")
    return t.to_local()


def local_inputs(x, weight, target, bias, group, vocab_start):
    """(x, weight, target, bias, layout) with DTensors replaced by their local tensors, through
    ``to_local`` (differentiable: their gradients come back as DTensors placed as they are), and
    checked; the layout last, as its gather is a collective every rank must reach."""
    mesh = None
    if is_dtensor(weight):
        if group is not None or vocab_start is not None:
            raise ValueError("group and vocab_start come from a DTensor weight's mesh and placement: leave them None "
                             f"(got group={group!r}, vocab_start={vocab_start!r})")
        mesh = weight.device_mesh
        layout, width = dtensor_layout(weight)
        weight = weight.to_local()
        if weight.shape[0] != width:
            raise ValueError(f"weight's local shard has {weight.shape[0]} rows, but DTensor's split of its vocabulary "
                             f"over {layout.world_size} ranks gives this rank {width}")
        if is_dtensor(bias):
            placements = tuple(bias.placements)
            if (bias.device_mesh != mesh or len(placements) != 1 or not placements[0].is_shard()
                    or placements[0].dim not in (0, -1)):
                raise ValueError(f"bias is a DTensor with placements {placements} over {bias.device_mesh}; with a "
                                 f"DTensor weight it must be sharded as the weight is, over its mesh: {VOCAB_SHARDED}")
            bias = bias.to_local()
    elif is_dtensor(bias):
        raise ValueError("bias is a DTensor but weight is not: pass both as DTensors, or both as this rank's shards")
    x = _replicated_local("x", x, mesh)
    target = _replicated_local("target", target, mesh)
    check_flce_args(x, weight, target, bias)
    check_target_and_class_weight(target.reshape(-1), target.numel(), weight.shape[0], None)
    if mesh is None:
        layout = plain_layout(weight.shape[0], group, vocab_start, x.device)
    return x, weight, target, bias, layout


def _all_reduce_sum(t, layout: ShardLayout) -> None:
    if t is not None and layout.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(t, group=layout.group)


class ShardChunkLoss:
    """``chunk_loss`` of ``linear_loss_chunks`` for a vocabulary shard: the chunk's stats,
    all-gathered, then its rows' losses and (over the logits) their gradient. ``keep_stats``
    keeps the gathered stats (for the backward of reduction "none"), which ``saved_stats`` hands
    back there: no collective then. ``count_hits`` counts the shards holding each row's target."""

    def __init__(self, target, layout: ShardLayout, opts: CrossEntropyOptions, norms, *, keep_stats=False,
                 count_hits=False, saved_stats=None):
        self.target, self.layout, self.opts, self.norms = target, layout, opts, norms
        self.stats = [] if keep_stats else None
        self.saved = None if saved_stats is None else iter(saved_stats)
        self.hits = torch.zeros(target.shape[0], dtype=torch.float32, device=target.device) if count_hits else None

    def __call__(self, logits, start, stop, grad):
        target, layout, opts = self.target[start:stop], self.layout, self.opts
        if self.saved is not None:
            stats = next(self.saved)
        else:
            stats = shard_stats(logits, target, layout.vocab_start, opts.ignore_index, opts.softcap,
                                opts.label_smoothing > 0)
            if layout.world_size > 1:
                stats = gather_rows(stats, layout.group)
            if self.stats is not None:
                self.stats.append(stats)
            if self.hits is not None:
                self.hits[start:stop] = shard_hit_counts(stats, stop - start, layout.world_size)
        return sharded_loss_rows(logits, target, stats, layout.world_size, layout.vocab_start, opts, self.norms, grad)

    def check_hits(self) -> None:
        """A ValueError (on every rank: they hold the same stats) for a target in no shard or several."""
        if self.hits is not None:
            check_hit_counts(self.hits, self.target, self.opts.ignore_index)


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """The chunk walk and its autograd over local tensors: x [..., H], weight [V_r, H], bias [V_r]
    or None, target [...] -> (loss fp32: a scalar, or [N] for "none"; z_loss fp32, empty unless
    asked for). ``need``: which of dx, dW, db to form (the same on every rank)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, layout: ShardLayout, opts: CrossEntropyOptions, chunk_budget: int,
                need: tuple[bool, bool, bool]):
        x2 = as_rows(x)
        target1 = target.reshape(-1).contiguous()
        norms = cross_entropy_norms(target1, opts)  # of the whole call, for every chunk
        chunk_rows = chunk_rows_for_budget(x2.shape[0], layout.widest, x2.element_size(), chunk_budget)
        per_row = opts.reduction == "none"
        in_forward = not per_row  # "none": the gradient depends on each row's grad_output
        need_dx, need_dw, need_db = (n and in_forward for n in need)
        chunk_loss = ShardChunkLoss(target1, layout, opts, norms, keep_stats=per_row and any(need),
                                    count_hits=bool(target1.numel()) and hit_check_wanted(x2, target1))
        with autocast_off(x2.device.type):
            outputs, dx, dw, db = linear_loss_chunks(x2, weight, bias, chunk_rows, chunk_loss, need_dx=need_dx,
                                                     need_dw=need_dw, need_db=need_db, accum_dtype=None)
        chunk_loss.check_hits()
        loss_parts, z_parts = (list(parts) for parts in zip(*outputs)) if outputs else ([], [])
        loss, z_loss, _, _ = reduce_loss_rows(
            joined_rows(loss_parts, True, torch.float32, x2.device),
            joined_rows(z_parts, bool(opts.lse_square_scale), torch.float32, x2.device), None, norms, target1, opts)
        _all_reduce_sum(dx, layout)
        z_loss = z_loss if z_loss is not None else loss.new_empty(0)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z_loss)
        ctx.per_row, ctx.need, ctx.x_shape = per_row, need, x.shape
        ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if per_row:  # the backward recomputes from the inputs and the kept stats
            ctx.save_for_backward(x, target1, *(chunk_loss.stats or ()))
            # Parameters kept, not saved (see the note in tigon.ops._common).
            ctx.weight, ctx.bias, ctx.layout, ctx.opts, ctx.chunk_rows = weight, bias, layout, opts, chunk_rows
        else:
            ctx.save_for_backward(dx, dw, db)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_z_loss):
        need_dx, need_dw, need_db = (n and ctx.needs_input_grad[i] for i, n in enumerate(ctx.need))
        dx = dw = db = None
        if grad_loss is not None and (need_dx or need_dw or need_db):
            if ctx.per_row:
                x, target, *stats = ctx.saved_tensors
                x2 = as_rows(x)
                chunk_loss = ShardChunkLoss(target, ctx.layout, ctx.opts, cross_entropy_norms(target, ctx.opts),
                                            saved_stats=stats)
                with autocast_off(x2.device.type):
                    _, dx, dw, db = linear_loss_chunks(
                        x2, ctx.weight, ctx.bias, ctx.chunk_rows, chunk_loss, need_dx=need_dx, need_dw=need_dw,
                        need_db=need_db, accum_dtype=None, row_scale=loss_scale(grad_loss, True))
                _all_reduce_sum(dx, ctx.layout)
            else:
                dx, dw, db = ctx.saved_tensors
                scale = loss_scale(grad_loss, False)
                dx = scaled_gradient(dx, scale) if need_dx else None
                dw = scaled_gradient(dw, scale) if need_dw else None
                db = db * scale if need_db else None
        w_dtype, b_dtype = ctx.param_dtypes
        return (dx.view(ctx.x_shape) if dx is not None else None,
                dw.to(w_dtype) if dw is not None else None,
                db.to(b_dtype) if db is not None else None) + (None,) * 5


@torch.compiler.disable
def vocab_parallel_linear_cross_entropy(x, weight, target, bias, group, vocab_start, opts: CrossEntropyOptions,
                                        chunk_budget: int):
    """(loss fp32, z_loss fp32 or empty) of cross_entropy(x @ weight.T + bias, target) over a
    vocabulary split across ranks. weight [V_r, H]: this rank's shard (ids from ``vocab_start``,
    None: gathered) over ``group``, or a DTensor [V, H] sharded over the vocabulary (group and
    start from its mesh and placement); bias [V_r] (a DTensor with the weight's placement) or
    None; x [..., H] and target [...] the same on every rank (or Replicate DTensors). One rank
    at vocab_start 0 is tigon::fused_linear_cross_entropy. ``chunk_budget``: bytes, checked."""
    check_option_values(opts)
    check_vocab_start(vocab_start)
    x, weight, target, bias, layout = local_inputs(x, weight, target, bias, group, vocab_start)
    grad = torch.is_grad_enabled()
    need = tuple(grad and t is not None and t.requires_grad for t in (x, weight, bias))
    if layout.world_size == 1 and layout.vocab_start == 0:
        return fused_linear_cross_entropy_op(x, weight, target, bias, *opts, chunk_budget, None, *need)[:2]
    return VocabParallelLinearCrossEntropy.apply(x, weight, bias, target, layout, opts, chunk_budget, need)
