"""Plain functions over the tigon ops (differentiable; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import torch

from tigon.ops import (
    cross_entropy_op,
    embedding_op,
    fused_add_rms_norm_op,
    fused_linear_cross_entropy_op,
    rms_norm_op,
)
from tigon.ops._common import check_tensor_args, is_dtensor
from tigon.ops._cross_entropy_common import checked_cross_entropy_options, rows_alias
from tigon.ops.cross_entropy import CrossEntropyOverLogits
from tigon.ops.dyt import dyt_op
from tigon.ops.embedding import check_padding_idx, tied_grad_slot
from tigon.ops.fused_linear_cross_entropy import checked_flce_options
from tigon.ops.glu import GELU_APPROXIMATIONS, activation_name, check_activation, glu_op
from tigon.ops.glu_down import glu_down_proj as _glu_down_proj
from tigon.ops.glu_mlp import glu_mlp_input_only
from tigon.ops.group_norm import check_num_groups, group_norm_op
from tigon.ops.jsd import check_jsd_options, jsd_op, linear_jsd_op
from tigon.ops.kl_div import check_kl_div_options, check_reduction, kl_div_op
from tigon.ops.layer_norm import layer_norm_op
from tigon.ops.linear_token_logps import check_ignore_index, linear_token_logps_op
from tigon.ops.moe_experts import moe_experts as _moe_experts
from tigon.ops.poly_norm import poly_norm_op
from tigon.ops.relu_squared import relu_squared_op
from tigon.ops.relu_squared_mlp import relu_squared_mlp as _relu_squared_mlp
from tigon.ops.rms_norm import check_casting, warn_inplace_ignored
from tigon.ops.rope import check_constant_tables, check_unsqueeze_dim, rope_op
from tigon.ops.softmax import over_dim, softmax_op
from tigon.ops.sparsemax import sparsemax_op
from tigon.ops.tiled_mlp import tiled_mlp as _tiled_mlp
from tigon.ops.tvd import tvd_op
from tigon.ops.vocab_parallel_cross_entropy import check_vocab_start, process_group, sharded_cross_entropy
from tigon.ops.vocab_parallel_linear_cross_entropy import (
    vocab_parallel_linear_cross_entropy as _vocab_parallel_linear_cross_entropy,
)


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama", inplace=False) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N] or None (no scaling); casting "llama", "gemma" or
    "none" (see ``tigon.ops.rms_norm``).

    ``offset=1.0`` with ``casting="gemma"`` is Gemma's ``(1 + weight)``. ``inplace`` is deprecated
    and ignored (True warns): the backward always writes dx into a new buffer, since the incoming
    gradient may be shared (see ``tigon.ops.rms_norm``).
    """
    check_casting(casting)  # before the op: its schema would refuse a non-str with a vaguer error
    warn_inplace_ignored(inplace, "rms_norm")
    return rms_norm_op(x, weight, float(eps), float(offset), casting)[0]


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting="llama", inplace=False):
    """(rms_norm(x + residual), x + residual) in one pass; x, residual [..., N], weight [N] or
    None. ``inplace``: deprecated and ignored, as in ``rms_norm``."""
    check_casting(casting)
    warn_inplace_ignored(inplace, "fused_add_rms_norm")
    y, s, _ = fused_add_rms_norm_op(x, residual, weight, float(eps), float(offset), casting)
    return y, s


