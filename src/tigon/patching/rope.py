"""The RoPE the patcher installs: tigon's drop-in for each form of HF's RoPE functions
(``ROPE_FORMS``), and the module-wide dispatcher and attention scope of instance patches."""

from __future__ import annotations

import types

import torch

from tigon import ambient
from tigon import functional as TF
from tigon.ambient import thread_flag

# tigon's op is a torch.library custom op: torch.compile traces it as one node (no graph break).
_rope = TF.apply_rotary_pos_emb


def tigon_apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
    """Drop-in for HF's ``apply_rotary_pos_emb(q, k, cos, sin, [position_ids,] unsqueeze_dim=1)``."""
    unsqueeze_dim = kwargs.pop("unsqueeze_dim", 1)
    position_ids = kwargs.pop("position_ids", None)
    if args:  # old signature (q, k, cos, sin, position_ids, unsqueeze_dim): HF ignored position_ids
        unsqueeze_dim = args[1] if len(args) > 1 else unsqueeze_dim
    if unsqueeze_dim == 0 and cos.ndim == 2:  # Pixtral: cos [T, R] shared by every image and head
        unsqueeze_dim = 1
    return _rope(q, k, cos, sin, position_ids, unsqueeze_dim)


tigon_apply_rotary_pos_emb._tigon = "rope"


def tigon_apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for GPT-OSS's ``apply_rotary_pos_emb``: halves rotate as with rotate_half, cos and
    sin [.., R/2] hold one angle per pair."""
    return _rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), None, unsqueeze_dim)


tigon_apply_rotary_pos_emb_half_angles._tigon = "rope (half_angles)"


def _pairs_to_halves(x):
    """x [..., D] with adjacent pairs (x[2j], x[2j+1]) laid out as halves: the even elements, then the odd."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def tigon_apply_rotary_pos_emb_pairs_to_halves(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Drop-in for DeepSeek-V3's ``apply_rotary_pos_emb_interleave``: adjacent pairs rotate, the
    result is laid out in halves (HF ignores position_ids). The pairs are gathered into halves
    (one copy of q and k) and rotated as rotate_half does, with HF's cos / sin [.., D] = cat(f, f)."""
    return _rope(_pairs_to_halves(q), _pairs_to_halves(k), cos, sin, None, unsqueeze_dim)


tigon_apply_rotary_pos_emb_pairs_to_halves._tigon = "rope (pairs_to_halves)"


def tigon_apply_rotary_emb_complex(xq, xk, freqs_cis):
    """Drop-in for DeepSeek-V2's ``apply_rotary_emb``: adjacent pairs of xq, xk [B, H, T, R] times
    freqs_cis [B, T, R/2] (complex) as complex numbers."""
    angles = torch.view_as_real(freqs_cis)
    return _rope(xq, xk, angles[..., 0], angles[..., 1], None, 1, interleaved=True)


tigon_apply_rotary_emb_complex._tigon = "rope (complex)"


def tigon_apply_rotary_emb_complex_bthd(xq, xk, freqs_cis):
    """Drop-in for Llama 4's ``apply_rotary_emb``: as "complex" with xq, xk [B, T, H, R] and
    freqs_cis [B, T, R/2]."""
    angles = torch.view_as_real(freqs_cis)
    return _rope(xq, xk, angles[..., 0], angles[..., 1], None, 2, interleaved=True)


tigon_apply_rotary_emb_complex_bthd._tigon = "rope (complex_bthd)"


def tigon_apply_rotary_pos_emb_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for GLM-4V's ``apply_rotary_pos_emb``: adjacent pairs rotate (``rotate_half_llm``)
    and cos / sin [.., R] hold each pair's angle twice (``repeat_interleave(2)``); R <= D."""
    return _rope(q, k, cos[..., ::2], sin[..., ::2], None, unsqueeze_dim, interleaved=True)


tigon_apply_rotary_pos_emb_interleaved._tigon = "rope (interleaved)"


