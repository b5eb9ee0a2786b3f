"""The tiled MLP (sequence-tiled recompute for long context; DeepSpeed's and Liger's TiledMLP,
the ALST recipe): any token-wise MLP run over x [..., T, H] in shards of the token axis.

Each shard runs under ``torch.utils.checkpoint`` (non-reentrant): the forward keeps no
activation of the MLP, only x (the shards are views of it); the backward recomputes one shard
with grad, runs its backward, frees it and moves to the next (autograd's engine finishes a shard
before it starts the one created before it), so the MLP's activations are never more than one
shard's. Parameter gradients reach autograd as usual: they accumulate over the shards in the
parameter's dtype, then into an existing ``.grad``; ``torch.autograd.grad`` over the parameters,
weights that are not leaves or not parameters (closures, LoRA), a second backward over a
retained graph and dropout (the RNG state is replayed, ``preserve_rng_state``) all work as for
the untiled MLP. dx is assembled from the shards' gradients (one [..., T, H] buffer more at the
end of the backward). No Triton kernel of its own: each shard runs the MLP as it is, so
``tigon.nn.TigonSwiGLUMLP`` runs its fused kernels there; inside the checkpoint it takes the
path that keeps only the shard's input and skips the recomputation's matmuls
(``glu_mlp_input_only``): 11 matmuls a shard, where recomputing the forward costs 12.

When to use which: ``tigon.functional.glu_mlp`` (``glu_mlp_input_only``) keeps only x too, but
slices the intermediate size I, not the tokens: its forward still forms a whole [T, I]
activation and its backward an fp32 [T, H] dx and [T, slice] buffers, transients that grow with
T. It is the right choice under per-layer checkpointing at ordinary lengths (a gated MLP with
plain weights; fewer, larger matmuls). ``tiled_mlp`` bounds every transient by T / num_shards
and takes any MLP: for sequences long enough that [T, I] buffers dominate the peak (the
intermediate is 3-4x the hidden size, so one [T, I] buffer costs 3-4 hidden-state tensors).

torch.compile traces the shards' checkpoints (no graph break); where the recomputation runs in
the compiled backward is then the compiler's choice. (torch 2.13's dynamo, with
``dynamic=True`` only, fails to trace tigon's GLU ops inside several checkpoints:
"lift_tracked_freevar_to_input should not be called on root SubgraphTracer", from their
default float multipliers made symbolic; the default dynamism traces them.)
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint


def default_num_shards(x: torch.Tensor) -> int:
    """ceil(T / H) shards for x [..., T, H] (Liger's and DeepSpeed's default): shards of about H
    tokens, whose [tokens, I] activations are then about the size of one [I, H] weight."""
    return max(1, math.ceil(x.shape[-2] / max(1, x.shape[-1])))


def check_tiled_mlp_args(mlp, x, num_shards, preserve_rng_state) -> int:
    """The number of shards, checked (a positive int, or None for ``default_num_shards``)."""
    if not callable(mlp):
        raise TypeError(f"mlp must be a module or callable mapping x [..., T, H] to [..., T, H_out], "
                        f"got {type(mlp).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"x must be [..., T, H] (tokens on dim -2), got shape {tuple(x.shape)}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {preserve_rng_state!r}")
    check_num_shards(num_shards)
    return default_num_shards(x) if num_shards is None else num_shards


def check_num_shards(num_shards) -> None:
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)
                                   or num_shards <= 0):
        raise ValueError(f"num_shards must be a positive int (or None for ceil(T / H)), got {num_shards!r}")


def _checked_output(out, shard):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"mlp must return a tensor, got {type(out).__name__}")
    if out.shape[:-1] != shard.shape[:-1]:
        raise ValueError(f"mlp must map [..., T, H] to [..., T, H_out] token by token: a shard of shape "
                         f"{tuple(shard.shape)} gave {tuple(out.shape)}")
    return out


def tiled_mlp(mlp, x, num_shards=None, *, preserve_rng_state=True):
    """mlp(x) for x [..., T, H], computed in ``num_shards`` shards of the token axis (dim -2;
    ceil(T / num_shards) tokens each) and recomputed shard by shard in the backward (see the
    module docstring). The output is mlp's, concatenated on dim -2. ``preserve_rng_state=False``
    skips saving and restoring the RNG state per shard (right for an MLP without dropout; older
    torch refuses that RNG read while a CUDA graph is captured)."""
    n_shards = check_tiled_mlp_args(mlp, x, num_shards, preserve_rng_state)
    tokens = x.shape[-2]
    step = max(1, -(-tokens // n_shards))
    shards = x.split(step, dim=-2) if tokens else (x,)
    if not torch.is_grad_enabled():
        outs = [_checked_output(mlp(s), s) for s in shards]
    else:
        outs = [_checked_output(checkpoint(mlp, s, use_reentrant=False, preserve_rng_state=preserve_rng_state), s)
                for s in shards]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