def layer_norm(x, weight, bias, eps=1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over the last dim; weight, bias [N] or None."""
    check_tensor_args(x=x, weight=weight, bias=bias)  # before the op: its schema's error would not name them
    return layer_norm_op(x, weight, bias, float(eps))[0]


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5) -> torch.Tensor:
    """GroupNorm of x [N, C, *spatial] in num_groups groups of channels, as
    ``torch.nn.functional.group_norm``; weight, bias [C] or None. Output in x's dtype."""
    check_num_groups(num_groups)  # before the op: its schema would refuse a non-int with a vaguer error
    check_tensor_args(x=x, weight=weight, bias=bias)
    return group_norm_op(x, num_groups, weight, bias, float(eps))[0]


def dyt(x, alpha, gamma, beta=None) -> torch.Tensor:
    """Dynamic Tanh: gamma * tanh(alpha * x) + beta of x [..., N]; alpha a one-element tensor,
    gamma [N], beta [N] or None. Output in x's dtype."""
    check_tensor_args(x=x, alpha=alpha, gamma=gamma, beta=beta)
    return dyt_op(x, alpha, gamma, beta)


def poly_norm(x, weight, bias, eps=1e-6) -> torch.Tensor:
    """PolyNorm: w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b over the last dim of x [..., N],
    norm(u) = u / sqrt(mean(u^2) + eps); weight [3], bias one element. Output in x's dtype."""
    check_tensor_args(x=x, weight=weight, bias=bias)
    return poly_norm_op(x, weight, bias, float(eps))[0]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """HF's ``apply_rotary_pos_emb`` in one kernel: returns (q_embed, k_embed).

    q [B, Hq, T, D], k [B, Hk, T, D] (or [B, T, H, D] with unsqueeze_dim=2); cos, sin
    [1|B, T, R] (2 <= R <= D, or R = D = 1; an odd R split as HF's rotate_half splits it, x[:R//2]
    and x[R//2:]). With position_ids [1|B, T], cos / sin are tables [P, R].
    ``interleaved=True``: adjacent pairs (x[2j], x[2j+1]) rotate together (torchtune's layout)
    and cos / sin hold one angle per pair, [.., R/2].
    """
    check_tensor_args(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    check_unsqueeze_dim(unsqueeze_dim)
    check_constant_tables(cos, sin)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    return rope_op(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)


def glu(a, b, activation="silu", gate_multiplier=1.0, out_multiplier=1.0) -> torch.Tensor:
    """act(a * gate_multiplier) * b * out_multiplier, elementwise; a, b [..., I] of one dtype.
    activation: one of tigon's names ("silu", "gelu_tanh", "gelu_erf") or an HF alias."""
    check_tensor_args(a=a, b=b)
    activation = activation_name(activation)
    check_activation(activation, gate_multiplier=gate_multiplier, out_multiplier=out_multiplier)
    return glu_op(a, b, activation, float(gate_multiplier), float(out_multiplier))


def swiglu(a, b, *, gate_multiplier=1.0) -> torch.Tensor:
    """silu(a * gate_multiplier) * b, elementwise; a, b [..., I] of one dtype."""
    return glu(a, b, "silu", gate_multiplier)


def geglu(a, b, approximate="tanh", *, gate_multiplier=1.0) -> torch.Tensor:
    """gelu(a * gate_multiplier) * b with ``approximate`` "tanh" (HF's gelu_pytorch_tanh) or
    "none" (exact erf)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return glu(a, b, GELU_APPROXIMATIONS[approximate], gate_multiplier)


def glu_down_proj(a, b, down_weight, down_bias=None, activation="silu", *, inplace=False, gate_multiplier=1.0,
                  down_multiplier=1.0) -> torch.Tensor:
    """((act(a * gate_multiplier) * b) @ down_weight.T + down_bias) * down_multiplier, keeping
    only a and b for the backward. a, b [..., I], down_weight [H, I], down_bias [H] -> [..., H].

    activation: one of tigon's names ("silu", "gelu_tanh", "gelu_erf") or an HF alias
    ("gelu_pytorch_tanh", ...). inplace=True lets the backward write the gradients of a and b
    over a and b (saves two [tokens, I] buffers; a and b must be intermediates nothing else
    reads, and backward can then run only once).
    """
    check_tensor_args(a=a, b=b, down_weight=down_weight, down_bias=down_bias)
    return _glu_down_proj(a, b, down_weight, down_bias, activation_name(activation), inplace=inplace,
                          gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


def glu_mlp(x, gate_weight, up_weight, down_weight, activation="silu", *, gate_multiplier=1.0,
            down_multiplier=1.0) -> torch.Tensor:
    """(act(x @ gate_weight.T * gate_multiplier) * (x @ up_weight.T)) @ down_weight.T *
    down_multiplier, keeping only x for the backward (gate and up are recomputed there in
    column slices). x [..., H], gate / up weights [I, H], down weight [H, I]. Meant for layers
    under torch.utils.checkpoint (non-reentrant), where its recomputation is skipped when
    nothing after it needs it; outside checkpointing it trades two matmuls for two [tokens, I]
    activations. (Falcon-H1's ``mlp_multipliers`` are the two multipliers.)"""
    check_tensor_args(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    return glu_mlp_input_only(x, gate_weight, up_weight, down_weight, activation_name(activation),
                              gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


def relu_squared(x) -> torch.Tensor:
    """relu(x)^2 elementwise (Primer's squared ReLU, transformers' ``ACT2FN["relu2"]``); x of any
    shape, float32 / float16 / bfloat16; the backward is 2 relu(x) dy."""
    check_tensor_args(x=x)
    return relu_squared_op(x)


def relu_squared_mlp(x, up_weight, down_weight, up_bias=None, down_bias=None) -> torch.Tensor:
    """relu(x @ up_weight.T + up_bias)^2 @ down_weight.T + down_bias (Nemotron's MLP), keeping only
    x and the pre-activation for the backward (relu^2 is recomputed there, inside the kernel that
    forms its gradient). x [..., H], up_weight [I, H], down_weight [H, I], up_bias [I] and
    down_bias [H] or None -> [..., H] in x's dtype (autocast's under autocast)."""
    check_tensor_args(x=x, up_weight=up_weight, down_weight=down_weight, up_bias=up_bias, down_bias=down_bias)
    return _relu_squared_mlp(x, up_weight, down_weight, up_bias, down_bias)


def tiled_mlp(mlp, x, num_shards=None, *, preserve_rng_state=True) -> torch.Tensor:
    """mlp(x) for x [..., T, H], run in ``num_shards`` shards of the token axis (None: ceil(T / H))
    and recomputed shard by shard in the backward: only x is kept, and the MLP's activations are
    never more than one shard's. Any token-wise MLP module or callable (tigon's MLP modules run
    their kernels per shard); see ``tigon.ops.tiled_mlp`` for when to prefer ``glu_mlp``.
    ``preserve_rng_state=False``: no RNG state saved and restored per shard (an MLP without
    dropout)."""
    return _tiled_mlp(mlp, x, num_shards, preserve_rng_state=preserve_rng_state)


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, gate_up_bias=None,
                down_bias=None, activation="silu", layout="gate_up", transposed=False, alpha=None,
                limit=None) -> torch.Tensor:
    """The routed experts of an MoE layer, as HF's stacked experts (``MixtralExperts``):
    out[t] = sum_k w[t, k] * (act(gate) * up) @ down_proj[e].T (+ down_bias[e]), e = top_k_index[t, k],
    gate / up = the two halves of hidden_states[t] @ gate_up_proj[e].T (+ gate_up_bias[e]).

    hidden_states [..., H]; top_k_index [..., K] integer (E = "no expert", skipped); top_k_weights
    [..., K] (any float dtype); gate_up_proj [E, 2I, H], down_proj [E, H, I] (with
    ``transposed=True``: [E, H, 2I] and [E, I, H], gpt-oss); biases [E, 2I] and [E, H] or None ->
    [..., H] in hidden_states' dtype. ``layout``: "gate_up" (gate rows, then up rows) or
    "interleaved" (gate, up, gate, ...: gpt-oss). ``activation``: tigon's GLU names or HF aliases
    ("silu", "gelu_pytorch_tanh", ...), or "clamped_swiglu": gpt-oss's (up.clamp(-limit, limit) + 1)
    * g * sigmoid(alpha * g), g = gate.clamp(max=limit) (alpha 1.702, limit 7.0 by default). Grouped
    GEMMs routed on the device (one host sync: the index range check, as cross entropy's labels),
    gate and up kept for the backward.
    """
    check_tensor_args(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
                      gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_bias=gate_up_bias, down_bias=down_bias)
    return _moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                        activation, layout, transposed, alpha, limit)


def _ce_rows(logits, target):
    """logits [..., V] and target [...] (or flattened [rows]) as [rows, V] and [rows]."""
    if not isinstance(logits, torch.Tensor) or logits.ndim == 0:
        raise ValueError("logits must be a tensor [..., V] with the classes last, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)!r}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(target).__name__}")
    rows = logits.shape[:-1]
    if target.shape != rows and not (target.ndim == 1 and target.numel() == math.prod(rows)):
        raise ValueError(f"target has shape {tuple(target.shape)}; for logits {tuple(logits.shape)} ([..., V]) it "
                         f"must be {tuple(rows)} or flat [{math.prod(rows)}]")
    return logits.reshape(math.prod(rows), logits.shape[-1]), target.reshape(-1)


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, weight=None,
                  lse_square_scale=0.0, softcap=None, use_token_scaling=False, return_z_loss=False,
                  return_token_accuracy=False, return_predicted_tokens=False, inplace=False):
    """Cross entropy of logits [..., V] against class indices target [...], loss in fp32.

    Options as ``torch.nn.functional.cross_entropy`` (ignore_index, reduction, label_smoothing,
    class weight), plus z-loss ``lse_square_scale * logsumexp^2``, Gemma 2's logit
    soft-capping ``softcap * tanh(logits / softcap)`` and ``use_token_scaling`` (each token's
    loss times its predicted probability of the target, detached). "mean" averages over
    non-ignored tokens; an all-ignored batch gives 0 (not NaN). Unlike torch, the classes are
    the last dim. ``inplace=True`` writes the gradient over ``logits`` during the forward pass
    when logits require grad (no [N, V] gradient allocated; do not read logits afterwards); under
    torch.compile it is ignored (the functional op runs, the logits are left alone).
    Returns the loss, or (loss, [z_loss], [token_accuracy], [predicted_tokens]) with the
    extras asked for; predicted tokens are the argmax per row (int64), -1 where ignored.
    """
    logits2, target1 = _ce_rows(logits, target)
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, weight, lse_square_scale, softcap,
                                         use_token_scaling, return_z_loss, return_token_accuracy,
                                         return_predicted_tokens)
    compute_grad = torch.is_grad_enabled() and logits2.requires_grad
    if inplace and compute_grad and not torch.compiler.is_compiling():
        rows = logits2 if logits2.stride(-1) == 1 else logits2.contiguous()  # a copy of ours to write over
        if not rows_alias(rows):  # rows sharing memory cannot each hold their own gradient
            return _loss_outputs(CrossEntropyOverLogits.apply(rows, target1, opts), target, opts)
    return _loss_outputs(cross_entropy_op(logits2, target1, *opts, compute_grad), target, opts)


def vocab_parallel_cross_entropy(logits, target, *, group=None, vocab_start=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, lse_square_scale=0.0, softcap=None, return_z_loss=False,
                                 inplace=False):
    """Cross entropy over a vocabulary split across the ranks of ``group`` (tensor parallel).

    logits [..., V_r]: this rank's shard, the vocabulary ids [vocab_start, vocab_start + V_r)
    (shards may be uneven; ``vocab_start=None`` gathers the shard widths, in rank order: one more
    collective and a host sync). target [...]: global ids, the same on every rank. ``group``: a
    ProcessGroup, or None for the default group (no collective when torch.distributed is not
    initialised). Every rank gets the whole loss (fp32, the same value) and, in the backward,
    d loss / d (its logits). Options as ``cross_entropy`` (label smoothing over the whole
    vocabulary, z-loss, softcap, ``inplace``). One all-gather of [N + 1, 5] fp32 row stats a call;
    torch.compile traces it (a functional collective), except the widths' gather of
    ``vocab_start=None`` (a graph break). With one rank and vocab_start 0 (or None) this is
    ``cross_entropy``. See tigon.ops.vocab_parallel_cross_entropy.
    """
    logits2, target1 = _ce_rows(logits, target)
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, None, lse_square_scale, softcap,
                                         return_z_loss=return_z_loss)
    check_vocab_start(vocab_start)
    group, world_size = process_group(group)
    if world_size == 1 and not vocab_start:
        return cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                             label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                             return_z_loss=return_z_loss, inplace=inplace)
    compute_grad = torch.is_grad_enabled() and logits2.requires_grad
    loss, z_loss = sharded_cross_entropy(logits2, target1, group, world_size, vocab_start, opts, compute_grad, inplace)
    return _loss_outputs((loss, z_loss, None, None), target, opts)


