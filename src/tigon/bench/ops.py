"""Op benchmark cases: tigon vs torch eager vs torch.compile vs Liger-Kernel (when installed).

Run on a CUDA machine: ``python -m tigon.bench.ops [--ops rms_norm rope ...] [--out DIR]``.
Each case counts the fewest bytes (or FLOPs) forward+backward must move, so every row also
says what fraction of the measured copy bandwidth (or bf16 matmul rate) it reaches.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tigon import functional as TF
from tigon.bench.harness import Row, generator, measure, measure_limits
from tigon.bench.report import merge_results, write_results

# The ops of the suite, in the order it runs them: the names `tigon bench` and --ops accept.
OP_NAMES = ("rms_norm", "layer_norm", "fused_add_rms_norm", "group_norm", "dyt", "poly_norm", "swiglu", "geglu",
            "rope", "swiglu_mlp", "cross_entropy",
            "relu_squared", "relu_squared_mlp", "tiled_mlp",
            "vocab_parallel_cross_entropy", "fused_linear_cross_entropy",
            "softmax", "sparsemax", "kl_div", "tvd", "moe_experts")


def unknown_op_error(names) -> str | None:
    """An argparse-style message for the names not in OP_NAMES (None when all are known)."""
    unknown = [name for name in names if name not in OP_NAMES]
    if not unknown:
        return None
    return (f"invalid choice: {', '.join(map(repr, unknown))} "
            f"(choose from {', '.join(map(repr, OP_NAMES))})")


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], list]
    impls: dict  # name -> fn(*inputs)
    bytes_full: int | None = None
    flops_full: int | None = None
    grad_output: float | None = None  # None: random cotangents; a loss's cases use 1 (loss.backward())
    size: tuple | None = None  # (axis name, value) when the case is a point of a size sweep (plotted)

    def __post_init__(self):
        if self.op not in OP_NAMES:
            raise ValueError(f"case op {self.op!r} is not in OP_NAMES {OP_NAMES}")


def _liger():
    try:
        import liger_kernel.transformers.functional as LF

        return LF
    except Exception:
        return None


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, shift=0.0, grad=True):
    t = torch.randn(*shape, device="cuda", dtype=torch.float32, generator=generator()).mul_(scale).add_(shift)
    t = t.to(dtype)
    return t.requires_grad_(grad)


def _randint(high, n):
    return torch.randint(0, high, (n,), device="cuda", generator=generator())


# ---- eager references (what HF models run) ----

def eager_rms_norm(x, w, eps=1e-6):
    xf = x.to(torch.float32)
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_fused_add_rms_norm(x, r, w, eps=1e-6):
    s = r + x
    return eager_rms_norm(s, w, eps), s


def eager_layer_norm(x, w, b, eps=1e-5):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


def eager_swiglu(a, b):
    return torch.nn.functional.silu(a) * b


def eager_geglu(a, b):
    return torch.nn.functional.gelu(a, approximate="tanh") * b


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class EagerSwiGLUMLP(torch.nn.Module):
    """HF's LlamaMLP in plain torch: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


# ---- cases ----

def eager_group_norm(x, num_groups, w, b, eps=1e-5):
    return torch.nn.functional.group_norm(x, num_groups, w, b, eps)


def eager_dyt(x, alpha, gamma, beta):
    """DyT as its paper's code writes it (no upcast)."""
    return gamma * torch.tanh(alpha * x) + beta


def eager_poly_norm(x, w, b, eps=1e-6):
    """PolyCom's PolyNorm, computed in fp32 (as the kernels) and cast back."""
    xf = x.float()

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    return (w[0] * norm(xf ** 3) + w[1] * norm(xf ** 2) + w[2] * norm(xf) + b).to(x.dtype)


def group_norm_cases(configs, liger):
    """configs: (N, C, spatial side, groups), swept over the spatial side."""
    cases = []
    for n, c, side, groups in configs:
        def inputs(n=n, c=c, side=side):
            return [_randn(n, c, side, side, shift=1.0), _randn(c, scale=0.1, shift=1.0), _randn(c, scale=0.1)]

        def eager(x, w, b, groups=groups):
            return eager_group_norm(x, groups, w, b)

        impls = {"tigon": lambda x, w, b, groups=groups: TF.group_norm(x, groups, w, b),
                 "torch eager": eager, "torch.compile": _compiled(eager)}
        if liger:
            impls["liger"] = lambda x, w, b, c=c, groups=groups: liger.liger_group_norm(x, w, b, c, groups, 1e-5)
        # Fewest bytes: fwd reads x, writes y; bwd reads dy, x, writes dx.
        cases.append(Case("group_norm", f"N{n} C{c} {side}x{side} G{groups}", inputs, impls,
                          bytes_full=5 * n * c * side * side * 2, size=("spatial side", side)))
    return cases


