"""Kernel time of tigon's norm and GLU ops eager vs launched by Inductor (their triton_op bodies
traced by torch.compile): the two must match. A gap means Inductor launches the kernel with
other arguments than tigon's own launch (e4035e7: Python floats reached the kernels as fp64 and
made the compiled rms_norm backward 8x slower). CUDA only:
``PYTHONPATH=src python benchmarks/tuning/compiled_kernel_time.py``
(results/h200/compile/compiled_kernel_time.log)."""

import torch
from torch.profiler import ProfilerActivity, profile

import tigon.functional as TF

ROWS, HIDDEN, INTERMEDIATE = 32768, 2048, 8192  # a Llama-3.2-1B step at batch 64 x 512


def kernel_times(fn, args, label, reps=10):
    """Print the Triton kernels' time per forward+backward of fn(*args)."""
    dy = None
    for _ in range(3):  # warm-up (compiles)
        y = fn(*args)
        dy = torch.randn_like(y) if dy is None else dy
        y.backward(dy)
        for t in args:
            t.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(*args).backward(dy)
            for t in args:
                t.grad = None
        torch.cuda.synchronize()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t and "kernel" in e.key and "elementwise" not in e.key and "reduce" not in e.key:
            print(f"{label:32s} {e.key[:40]:40s} {t / reps:9.1f} us/step", flush=True)


def main():
    torch.manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf, requires_grad=True)

    x, w, b = rnd(ROWS, HIDDEN), rnd(HIDDEN), rnd(HIDDEN)
    gate, up = rnd(ROWS, INTERMEDIATE), rnd(ROWS, INTERMEDIATE)
    cases = {
        "rms_norm": (lambda x, w: TF.rms_norm(x, w, 1e-6), (x, w)),
        "layer_norm": (lambda x, w, b: TF.layer_norm(x, w, b, 1e-5), (x, w, b)),
        "swiglu": (TF.swiglu, (gate, up)),
    }
    for op, (fn, args) in cases.items():
        kernel_times(fn, args, f"{op} eager")
        torch.compiler.reset()
        kernel_times(torch.compile(fn, dynamic=True), args, f"{op} compiled")


if __name__ == "__main__":
    main()