def fused_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, ce_weight=None, lse_square_scale=0.0, softcap=None,
                               use_token_scaling=False, return_z_loss=False, return_token_accuracy=False,
                               return_predicted_tokens=False, chunk_budget=None, accum_dtype=None, tied_slot=None):
    """cross_entropy(x @ weight.T + bias, target) without materialising the [rows, V] logits.

    x [..., H] (bf16 or fp32), weight [V, H] (x's dtype or fp32; tied embeddings and frozen
    heads are fine), bias [V] or None, target [...] class indices. Cross-entropy options as
    ``cross_entropy`` (``ce_weight`` is its class weight). ``chunk_budget``: bytes of logits a
    chunk may hold (default 512 MiB); ``accum_dtype=torch.float32`` accumulates dW in fp32
    (V * H * 4 bytes more). Gradients are computed in the forward pass (reduction "mean" /
    "sum"); the backward scales them by grad_output. ``tied_slot``: a TiedGradSlot shared with
    ``embedding`` of the same forward when ``weight`` is also the input embedding (see
    tigon.ops.embedding): the two backward passes then fill one [V, H] gradient (eager mode;
    under torch.compile the slot is not used and each returns its own gradient).
    """
    _refuse_dtensors(weight=weight, x=x, bias=bias)
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, ce_weight, lse_square_scale,
                                         softcap, use_token_scaling, return_z_loss, return_token_accuracy,
                                         return_predicted_tokens)
    chunk_budget, accum_dtype = checked_flce_options(chunk_budget, accum_dtype)
    grad = torch.is_grad_enabled()
    need = (grad and _requires_grad(x), grad and _requires_grad(weight), grad and _requires_grad(bias))
    args = (x, weight, target, bias, *opts, chunk_budget, accum_dtype, *need)
    with tied_grad_slot(tied_slot):
        return _loss_outputs(fused_linear_cross_entropy_op(*args), target, opts)


