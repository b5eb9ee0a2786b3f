"""Host cost per call of tigon's ops: forward + backward on tiny tensors, where the GPU work is
negligible and the time is what the host spends (Python checks, Triton launches, autograd),
next to the same computation in eager torch and Liger-Kernel's (when installed), and tigon's ops
through torch's dispatcher (TIGON_LEAN_EAGER's path off) for comparison. CUDA only:
``PYTHONPATH=src python benchmarks/tuning/host_overhead.py [--profile]`` (--profile: cProfile of each
tigon op, by own time)."""

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import tigon.functional as TF
from tigon.bench.harness import host_us_per_call
from tigon.ops._internals import lean_eager_enabled, set_lean_eager


def fwd_bwd(op, *inputs):
    def run():
        out = op(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


@triton.jit
def _twenty_args_kernel(X, Y, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16,
                        BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs) + a0)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def print_primitives(x):
    """Host microseconds of the pieces a tigon call is made of, on this machine."""
    y = torch.empty_like(x)
    ints = list(range(3, 20))
    disabled = torch.compiler.disable(lambda t: t, recursive=True)
    rows = [
        ("triton launch, 19 args", lambda: _twenty_args_kernel[(1,)](x, y, *ints, BLOCK=16)),
        ("torch.empty (cuda)", lambda: torch.empty((16, 256), device=x.device, dtype=x.dtype)),
        ("x.add(1) (cuda)", lambda: x.detach().add(1)),
        ("torch.mm 16x256 @ 256x16", lambda: torch.mm(x.detach(), x.detach().t())),
        ("empty_like(device=meta)", lambda: torch.empty_like(x, device="meta")),
        ("autograd.Function.apply", lambda: _Identity.apply(x)),
        ("torch.compiler.disable call", lambda: disabled(x)),
    ]
    # The compiled kernel called directly (what JITFunction.run ends with), skipping the binder,
    # specialization and cache lookup: what a cached launch path could cost.
    try:
        compiled = _twenty_args_kernel[(1,)](x, y, *ints, BLOCK=16)
        stream = torch.cuda.current_stream().cuda_stream
        direct = (x, y, *ints, 16)
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *direct)
        rows.insert(1, ("triton compiled.run, 19 args", lambda: compiled.run(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *direct)))
        rows.insert(2, ("current stream (torch)", lambda: torch.cuda.current_stream().cuda_stream))
    except Exception as exc:  # another triton's launcher signature
        print(f"  (compiled.run direct: {type(exc).__name__}: {exc})")
    print("host cost of primitives, microseconds per call")
    for name, fn in rows:
        print(f"  {name:30s} {host_us_per_call(fn, n=2000):7.1f}", flush=True)


def liger_cases(x, w, xl, wl, bl, a, b, q, k, cos, sin, logits, head, target):
    """Liger-Kernel's autograd Functions on the same tensors, by case name; {} without Liger."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return {}
    return {
        "rms_norm": fwd_bwd(lambda: LigerRMSNormFunction.apply(x, w, 1e-6)),
        "layer_norm": fwd_bwd(lambda: LigerLayerNormFunction.apply(xl, wl, bl, 1e-5)),
        "cross_entropy": fwd_bwd(lambda: LigerCrossEntropyFunction.apply(logits, target)),
        "rope": fwd_bwd(lambda: sum(t.sum() for t in LigerRopeFunction.apply(q, k, cos, sin))),
        "swiglu": fwd_bwd(lambda: LigerSiLUMulFunction.apply(a, b)),
        "flce": fwd_bwd(lambda: LigerFusedLinearCrossEntropyFunction.apply(x, head, target)),
    }


def main():
    dev, dt = "cuda", torch.bfloat16
    tokens, hidden, inter, vocab = 16, 256, 512, 1024

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dt).requires_grad_()

    x, w = leaf(tokens, hidden), leaf(hidden)
    a, b = leaf(tokens, inter), leaf(tokens, inter)
    wg, wu, wd = leaf(inter, hidden, scale=0.05), leaf(inter, hidden, scale=0.05), leaf(hidden, inter, scale=0.05)
    head = leaf(vocab, hidden, scale=0.05)
    target = torch.randint(0, vocab, (tokens,), device=dev)
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    q = leaf(1, 4, tokens, 64)
    k = leaf(1, 2, tokens, 64)
    cos = torch.randn(1, tokens, 64, device=dev, dtype=dt)
    sin = torch.randn(1, tokens, 64, device=dev, dtype=dt)

    def rms_ref(x, w):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * w

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return torch.cat((-t2, t1), -1)

    xl, wl, bl = leaf(tokens, hidden), leaf(hidden), leaf(hidden)
    logits = leaf(tokens, vocab)
    liger = liger_cases(x, w, xl, wl, bl, a, b, q, k, cos, sin, logits, head, target)
    cases = [
        ("rms_norm", fwd_bwd(lambda: TF.rms_norm(x, w)), fwd_bwd(lambda: rms_ref(x, w))),
        ("layer_norm", fwd_bwd(lambda: TF.layer_norm(xl, wl, bl)),
         fwd_bwd(lambda: F.layer_norm(xl, (hidden,), wl, bl))),
        ("cross_entropy", fwd_bwd(lambda: TF.cross_entropy(logits, target)),
         fwd_bwd(lambda: F.cross_entropy(logits.float(), target))),
        ("rope", fwd_bwd(lambda: sum(t.sum() for t in TF.apply_rotary_pos_emb(q, k, cos, sin))),
         fwd_bwd(lambda: sum((t * cos[:, None] + rot(t) * sin[:, None]).sum() for t in (q, k)))),
        ("swiglu", fwd_bwd(lambda: TF.swiglu(a, b)), fwd_bwd(lambda: F.silu(a) * b)),
        ("glu_down_proj", fwd_bwd(lambda: TF.glu_down_proj(a * 1, b * 1, wd, inplace=True)),
         fwd_bwd(lambda: F.linear(F.silu(a) * b, wd))),
        ("glu_mlp", fwd_bwd(lambda: TF.glu_mlp(x, wg, wu, wd)),
         fwd_bwd(lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd))),
        ("flce", fwd_bwd(lambda: TF.fused_linear_cross_entropy(x, head, target)),
         fwd_bwd(lambda: F.cross_entropy(F.linear(x, head).float(), target))),
        ("embedding", fwd_bwd(lambda: TF.embedding(ids, head)), fwd_bwd(lambda: F.embedding(ids, head))),
    ]
    print_primitives(x)
    print(f"host cost per forward+backward call, tiny tensors ({tokens} tokens), microseconds")
    lean = lean_eager_enabled()
    for name, ours, eager in cases:
        set_lean_eager(False)
        dispatched = host_us_per_call(ours)
        set_lean_eager(lean)
        peer = f"{host_us_per_call(liger[name]):7.1f}" if name in liger else "    n/a"
        print(f"  {name:14s} tigon {host_us_per_call(ours):7.1f}   tigon via dispatcher {dispatched:7.1f}   "
              f"Liger {peer}   eager torch {host_us_per_call(eager):7.1f}", flush=True)
    if "--profile" in sys.argv:  # where tigon's host time goes, op by op (cProfile, own time)
        import cProfile
        import io
        import pstats

        for name, ours, _ in cases:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                ours()
            torch.cuda.synchronize()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
            print(f"--- {name} (100 calls)\n" + "\n".join(lines[3:]).replace("/usr/local/lib/python3", ""), flush=True)


if __name__ == "__main__":
    main()
