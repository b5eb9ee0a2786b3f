"""Rotary position embedding for q and k in one launch, equal to HF's ``apply_rotary_pos_emb``.

out = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) over the rotated part.
q [B, Hq, T, D] and k [B, Hk, T, D] (``unsqueeze_dim=1``; [B, T, H, D] with ``unsqueeze_dim=2``),
any strides with a unit last stride; Hq != Hk (GQA) is fine. cos, sin [T, R] or [1|B, T, R]
with R <= D: the first R dims rotate, the rest pass through (partial rotary, as Phi-3).
An odd R (R = D of an odd head dim, or an odd partial R) is HF's formula as written:
rotate_half splits x into x1 = x[:R//2] and x2 = x[R//2:], one longer, so out[j] = x[j] c[j] -
x[j + R//2] s[j] for j <= R//2 and out[j] = x[j] c[j] + x[j - R//2 - 1] s[j] after (cos, sin
taken element-wise).
With ``position_ids`` [1|B, T], cos and sin are tables [P, R] or [1, P, R] gathered in the
kernel at those positions. cos and sin are constants (no gradient), as HF computes them.

``interleaved=True`` rotates adjacent pairs (x[2j], x[2j+1]) instead of halves (torchtune's,
GPT-J's and Meta's layout), and cos, sin then hold one angle per pair: [.., R/2] for R rotated
dims (torchtune's rope cache [..., 0] and [..., 1]).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tigon.ops._common import (
    capturing,
    cdiv,
    check_same_device,
    check_same_dtype,
    check_tensor,
    kernel_op,
    new_output,
    next_pow2,
    poison_,
    traced,
)
from tigon.ops._internals import assert_on_device, interpreter_enabled, launch


@triton.jit
def rope_load_heads(X, sxb, sxh, sxt, b, t, tok_mask, n_heads, n_first, n_second, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr, UNEQUAL: tl.constexpr):
    """(x1, p1, x2) [BLOCK_T, BLOCK_H, BLOCK_D] (fp32) of every head of tokens (b, t) [BLOCK_T]:
    the rotated part is two blocks, [0, n_first) and [n_first, R); x1 = x[d], p1 = x[n_second + d]
    (the partner of the first block's d), x2 = x[n_first + d] (the second block). Equal blocks:
    p1 is x2."""
    h = tl.arange(0, BLOCK_H)
    base = X + (b * sxb + t * sxt)[:, None, None] + h[None, :, None] * sxh
    heads = tok_mask[:, None, None] & (h[None, :, None] < n_heads)
    if INTERLEAVED:
        # One contiguous load of the pairs, split in registers: loads and stores at stride 2
        # ran at a tenth of copy bandwidth on an H100 (123 ms against 12.4 ms a step of
        # torchtune's Llama-3.2-1B at batch 128 x 512).
        e = tl.arange(0, 2 * BLOCK_D)
        x = tl.load(base + e[None, None, :], mask=heads & (e[None, None, :] < 2 * n_first), other=0.0)
        x1, x2 = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], BLOCK_H, BLOCK_D, 2]))
        return x1, x2, x2
    d = tl.arange(0, BLOCK_D)[None, None, :]
    first = heads & (d < n_first)
    p1 = tl.load(base + n_second + d, mask=first, other=0.0).to(tl.float32)
    if UNEQUAL:  # odd R: the blocks differ by one, x1 also partners the second block
        second = heads & (d < n_second)
        x1 = tl.load(base + d, mask=first | second, other=0.0).to(tl.float32)
        x2 = tl.load(base + n_first + d, mask=second, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + d, mask=first, other=0.0).to(tl.float32)
        x2 = p1
    return x1, p1, x2


@triton.jit
def rope_store_heads(
    X, sxb, sxh, sxt, Y, syb, syh, syt, b, t, tok_mask, n_heads, head_dim, n_first, n_second,
    x1, p1, x2, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """y1 = x1 c1 - p1 s1 (first block), y2 = x2 c2 + x1 s2 (second block), with c1 .. s2
    [BLOCK_T, BLOCK_D]; dims past the rotated part are copied from X."""
    h = tl.arange(0, BLOCK_H)
    y_base = Y + (b * syb + t * syt)[:, None, None] + h[None, :, None] * syh
    heads = tok_mask[:, None, None] & (h[None, :, None] < n_heads)
    y1 = x1 * c1[:, None, :] - p1 * s1[:, None, :]
    y2 = x2 * c2[:, None, :] + x1 * s2[:, None, :]
    if INTERLEAVED:  # pairs joined back in registers, one contiguous store (see rope_load_heads)
        e = tl.arange(0, 2 * BLOCK_D)[None, None, :]
        y = tl.reshape(tl.join(y1, y2), [y1.shape[0], BLOCK_H, 2 * BLOCK_D])
        tl.store(y_base + e, y.to(Y.dtype.element_ty), mask=heads & (e < 2 * n_first))
    else:
        d = tl.arange(0, BLOCK_D)[None, None, :]
        tl.store(y_base + d, y1.to(Y.dtype.element_ty), mask=heads & (d < n_first))
        tl.store(y_base + n_first + d, y2.to(Y.dtype.element_ty), mask=heads & (d < n_second))
    if BLOCK_PASS > 0:
        p = n_first + n_second + tl.arange(0, BLOCK_PASS)[None, None, :]
        pass_mask = heads & (p < head_dim)
        x_base = X + (b * sxb + t * sxt)[:, None, None] + h[None, :, None] * sxh
        tl.store(y_base + p, tl.load(x_base + p, mask=pass_mask), mask=pass_mask)


@triton.jit
def rope_kernel(
    Q, sqb, sqh, sqt, K, skb, skh, skt,
    QO, sqob, sqoh, sqot, KO, skob, skoh, skot,
    COS, SIN, scb, sct, POS, spb, spt,
    n_tokens, seq_len, n_q_heads, n_k_heads, head_dim, n_first, n_second,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr = False, UNEQUAL: tl.constexpr = False,
):
    """One program per BLOCK_T tokens (b, t): loads their cos/sin rows once and rotates every q
    and k head. All loads are issued before the first store (the compiler may not move loads
    past stores).

    The R rotated dims are two blocks, [0, n_first) and [n_first, R): d of the first pairs with
    n_second + d, n_first + d of the second with d. The forward has n_first = R - R//2 and
    n_second = R//2 (HF's rotate_half: out[j] = x[j] c[j] - x[j + R//2] s[j] for j < R - R//2,
    x[j] c[j] + x[j - (R - R//2)] s[j] after), equal halves for an even R. The backward is the
    transpose: the same pairing with the blocks' lengths swapped, sin read at the partner's index
    and negated (for equal halves: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1). Interleaved:
    n_first = n_second = R/2 pairs, one angle each.
    """
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    b = tok // seq_len
    t = tok % seq_len
    if HAS_POS:
        row = tl.load(POS + b * spb + t * spt, mask=tok_mask, other=0).to(tl.int64)
        cs_offset = (row * sct)[:, None]
    else:
        cs_offset = (b * scb + t * sct)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    tm = tok_mask[:, None]
    dm1 = tm & (d < n_first)
    if UNEQUAL:
        dm2 = tm & (d < n_second)
        dm_both = dm1 | dm2
    else:  # equal halves: one length, one mask (the code of the even case)
        n_second = n_first
        dm2 = dm1
        dm_both = dm1
    c1 = tl.load(COS + cs_offset + d, mask=dm1, other=0.0).to(tl.float32)
    s_own = tl.load(SIN + cs_offset + d, mask=dm_both, other=0.0).to(tl.float32)
    if INTERLEAVED:  # one angle per pair
        c2 = c1
        s1 = s_own
        s2 = s_own
    else:
        c2 = tl.load(COS + cs_offset + n_first + d, mask=dm2, other=0.0).to(tl.float32)
        if BACKWARD:  # the partner's sin
            s1 = tl.load(SIN + cs_offset + n_second + d, mask=dm1, other=0.0).to(tl.float32)
            s2 = s_own
        else:
            s1 = s_own
            s2 = tl.load(SIN + cs_offset + n_first + d, mask=dm2, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s1, -s2
    q1, qp, q2 = rope_load_heads(Q, sqb, sqh, sqt, b, t, tok_mask, n_q_heads, n_first, n_second, BLOCK_HQ,
                                 BLOCK_D, INTERLEAVED, UNEQUAL)
    k1, kp, k2 = rope_load_heads(K, skb, skh, skt, b, t, tok_mask, n_k_heads, n_first, n_second, BLOCK_HK,
                                 BLOCK_D, INTERLEAVED, UNEQUAL)
    rope_store_heads(Q, sqb, sqh, sqt, QO, sqob, sqoh, sqot, b, t, tok_mask, n_q_heads, head_dim, n_first,
                     n_second, q1, qp, q2, c1, c2, s1, s2, BLOCK_HQ, BLOCK_D, BLOCK_PASS, INTERLEAVED)
    rope_store_heads(K, skb, skh, skt, KO, skob, skoh, skot, b, t, tok_mask, n_k_heads, head_dim, n_first,
                     n_second, k1, kp, k2, c1, c2, s1, s2, BLOCK_HK, BLOCK_D, BLOCK_PASS, INTERLEAVED)


def tokens_per_program(n_tokens, elements_per_token) -> int:
    """BLOCK_T of rope_kernel. The GPU: 1 (a token's heads are 1-8K elements, enough work for a
    program). Triton's interpreter: as many tokens as fit 2**14 elements (its cost is per program
    and per op, nearly not per element: 16 tokens a program cut a test model's RoPE time ~10x)."""
    if not interpreter_enabled():
        return 1
    fit = max(1, 2**14 // max(1, elements_per_token))
    return min(next_pow2(n_tokens), 1 << (fit.bit_length() - 1))


def _bhtd_strides(x, unsqueeze_dim):
    """Strides of x in (batch, head, token) order for either HF layout."""
    sb, s1, s2, _ = x.stride()
    return (sb, s1, s2) if unsqueeze_dim == 1 else (sb, s2, s1)  # [B, H, T, D] or [B, T, H, D]


def _unit_last_stride(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_apply(q, k, cos, sin, position_ids, unsqueeze_dim, backward, num_warps=None, out_strides=None,
               interleaved=False):
    """Launch the kernel on checked inputs; returns new (q_out, k_out) in q's and k's layouts,
    or with ``out_strides`` (two dense_strides results) when given."""
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    h_axis, t_axis = (1, 2) if unsqueeze_dim == 1 else (2, 1)
    batch, seq_len, head_dim = q.shape[0], q.shape[t_axis], q.shape[3]
    n_q_heads, n_k_heads = q.shape[h_axis], k.shape[h_axis]
    rot = rotated_dims(cos, interleaved)
    cos3, sin3 = cos.reshape(-1, *cos.shape[-2:]), sin.reshape(-1, *sin.shape[-2:])
    cos3, sin3 = _unit_last_stride(cos3), _unit_last_stride(sin3)
    if cos3.stride() != sin3.stride():
        cos3, sin3 = cos3.contiguous(), sin3.contiguous()
    # A cos of batch 1 is shared by every sequence: batch stride 0.
    scb = cos3.stride(0) if cos3.shape[0] > 1 else 0
    sct = cos3.stride(1)
    q_strides, k_strides = (dense_strides(q), dense_strides(k)) if out_strides is None else out_strides
    q_out = new_with_strides(q.shape, q.dtype, q.device, q_strides)
    k_out = new_with_strides(k.shape, k.dtype, k.device, k_strides)
    if position_ids is not None:
        pos = position_ids
        spb = pos.stride(0) if pos.shape[0] > 1 else 0
        spt = pos.stride(1)
    else:
        pos, spb, spt = cos3, 0, 0
    # The two blocks of the rotated dims (see rope_kernel): R - R//2 and R//2 long in the
    # forward, swapped in the backward; R/2 pairs when interleaved.
    half_rot = rot // 2
    n_first, n_second = (half_rot, rot - half_rot) if backward else (rot - half_rot, half_rot)
    block_d = next_pow2(max(n_first, n_second))
    n_pass = head_dim - rot
    block_pass = next_pow2(n_pass) if n_pass > 0 else 0
    n_tokens = batch * seq_len
    if n_tokens and head_dim:
        block_t = tokens_per_program(n_tokens, (next_pow2(n_q_heads) + next_pow2(n_k_heads)) * head_dim)
        launch(rope_kernel, (cdiv(n_tokens, block_t),),
            q, *_bhtd_strides(q, unsqueeze_dim), k, *_bhtd_strides(k, unsqueeze_dim),
            q_out, *_bhtd_strides(q_out, unsqueeze_dim), k_out, *_bhtd_strides(k_out, unsqueeze_dim),
            cos3, sin3, scb, sct, pos, spb, spt,
            n_tokens, seq_len, n_q_heads, n_k_heads, head_dim, n_first, n_second,
            HAS_POS=position_ids is not None, BACKWARD=backward, BLOCK_T=block_t,
            BLOCK_HQ=next_pow2(n_q_heads), BLOCK_HK=next_pow2(n_k_heads),
            BLOCK_D=block_d, BLOCK_PASS=block_pass, INTERLEAVED=interleaved, UNEQUAL=n_first != n_second,
            # H100, bf16: 4 warps for up to 2K elements a token, else 8 (83-88% of copy bandwidth).
            num_warps=num_warps or (4 if (n_q_heads + n_k_heads) * head_dim <= 2048 else 8),
        )
    return q_out, k_out


def dense_strides(x):
    """x's strides when x is a non-contiguous view that covers its memory exactly (e.g. HF's
    q, a transposed view of the projection), else None (a contiguous buffer will do)."""
    if x.is_contiguous() or x.stride(-1) != 1:
        return None
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return x.stride()


def new_with_strides(shape, dtype, device, strides=None):
    """An output buffer of ``shape``, laid out with ``strides`` when given (see dense_strides)."""
    if strides is None:
        return new_output(shape, dtype, device)
    return poison_(torch.empty_strided(shape, strides, dtype=dtype, device=device))


def check_unsqueeze_dim(unsqueeze_dim):
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, T, D]) or 2 ([B, T, H, D]), got {unsqueeze_dim!r}")


TABLES_REQUIRE_GRAD = ("cos / sin require grad, but tigon's RoPE treats them as constants "
                       "(compute them under torch.no_grad(), as HF's rotary embedding does)")


def check_constant_tables(cos, sin):
    if torch.is_grad_enabled() and (getattr(cos, "requires_grad", False) or getattr(sin, "requires_grad", False)):
        raise ValueError(TABLES_REQUIRE_GRAD)


def rotated_dims(cos, interleaved) -> int:
    """Dims of a head that rotate: cos's last dim, or twice it (one angle per interleaved pair)."""
    return cos.shape[-1] * 2 if interleaved else cos.shape[-1]


def check_rope_args(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=False):
    """Checks of metadata only (they run on FakeTensors too); see check_positions_in_table."""
    check_unsqueeze_dim(unsqueeze_dim)
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    check_tensor("cos", cos, min_ndim=2)
    check_tensor("sin", sin, min_ndim=2)
    check_same_dtype(q=q, k=k)
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    h_axis, t_axis = (1, 2) if unsqueeze_dim == 1 else (2, 1)
    batch, seq_len, head_dim = q.shape[0], q.shape[t_axis], q.shape[3]
    if k.shape[0] != batch or k.shape[t_axis] != seq_len or k.shape[3] != head_dim:
        raise ValueError(f"k has shape {tuple(k.shape)}, which does not match q's batch, tokens and head dim "
                         f"(q has shape {tuple(q.shape)})")
    if cos.shape != sin.shape:
        raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has shape {tuple(sin.shape)}")
    if cos.ndim > 3 and any(s != 1 for s in cos.shape[:-3]):
        raise ValueError(f"cos must be [T, R] or [1|B, T, R], got shape {tuple(cos.shape)}")
    rot = rotated_dims(cos, interleaved)
    if interleaved and (rot > head_dim or rot == 0):
        raise ValueError(f"with interleaved=True cos holds one angle per rotated pair: its last dim "
                         f"{cos.shape[-1]} must be non-zero and at most half the head dim {head_dim}")
    if rot > head_dim:
        raise ValueError(f"cos's last dim {rot} is more than the head dim {head_dim}: HF's q * cos does not "
                         "broadcast (a rotary embedding built for an odd head dim D gives D + 1 angles: rotate "
                         "at most D dims)")
    if rot == 0 or (rot == 1 and head_dim > 1):
        raise ValueError(f"cos's last dim {rot} must be at least 2 (or the head dim): a cos of width 1 "
                         "broadcasts over the head in HF's Llama formula but rotates one dim in Phi-3's")
    cos_batch = cos.shape[-3] if cos.ndim >= 3 else 1
    if position_ids is None:
        if cos.shape[-2] != seq_len:
            raise ValueError(f"cos has {cos.shape[-2]} positions but q has {seq_len} tokens "
                             "(pass position_ids to index a longer table)")
        if cos_batch not in (1, batch):
            raise ValueError(f"cos has batch {cos_batch}; it must be 1 or q's batch {batch}")
    else:
        check_tensor("position_ids", position_ids, ndim=2, floating=False)
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"position_ids must be int32 or int64, got {position_ids.dtype}")
        if position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected [1|{batch}, {seq_len}]")
        if cos_batch != 1:
            raise ValueError(f"with position_ids, cos must be a table [P, R] or [1, P, R], got {tuple(cos.shape)}")


def check_positions_in_table(position_ids, cos):
    """An out-of-table position would read outside cos / sin: one host sync in eager calls
    (skipped in CUDA-graph capture), a device-side assert in a traced graph."""
    if position_ids is None or not position_ids.numel():
        return
    if traced(position_ids):
        n = cos.shape[-2]
        assert_on_device(((position_ids >= 0) & (position_ids < n)).all(),
                         "position_ids must lie in [0, P) for cos / sin of P positions")
    elif not capturing():
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= cos.shape[-2]:
            raise ValueError(f"position_ids range over [{lo}, {hi}] but cos has {cos.shape[-2]} positions")


# ---- custom ops: torch.ops.tigon.rope and its backward (see tigon.ops.rms_norm) ----
#
# Outputs and (in the backward) gradients are written in q's and k's own layouts: for HF's q, a
# transposed view of the projection, the view's backward is then free instead of a copy of dq
# (H100, B4 T8192 32/8 heads: fwd+bwd 0.95 -> ~0.6 ms). The fake implementations derive the
# same strides from the same metadata (dense_strides).


@kernel_op("tigon::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], unsqueeze_dim: int,
            interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """(q_embed, k_embed) of q, k [B, H, T, D] (``unsqueeze_dim=1``) or [B, T, H, D] (2)."""
    check_rope_args(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
    check_positions_in_table(position_ids, cos)
    return rope_apply(q, k, cos, sin, position_ids, unsqueeze_dim, backward=False,
                      out_strides=(dense_strides(q), dense_strides(k)), interleaved=interleaved)


@rope_op.register_fake
def _(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=False):
    check_rope_args(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
    return (new_with_strides(q.shape, q.dtype, q.device, dense_strides(q)),
            new_with_strides(k.shape, k.dtype, k.device, dense_strides(k)))


@kernel_op("tigon::rope_backward", mutates_args=())
def rope_backward_op(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
                     unsqueeze_dim: int, q_strides: list[int], k_strides: list[int], interleaved: bool = False
                     ) -> tuple[Tensor, Tensor]:
    """(dq, dk) laid out with ``q_strides`` / ``k_strides`` (empty: contiguous)."""
    return rope_apply(grad_q, grad_k, cos, sin, position_ids, unsqueeze_dim, backward=True,
                      out_strides=(q_strides or None, k_strides or None), interleaved=interleaved)


@rope_backward_op.register_fake
def _(grad_q, grad_k, cos, sin, position_ids, unsqueeze_dim, q_strides, k_strides, interleaved=False):
    return (new_with_strides(grad_q.shape, grad_q.dtype, grad_q.device, q_strides or None),
            new_with_strides(grad_k.shape, grad_k.dtype, grad_k.device, k_strides or None))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids, unsqueeze_dim, interleaved = inputs
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise ValueError(TABLES_REQUIRE_GRAD)
    ctx.tables = (cos, sin, position_ids)  # constants: kept, not saved (see the note in tigon.ops._common)
    ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
    ctx.grad_strides = tuple(list(strides or ()) for strides in (dense_strides(q), dense_strides(k)))


def _backward(ctx, grad_q, grad_k):
    cos, sin, position_ids = ctx.tables
    dq, dk = rope_backward_op(grad_q, grad_k, cos, sin, position_ids, ctx.unsqueeze_dim, *ctx.grad_strides,
                              ctx.interleaved)
    return dq, dk, None, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)
