"""The op suite's cases for the layers: norms, GLUs, RoPE, activations, MLP modules, MoE experts.

"torch eager" is tigon.reference's formula on the inputs as the model code runs them (HF's, in
bf16), or HF's module code (the MLPs, the MoE experts' grouped_mm path).
"""

from __future__ import annotations

import functools

import torch

from tigon import functional as TF
from tigon.bench.cases import Case, compiled, randn
from tigon.reference import (
    dyt_ref,
    fused_add_rms_norm_ref,
    glu_ref,
    group_norm_ref,
    layer_norm_ref,
    poly_norm_ref,
    relu_squared_ref,
    rms_norm_ref,
    rope_ref,
    softmax_ref,
    sparsemax_ref,
)

# The eager baselines that keep to the inputs' dtype, as HF's modules (and DyT's paper) run them.
EAGER_LAYER_NORM = functools.partial(layer_norm_ref, upcast=False)
EAGER_DYT = functools.partial(dyt_ref, upcast=False)
EAGER_SWIGLU = functools.partial(glu_ref, activation="silu", upcast=False)
EAGER_GEGLU = functools.partial(glu_ref, activation="gelu_tanh", upcast=False)
EAGER_RELU_SQUARED = functools.partial(relu_squared_ref, upcast=False)
EAGER_SOFTMAX = functools.partial(softmax_ref, upcast=False)