def dyt_poly_norm_cases(rows_cols, liger):
    cases = []
    for m, n in rows_cols:
        def dyt_inputs(m=m, n=n):
            return [_randn(m, n), _randn(1, scale=0.0, shift=0.5), _randn(n, scale=0.1, shift=1.0),
                    _randn(n, scale=0.1)]

        impls = {"tigon": TF.dyt, "torch eager": eager_dyt, "torch.compile": _compiled(eager_dyt)}
        if liger and hasattr(liger, "liger_dyt"):
            impls["liger"] = liger.liger_dyt
        cases.append(Case("dyt", f"{m}x{n}", dyt_inputs, impls, bytes_full=5 * m * n * 2, size=("hidden", n)))

        def poly_inputs(m=m, n=n):
            return [_randn(m, n), _randn(3, scale=0.1, shift=1 / 3), _randn(1, scale=0.1)]

        impls = {"tigon": TF.poly_norm, "torch eager": eager_poly_norm, "torch.compile": _compiled(eager_poly_norm)}
        if liger and hasattr(liger, "liger_poly_norm"):
            # Liger's bias is a 0-dim tensor (its dbias has that shape).
            impls["liger"] = lambda x, w, b: liger.liger_poly_norm(x, w, b.view(()), 1e-6)
        cases.append(Case("poly_norm", f"{m}x{n}", poly_inputs, impls, bytes_full=5 * m * n * 2, size=("hidden", n)))
    return cases


def norm_cases(rows_cols, liger):
    cases = []
    for m, n in rows_cols:
        shape = f"{m}x{n}"
        elt = 2

        def rms_inputs(m=m, n=n):
            return [_randn(m, n), _randn(n, scale=0.1, shift=1.0)]

        impls = {"tigon": TF.rms_norm, "torch eager": eager_rms_norm, "torch.compile": _compiled(eager_rms_norm)}
        if liger:
            impls["liger"] = lambda x, w: liger.liger_rms_norm(x, w, 1e-6)
        cases.append(Case("rms_norm", shape, rms_inputs, impls, bytes_full=5 * m * n * elt, size=("hidden", n)))

        def ln_inputs(m=m, n=n):
            return [_randn(m, n, shift=2.0), _randn(n, scale=0.1, shift=1.0), _randn(n, scale=0.1)]

        impls = {"tigon": TF.layer_norm, "torch eager": eager_layer_norm, "torch.compile": _compiled(eager_layer_norm)}
        if liger:
            impls["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
        cases.append(Case("layer_norm", shape, ln_inputs, impls, bytes_full=5 * m * n * elt, size=("hidden", n)))

        def add_inputs(m=m, n=n):
            return [_randn(m, n), _randn(m, n), _randn(n, scale=0.1, shift=1.0)]

        impls = {"tigon": TF.fused_add_rms_norm, "torch eager": eager_fused_add_rms_norm,
                 "torch.compile": _compiled(eager_fused_add_rms_norm)}
        if liger and hasattr(liger, "liger_fused_add_rms_norm"):
            impls["liger"] = lambda x, r, w: liger.liger_fused_add_rms_norm(x, r, w, 1e-6)
        cases.append(Case("fused_add_rms_norm", shape, add_inputs, impls, bytes_full=8 * m * n * elt,
                          size=("hidden", n)))
    return cases


def glu_cases(rows_cols, liger):
    cases = []
    for m, n in rows_cols:
        def inputs(m=m, n=n):
            return [_randn(m, n, scale=2.0), _randn(m, n)]

        for op, ours, eager, peer in (("swiglu", TF.swiglu, eager_swiglu, "liger_swiglu"),
                                      ("geglu", TF.geglu, eager_geglu, "liger_geglu")):
            impls = {"tigon": ours, "torch eager": eager, "torch.compile": _compiled(eager)}
            if liger:
                impls["liger"] = getattr(liger, peer)
            # fwd reads a, b, writes c; bwd reads dc, a, b, writes da, db.
            cases.append(Case(op, f"{m}x{n}", inputs, impls, bytes_full=8 * m * n * 2, size=("tokens", m)))
    return cases


def rope_cases(configs, liger):
    cases = []
    for batch, hq, hk, tokens, dim in configs:
        def inputs(batch=batch, hq=hq, hk=hk, tokens=tokens, dim=dim):
            # HF's layout: [B, T, H*D] projections viewed and transposed to [B, H, T, D].
            q = _randn(batch, tokens, hq, dim, grad=False).transpose(1, 2).requires_grad_()
            k = _randn(batch, tokens, hk, dim, grad=False).transpose(1, 2).requires_grad_()
            inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
            freqs = torch.arange(tokens, device="cuda", dtype=torch.float32)[:, None] * inv
            emb = torch.cat((freqs, freqs), -1)[None]
            return [q, k, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)]

        impls = {"tigon": TF.apply_rotary_pos_emb, "torch eager": eager_rope, "torch.compile": _compiled(eager_rope)}
        if liger:
            impls["liger"] = liger.liger_rope
        n = batch * tokens * (hq + hk) * dim
        cases.append(Case("rope", f"B{batch} T{tokens} Hq{hq} Hk{hk} D{dim}", inputs, impls, bytes_full=4 * n * 2,
                          size=("sequence length", tokens)))
    return cases


