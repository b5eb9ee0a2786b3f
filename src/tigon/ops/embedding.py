"""Embedding lookup whose backward adds into a gradient buffer instead of allocating one.

out = weight[ids] for ids [...] (int) and weight [V, H]; out is [..., H] in weight's dtype.
The backward sorts the ids once and sums each token's rows in fp32 (in a fixed order:
deterministic), then adds the sum into row ``token`` of the weight's gradient.

Why: with tied input / output embeddings (Llama 3.2, Qwen2.5 small, Gemma) the output head's
[V, H] gradient already exists when the embedding's backward runs (FLCE computes it in its
forward). PyTorch's embedding backward allocates a second zero-filled [V, H] gradient and
autograd then sums the two: 0.5 GiB at the very end of the backward for a 1B Llama, 1.1 GiB
for Gemma 2. With a ``TiedGradSlot`` shared between this op and the fused linear cross
entropy of one forward, the head hands its gradient to the slot and this backward adds the
embedding's rows into it, so the weight's gradient arrives once, complete, from this op.

Custom ops: ``torch.ops.tigon.embedding`` (the forward) and ``tigon::embedding_backward`` (a new
zero gradient with the rows added), called from its registered backward unless the slot holds
the head's gradient (eager only; under torch.compile each op returns its own gradient).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from tigon import ambient
from tigon.ops._common import cdiv, check_same_device, check_tensor, kernel_op, next_pow2
from tigon.ops._internals import engine_will_run, launch

# Sorted rows summed per loop step: one [ROWS, BLOCK_H] tile, masked to the token's rows.
SEGMENT_ROWS = 32


@triton.jit
def embedding_backward_accumulate_kernel(
    sorted_ids_ptr, order_ptr, grad_out_ptr, grad_weight_ptr,
    n_rows, n_cols, stride_grad_out, stride_grad_weight, padding_idx,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """grad_weight[t, cols] += sum of grad_out[r, cols] over the rows r with ids[r] == t.

    One program per (sorted position, column block). Only the first position of a token's run
    in the sorted ids does work: it walks the run ROWS rows at a time, in order, in fp32.
    """
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    token = tl.load(sorted_ids_ptr + pos)
    previous = tl.load(sorted_ids_ptr + pos - 1, mask=pos > 0, other=-2)
    run = (token != previous) & (token != padding_idx)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    base = pos
    while run:
        rows = base + tl.arange(0, ROWS)
        ids = tl.load(sorted_ids_ptr + rows, mask=rows < n_rows, other=-2)
        mine = ids == token
        src = tl.load(order_ptr + rows, mask=mine, other=0)
        vals = tl.load(grad_out_ptr + src[:, None] * stride_grad_out + cols[None, :],
                       mask=mine[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(vals.to(tl.float32), axis=0)
        base += ROWS
        following = tl.load(sorted_ids_ptr + base, mask=base < n_rows, other=-2)
        run = following == token
    # Compared as a [BLOCK_H] vector: the interpreter rejects a load mask broadcast from a scalar.
    token_row = token + tl.zeros((BLOCK_H,), dtype=tl.int64)
    write = col_mask & (token_row != previous) & (token_row != padding_idx)
    dst = grad_weight_ptr + token * stride_grad_weight + cols
    old = tl.load(dst, mask=write, other=0.0)
    tl.store(dst, (old.to(tl.float32) + acc).to(grad_weight_ptr.dtype.element_ty), mask=write)


def embedding_backward_accumulate_(grad_weight: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor,
                                   padding_idx: int | None = None) -> torch.Tensor:
    """grad_weight [V, H] += the embedding gradient of grad_out [..., H] at ids [...], in place.
    Rows of ``padding_idx`` get nothing (as nn.Embedding). Returns grad_weight."""
    flat_ids = ids.reshape(-1)
    n_rows = flat_ids.numel()
    n_cols = grad_weight.shape[1]
    if n_rows == 0 or n_cols == 0:
        return grad_weight
    g2 = grad_out.reshape(n_rows, n_cols)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    block_h = min(256, max(16, next_pow2(n_cols)))
    launch(embedding_backward_accumulate_kernel, (n_rows, cdiv(n_cols, block_h)),
        sorted_ids, order, g2, grad_weight, n_rows, n_cols, g2.stride(0), grad_weight.stride(0),
        -1 if padding_idx is None else padding_idx, ROWS=SEGMENT_ROWS, BLOCK_H=block_h,
        num_warps=4 if block_h >= 128 else 2)
    return grad_weight


class TiedGradSlot:
    """Couples one embedding call and one output-head call of the same forward that share a
    weight. The head's backward (which runs first) may hand its weight gradient over with
    ``offer``; the embedding's backward then adds into it and returns the sum. Eager only: the
    functional entries pass it to the ops' autograd through ``tied_grad_slot`` (under
    torch.compile they do not, and each op returns its own gradient)."""

    def __init__(self):
        self._embedding_node = None  # weakref to the embedding's autograd node
        self.grad = None

    def register_embedding(self, node) -> bool:
        """Record the embedding call of this forward (the first one only). True if recorded."""
        if self._embedding_node is not None:
            return False
        self._embedding_node = weakref.ref(node)
        return True

    def offer(self, grad_weight: torch.Tensor) -> bool:
        """Called from the head's backward: keep ``grad_weight`` for the embedding's backward if
        that backward will run in this backward pass. False: the head must return it itself."""
        node = self._embedding_node() if self._embedding_node is not None else None
        if node is None or self.grad is not None:
            return False
        will_run = engine_will_run(node)
        if will_run:
            self.grad = grad_weight
        return will_run

    def take(self) -> torch.Tensor | None:
        grad, self.grad = self.grad, None
        return grad


@contextlib.contextmanager
def tied_grad_slot(slot: TiedGradSlot | None):
    """Within the block, an embedding or fused linear cross entropy op call records ``slot`` on
    its autograd node (eager mode; the functional entries use it). Nothing is set for a None
    slot, nor under torch.compile (where each op returns its own gradient)."""
    if slot is None or torch.compiler.is_compiling():
        yield
        return
    with ambient.thread_value(ambient.TIED_GRAD_SLOT, slot):
        yield


def current_tied_slot() -> TiedGradSlot | None:
    """The slot set by ``tied_grad_slot`` (None under torch.compile)."""
    return None if torch.compiler.is_compiling() else ambient.TIED_GRAD_SLOT.value


def check_embedding_args(ids, weight, padding_idx):
    check_tensor("weight", weight, ndim=2)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    check_same_device(weight=weight, ids=ids)
    if padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        raise ValueError(f"padding_idx {padding_idx} is out of range for {weight.shape[0]} embeddings")


def check_padding_idx(padding_idx) -> None:
    """padding_idx None or an int (the functional entry and the real implementation: a fake one
    may get a symbolic int)."""
    if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)):
        raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")


# ---- custom ops: torch.ops.tigon.embedding and its backward ----

@kernel_op("tigon::embedding", mutates_args=())
def embedding_op(ids: Tensor, weight: Tensor, padding_idx: Optional[int]) -> Tensor:
    """weight[ids]: ids [...] integer, weight [V, H] -> [..., H] in weight's dtype. ``padding_idx``
    rows get no gradient."""
    check_padding_idx(padding_idx)
    check_embedding_args(ids, weight, padding_idx)
    return F.embedding(ids, weight)  # a gather; its range check raises on a bad id


@embedding_op.register_fake
def _(ids, weight, padding_idx):
    check_embedding_args(ids, weight, padding_idx)
    return weight.new_empty((*ids.shape, weight.shape[1]))


@kernel_op("tigon::embedding_backward", mutates_args=())
def embedding_backward_op(grad_out: Tensor, ids: Tensor, n_embeddings: int, padding_idx: Optional[int]) -> Tensor:
    """The weight's gradient [n_embeddings, H] (grad_out's dtype) of the embedding of ids [...],
    for grad_out [..., H]; rows of ``padding_idx`` (in [0, n_embeddings)) stay zero."""
    grad_weight = torch.zeros((n_embeddings, grad_out.shape[-1]), dtype=grad_out.dtype, device=grad_out.device)
    return embedding_backward_accumulate_(grad_weight, ids, grad_out, padding_idx)


@embedding_backward_op.register_fake
def _(grad_out, ids, n_embeddings, padding_idx):
    return grad_out.new_empty((n_embeddings, grad_out.shape[-1]))


def _setup_context(ctx, inputs, output):
    ids, weight, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.n_embeddings = weight.shape[0]
    ctx.padding_idx = padding_idx + weight.shape[0] if padding_idx is not None and padding_idx < 0 else padding_idx
    slot = current_tied_slot()
    ctx.slot = slot if slot is not None and slot.register_embedding(ctx) else None


def _backward(ctx, grad_out):
    if grad_out is None or not ctx.needs_input_grad[1]:
        return None, None, None
    (ids,) = ctx.saved_tensors
    head_grad = ctx.slot.take() if ctx.slot is not None else None
    if head_grad is not None:  # eager: the tied head's [V, H] gradient, our rows added in place
        return None, embedding_backward_accumulate_(head_grad, ids, grad_out, ctx.padding_idx), None
    return None, embedding_backward_op(grad_out, ids, ctx.n_embeddings, ctx.padding_idx), None


embedding_op.register_autograd(_backward, setup_context=_setup_context)