def _refuse_dtensors(**named) -> None:
    """fused_linear_cross_entropy's arguments are plain tensors: a DTensor would fail deep inside
    ("got mixed torch.Tensor and DTensor"). Say what to do instead."""
    for name, t in named.items():
        if is_dtensor(t):
            raise ValueError(
                f"fused_linear_cross_entropy takes plain tensors, but {name} is a DTensor (placements "
                f"{tuple(t.placements)}). A weight sharded by FSDP2 / ZeRO-3 must be used inside the head module's "
                "forward, where it is gathered (tigon.patch does this); a vocabulary-sharded (tensor-parallel) head "
                "should use tigon.functional.vocab_parallel_linear_cross_entropy")


def vocab_parallel_linear_cross_entropy(x, weight, target, bias=None, *, group=None, vocab_start=None,
                                        ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                                        softcap=None, return_z_loss=False, chunk_budget=None):
    """cross_entropy(x @ weight.T + bias, target) for an output head split over the vocabulary
    across the ranks of a group (tensor parallel), without materialising the logits: each rank
    forms one chunk of rows of its shard's logits at a time.

    x [..., H] (bf16 or fp32) and target [...] (global ids): the same on every rank (either may be
    a DTensor with Replicate placements). weight: this rank's shard [V_r, H], the vocabulary ids
    [vocab_start, vocab_start + V_r), with ``group`` and ``vocab_start`` as in
    ``vocab_parallel_cross_entropy`` (None: the default group; the start gathered); or a DTensor
    [V, H] with placements (Shard(0),) over a 1-D DeviceMesh (torch's ColwiseParallel), whose
    mesh gives the group and whose split the start (group and vocab_start then left None); its
    gradient arrives as a DTensor placed as it is. bias [V_r] (a DTensor sharded as the weight)
    or None. Every rank gets the whole loss (fp32, the same value), x's whole gradient and its
    shard's. Options as ``vocab_parallel_cross_entropy``; ``chunk_budget`` as in
    ``fused_linear_cross_entropy`` (bytes of one chunk's [rows, V_r] logits; chunks are sized
    by the widest shard). One all-gather of row stats per chunk and an all-reduce of dx a call
    (a plain weight on several ranks: first a gather of the shard widths, with a host sync).
    Every rank must make the same call and its backward. With one rank and vocab_start 0 (or
    None) this is ``fused_linear_cross_entropy``. Under torch.compile the call is a graph break
    (it runs eagerly), except in that one-rank case. See tigon.ops.vocab_parallel_linear_cross_entropy.
    """
    opts = checked_cross_entropy_options(ignore_index, reduction, label_smoothing, None, lse_square_scale, softcap,
                                         return_z_loss=return_z_loss)
    chunk_budget, _ = checked_flce_options(chunk_budget, None)
    check_vocab_start(vocab_start)
    check_tensor_args(x=x, weight=weight, target=target, bias=bias)
    if not vocab_start and not any(is_dtensor(t) for t in (x, weight, target, bias)) and process_group(group)[1] == 1:
        return fused_linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                          label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                                          softcap=softcap, return_z_loss=return_z_loss, chunk_budget=chunk_budget)
    loss, z_loss = _vocab_parallel_linear_cross_entropy(x, weight, target, bias, group, vocab_start, opts, chunk_budget)
    return _loss_outputs((loss, z_loss, None, None), target, opts)