def mlp_cases(configs, liger):
    from tigon.nn import TigonSwiGLUMLP

    cases = []
    for tokens, hidden, inter in configs:
        modules = {"torch eager": EagerSwiGLUMLP(hidden, inter),
                   "tigon": TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter)}
        if liger:
            from types import SimpleNamespace

            from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

            modules["liger"] = LigerSwiGLUMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter,
                                                              hidden_act="silu"))
        for mod in modules.values():
            mod.to(device="cuda", dtype=torch.bfloat16)
        compiled = _compiled(modules["torch eager"])
        for mod in modules.values():
            mod.load_state_dict(modules["torch eager"].state_dict())

        def call(mod):
            return lambda x, *_: mod(x)

        impls = {name: call(mod) for name, mod in modules.items()}
        impls["torch.compile"] = call(compiled)
        all_params = [p for mod in modules.values() for p in mod.parameters()]

        def inputs(tokens=tokens, hidden=hidden, all_params=all_params):
            return [_randn(tokens, hidden), *all_params]

        cases.append(Case("swiglu_mlp", f"T{tokens} H{hidden} I{inter}", inputs, impls,
                          flops_full=18 * tokens * hidden * inter))
    return cases


def eager_relu_squared(x):
    """transformers' ReLUSquaredActivation (ACT2FN["relu2"])."""
    return torch.square(torch.relu(x))


class EagerReLUSquaredMLP(torch.nn.Module):
    """HF's NemotronMLP in plain torch: down_proj(relu(up_proj(x))^2)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(eager_relu_squared(self.up_proj(x)))


def relu_squared_cases(rows_cols, liger):
    cases = []
    for m, n in rows_cols:
        def inputs(m=m, n=n):
            return [_randn(m, n, scale=2.0)]

        impls = {"tigon": TF.relu_squared, "torch eager": eager_relu_squared,
                 "torch.compile": _compiled(eager_relu_squared)}
        if liger and hasattr(liger, "liger_relu_squared"):
            impls["liger"] = liger.liger_relu_squared
        # fwd reads x, writes y; bwd reads dy, x, writes dx.
        cases.append(Case("relu_squared", f"{m}x{n}", inputs, impls, bytes_full=5 * m * n * 2, size=("tokens", m)))
    return cases


def _module_case(op, shape, modules, tokens, hidden, **case_args):
    """A Case over MLP modules that share the eager module's weights (bf16); "torch.compile"
    compiles "torch eager". Every module's parameters are inputs (their gradients are reset)."""
    for mod in modules.values():
        mod.to(device="cuda", dtype=torch.bfloat16)
    for mod in modules.values():
        mod.load_state_dict(modules["torch eager"].state_dict())
    compiled = _compiled(modules["torch eager"])
    impls = {name: (lambda x, *_, mod=mod: mod(x)) for name, mod in modules.items()}
    impls["torch.compile"] = lambda x, *_: compiled(x)
    all_params = [p for mod in modules.values() for p in mod.parameters()]

    def inputs():
        return [_randn(tokens, hidden), *all_params]

    return Case(op, shape, inputs, impls, **case_args)


def relu_squared_mlp_cases(configs):
    """Nemotron's MLP; no Liger peer (Liger has the activation only)."""
    from tigon.nn import TigonReLUSquaredMLP

    return [_module_case("relu_squared_mlp", f"T{t} H{h} I{i}",
                         {"torch eager": EagerReLUSquaredMLP(h, i), "tigon": TigonReLUSquaredMLP(h, i)}, t, h,
                         flops_full=12 * t * h * i) for t, h, i in configs]


