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

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
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
    N_OPTIONS,
    CrossEntropyOptions,
    check_option_values,
    check_target_and_class_weight,
    checked_norms,
    fake_op_loss_outputs,
    kernel_target_and_options,
    loss_scale,
    op_loss_outputs,
    writable_rows,
)
from tigon.ops._gradient_scaling import scaled_gradient
from tigon.ops._internals import launch
from tigon.ops._jit_math import online_lse_update, safe_max, soft_cap


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


# ---- custom ops: torch.ops.tigon.cross_entropy, and tigon::cross_entropy_ writing over the logits ----
#
# Schema: logits [N, V], target [N], then CrossEntropyOptions' fields in order, then what to
# compute. The loss outputs are fp32 (predicted tokens int64), one per row for reduction "none",
# else 0-dim; those a call did not ask for are empty tensors (custom ops cannot return None).


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
