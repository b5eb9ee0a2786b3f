"""One chunked base for every post-training loss: the logits are formed a chunk of rows at a time.

A loss is written as a function of one chunk, ``chunk_fn(*chunked, *shared) -> (loss_share,
metrics)``: ``chunked`` tensors are indexed by the chunk's rows (hidden states, targets, the
reference's hidden states...), ``shared`` ones are whole (lm_head weight and bias). The loss
must be a sum over chunks (its normalisers computed from the whole batch beforehand), so the
chunk gradients add up to the full gradients exactly.

Eager (``ChunkedLossFunction``): the forward walks the chunks and takes each chunk's loss share
and its gradients with respect to the differentiable inputs (``torch.autograd.grad`` over the
chunk, whose inputs are fresh leaves; with ``compiled=True`` the chunk_fn runs under
``torch.compile`` with dynamic shapes). Row chunks are disjoint, so a chunked input's gradient
is written once, in its own dtype; a shared input's gradient is summed over chunks in its
dtype (fp32 for fp32 parameters; one rounding per chunk for bf16), a linear head's by the
head op's dW matmul itself (``accumulate_head_grads``). The gradients are formed in
the forward pass; the backward scales them by grad_output on the device (its value is never
read on the host): in place, and hands them out, when the graph is freed after it (a scale of
exactly 1, ``loss.backward()``, then costs a kernel launch, not a pass); into new tensors when
it is retained (they are read again by the next backward).

Under torch.compile (the loss call, or a whole step, compiled by the user): dynamo cannot trace
that Function (a backward pass inside its forward, autograd's private state in its backward),
so ``run_chunked`` takes ``checkpointed_chunks`` instead: each chunk's loss is a
non-reentrant torch.utils.checkpoint region, traced as one graph with the rest of the step
(no graph break); AOTAutograd differentiates it and recomputes each chunk's forward in the
backward, so no chunk's logits are kept between forward and backward. The same loss and
gradients as eager, to rounding, for one more forward of each chunk.

Metrics: per-row tensors are concatenated in chunk order; scalars are summed over chunks.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tigon.ops._common import chunk_budget_bytes, traced
from tigon.ops._gradient_scaling import scaled_gradient
from tigon.ops._internals import graph_retained
from tigon.ops.fused_linear_cross_entropy import chunk_rows_for_budget
from tigon.ops.linear_token_logps import accumulate_head_grads


def token_logps(logits, target, ignore_index):
    """log p(target) per token (0 where ignored) and the mask; logits [..., V] fp32, target [...].
    z[y] - logsumexp(z): no [..., V] log-softmax tensor is formed in the forward."""
    mask = target != ignore_index
    z_y = torch.gather(logits, -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return (z_y - torch.logsumexp(logits, -1)) * mask, mask


def head_vocab(*weights):
    """The vocabulary every given head ([V, H] weights; None skipped) covers: the labels' bound."""
    return min(w.shape[0] for w in weights if w is not None)


def head_logits(x, weight, bias):
    """fp32 logits of x @ weight.T + bias; the matmul runs in the inputs' dtype (bf16 tensor
    cores, fp32 accumulation) when x and weight share it."""
    logits = (x @ weight.t()) if x.dtype == weight.dtype else (x.float() @ weight.float().t())
    logits = logits.float()
    return logits + bias.float() if bias is not None else logits


class _Metrics:
    """The chunks' metrics (detached): per-row tensors joined in chunk order, scalars summed."""

    def __init__(self):
        self.per_row, self.scalars = {}, {}

    def add(self, metrics):
        for k, v in metrics.items():
            v = v.detach()
            if v.ndim == 0:
                self.scalars[k] = v if k not in self.scalars else self.scalars[k] + v
            else:
                self.per_row.setdefault(k, []).append(v)

    def joined(self):
        return {**{k: torch.cat(v) for k, v in self.per_row.items()}, **self.scalars}