def tiled_mlp_cases(configs, liger):
    """A long-context SwiGLU MLP in token shards (ceil(T / H) of them) against the untiled MLPs:
    time and peak memory. FLOPs: the untiled MLP's 18 T H I (the shards' recomputation is the
    price of the memory)."""
    from tigon.nn import TigonSwiGLUMLP, TigonTiledSwiGLUMLP

    cases = []
    for t, h, i in configs:
        modules = {"torch eager": EagerSwiGLUMLP(h, i),
                   "tigon": TigonTiledSwiGLUMLP(hidden_size=h, intermediate_size=i),
                   "tigon, untiled": TigonSwiGLUMLP(hidden_size=h, intermediate_size=i)}
        if liger:
            try:
                from types import SimpleNamespace

                from liger_kernel.transformers import LigerTiledSwiGLUMLP

                modules["liger"] = LigerTiledSwiGLUMLP(SimpleNamespace(hidden_size=h, intermediate_size=i,
                                                                       hidden_act="silu"))
            except ImportError:
                pass
        cases.append(_module_case("tiled_mlp", f"T{t} H{h} I{i}", modules, t, h, flops_full=18 * t * h * i,
                                  size=("tokens", t)))
    return cases


def _cce():
    try:
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy
    except Exception:
        return None


def eager_cross_entropy(logits, target):
    """What HF's loss does: upcast the logits, then torch's cross entropy."""
    return torch.nn.functional.cross_entropy(logits.float(), target)


def eager_linear_cross_entropy(x, w, target):
    return eager_cross_entropy(x @ w.t(), target)


def _grad_output_variants(shape, first):
    """A loss is timed with grad_output 1 (loss.backward()); the first shape also with 0.5 (a
    loss weight, or gradient accumulation), where stored gradients must be rescaled."""
    return [(shape, 1.0)] + ([(f"{shape} go=0.5", 0.5)] if first else [])


class ThreeMatmuls(torch.autograd.Function):
    """The floor of FLCE: logits = x @ w.T forward, dx = g @ w and dw = g.T @ x backward (g: the
    logits themselves, as a stand-in for their gradient). Time reference, not a loss."""

    @staticmethod
    def forward(ctx, x, w, target):
        logits = x @ w.t()
        ctx.save_for_backward(x, w, logits)
        return logits.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        x, w, g = ctx.saved_tensors
        return g @ w, g.t() @ x, None


def three_matmuls(x, w, target):
    return ThreeMatmuls.apply(x, w, target)


def cross_entropy_cases(shapes, liger, grad_output_variant=True):
    cases = []
    for i, (rows, vocab) in enumerate(shapes):
        def inputs(rows=rows, vocab=vocab):
            return [_randn(rows, vocab, scale=2.0), _randint(vocab, rows)]

        # tigon in place, as the patched models and Liger run it; "tigon, new gradient" is the
        # public default (the logits are left alone, as torch does).
        impls = {"tigon": functools.partial(TF.cross_entropy, inplace=True),
                 "tigon, new gradient": TF.cross_entropy, "torch eager": eager_cross_entropy,
                 "torch.compile": _compiled(eager_cross_entropy)}
        if liger:
            impls["liger"] = liger.liger_cross_entropy
        # Read the logits once and write their gradient once.
        for shape, go in _grad_output_variants(f"{rows}x{vocab}", i == 0 and grad_output_variant):
            cases.append(Case("cross_entropy", shape, inputs, impls, bytes_full=2 * rows * vocab * 2, grad_output=go,
                              size=("vocab", vocab) if go == 1.0 else None))
    return cases