def group_norm_cases(configs, liger):
    """configs: (N, C, spatial side, groups), swept over the spatial side."""
    cases = []
    for n, c, side, groups in configs:
        def inputs(n=n, c=c, side=side):
            return [randn(n, c, side, side, shift=1.0), randn(c, scale=0.1, shift=1.0), randn(c, scale=0.1)]

        def eager(x, w, b, groups=groups):
            return group_norm_ref(x, groups, w, b, upcast=False)

        impls = {"tigon": lambda x, w, b, groups=groups: TF.group_norm(x, groups, w, b),
                 "torch eager": eager, "torch.compile": compiled(eager)}
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
            return [randn(m, n), randn(1, scale=0.0, shift=0.5), randn(n, scale=0.1, shift=1.0),
                    randn(n, scale=0.1)]

        impls = {"tigon": TF.dyt, "torch eager": EAGER_DYT, "torch.compile": compiled(EAGER_DYT)}
        if liger and hasattr(liger, "liger_dyt"):
            impls["liger"] = liger.liger_dyt
        cases.append(Case("dyt", f"{m}x{n}", dyt_inputs, impls, bytes_full=5 * m * n * 2, size=("hidden", n)))

        def poly_inputs(m=m, n=n):
            return [randn(m, n), randn(3, scale=0.1, shift=1 / 3), randn(1, scale=0.1)]

        impls = {"tigon": TF.poly_norm, "torch eager": poly_norm_ref, "torch.compile": compiled(poly_norm_ref)}
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
            return [randn(m, n), randn(n, scale=0.1, shift=1.0)]

        impls = {"tigon": TF.rms_norm, "torch eager": rms_norm_ref, "torch.compile": compiled(rms_norm_ref)}
        if liger:
            impls["liger"] = lambda x, w: liger.liger_rms_norm(x, w, 1e-6)
        cases.append(Case("rms_norm", shape, rms_inputs, impls, bytes_full=5 * m * n * elt, size=("hidden", n)))

        def ln_inputs(m=m, n=n):
            return [randn(m, n, shift=2.0), randn(n, scale=0.1, shift=1.0), randn(n, scale=0.1)]

        impls = {"tigon": TF.layer_norm, "torch eager": EAGER_LAYER_NORM, "torch.compile": compiled(EAGER_LAYER_NORM)}
        if liger:
            impls["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
        cases.append(Case("layer_norm", shape, ln_inputs, impls, bytes_full=5 * m * n * elt, size=("hidden", n)))

        def add_inputs(m=m, n=n):
            return [randn(m, n), randn(m, n), randn(n, scale=0.1, shift=1.0)]

        impls = {"tigon": TF.fused_add_rms_norm, "torch eager": fused_add_rms_norm_ref,
                 "torch.compile": compiled(fused_add_rms_norm_ref)}
        if liger and hasattr(liger, "liger_fused_add_rms_norm"):
            impls["liger"] = lambda x, r, w: liger.liger_fused_add_rms_norm(x, r, w, 1e-6)
        cases.append(Case("fused_add_rms_norm", shape, add_inputs, impls, bytes_full=8 * m * n * elt,
                          size=("hidden", n)))
    return cases


def _function_cases(specs, inputs, shape, liger, bytes_full, size):
    """A Case for each (op, tigon's function, the eager one, the name of Liger's) of ``specs``, on
    the inputs ``inputs()`` makes; Liger's where it has one."""
    cases = []
    for op, ours, eager, peer in specs:
        impls = {"tigon": ours, "torch eager": eager, "torch.compile": compiled(eager)}
        if liger and hasattr(liger, peer):
            impls["liger"] = getattr(liger, peer)
        cases.append(Case(op, shape, inputs, impls, bytes_full=bytes_full, size=size))
    return cases


def _rows(m, n, count=1):
    """An input maker: ``count`` [m, n] tensors, the first (an activation's input) scaled by 2."""
    return lambda: [randn(m, n, scale=2.0)] + [randn(m, n) for _ in range(count - 1)]


def glu_cases(rows_cols, liger):
    cases = []
    for m, n in rows_cols:
        # fwd reads a, b, writes c; bwd reads dc, a, b, writes da, db.
        cases += _function_cases((("swiglu", TF.swiglu, EAGER_SWIGLU, "liger_swiglu"),
                                  ("geglu", TF.geglu, EAGER_GEGLU, "liger_geglu")),
                                 _rows(m, n, 2), f"{m}x{n}", liger, bytes_full=8 * m * n * 2, size=("tokens", m))
    return cases


def rope_cases(configs, liger):
    cases = []
    for batch, hq, hk, tokens, dim in configs:
        def inputs(batch=batch, hq=hq, hk=hk, tokens=tokens, dim=dim):
            # HF's layout: [B, T, H*D] projections viewed and transposed to [B, H, T, D].
            q = randn(batch, tokens, hq, dim, grad=False).transpose(1, 2).requires_grad_()
            k = randn(batch, tokens, hk, dim, grad=False).transpose(1, 2).requires_grad_()
            inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
            freqs = torch.arange(tokens, device="cuda", dtype=torch.float32)[:, None] * inv
            emb = torch.cat((freqs, freqs), -1)[None]
            return [q, k, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)]

        impls = {"tigon": TF.apply_rotary_pos_emb, "torch eager": rope_ref, "torch.compile": compiled(rope_ref)}
        if liger:
            impls["liger"] = liger.liger_rope
        n = batch * tokens * (hq + hk) * dim
        cases.append(Case("rope", f"B{batch} T{tokens} Hq{hq} Hk{hk} D{dim}", inputs, impls, bytes_full=4 * n * 2,
                          size=("sequence length", tokens)))
    return cases


class EagerMLP(torch.nn.Module):
    """HF's MLP modules in plain torch: LlamaMLP (gated: down_proj(silu(gate_proj(x)) *
    up_proj(x))) or NemotronMLP (not gated: down_proj(relu(up_proj(x))^2)), in the weights' dtype."""

    def __init__(self, hidden, inter, gated=True):
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        if self.gated:
            return self.down_proj(glu_ref(self.gate_proj(x), self.up_proj(x), upcast=False))
        return self.down_proj(relu_squared_ref(self.up_proj(x), upcast=False))


def mlp_cases(configs, liger):
    from tigon.nn import TigonSwiGLUMLP

    cases = []
    for tokens, hidden, inter in configs:
        modules = {"torch eager": EagerMLP(hidden, inter),
                   "tigon": TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter)}
        if liger:
            from types import SimpleNamespace

            from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

            modules["liger"] = LigerSwiGLUMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter,
                                                              hidden_act="silu"))
        cases.append(_module_case("swiglu_mlp", f"T{tokens} H{hidden} I{inter}", modules, tokens, hidden,
                                  flops_full=18 * tokens * hidden * inter))
    return cases


