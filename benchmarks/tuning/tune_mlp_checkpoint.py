"""A Llama-style MLP block (x + MLP(x)) under torch.utils.checkpoint (non-reentrant), fwd+bwd:
tigon's glu_down path (keeps gate and up; the recompute redoes all three matmuls) against
glu_mlp (keeps x; the recompute stops before its matmuls; gate and up are recomputed in
the backward in column slices) at several slice budgets. Time (median, CUDA events through
triton's do_bench) and peak memory beyond the inputs. CUDA only:
``PYTHONPATH=src python benchmarks/tuning/tune_mlp_checkpoint.py``."""

import argparse

import torch
import torch.utils.checkpoint as ckpt
from triton.testing import do_bench

import tigon.ops.glu_mlp as GM


def down_proj_block(x, wg, wu, wd):
    a, b = torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu)
    return x + GM.glu_down_proj(a, b, wd, None, "silu", inplace=True)


def fused_block(x, wg, wu, wd):
    return x + GM.glu_mlp_input_only(x, wg, wu, wd, "silu")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budgets", type=int, nargs="*", default=[32, 64], help="slice budgets, MiB")
    args = p.parse_args()
    for tokens, hidden, inter in ((8192, 2048, 8192), (32768, 2048, 8192), (65536, 2048, 8192), (2048, 2048, 8192),
                                  (8192, 4096, 14336)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ws = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * shape[1] ** -0.5).requires_grad_(True)
              for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
        g = torch.randn_like(x)

        def run(block):
            def step():
                for t in (x, *ws):
                    t.grad = None
                ckpt.checkpoint(block, x, *ws, use_reentrant=False).backward(g)
            return step

        def measure(name, block):
            step = run(block)
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = do_bench(step, warmup=25, rep=200, return_mode="median")
            return f"{name} {ms:.2f} ms ({peak:.0f} MiB)"

        line = [f"T{tokens} H{hidden} I{inter}:", measure("down-proj path", down_proj_block)]
        for mib in args.budgets:
            GM.MLP_SLICE_BUDGET_BYTES = mib * 2**20
            line.append(measure(f"fused {mib} MiB slices", fused_block))
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
