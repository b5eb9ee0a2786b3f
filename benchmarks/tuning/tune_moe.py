"""Sweep the tiles of tigon's MoE kernels (tigon.ops.moe_experts.GPU_TILES) on the benchmark's
layers, one process, bf16 forward + backward. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/tuning/tune_moe.py [--layers qwen3-30b-a3b] [--tokens 8192]``.

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

# (BLOCK_N, BLOCK_K, num_warps, num_stages); expert_grad: (BLOCK_N, BLOCK_M2, rows a step, warps, stages).
CANDIDATES = {
    "gate_up": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 32, 8, 4), (64, 64, 8, 4)],
    "down": [(256, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (256, 32, 8, 4), (128, 128, 8, 3)],
    "down_backward": [(64, 64, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4), (64, 128, 8, 3), (128, 32, 8, 4)],
    "expert_grad": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                    (128, 128, 32, 8, 4), (128, 64, 64, 4, 4)],
}


def fwd_bwd_ms(leaves, index, cotangent):
    from triton.testing import do_bench

    def step():
        for t in leaves:
            t.grad = None
        x, w, gate_up, down = leaves
        TF.moe_experts(x, index, w, gate_up, down).backward(cotangent)

    return float(do_bench(step, warmup=50, rep=300, return_mode="median"))


def tune_layer(layer, tokens):
    _, x, index, weights, gate_up, down = bench_moe.make_layer(layer, tokens, "cuda")
    leaves = [x, weights, gate_up, down]
    cotangent = torch.randn_like(x)
    n_pairs, n_experts = index.numel(), gate_up.shape[0]
    block_m = M.moe_block_m(n_pairs, n_experts)
    best = {"block_m": block_m, **{k: list(v) for k, v in M.moe_tiles(block_m, torch.bfloat16)._asdict().items()}}

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
            defaults = M.moe_tiles(bm, torch.bfloat16)._asdict()
            table = {**best, "block_m": bm, **{k: list(v) for k, v in defaults.items()}}
            ms = measure(table, f"block_m {bm} (its default tiles)")
            if ms < best_ms:
                best, best_ms = table, ms
    for kernel, options in CANDIDATES.items():
        for tile in options:
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
    args = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for layer in args.layers:
        tune_layer(layer, args.tokens)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
