"""Host cost of the primitives a tigon call is made of (a Triton launch, an allocation, an
autograd.Function, ...), then the per-op table of ``tigon bench --host`` (tigon.bench.host). CUDA only:
``PYTHONPATH=src python benchmarks/tuning/host_overhead.py [--profile]`` (--profile: cProfile of each
tigon op, by own time)."""

import sys

import torch
import triton
import triton.language as tl

from tigon.bench import host
from tigon.bench.harness import host_us_per_call


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


def main():
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print_primitives(x)
    print("host cost per forward+backward call, tiny tensors (16 tokens), microseconds (kernel launches)")
    print(host.table(host.measure("cuda")), flush=True)
    if "--profile" in sys.argv:  # where tigon's host time goes, op by op (cProfile, own time)
        import cProfile
        import io
        import pstats

        for name, impls in host.cases("cuda").items():
            ours = impls["tigon"]
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
