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
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tigon.ops._common import cdiv, check_same_device, check_tensor, next_pow2
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
    ``offer``; the embedding's backward then adds into it and returns the sum."""

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


def check_embedding_args(ids, weight, padding_idx):
    check_tensor("weight", weight, ndim=2)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    check_same_device(weight=weight, ids=ids)
    if padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        raise ValueError(f"padding_idx {padding_idx} is out of range for {weight.shape[0]} embeddings")


class EmbeddingFunction(torch.autograd.Function):
    """weight[ids] ([..., H]); backward as described in the module docstring. ``slot``: a
    TiedGradSlot shared with the tied output head's FLCE of the same forward, or None."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx=None, slot=None):
        check_embedding_args(ids, weight, padding_idx)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += weight.shape[0]
        out = F.embedding(ids, weight)  # a gather; its range check raises on a bad id
        ctx.save_for_backward(ids)
        ctx.padding_idx = padding_idx
        ctx.weight_meta = (weight.shape, weight.dtype, weight.device)
        ctx.slot = slot if slot is not None and slot.register_embedding(ctx) else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.weight_meta
        grad_weight = ctx.slot.take() if ctx.slot is not None else None
        if grad_weight is None:
            grad_weight = torch.zeros(shape, dtype=dtype, device=device)
        embedding_backward_accumulate_(grad_weight, ids, grad_out, ctx.padding_idx)
        return None, grad_weight, None, None