@dataclass
class ChunkSpec:
    """What ChunkedLossFunction computes: chunk_fn over row chunks of the first n_chunked inputs."""

    chunk_fn: Callable
    n_chunked: int
    row_chunks: list  # LongTensor row indices per chunk (into dim 0 of the chunked inputs)
    compiled: bool = False  # eager: chunk_fn under torch.compile (dynamic shapes)
    metric_names: list = field(default_factory=list)  # filled by forward: the outputs after the loss


class ChunkedLossFunction(torch.autograd.Function):
    """ChunkedLossFunction.apply(spec, *inputs) -> (loss, *metrics); inputs are the chunked
    tensors then the shared ones (None allowed). Eager only (``run_chunked`` takes another path
    under torch.compile)."""

    @staticmethod
    def forward(ctx, spec: ChunkSpec, *inputs):
        need = [bool(flag) and t is not None and t.is_floating_point()
                for flag, t in zip(ctx.needs_input_grad[1:], inputs)]
        argnums = tuple(i for i, n in enumerate(need) if n)
        fn = torch.compile(spec.chunk_fn, dynamic=True) if argnums and spec.compiled else spec.chunk_fn
        # The shared inputs' leaves serve every chunk (torch.autograd.grad does not accumulate
        # into them); a chunked input gets a leaf per chunk, its rows.
        shared = {i: inputs[i].detach().requires_grad_() for i in argnums if i >= spec.n_chunked}
        grads: dict[int, torch.Tensor] = {}
        total, collected = None, _Metrics()
        # A shared input that is a linear head's weight or bias gets its gradient added by the
        # head op's own matmul (accumulate_head_grads); any other path's adds up below.
        heads = contextlib.nullcontext() if spec.compiled else accumulate_head_grads(*shared.values())
        with heads as accumulated:
            for rows in spec.row_chunks:
                args = [t[rows] if (i < spec.n_chunked and t is not None) else shared.get(i, t)
                        for i, t in enumerate(inputs)]
                if not argnums:
                    loss_c, metrics = fn(*args)  # grad mode is off in a Function's forward
                else:
                    for i in argnums:
                        if i < spec.n_chunked:
                            args[i] = args[i].detach().requires_grad_()
                    leaves = [args[i] for i in argnums]
                    with torch.enable_grad():
                        loss_c, metrics = fn(*args)
                        # None: no gradient reached the leaf (or a head op accumulated it)
                        g = torch.autograd.grad(loss_c, leaves, allow_unused=True) if loss_c.requires_grad \
                            else [None] * len(leaves)
                    del leaves
                    for i, gi in zip(argnums, g):
                        if gi is None:
                            continue
                        if i < spec.n_chunked:
                            if i not in grads:
                                grads[i] = torch.zeros(inputs[i].shape, dtype=inputs[i].dtype, device=gi.device)
                            grads[i].index_copy_(0, rows, gi.to(inputs[i].dtype))
                        elif i not in grads:
                            grads[i] = gi.to(inputs[i].dtype)
                        else:
                            grads[i].add_(gi)
                    # The chunk's gradients (a [V, H] head gradient among them) must not live on
                    # into the next chunk: that would hold one more head gradient at the peak.
                    del g, gi
                loss_c = loss_c.detach().float()
                total = loss_c if total is None else total + loss_c
                collected.add(metrics)
            for i in argnums:
                acc = accumulated.get(shared[i]) if accumulated is not None and i in shared else None
                if acc is not None:
                    grads[i] = acc if i not in grads else grads[i].add_(acc)
                elif i not in grads:  # no gradient reached it: zeros, as autograd would materialise
                    grads[i] = torch.zeros(inputs[i].shape, dtype=inputs[i].dtype, device=inputs[i].device)
        metrics = collected.joined()
        ctx.grad_index = sorted(grads)
        ctx.save_for_backward(*(grads[i] for i in ctx.grad_index))
        ctx.dtypes = [t.dtype if t is not None else None for t in inputs]
        ctx.n_inputs = len(inputs)
        ctx.mark_non_differentiable(*metrics.values())
        spec.metric_names[:] = list(metrics)
        return (total, *metrics.values())

    @staticmethod
    def backward(ctx, grad_loss, *_grad_metrics):
        out = [None] * ctx.n_inputs
        # The saved gradients are handed to autograd (which may adopt one as .grad and add
        # into it) only when this is the graph's last backward; otherwise scaled copies. The
        # probe of autograd's private state is eager-only: a traced backward (compiled
        # autograd, make_fx) always scales into new tensors.
        retained = traced(grad_loss) or graph_retained()
        for i, g in zip(ctx.grad_index, ctx.saved_tensors):
            out[i] = scaled_gradient(g, grad_loss, retained)
        return (None, *out)


