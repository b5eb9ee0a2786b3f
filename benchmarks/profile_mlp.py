"""Kernel-level profile of one forward+backward of the SwiGLU MLP: tigon vs an eager LlamaMLP.

Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/profile_mlp.py``. Prints the CUDA
time per kernel (torch.profiler) and CUDA-event times of fwd+bwd for both, with many repeats.
"""

import torch
from torch.profiler import ProfilerActivity, profile

from tigon.bench.ops import EagerSwiGLUMLP
from tigon.nn import TigonSwiGLUMLP

T, H, I = 8192, 4096, 14336


def step(mod, x, g):
    mod(x).backward(g)
    for p in mod.parameters():
        p.grad = None
    x.grad = None


def main():
    eager = EagerSwiGLUMLP(H, I).cuda().bfloat16()
    ours = TigonSwiGLUMLP(hidden_size=H, intermediate_size=I).cuda().bfloat16()
    ours.load_state_dict(eager.state_dict())
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    for name, mod in (("eager", eager), ("tigon", ours), ("eager", eager), ("tigon", ours)):
        for _ in range(3):
            step(mod, x, g)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            step(mod, x, g)
        end.record()
        torch.cuda.synchronize()
        print(f"{name}: {start.elapsed_time(end) / 20:.3f} ms per fwd+bwd (20 back-to-back)")
    for name, mod in (("eager", eager), ("tigon", ours)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step(mod, x, g)
            torch.cuda.synchronize()
        print(f"--- {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