def vocab_parallel_ce_cases(shapes, liger):
    """Vocab-parallel cross entropy, single-GPU stand-in: one rank (no collective) holding a shard
    of V_r ids, swept over the shard width (V 128256 over TP 8, 2, 1). "tigon" at vocab_start 0
    is tigon's cross_entropy (what one rank runs); "tigon, sharded kernels" runs a rank's two
    passes of the several-rank path (row stats, then loss and gradient) without the all-gather of
    [N + 1, 5] fp32 stats between them. The multi-GPU benchmark (TP > 1, with the collective)
    belongs to the multi-GPU issue."""
    from tigon.ops.vocab_parallel_cross_entropy import shard_options, sharded_cross_entropy

    def sharded(logits, target):
        grad = torch.is_grad_enabled() and logits.requires_grad
        return sharded_cross_entropy(logits, target, None, 1, 0, shard_options(-100, "mean", 0.0, 0.0, None, False),
                                     grad, inplace=True)[0]

    liger_vp = None
    try:
        from liger_kernel.transformers import LigerVocabParallelCrossEntropy

        liger_vp = LigerVocabParallelCrossEntropy()  # [S, B, V] in, per-token loss out
    except Exception:
        pass
    cases = []
    for rows, vocab in shapes:
        def inputs(rows=rows, vocab=vocab):
            return [_randn(rows, vocab, scale=2.0), _randint(vocab, rows)]

        impls = {"tigon": functools.partial(TF.vocab_parallel_cross_entropy, vocab_start=0, inplace=True),
                 "tigon, new gradient": functools.partial(TF.vocab_parallel_cross_entropy, vocab_start=0),
                 "tigon, sharded kernels": sharded, "torch eager": eager_cross_entropy,
                 "torch.compile": _compiled(eager_cross_entropy)}
        if liger:
            impls["liger"] = liger.liger_cross_entropy
        if liger_vp is not None:
            impls["liger, vocab-parallel"] = lambda logits, target: liger_vp(logits[:, None], target[:, None]).mean()
        # Read the logits once and write their gradient once.
        cases.append(Case("vocab_parallel_cross_entropy", f"BT{rows} V_r{vocab}", inputs, impls,
                          bytes_full=2 * rows * vocab * 2, grad_output=1.0, size=("vocab shard", vocab)))
    return cases


def flce_cases(shapes, liger, cce, sweep_hidden=4096, grad_output_variant=True):
    """The shapes with hidden == sweep_hidden (and the same rows) form the plotted vocab sweep."""
    cases = []
    for i, (rows, hidden, vocab) in enumerate(shapes):
        def inputs(rows=rows, hidden=hidden, vocab=vocab):
            return [_randn(rows, hidden), _randn(vocab, hidden, scale=hidden**-0.5),
                    _randint(vocab, rows)]

        impls = {"tigon": TF.fused_linear_cross_entropy, "torch eager": eager_linear_cross_entropy,
                 "torch.compile": _compiled(eager_linear_cross_entropy)}
        if liger:
            impls["liger"] = liger.liger_fused_linear_cross_entropy
        if cce:
            impls["cce"] = cce
        impls["3 matmuls (floor)"] = three_matmuls
        for shape, go in _grad_output_variants(f"BT{rows} H{hidden} V{vocab}", i == 0 and grad_output_variant):
            swept = hidden == sweep_hidden and rows == shapes[0][0] and go == 1.0
            cases.append(Case("fused_linear_cross_entropy", shape, inputs, impls,
                              flops_full=3 * 2 * rows * hidden * vocab, grad_output=go,
                              size=("vocab", vocab) if swept else None))
    return cases


def eager_softmax(x):
    return torch.softmax(x, -1)