def run_chunked(chunk_fn, chunked, shared, row_chunks, compiled=False):
    """(loss, metrics dict) of chunk_fn over row_chunks: eager, ChunkedLossFunction; under
    torch.compile, ``checkpointed_chunks``."""
    if torch.compiler.is_compiling():
        return checkpointed_chunks(chunk_fn, chunked, shared, row_chunks)
    spec = ChunkSpec(chunk_fn, len(chunked), row_chunks, compiled)
    loss, *values = ChunkedLossFunction.apply(spec, *chunked, *shared)
    return loss, dict(zip(spec.metric_names, values))


def checkpointed_chunks(chunk_fn, chunked, shared, row_chunks):
    """run_chunked as torch.compile traces it: each chunk's loss is a non-reentrant
    torch.utils.checkpoint region (which dynamo traces as a higher-order op), so autograd
    differentiates the sum of the chunks and the backward recomputes each chunk's forward (its
    [rows, V] logits, and the gradient the tigon ops form there) just before that chunk's
    backward: what is kept between forward and backward is the inputs, never a chunk's logits.
    The chunks' rows are taken inside the region (the whole inputs are kept, not copies of
    their rows). Costs one more forward of each chunk than the eager path."""
    n_chunked = len(chunked)
    inputs = (*chunked, *shared)

    def chunk(rows, *inputs):
        return chunk_fn(*(t[rows] if i < n_chunked and t is not None else t for i, t in enumerate(inputs)))

    total, collected = None, _Metrics()
    for rows in row_chunks:
        loss_c, metrics = checkpoint(chunk, rows, *inputs, use_reentrant=False, preserve_rng_state=False)
        loss_c = loss_c.float()
        total = loss_c if total is None else total + loss_c
        collected.add(metrics)
    return total, collected.joined()


def plain_numbers(options: dict) -> dict:
    """``options`` with its numbers (bools aside) as Python floats, for a chunk_fn to close over.
    Under torch.compile with dynamic shapes a float that reaches the loss from a keyword default
    is traced as a symbolic float, which dynamo (torch 2.13) fails to carry into a checkpoint
    region (``checkpointed_chunks``); float() makes it a constant (guarded)."""
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in options.items()}


def check_chunk_size(name, value) -> int:
    """A chunk size given by the caller (``chunk_rows``, ``chunk_pairs``): a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def contiguous_chunks(n_rows, rows_per_chunk, device, name="chunk_rows"):
    """Row indices [rows_per_chunk] of consecutive chunks of n_rows rows."""
    step = check_chunk_size(name, rows_per_chunk)
    return [torch.arange(s, min(s + step, n_rows), device=device) for s in range(0, n_rows, step)]


def rows_per_chunk(chunk_rows, chunk_budget, n_rows, vocab, bytes_per_logit, name="chunk_rows"):
    """chunk_rows if given (a positive int, named ``name`` in errors), else as many rows as fit
    chunk_budget bytes at bytes_per_logit a logit and ``vocab`` logits a row, evened out over the
    chunks (as fused linear cross entropy's)."""
    if chunk_rows is not None:
        return check_chunk_size(name, chunk_rows)
    return chunk_rows_for_budget(n_rows, vocab, bytes_per_logit, chunk_budget_bytes(chunk_budget))


class LossModule(nn.Module):
    """A chunked loss as a module: ``fn`` called with the options given at construction; a
    keyword at the call overrides them. Subclasses whose inputs differ override forward."""

    fn = None

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, x, weight, target, bias=None, **kwargs):
        return type(self).fn(x, weight, target, bias, **{**self.options, **kwargs})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
