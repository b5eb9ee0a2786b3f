"""Triton device functions more than one op's kernels call (fp32 math the interpreter runs too)."""

import triton
import triton.language as tl


@triton.jit
def tanh_and_sech2(u):
    """(tanh(u), 1 - tanh(u)^2) in fp32, to a few ulp (libdevice's tanh does not run in the
    interpreter; 2 sigmoid(2u) - 1 loses the relative precision of small u: a softcapped cross
    entropy's gradient at small logits was 5x eager torch's error through it). One division."""
    a = tl.abs(u)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|u|), the factor 2 log2(e) folded
    # |u| >= 1/4: tanh = (1 - e) / (1 + e) with e <= 0.61 (no cancellation), and
    # 1 - tanh^2 = 4e / (1 + e)^2 = e (1 + tanh)^2 stays exact where tanh rounds to +-1.
    big = (1.0 - e) / (1.0 + e)
    sech2_big = e * (1.0 + big) * (1.0 + big)
    # |u| < 1/4: Taylor series to u^11 (the next term is below 1e-9 relative).
    u2 = u * u
    poly = -1382.0 / 155925.0
    poly = poly * u2 + 62.0 / 2835.0
    poly = poly * u2 - 17.0 / 315.0
    poly = poly * u2 + 2.0 / 15.0
    poly = poly * u2 - 1.0 / 3.0
    small = u + u * u2 * poly
    is_small = a < 0.25
    t = tl.where(is_small, small, tl.where(u < 0, -big, big))
    sech2 = tl.where(is_small, 1.0 - small * small, sech2_big)
    return t, sech2


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), and its derivative 1 - tanh(x / cap)^2."""
    t, sech2 = tanh_and_sech2(x / cap)
    return cap * t, sech2


@triton.jit
def safe_max(m):
    """m, or 0 where m is -inf: what an online log-sum-exp subtracts before exp. While every logit
    seen is -inf (a masked vocabulary) exp(x - m) would be exp(-inf + inf) = NaN; against 0 the
    sum stays 0 and exp(m - 0) rescales it by 0. One scalar select a block (H100: no measurable
    cost)."""
    return tl.where(m > -float("inf"), m, 0.0)


@triton.jit
def online_lse_update(m, s, x, block_max):
    """One block x (block_max = its maximum) into a row's running maximum m and s = sum exp(z - m):
    -> (new m, new s). Rows (or leading blocks) of only -inf stay (-inf, 0), never NaN."""
    new_m = tl.maximum(m, block_max)
    shift = safe_max(new_m)
    return new_m, s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