def eager_sparsemax(x):
    """Sparsemax by sorting (Martins & Astudillo's algorithm), in fp32 as the kernels."""
    z = x.float()
    zs = torch.sort(z, dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cumsum = zs.cumsum(-1)
    support = (1 + k * zs > cumsum).sum(-1, keepdim=True)
    tau = (cumsum.gather(-1, support - 1) - 1) / support
    return (z - tau).clamp_min(0).to(x.dtype)


def eager_kl_div(x, t):
    return torch.nn.functional.kl_div(x, t, reduction="batchmean")


def eager_tvd(p, q):
    """Liger's TVD (batchmean, no labels) in plain torch."""
    return 0.5 * (p - q).abs().sum() / p.shape[0]


def row_activation_cases(rows_cols, liger):
    """softmax and sparsemax over the last dim, swept over its width (sparsemax: up to 65536)."""
    cases = []
    for m, n in rows_cols:
        def inputs(m=m, n=n):
            return [_randn(m, n, scale=2.0)]

        for op, ours, eager, peer in (("softmax", TF.softmax, eager_softmax, "liger_softmax"),
                                      ("sparsemax", TF.sparsemax, eager_sparsemax, "liger_sparsemax")):
            if op == "sparsemax" and n > 65536:
                continue
            impls = {"tigon": ours, "torch eager": eager, "torch.compile": _compiled(eager)}
            if liger and hasattr(liger, peer):
                impls["liger"] = getattr(liger, peer)
            # fwd reads x, writes y; bwd reads dy, y, writes dx.
            cases.append(Case(op, f"{m}x{n}", inputs, impls, bytes_full=5 * m * n * 2, size=("width", n)))
    return cases


def distribution_loss_cases(shapes, liger):
    """kl_div (input log-probabilities, target probabilities) and tvd (two probability rows),
    reduction "batchmean", only the first input requiring grad (a student against a teacher)."""
    cases = []
    for rows, vocab in shapes:
        def log_probs_and_probs(rows=rows, vocab=vocab):
            x = torch.log_softmax(_randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
            t = torch.softmax(_randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
            return [x.requires_grad_(), t]

        def two_probs(rows=rows, vocab=vocab):
            p, q = (torch.softmax(_randn(rows, vocab, scale=2.0, grad=False).float(), -1).to(torch.bfloat16)
                    for _ in range(2))
            return [p.requires_grad_(), q]

        impls = {"tigon": TF.kl_div, "torch eager": eager_kl_div, "torch.compile": _compiled(eager_kl_div)}
        if liger and hasattr(liger, "liger_kl_div"):
            impls["liger"] = lambda x, t: liger.liger_kl_div(x, t, reduction="batchmean")
        # Read both inputs once, write the first one's gradient once.
        cases.append(Case("kl_div", f"BT{rows} V{vocab}", log_probs_and_probs, impls, bytes_full=3 * rows * vocab * 2,
                          grad_output=1.0, size=("vocab", vocab)))
        impls = {"tigon": TF.tvd, "torch eager": eager_tvd, "torch.compile": _compiled(eager_tvd)}
        if liger and hasattr(liger, "liger_tvd"):
            impls["liger"] = lambda p, q: liger.liger_tvd(p, q, None, "batchmean")
        cases.append(Case("tvd", f"BT{rows} V{vocab}", two_probs, impls, bytes_full=3 * rows * vocab * 2,
                          grad_output=1.0, size=("vocab", vocab)))
    return cases


def eager_moe_experts(x, index, weights, gate_up, down):
    """HF 5.x's default experts forward ("grouped_mm", transformers.integrations.moe) in plain
    torch: the (token, slot) pairs sorted by expert, two grouped matmuls with SwiGLU between,
    weighted and summed back per token."""
    n_experts, top_k = gate_up.shape[0], index.shape[-1]
    ids, perm = torch.sort(index.reshape(-1))
    counts = torch.histc(ids.int() if ids.is_cuda else ids.float(), bins=n_experts, min=0, max=n_experts - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # histc, not bincount: no host sync (as HF)
    grouped_mm = torch.nn.functional.grouped_mm
    gate, up = grouped_mm(x[perm // top_k], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = grouped_mm(torch.nn.functional.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    y = y * weights.reshape(-1)[perm, None]
    pairs = torch.zeros_like(y).index_copy(0, perm, y)  # back in (token, slot) order
    return pairs.view(x.shape[0], top_k, -1).sum(1).to(x.dtype)


def moe_cases(configs, liger):
    """configs: (tokens, experts E, top-k K, hidden H, intermediate I, router weights' dtype,
    swept). Routing from a random router (softmax top-k, renormalised). FLOPs: forward
    2 TK H 2I + 2 TK I H, backward twice that."""
    fused_moe = None
    if liger:
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction as fused_moe
        except Exception:  # noqa: BLE001 (this Liger has no fused MoE, or it does not import here)
            fused_moe = None
    cases = []
    for tokens, experts, top_k, hidden, inter, w_dtype, swept in configs:
        def inputs(tokens=tokens, experts=experts, top_k=top_k, hidden=hidden, inter=inter, w_dtype=w_dtype):
            top = torch.softmax(_randn(tokens, experts, dtype=torch.float32, grad=False), -1).topk(top_k, -1)
            weights = (top.values / top.values.sum(-1, keepdim=True)).to(w_dtype).requires_grad_()
            gate_up = _randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
            down = _randn(experts, hidden, inter, scale=inter**-0.5)
            return [_randn(tokens, hidden), top.indices, weights, gate_up, down]

        impls = {"tigon": TF.moe_experts, "torch eager": eager_moe_experts,
                 "torch.compile": _compiled(eager_moe_experts)}
        if fused_moe is not None:
            impls["liger"] = lambda x, index, w, gate_up, down: fused_moe.apply(x, gate_up, down, index.int(), w)
        cases.append(Case("moe_experts", f"T{tokens} E{experts} K{top_k} H{hidden} I{inter}", inputs, impls,
                          flops_full=3 * 6 * tokens * top_k * hidden * inter,
                          size=("tokens", tokens) if swept else None))
    return cases


def all_cases(quick=False):
    liger = _liger()
    # Sweeps (one axis each, as the Liger paper plots them): hidden size for the norms, tokens for
    # the GLUs, sequence length for RoPE, vocabulary for the losses; --quick: one point each.
    hidden = [(16384, 4096)] if quick else [(16384, n) for n in (1024, 4096, 8192)]
    glu = [(8192, 14336)] if quick else [(t, 14336) for t in (4096, 8192, 16384)]
    rope = [(4, 32, 8, 2048, 128)] if quick else [(4, 32, 8, t, 128) for t in (1024, 4096, 8192)]
    mlp = [(8192, 4096, 14336)]
    ce = [(8192, 128256)] if quick else [(8192, v) for v in (32000, 128256, 151936)]
    flce = ([(8192, 4096, 128256)] if quick else
            [(8192, 4096, v) for v in (32000, 128256, 151936)] + [(4096, 2048, 128256)])
    cases = (norm_cases(hidden, liger) + glu_cases(glu, liger) + rope_cases(rope, liger) + mlp_cases(mlp, liger)
             + cross_entropy_cases(ce, liger, not quick)
             + flce_cases(flce, liger, _cce(), grad_output_variant=not quick))
    # One rank's shard of Llama 3's 128256 ids at TP 8, 2 and 1, 8192 tokens.
    vocab_shards = [(8192, 128256)] if quick else [(8192, v) for v in (16032, 64128, 128256)]
    cases += vocab_parallel_ce_cases(vocab_shards, liger)
    # GroupNorm on UNet / VAE-like activations [32, 512, S, S] in 32 groups (C / G * S^2 elements a group).
    spatial = [64] if quick else [32, 64, 128]
    cases += group_norm_cases([(32, 512, side, 32) for side in spatial], liger) + dyt_poly_norm_cases(hidden, liger)
    # softmax / sparsemax over vocabulary-like widths, 16384 rows; kl_div / tvd over BT 8192 and
    # Llama 2's and 3's vocabularies.
    widths = [(16384, 32768)] if quick else [(16384, n) for n in (4096, 16384, 32768, 128256)]
    cases += row_activation_cases(widths, liger)
    cases += distribution_loss_cases([(8192, 128256)] if quick else [(8192, v) for v in (32000, 128256)], liger)
    # ReLU² over tokens x 14336 as the GLUs; Nemotron-like MLP; a long-context SwiGLU MLP in shards.
    cases += relu_squared_cases(glu, liger) + relu_squared_mlp_cases([(8192, 4096, 16384)])
    cases += tiled_mlp_cases([(65536, 4096, 14336)] if quick else [(t, 4096, 14336) for t in (16384, 65536)], liger)
    # MoE experts: Qwen3-30B-A3B's layer (E 128, K 8, H 2048, I 768) over tokens; Mixtral-8x7B's at 8192.
    moe_tokens = [16384] if quick else [8192, 16384, 32768]
    cases += moe_cases([(t, 128, 8, 2048, 768, torch.bfloat16, True) for t in moe_tokens]
                       + ([] if quick else [(8192, 8, 2, 4096, 14336, torch.float32, False)]), liger)
    missing = set(OP_NAMES) - {case.op for case in cases}
    if missing:
        raise ValueError(f"OP_NAMES lists ops with no case: {sorted(missing)}")
    return cases, liger


def max_rel_err(a, b):
    outs_a = a if isinstance(a, (tuple, list)) else (a,)
    outs_b = b if isinstance(b, (tuple, list)) else (b,)
    errs = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)).item() for x, y in zip(outs_a, outs_b)]
    return max(errs)


def run_cases(indices, quick, limits, rows_out):
    """Measure every implementation of the cases `indices` in this process, rewriting rows_out
    (JSON) after each case, so a crash loses only the case it happened in."""
    torch._dynamo.config.cache_size_limit = 64
    cases, _ = all_cases(quick)
    rows = []
    for index in indices:
        rows += run_case(cases[index], quick, limits)
        with open(rows_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f)
        print(f"case done: {cases[index].op} {cases[index].shape}", flush=True)  # the parent's progress bar


def run_case(case, quick, limits):
    """Measure every implementation of one case; returns its rows."""
    inputs = case.make_inputs()
    with torch.no_grad():  # no grad: nothing is computed in place over the inputs
        err = max_rel_err(case.impls["tigon"](*inputs), case.impls["torch eager"](*inputs))
    rows = []
    for name, fn in case.impls.items():
        row = Row(case.op, case.shape, name, "bf16", bytes_full=case.bytes_full, flops_full=case.flops_full)
        measure(fn, inputs, row, limits, grad_output=case.grad_output, quick=quick)
        if name == "tigon":
            row.extra["rel_err_vs_eager"] = err
        if case.size:
            row.extra["size_name"], row.extra["size"] = case.size
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {case.op} {case.shape} {name}: eager-dispatch {row.full_ms} ms, graph {row.graph_ms} ms, "
              f"peak {row.peak_mb} MB {row.error or ''}", file=sys.stderr, flush=True)
    return rows


# Liger's kl_div and tvd sync with the host in their backward too (torch.equal on grad_output).
ISOLATED_OPS = ("cross_entropy", "vocab_parallel_cross_entropy", "fused_linear_cross_entropy", "kl_div", "tvd")


def _progress_bar(total):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="case", file=sys.stderr)


def run(ops=None, quick=False, out_dir="bench_out", verbose=False, shapes=None):
    """The cases in child processes, one per op (all its sizes): a peer whose CUDA-graph capture
    fails (a host sync inside) leaks the capture's memory pool, which must not starve the other
    ops' cases. --quick runs its few cases in one child."""
    import subprocess
    import tempfile

    error = unknown_op_error(ops or ())
    if error:
        raise ValueError(f"ops: {error}")
    os.makedirs(out_dir, exist_ok=True)
    limits = measure_limits()
    cases, liger = all_cases(quick)
    selected = [i for i, c in enumerate(cases) if (not ops or c.op in ops)
                and (not shapes or any(s == c.shape or s in c.shape.split() for s in shapes))]
    # One child process per op (all its sizes), or one for the whole --quick run: the child's
    # fixed costs (imports, inductor's start-up) are paid once per group, not per case.
    groups = {}
    for index in selected:
        op = cases[index].op
        # Liger's and CCE's losses sync with the host, so their graph capture fails and leaks its
        # memory pool: a loss case (tens of GB at these shapes) gets a process of its own.
        key = "all" if quick else (op, index) if op in ISOLATED_OPS else op
        groups.setdefault(key, []).append(index)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # small graphs: no compile-worker pool to start
    rows = []
    bar = _progress_bar(len(selected))
    for indices in groups.values():
        names = sorted({cases[i].op for i in indices})
        bar.set_description(", ".join(names) if len(names) < 3 else f"{len(indices)} cases")
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp, tempfile.TemporaryFile("w+") as err:
            cmd = [sys.executable, "-m", "tigon.bench.ops", "--case-indices", *map(str, indices),
                   "--rows-out", tmp.name, "--limits", json.dumps(limits)] + (["--quick"] if quick else [])
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else err, text=True, env=env)
            done_cases = 0
            for line in child.stdout:
                if line.startswith("case done: "):
                    done_cases += 1
                    bar.update(1)
                    bar.set_postfix_str(line[len("case done: "):].strip())
            child.wait()
            if done_cases:
                rows += [Row(**r) for r in json.load(open(tmp.name))]
            if done_cases < len(indices):
                err.seek(0)
                last = err.read().strip().splitlines()[-1:] or [""]
                rows += [Row(cases[i].op, cases[i].shape, "all", "bf16",
                             error=f"case process exited {child.returncode}: {last[0][:200]}")
                         for i in indices[done_cases:]]
                bar.update(len(indices) - done_cases)
    bar.close()
    meta = {
        "limits": limits,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger": getattr(__import__("liger_kernel"), "__version__", "installed") if liger else None,
        "cce": "installed" if _cce() else None,
    }
    write_results(rows, meta, out_dir)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="*", choices=OP_NAMES, metavar="OP",
                        help=f"op names to run (default: all): {', '.join(OP_NAMES)}")
    parser.add_argument("--quick", action="store_true", help="one size per op")
    parser.add_argument("--out", default="bench_out", help="folder for ops.json, ops.csv, ops.md and the plots")
    parser.add_argument("--verbose", action="store_true", help="show each case's own progress lines")
    parser.add_argument("--shapes", nargs="*", help="only cases with these shapes (or a word of one, e.g. V151936)")
    parser.add_argument("--merge", nargs="*", help="combine the results in these folders into --out (no GPU work)")
    parser.add_argument("--case-indices", type=int, nargs="*", help=argparse.SUPPRESS)  # internal: a child's cases
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case_indices is not None:
        run_cases(args.case_indices, args.quick, json.loads(args.limits), args.rows_out)
        return
    if args.merge:
        merge_results(args.merge, args.out)
        return
    run(args.ops, args.quick, args.out, args.verbose, args.shapes)


if __name__ == "__main__":
    main()