def relu_squared_cases(rows_cols, liger):
    spec = (("relu_squared", TF.relu_squared, EAGER_RELU_SQUARED, "liger_relu_squared"),)
    cases = []
    for m, n in rows_cols:
        # fwd reads x, writes y; bwd reads dy, x, writes dx.
        cases += _function_cases(spec, _rows(m, n), f"{m}x{n}", liger, bytes_full=5 * m * n * 2, size=("tokens", m))
    return cases


def _module_case(op, shape, modules, tokens, hidden, **case_args):
    """A Case over MLP modules that share the eager module's weights (bf16); "torch.compile"
    compiles "torch eager". Every module's parameters are inputs (their gradients are reset)."""
    for mod in modules.values():
        mod.to(device="cuda", dtype=torch.bfloat16)
    for mod in modules.values():
        mod.load_state_dict(modules["torch eager"].state_dict())
    compiled_eager = compiled(modules["torch eager"])
    impls = {name: (lambda x, *_, mod=mod: mod(x)) for name, mod in modules.items()}
    impls["torch.compile"] = lambda x, *_: compiled_eager(x)
    all_params = [p for mod in modules.values() for p in mod.parameters()]

    def inputs():
        return [randn(tokens, hidden), *all_params]

    return Case(op, shape, inputs, impls, **case_args)


def relu_squared_mlp_cases(configs):
    """Nemotron's MLP; no Liger peer (Liger has the activation only)."""
    from tigon.nn import TigonReLUSquaredMLP

    return [_module_case("relu_squared_mlp", f"T{t} H{h} I{i}",
                         {"torch eager": EagerMLP(h, i, gated=False), "tigon": TigonReLUSquaredMLP(h, i)}, t, h,
                         flops_full=12 * t * h * i) for t, h, i in configs]


def tiled_mlp_cases(configs, liger):
    """A long-context SwiGLU MLP in token shards (ceil(T / H) of them) against the untiled MLPs:
    time and peak memory. FLOPs: the untiled MLP's 18 T H I (the shards' recomputation is the
    price of the memory)."""
    from tigon.nn import TigonSwiGLUMLP, TigonTiledSwiGLUMLP

    cases = []
    for t, h, i in configs:
        modules = {"torch eager": EagerMLP(h, i),
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


def row_activation_cases(rows_cols, liger):
    """softmax and sparsemax over the last dim, swept over its width (sparsemax: up to 65536)."""
    cases = []
    for m, n in rows_cols:
        specs = [("softmax", TF.softmax, EAGER_SOFTMAX, "liger_softmax")]
        if n <= 65536:
            specs.append(("sparsemax", TF.sparsemax, sparsemax_ref, "liger_sparsemax"))
        # fwd reads x, writes y; bwd reads dy, y, writes dx.
        cases += _function_cases(specs, _rows(m, n), f"{m}x{n}", liger, bytes_full=5 * m * n * 2, size=("width", n))
    return cases


def eager_moe_experts(x, index, weights, gate_up, down):
    """HF 5.x's default experts forward ("grouped_mm", transformers.integrations.moe) in plain
    torch: the (token, slot) pairs sorted by expert, two grouped matmuls with SwiGLU between,
    weighted and summed back per token. Not tigon.reference.moe_experts_ref (HF's per-expert
    loop, the tests' reference, the same formula): the algorithm HF runs by default is the fair
    baseline to time."""
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
            top = torch.softmax(randn(tokens, experts, dtype=torch.float32, grad=False), -1).topk(top_k, -1)
            weights = (top.values / top.values.sum(-1, keepdim=True)).to(w_dtype).requires_grad_()
            gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
            down = randn(experts, hidden, inter, scale=inter**-0.5)
            return [randn(tokens, hidden), top.indices, weights, gate_up, down]

        impls = {"tigon": TF.moe_experts, "torch eager": eager_moe_experts,
                 "torch.compile": compiled(eager_moe_experts)}
        if fused_moe is not None:
            impls["liger"] = lambda x, index, w, gate_up, down: fused_moe.apply(x, gate_up, down, index.int(), w)
        cases.append(Case("moe_experts", f"T{tokens} E{experts} K{top_k} H{hidden} I{inter}", inputs, impls,
                          flops_full=3 * 6 * tokens * top_k * hidden * inter,
                          size=("tokens", tokens) if swept else None))
    return cases
