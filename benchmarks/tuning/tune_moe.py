"""Sweep the tiles of tigon's MoE kernels (tigon.ops.moe_experts.GPU_TILES) on the benchmark's
layers, one process, bf16 forward + backward. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/tuning/tune_moe.py [--layers qwen3-30b-a3b] [--tokens 8192]``.

``--reference``: first, the time torch's grouped GEMM (``grouped_mm``, cuBLAS / CUTLASS) takes
for the two weight-gradient contractions of each layer on sorted rows, the bar for
``moe_expert_grad_kernel``.

Coordinate descent: from the current defaults, each kernel's candidates in turn (the rows per
block, block_m, first: every kernel depends on it), keeping the best fwd+bwd time so far. Each
candidate is timed by triton.testing.do_bench (median, L2 flushed). Prints every measurement
and, per layer, the best table as TIGON_MOE_TILES JSON (to try with bench_moe.py, or to copy into
GPU_TILES with a comment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import tigon.functional as TF
from tigon.ops import moe_experts as M

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
bench_moe = __import__("bench_moe")  # benchmarks/bench_moe.py: the layers and their inputs

# (BLOCK_N, BLOCK_K, num_warps, num_stages); expert_grad: (BLOCK_N, BLOCK_M2, rows a step, warps,
# stages); activation_backward: the split pass's (BLOCK_R, BLOCK_N, warps), or () for the epilogue
# fused into down_backward (swept first: down_backward's best tile depends on it).
CANDIDATES = {
    "activation_backward": [(), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8)],
    "gate_up": [(128, 64, 8, 3), (128, 32, 8, 4), (64, 64, 4, 4), (128, 64, 8, 4), (64, 64, 8, 4)],
    "down_backward": [(64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3),
                      (128, 128, 8, 3), (256, 32, 8, 4)],
    "down": [(256, 64, 8, 3), (128, 64, 8, 4), (256, 32, 8, 4), (128, 128, 8, 3)],
    "expert_grad": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 32, 8, 4),
                    (128, 256, 64, 8, 4), (128, 256, 32, 8, 4)],
}


def fwd_bwd_ms(leaves, index, cotangent):
    from triton.testing import do_bench

    def step():
        for t in leaves:
            t.grad = None
        x, w, gate_up, down = leaves
        TF.moe_experts(x, index, w, gate_up, down).backward(cotangent)

    return float(do_bench(step, warmup=50, rep=300, return_mode="median"))


def grouped_mm_reference(layer, tokens):
    """ms of dW_gate_up = d[g|u]^T x and dW_down = dout^T (w h) through torch's grouped_mm, each
    expert's rows contiguous (the sorted order tigon's kernels read)."""
    from triton.testing import do_bench

    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    _, x, index, _, gate_up, down = bench_moe.make_layer(layer, tokens, "cuda")
    n_experts, inter = gate_up.shape[0], down.shape[2]
    ids, order = torch.sort(index.reshape(-1), stable=True)
    offs = torch.cumsum(torch.bincount(ids, minlength=n_experts), 0).to(torch.int32)
    x_sorted = x.detach()[order // index.shape[1]]
    dgu = torch.randn(ids.numel(), 2 * inter, device="cuda", dtype=x.dtype)
    hw = torch.randn(ids.numel(), inter, device="cuda", dtype=x.dtype)
    for name, a, b in (("dW_gate_up", dgu, x_sorted), ("dW_down", x_sorted, hw)):
        try:
            ms = do_bench(lambda: grouped_mm(a.t(), b, offs=offs), warmup=25, rep=200, return_mode="median")
            flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            print(f"{layer} grouped_mm {name}: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as exc:  # noqa: BLE001 (a layout or dtype grouped_mm does not take)
            print(f"{layer} grouped_mm {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)


def tune_layer(layer, tokens, kernels):
    _, x, index, weights, gate_up, down = bench_moe.make_layer(layer, tokens, "cuda")
    leaves = [x, weights, gate_up, down]
    cotangent = torch.randn_like(x)
    n_pairs, n_experts = index.numel(), gate_up.shape[0]
    block_m = M.moe_block_m(n_pairs, n_experts)
    tiles = M.moe_tiles(n_pairs, n_experts, torch.bfloat16)._asdict()
    best = {"block_m": block_m, **{k: list(v) for k, v in tiles.items()}}

    def measure(table, what):
        M.set_tile_overrides(table)
        try:
            ms = fwd_bwd_ms(leaves, index, cotangent)
        except Exception as exc:  # noqa: BLE001 (a tile that does not fit: shared memory, registers)
            print(f"{layer} {what}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            return float("inf")
        print(f"{layer} {what}: {ms:.3f} ms", flush=True)
        return ms

    best_ms = measure(best, "defaults")
    for bm in (64, 128):
        if bm != best["block_m"]:
            table = {**best, "block_m": bm}
            ms = measure(table, f"block_m {bm}")
            if ms < best_ms:
                best, best_ms = table, ms
    for kernel in kernels:
        for tile in CANDIDATES[kernel]:
            if list(tile) == best[kernel]:
                continue
            table = {**best, kernel: list(tile)}
            ms = measure(table, f"block_m {best['block_m']} {kernel} {tile}")
            if ms < best_ms:
                best, best_ms = table, ms
    M.set_tile_overrides({})
    print(f"{layer} best {best_ms:.3f} ms: TIGON_MOE_TILES='{json.dumps(best)}'", flush=True)
    return best, best_ms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", nargs="*", choices=list(bench_moe.LAYERS), default=list(bench_moe.LAYERS))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reference", action="store_true", help="time torch's grouped_mm on the weight gradients first")
    p.add_argument("--kernels", nargs="*", choices=list(CANDIDATES), default=list(CANDIDATES),
                   help="the kernels to sweep, in this order")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for layer in args.layers:
        if args.reference:
            grouped_mm_reference(layer, args.tokens)
        tune_layer(layer, args.tokens, args.kernels)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