def tigon_apply_rotary_pos_emb_vision(q, k, cos, sin):
    """Drop-in for the Qwen-VL / GLM-4V vision towers' ``apply_rotary_pos_emb_vision``: q, k
    [T, H, D] (the images' patches in one sequence), cos, sin [T, D]; fp32 arithmetic, results
    in q's dtype as HF's."""
    q_out, k_out = _rope(q.unsqueeze(0), k.unsqueeze(0), cos, sin, None, 2)
    return q_out[0], k_out[0]


tigon_apply_rotary_pos_emb_vision._tigon = "rope (vision)"


def tigon_apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=1):
    """Drop-in for Gemma 3n's / Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)``:
    one tensor a call (q and k rotate in separate calls), halves as rotate_half. The op's k is an
    empty view of x (no heads: nothing read or written for it)."""
    return _rope(x, x.narrow(unsqueeze_dim, 0, 0), cos, sin, None, unsqueeze_dim)[0]


tigon_apply_rotary_pos_emb_single._tigon = "rope (single)"


# HF's RoPE forms (families.Family.rope_form) -> tigon's drop-in.
ROPE_FORMS = {
    "half": tigon_apply_rotary_pos_emb,
    "half_angles": tigon_apply_rotary_pos_emb_half_angles,
    "pairs_to_halves": tigon_apply_rotary_pos_emb_pairs_to_halves,
    "complex": tigon_apply_rotary_emb_complex,
    "complex_bthd": tigon_apply_rotary_emb_complex_bthd,
    "interleaved": tigon_apply_rotary_pos_emb_interleaved,
    "vision": tigon_apply_rotary_pos_emb_vision,
    "single": tigon_apply_rotary_pos_emb_single,
}


def rope_drop_in(form: str):
    """tigon's function for a RoPE form of ROPE_FORMS."""
    if form not in ROPE_FORMS:
        raise ValueError(f"unknown RoPE form {form!r}; the forms are {list(ROPE_FORMS)}")
    return ROPE_FORMS[form]


# RoPE is a module-level function of HF's modeling files, called by the attention modules. An
# instance patch must change one model only. A patched attention module runs a copy of its
# forward whose globals name tigon's RoPE (nothing changes while it runs: torch.compile traces it
# inside checkpointed layers, where a flag set during the call would be a side effect it refuses).
# Forwards that are not plain functions calling the RoPE by name fall back to a dispatcher: the
# module function runs tigon's RoPE while a patched attention module's forward is on this
# thread, HF's otherwise.


def make_rope_dispatcher(original, drop_in=None):
    """``drop_in``: tigon's function for the form of ``original`` (None: the "half" form's)."""
    def apply_rotary_pos_emb(*args, **kwargs):
        if ambient.ROPE_SCOPE.on:
            return (drop_in or tigon_apply_rotary_pos_emb)(*args, **kwargs)
        return original(*args, **kwargs)

    apply_rotary_pos_emb._tigon = "rope (inside patched models' attention only)"
    apply_rotary_pos_emb._tigon_original = original
    return apply_rotary_pos_emb


def make_rope_scope(forward, drop_ins: dict):
    """An attention module's forward that runs ``forward`` with tigon's RoPE (see above).
    ``drop_ins``: HF's RoPE function names -> tigon's functions (None: the "half" form's)."""
    if isinstance(forward, types.FunctionType) and any(n in forward.__code__.co_names for n in drop_ins):
        ours = {name: fn or tigon_apply_rotary_pos_emb for name, fn in drop_ins.items()}
        scoped = types.FunctionType(forward.__code__, {**forward.__globals__, **ours},
                                    forward.__name__, forward.__defaults__, forward.__closure__)
        scoped.__kwdefaults__ = forward.__kwdefaults__
        scoped.__qualname__, scoped.__module__ = forward.__qualname__, forward.__module__
        scoped._tigon = "attention with tigon's RoPE"
        return scoped

    def scoped_forward(self, *args, **kwargs):
        with thread_flag(ambient.ROPE_SCOPE):
            return forward(self, *args, **kwargs)

    scoped_forward._tigon = "attention with tigon's RoPE"
    return scoped_forward
