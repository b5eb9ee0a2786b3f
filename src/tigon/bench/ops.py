"""Op benchmark cases: tigon vs torch eager vs torch.compile vs Liger-Kernel (when installed).

Run on a CUDA machine: ``python -m tigon.bench.ops [--ops rms_norm rope ...] [--out DIR]``.
Each case counts the fewest bytes (or FLOPs) forward+backward must move, so every row also
says what fraction of the measured copy bandwidth (or bf16 matmul rate) it reaches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tigon import functional as TF
from tigon.bench.harness import Row, generator, markdown_table, measure, measure_limits


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], list]
    impls: dict  # name -> fn(*inputs)
    bytes_full: int | None = None
    flops_full: int | None = None
    grad_output: float | None = None  # None: random cotangents; a loss's cases use 1 (loss.backward())


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
        cases.append(Case("rms_norm", shape, rms_inputs, impls, bytes_full=5 * m * n * elt))

        def ln_inputs(m=m, n=n):
            return [_randn(m, n, shift=2.0), _randn(n, scale=0.1, shift=1.0), _randn(n, scale=0.1)]

        impls = {"tigon": TF.layer_norm, "torch eager": eager_layer_norm, "torch.compile": _compiled(eager_layer_norm)}
        if liger:
            impls["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
        cases.append(Case("layer_norm", shape, ln_inputs, impls, bytes_full=5 * m * n * elt))

        def add_inputs(m=m, n=n):
            return [_randn(m, n), _randn(m, n), _randn(n, scale=0.1, shift=1.0)]

        impls = {"tigon": TF.fused_add_rms_norm, "torch eager": eager_fused_add_rms_norm,
                 "torch.compile": _compiled(eager_fused_add_rms_norm)}
        if liger and hasattr(liger, "liger_fused_add_rms_norm"):
            impls["liger"] = lambda x, r, w: liger.liger_fused_add_rms_norm(x, r, w, 1e-6)
        cases.append(Case("fused_add_rms_norm", shape, add_inputs, impls, bytes_full=8 * m * n * elt))
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
            cases.append(Case(op, f"{m}x{n}", inputs, impls, bytes_full=8 * m * n * 2))
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
        cases.append(Case("rope", f"B{batch} T{tokens} Hq{hq} Hk{hk} D{dim}", inputs, impls, bytes_full=4 * n * 2))
    return cases


def mlp_cases(configs, liger):
    from tigon.nn import TigonSwiGLUMLP

    cases = []
    for tokens, hidden, inter in configs:
        modules = {"torch eager": EagerSwiGLUMLP(hidden, inter), "tigon": TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter)}
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


def cross_entropy_cases(shapes, liger):
    cases = []
    for i, (rows, vocab) in enumerate(shapes):
        def inputs(rows=rows, vocab=vocab):
            return [_randn(rows, vocab, scale=2.0), _randint(vocab, rows)]

        impls = {"tigon": TF.cross_entropy, "torch eager": eager_cross_entropy,
                 "torch.compile": _compiled(eager_cross_entropy)}
        if liger:
            impls["liger"] = liger.liger_cross_entropy
        # Read the logits once and write their gradient once.
        for shape, go in _grad_output_variants(f"{rows}x{vocab}", i == 0):
            cases.append(Case("cross_entropy", shape, inputs, impls, bytes_full=2 * rows * vocab * 2, grad_output=go))
    return cases


def flce_cases(shapes, liger, cce):
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
        for shape, go in _grad_output_variants(f"BT{rows} H{hidden} V{vocab}", i == 0):
            cases.append(Case("fused_linear_cross_entropy", shape, inputs, impls,
                              flops_full=3 * 2 * rows * hidden * vocab, grad_output=go))
    return cases


def all_cases(quick=False):
    liger = _liger()
    hidden = [(16384, 4096)] if quick else [(16384, 1024), (16384, 4096), (8192, 8192)]
    glu = [(16384, 14336)] if quick else [(8192, 11008), (16384, 14336)]
    rope = [(4, 32, 8, 2048, 128)] if quick else [(4, 32, 8, 2048, 128), (8, 28, 4, 1024, 128)]
    mlp = [(8192, 4096, 14336)]
    ce = [(8192, 128256)] if quick else [(8192, 128256), (4096, 151936)]
    flce = ([(8192, 4096, 128256)] if quick else
            [(8192, 4096, 128256), (4096, 2048, 128256), (8192, 896, 151936), (2048, 896, 151936)])
    return (norm_cases(hidden, liger) + glu_cases(glu, liger) + rope_cases(rope, liger) + mlp_cases(mlp, liger)
            + cross_entropy_cases(ce, liger) + flce_cases(flce, liger, _cce())), liger


def max_rel_err(a, b):
    outs_a = a if isinstance(a, (tuple, list)) else (a,)
    outs_b = b if isinstance(b, (tuple, list)) else (b,)
    errs = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)).item() for x, y in zip(outs_a, outs_b)]
    return max(errs)


def run_case(index, quick, limits):
    """Measure every implementation of case `index`; returns its rows."""
    torch._dynamo.config.cache_size_limit = 64
    cases, _ = all_cases(quick)
    case = cases[index]
    inputs = case.make_inputs()
    with torch.no_grad():  # no grad: nothing is computed in place over the inputs
        err = max_rel_err(case.impls["tigon"](*inputs), case.impls["torch eager"](*inputs))
    rows = []
    for name, fn in case.impls.items():
        row = Row(case.op, case.shape, name, "bf16", bytes_full=case.bytes_full, flops_full=case.flops_full)
        measure(fn, inputs, row, limits, grad_output=case.grad_output)
        if name == "tigon":
            row.extra["rel_err_vs_eager"] = err
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {case.op} {case.shape} {name}: eager-dispatch {row.full_ms} ms, graph {row.graph_ms} ms, "
              f"peak {row.peak_mb} MB {row.error or ''}", file=sys.stderr, flush=True)
    return rows


def run(ops=None, quick=False, out_dir="bench_out"):
    """Every case in a process of its own: a peer whose CUDA-graph capture fails (a host sync
    inside) leaks the capture's memory pool, which would starve the cases after it."""
    import subprocess
    import tempfile

    os.makedirs(out_dir, exist_ok=True)
    limits = measure_limits()
    cases, liger = all_cases(quick)
    selected = [i for i, c in enumerate(cases) if not ops or c.op in ops]
    rows = []
    start = time.time()
    for n, index in enumerate(selected):
        case = cases[index]
        print(f"[{n + 1}/{len(selected)} {time.time() - start:6.1f}s] {case.op} {case.shape}", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, "-m", "tigon.bench.ops", "--case-index", str(index), "--rows-out", tmp.name,
                   "--limits", json.dumps(limits)] + (["--quick"] if quick else [])
            done = subprocess.run(cmd)
            if done.returncode == 0:
                rows += [Row(**r) for r in json.load(open(tmp.name))]
            else:
                rows.append(Row(case.op, case.shape, "all", "bf16", error=f"case process exited {done.returncode}"))
    meta = {
        "limits": limits,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger": getattr(__import__("liger_kernel"), "__version__", "installed") if liger else None,
        "cce": "installed" if _cce() else None,
    }
    with open(os.path.join(out_dir, "ops.json"), "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    table = markdown_table(rows)
    header = (f"GPU {limits['gpu']}: copy {limits['copy_gbps']:.0f} GB/s, bf16 matmul "
              f"{limits['matmul_tflops']:.0f} TFLOP/s; torch {meta['torch']}, triton {meta['triton']}, "
              f"liger {meta['liger']}, cce {meta['cce']}")
    with open(os.path.join(out_dir, "ops.md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    print(header)
    print(table)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="*", help="op names to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="one size per op")
    parser.add_argument("--out", default="bench_out", help="folder for ops.json and ops.md")
    parser.add_argument("--case-index", type=int, help=argparse.SUPPRESS)  # internal: one case, in a child
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case_index is not None:
        rows = run_case(args.case_index, args.quick, json.loads(args.limits))
        with open(args.rows_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f)
        return
    run(args.ops, args.quick, args.out)


if __name__ == "__main__":
    main()