def embedding(ids, weight, padding_idx=None, tied_slot=None) -> torch.Tensor:
    """weight[ids]: ids [...] integer, weight [V, H] -> [..., H] in weight's dtype. The backward
    sums each token's rows in fp32 in a fixed order (deterministic) and adds them into the
    weight's gradient; ``padding_idx`` rows get no gradient (as nn.Embedding). ``tied_slot``:
    see fused_linear_cross_entropy."""
    check_padding_idx(padding_idx)  # before the op: its schema would refuse a non-int with a vaguer error
    with tied_grad_slot(tied_slot):
        return embedding_op(ids, weight, padding_idx)


def linear_token_logps(x, weight, target, bias=None, ignore_index=-100) -> torch.Tensor:
    """log softmax(x @ weight.T + bias)[target] per row, 0 where target == ignore_index.

    x [..., H], weight [V, H], bias [V] or None, target [...] -> fp32 [...]. Forms the rows'
    [rows, V] logits once (meant for a chunk of a batch, as the post-training losses use it)
    and keeps their gradient for a two-matmul backward.
    """
    check_tensor_args(x=x, weight=weight, target=target, bias=bias)
    check_ignore_index(ignore_index)  # before the op: its schema would refuse a non-int with a vaguer error
    x2 = x.reshape(-1, x.shape[-1])
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    logp, _ = linear_token_logps_op(x2, weight, bias, target.reshape(-1), ignore_index, compute_grad)
    return logp.view(target.shape)


