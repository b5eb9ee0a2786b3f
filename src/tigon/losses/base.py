"""One chunked base for every post-training loss: the logits are formed a chunk of rows at a time.

A loss is written as a function of one chunk, ``chunk_fn(*chunked, *shared) -> (loss_share,
metrics)``: ``chunked`` tensors are indexed by the chunk's rows (hidden states, targets, the
reference's hidden states...), ``shared`` ones are whole (lm_head weight and bias). The loss
must be a sum over chunks (its normalisers computed from the whole batch beforehand), so the
chunk gradients add up to the full gradients exactly. ``ChunkedLossFunction`` walks the
chunks, takes each chunk's loss share and its gradients with respect to the differentiable
inputs in one call (``torch.func.grad_and_value``, optionally under ``torch.compile`` with
dynamic shapes). Row chunks are disjoint, so a chunked input's gradient is written once, in
its own dtype; a shared input's gradient is summed over chunks in its dtype (fp32 for fp32
parameters; one rounding per chunk for bf16). The gradients are formed in the forward pass;
the backward scales them by grad_output: in place, and hands them out, when the graph is freed
after it; into new tensors when it is retained (they are read again by the next backward).

Metrics: per-row tensors are concatenated in chunk order; scalars are summed over chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.func import grad_and_value

from tigon.ops._common import capturing
from tigon.ops._internals import graph_retained


def token_logps(logits, target, ignore_index):
    """log p(target) per token (0 where ignored) and the mask; logits [..., V] fp32, target [...].
    z[y] - logsumexp(z): no [..., V] log-softmax tensor is formed in the forward."""
    mask = target != ignore_index
    z_y = torch.gather(logits, -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return (z_y - torch.logsumexp(logits, -1)) * mask, mask


def head_logits(x, weight, bias):
    """fp32 logits of x @ weight.T + bias; the matmul runs in the inputs' dtype (bf16 tensor
    cores, fp32 accumulation) when x and weight share it."""
    logits = (x @ weight.t()) if x.dtype == weight.dtype else (x.float() @ weight.float().t())
    logits = logits.float()
    return logits + bias.float() if bias is not None else logits


@dataclass
class ChunkSpec:
    """What ChunkedLossFunction computes: chunk_fn over row chunks of the first n_chunked inputs."""

    chunk_fn: Callable
    n_chunked: int
    row_chunks: list  # LongTensor row indices per chunk (into dim 0 of the chunked inputs)
    compiled: bool = False
    metric_names: list = field(default_factory=list)  # filled by forward: the outputs after the loss


class ChunkedLossFunction(torch.autograd.Function):
    """ChunkedLossFunction.apply(spec, *inputs) -> (loss, *metrics); inputs are the chunked
    tensors then the shared ones (None allowed)."""

    @staticmethod
    def forward(ctx, spec: ChunkSpec, *inputs):
        need = [bool(flag) and t is not None and t.is_floating_point()
                for flag, t in zip(ctx.needs_input_grad[1:], inputs)]
        argnums = tuple(i for i, n in enumerate(need) if n)
        step = grad_and_value(spec.chunk_fn, argnums=argnums, has_aux=True) if argnums else None
        if step is not None and spec.compiled:
            step = torch.compile(step, dynamic=True)
        grads: dict[int, torch.Tensor] = {}
        total, per_row, scalars = None, {}, {}
        for rows in spec.row_chunks:
            args = [t[rows] if (i < spec.n_chunked and t is not None) else t for i, t in enumerate(inputs)]
            if step is None:
                with torch.no_grad():
                    loss_c, metrics = spec.chunk_fn(*args)
            else:
                g, (loss_c, metrics) = step(*args)
                for i, gi in zip(argnums, g):
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
            for k, v in metrics.items():
                v = v.detach()
                if v.ndim == 0:
                    scalars[k] = v if k not in scalars else scalars[k] + v
                else:
                    per_row.setdefault(k, []).append(v)
        metrics = {**{k: torch.cat(v) for k, v in per_row.items()}, **scalars}
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
        # into it) only when this is the graph's last backward; otherwise scaled copies.
        retained = graph_retained()
        one = not retained and _is_one(grad_loss)
        for i, g in zip(ctx.grad_index, ctx.saved_tensors):
            if retained:
                out[i] = (g * grad_loss).to(ctx.dtypes[i])
            else:
                out[i] = g if one else g.mul_(grad_loss)
        return (None, *out)


def _is_one(t):
    """grad_output == 1 (loss.backward()): the saved gradients need no scaling. A host sync,
    except under CUDA-graph capture where it is skipped (and the scaling done)."""
    return t.numel() == 1 and not capturing() and bool(t == 1)


def run_chunked(chunk_fn, chunked, shared, row_chunks, compiled=False):
    """(loss, metrics dict) of chunk_fn over row_chunks; see ChunkedLossFunction."""
    spec = ChunkSpec(chunk_fn, len(chunked), row_chunks, compiled)
    loss, *values = ChunkedLossFunction.apply(spec, *chunked, *shared)
    return loss, dict(zip(spec.metric_names, values))


def check_chunk_size(name, value) -> int:
    """A chunk size given by the caller (``chunk_rows``, ``chunk_pairs``): a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def contiguous_chunks(n_rows, rows_per_chunk, device, name="chunk_rows"):
    """Row indices [rows_per_chunk] of consecutive chunks of n_rows rows."""
    step = check_chunk_size(name, rows_per_chunk)
    return [torch.arange(s, min(s + step, n_rows), device=device) for s in range(0, n_rows, step)]
