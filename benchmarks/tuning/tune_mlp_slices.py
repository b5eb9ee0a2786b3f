"""tigon's SwiGLU MLP fwd+bwd with the down-projection backward in 1, 2 or 4 column slices
(glu_down.DOWN_PROJ_BACKWARD_SLICES), next to eager torch and Liger's MLP, at two shapes. CUDA only:
``PYTHONPATH=src python benchmarks/tuning/tune_mlp_slices.py``."""

import torch
from triton.testing import do_bench

import tigon.ops.glu_down as GD
from tigon.nn import TigonSwiGLUMLP


def fwd_bwd(mod, x):
    def step():
        mod.zero_grad(set_to_none=True)
        x.grad = None
        mod(x).backward(torch.ones_like(x))
    return step


def main():
    for tokens, hidden, inter in ((8192, 4096, 14336), (65536, 2048, 8192)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mod = TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter).to("cuda", torch.bfloat16)
        line = [f"T{tokens} H{hidden} I{inter}:"]
        for slices in (1, 2, 4):
            GD.DOWN_PROJ_BACKWARD_SLICES = slices
            torch.cuda.reset_peak_memory_stats()
            ms = do_bench(fwd_bwd(mod, x), warmup=100, rep=1000, return_mode="median")
            peak = torch.cuda.max_memory_allocated() / 2**20
            line.append(f"tigon {slices} slice(s) {ms:.2f} ms (peak {peak:.0f} MB)")
        eager = torch.nn.ModuleDict(dict(gate_proj=mod.gate_proj, up_proj=mod.up_proj, down_proj=mod.down_proj))

        class Eager(torch.nn.Module):
            def forward(self, x):
                return eager.down_proj(torch.nn.functional.silu(eager.gate_proj(x)) * eager.up_proj(x))
        ms = do_bench(fwd_bwd(Eager(), x), warmup=100, rep=1000, return_mode="median")
        line.append(f"eager {ms:.2f} ms")
        try:
            from types import SimpleNamespace

            from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
            lig = LigerSwiGLUMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu"))
            lig = lig.to("cuda", torch.bfloat16)
            ms = do_bench(fwd_bwd(lig, x), warmup=100, rep=1000, return_mode="median")
            line.append(f"liger {ms:.2f} ms")
        except ImportError:
            pass
        print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