def linear_jsd(x, weight, teacher_x, teacher_weight, bias=None, teacher_bias=None, beta=0.5, temperature=1.0):
    """Generalised JSD per row between the student x @ weight.T + bias and the teacher
    teacher_x @ teacher_weight.T + teacher_bias (beta 0: KL(teacher || student), 1: KL(student
    || teacher)), logits divided by temperature. x [..., Hs], teacher_x [..., Ht] -> fp32 [...].
    Gradients flow to the student only. Forms the rows' logits once (meant for a chunk)."""
    check_tensor_args(x=x, weight=weight, teacher_x=teacher_x, teacher_weight=teacher_weight, bias=bias,
                      teacher_bias=teacher_bias)
    check_jsd_options(beta, temperature)  # before the op (a ValueError / TypeError naming the argument)
    lead = x.shape[:-1]
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    loss, _ = linear_jsd_op(x.reshape(-1, x.shape[-1]), weight, bias,
                            teacher_x.reshape(-1, teacher_x.shape[-1]).detach(), teacher_weight.detach(),
                            None if teacher_bias is None else teacher_bias.detach(), float(beta),
                            float(temperature), compute_grad)
    return loss.view(lead)


def jsd(student_logprobs, teacher_logprobs, target=None, *, beta=0.5, ignore_index=-100) -> torch.Tensor:
    """Generalised JSD between student and teacher log-probabilities, averaged over the rows
    whose target is not ignore_index (all rows without a target; all ignored gives 0).

    student_logprobs [..., V] (the gradient is taken with respect to them), teacher_logprobs
    [..., V] (no gradient), target [...] integer or None -> fp32 scalar. Per row, with P the
    student's and Q the teacher's distribution: beta 0 is KL(Q || P) (forward KL), beta 1 is
    KL(P || Q) (reverse KL), otherwise beta KL(Q || M) + (1 - beta) KL(P || M) with
    M = beta Q + (1 - beta) P. This beta is TRL's (GKD) and Liger's (``LigerJSD``) as they are,
    and ``linear_jsd``'s: no conversion. As ``LigerJSD(beta, ignore_index)(student_logprobs,
    teacher_logprobs, shift_labels)``: the log-probabilities are taken as given (not
    renormalised) and the gradient is that of the per-element formula with respect to them.
    """
    check_jsd_options(beta)  # before the op (a ValueError / TypeError naming the argument)
    check_ignore_index(ignore_index)
    check_tensor_args(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, target=target)
    compute_grad = torch.is_grad_enabled() and student_logprobs.requires_grad
    loss, _ = jsd_op(student_logprobs, teacher_logprobs.detach(), target, float(beta), ignore_index, compute_grad)
    return loss


def softmax(x, dim=-1) -> torch.Tensor:
    """softmax of x over ``dim`` in x's dtype (fp32 arithmetic). The last dim is the fast path;
    another dim runs on a copy with that dim moved last (the result is a view moved back)."""
    check_tensor_args(x=x)
    return over_dim(softmax_op, x, dim)


def sparsemax(x, dim=-1) -> torch.Tensor:
    """sparsemax of x over ``dim`` (Martins & Astudillo 2016): max(x - tau, 0), the Euclidean
    projection of each slice onto the probability simplex (sparse where softmax is dense), in
    x's dtype; ``dim`` up to 65536 long. Backward: dy minus its mean over the support, on the
    support. Sort-free (see tigon.ops.sparsemax); another dim than the last as ``softmax``."""
    check_tensor_args(x=x)
    return over_dim(sparsemax_op, x, dim)


def kl_div(input, target, reduction="batchmean", log_target=False) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: input log-probabilities [..., V], target probabilities
    (log-probabilities with ``log_target``) of the same shape; pointwise t (log t - input), 0
    where t == 0. reduction "batchmean" (sum / input.shape[0]; the default here, as Liger's),
    "sum", "mean" (over every element) or "none" (pointwise, in the inputs' promoted dtype). A
    reduction's loss is fp32 and its gradients are formed in the forward pass (one read of
    input and target). Gradients flow to input and to target when it requires grad."""
    check_kl_div_options(reduction, log_target)  # before the op: its schema's errors would be vaguer
    check_tensor_args(input=input, target=target)
    grad = torch.is_grad_enabled()
    return kl_div_op(input, target, reduction, log_target, grad and input.requires_grad,
                     grad and target.requires_grad)[0]


def tvd(p, q, labels=None, *, reduction="batchmean", ignore_index=-100) -> torch.Tensor:
    """Total variation distance 0.5 * sum |p - q| over the last dim of probabilities p, q
    [..., V] (Liger's ``LigerTVDLoss``). Rows whose label (``labels`` [...] or flat, integer)
    is ignore_index contribute nothing and are not counted. reduction "batchmean" (over the kept
    rows), "sum", "mean" (over kept rows times V) or "none" (pointwise, 0 on ignored rows, in
    the promoted dtype); all rows ignored gives 0. A reduction's loss is fp32 and its gradients
    are formed in the forward pass. Gradients: 0.5 sign(p - q) to p, its negation to q."""
    check_reduction(reduction)
    check_ignore_index(ignore_index)
    check_tensor_args(p=p, q=q, labels=labels)
    grad = torch.is_grad_enabled()
    return tvd_op(p, q, labels, reduction, ignore_index, grad and p.requires_grad, grad and q.requires_grad)[0]


def _requires_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _loss_outputs(outputs, target, opts):
    """The loss (shaped like target for reduction "none"), plus the extras asked for (the ops
    return empty tensors for the others, and their gradients after these four)."""
    loss, z_loss, accuracy, predicted = outputs[:4]
    extras = [e for e, asked in ((z_loss, opts.returns_z_loss), (accuracy, opts.return_token_accuracy),
                                 (predicted, opts.return_predicted_tokens)) if asked]
    if target.ndim != 1:
        if opts.reduction == "none":
            loss = loss.view(target.shape)
            extras = [e.view(target.shape) for e in extras]
        elif opts.return_predicted_tokens:  # the predicted tokens are per row whatever the reduction
            extras[-1] = extras[-1].view(target.shape)
    return (loss, *extras) if extras else loss
