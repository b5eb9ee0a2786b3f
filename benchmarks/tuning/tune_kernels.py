"""Launch-configuration sweep for the row and elementwise kernels (host cost per call:
benchmarks/tuning/host_overhead.py).

Run on a CUDA machine (repo root): ``PYTHONPATH=src python benchmarks/tuning/tune_kernels.py OUT_DIR``.
Calls the Triton kernels directly with each configuration and times them with do_bench
(median, L2 flushed), printing the best per shape next to the byte floor at the measured copy
bandwidth. The heuristics in tigon/ops/_common.py and the op files are chosen from its output.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

from tigon.ops import glu as glu_ops
from tigon.ops import rope as rope_ops
from tigon.ops.layer_norm import layer_norm_backward_kernel, layer_norm_forward_kernel
from tigon.ops.rms_norm import rms_norm_backward_kernel, rms_norm_forward_kernel

DT = torch.bfloat16
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def bench(fn):
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def copy_gbps():
    x = torch.empty(2**30, device="cuda", dtype=DT)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / bench(lambda: y.copy_(x)) / 1e6


def sweep_norms(results, bw):
    for m, n in ((16384, 1024), (16384, 4096), (8192, 8192), (65536, 896)):
        x = torch.randn(m, n, device="cuda", dtype=DT)
        dy = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=DT)
        rstd = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
        mean = torch.randn(m, device="cuda", dtype=torch.float32)
        y = torch.empty_like(x)
        dx = torch.empty_like(x)
        block_n = triton.next_power_of_2(n)
        floor_fwd = 2 * m * n * 2 / bw / 1e6
        floor_bwd = 3 * m * n * 2 / bw / 1e6
        for block_m in (1, 2, 4, 8, 16):
            if block_m * block_n > 32768 or block_m * block_n < 512:
                continue
            for warps in (4, 8, 16):
                if warps * 32 * 2 > block_m * block_n:  # fewer than 2 elements a thread
                    continue
                grid = (triton.cdiv(m, block_m),)
                try:
                    t = bench(lambda: rms_norm_forward_kernel[grid](
                        x, n, x, 0, x, 0, y, n, w, rstd, m, n, 1e-6, 0.0,
                        CASTING=0, HAS_RESIDUAL=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
                    results.append(dict(kernel="rms_fwd", m=m, n=n, block_m=block_m, warps=warps, ms=t,
                                        frac=floor_fwd / t))
                    t = bench(lambda: layer_norm_forward_kernel[grid](
                        x, n, y, n, w, w, mean, rstd, m, n, 1e-5,
                        HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
                    results.append(dict(kernel="ln_fwd", m=m, n=n, block_m=block_m, warps=warps, ms=t,
                                        frac=floor_fwd / t))
                except Exception as exc:
                    print("skip fwd", m, n, block_m, warps, type(exc).__name__, file=sys.stderr)
                for per_sm in (2, 4, 8, 16):
                    progs = min(SMS * per_sm, triton.cdiv(m, block_m))
                    part = torch.empty(progs, n, device="cuda", dtype=torch.float32)
                    try:
                        t = bench(lambda: rms_norm_backward_kernel[(progs,)](
                            dy, n, x, n, w, rstd, dx, n, dy, 0, part, m, n, 0.0,
                            CASTING=0, HAS_DS=False, COMPUTE_DW=True,
                            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
                        results.append(dict(kernel="rms_bwd", m=m, n=n, block_m=block_m, warps=warps,
                                            per_sm=per_sm, ms=t, frac=floor_bwd / t))
                        t = bench(lambda: layer_norm_backward_kernel[(progs,)](
                            dy, n, x, n, w, mean, rstd, dx, n, part, part, m, n,
                            HAS_WEIGHT=True, COMPUTE_DW=True, COMPUTE_DB=True,
                            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
                        results.append(dict(kernel="ln_bwd", m=m, n=n, block_m=block_m, warps=warps,
                                            per_sm=per_sm, ms=t, frac=floor_bwd / t))
                    except Exception as exc:
                        print("skip bwd", m, n, block_m, warps, per_sm, type(exc).__name__, file=sys.stderr)
        print(f"norms {m}x{n} done", file=sys.stderr, flush=True)


def sweep_glu(results, bw):
    for m, n in ((16384, 14336), (8192, 11008), (4096, 896)):
        a = torch.randn(m, n, device="cuda", dtype=DT)
        b = torch.randn_like(a)
        c = torch.empty_like(a)
        da = torch.empty_like(a)
        db = torch.empty_like(a)
        for block in (512, 1024, 2048, 4096, 8192):
            for warps in (2, 4, 8, 16):
                if warps * 32 * 4 > block:
                    continue
                grid = (m * triton.cdiv(n, block),)
                t = bench(lambda: glu_ops.glu_forward_kernel[grid](
                    a, n, b, n, c, n, n, triton.cdiv(n, block), ACTIVATION=0, BLOCK=block, num_warps=warps))
                results.append(dict(kernel="glu_fwd", m=m, n=n, block=block, warps=warps, ms=t,
                                    frac=3 * m * n * 2 / bw / 1e6 / t))
                t = bench(lambda: glu_ops.glu_backward_kernel[grid](
                    c, n, a, n, b, n, da, n, db, n, n, triton.cdiv(n, block),
                    ACTIVATION=0, BLOCK=block, num_warps=warps))
                results.append(dict(kernel="glu_bwd", m=m, n=n, block=block, warps=warps, ms=t,
                                    frac=5 * m * n * 2 / bw / 1e6 / t))
        print(f"glu {m}x{n} done", file=sys.stderr, flush=True)


def sweep_rope(results, bw):
    for batch, hq, hk, tokens, dim in ((4, 32, 8, 2048, 128), (8, 28, 4, 1024, 128), (4, 14, 2, 2048, 64)):
        q = torch.randn(batch, tokens, hq, dim, device="cuda", dtype=DT).transpose(1, 2)
        k = torch.randn(batch, tokens, hk, dim, device="cuda", dtype=DT).transpose(1, 2)
        cos = torch.randn(1, tokens, dim, device="cuda", dtype=DT)
        sin = torch.randn_like(cos)
        floor = 2 * batch * tokens * (hq + hk) * dim * 2 / bw / 1e6
        default_tokens = rope_ops.tokens_per_program
        for block_t in (1, 2, 4):  # tokens per program
            rope_ops.tokens_per_program = lambda n_tokens, elements, block_t=block_t: block_t
            for warps in (1, 2, 4, 8, 16):
                t = bench(lambda: rope_ops.rope_apply(q, k, cos, sin, None, 1, False, num_warps=warps))
                results.append(dict(kernel="rope_fwd", shape=f"B{batch} T{tokens} Hq{hq} Hk{hk} D{dim}",
                                    block_t=block_t, warps=warps, ms=t, frac=floor / t))
        rope_ops.tokens_per_program = default_tokens
        print(f"rope {batch} {tokens} done", file=sys.stderr, flush=True)


def summarize(results):
    best = {}
    for r in results:
        key = (r["kernel"], r.get("m"), r.get("n"), r.get("shape"))
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for key, r in sorted(best.items(), key=lambda kv: str(kv[0])):
        cfg = {k: v for k, v in r.items() if k in ("block_m", "block", "block_t", "warps", "per_sm")}
        print(f"{key[0]:9s} {key[1] or key[3]} x {key[2] or ''}: best {r['ms']:.4f} ms "
              f"({100 * r['frac']:.0f}% of copy BW) {cfg}")


def run_sweeps(sweeps, json_name, summarize_results):
    """Run each sweep(results, copy GB/s), save the results in OUT_DIR (argv[1]) / json_name,
    print the summary (this script's and tune_dyt_group_norm.py's main)."""
    out = sys.argv[1] if len(sys.argv) > 1 else "tune_out"
    os.makedirs(out, exist_ok=True)
    bw = copy_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s, {SMS} SMs")
    results = []
    for sweep in sweeps:
        sweep(results, bw)
    with open(os.path.join(out, json_name), "w") as f:
        json.dump({"copy_gbps": bw, "results": results}, f)
    summarize_results(results)


def main():
    run_sweeps((sweep_rope, sweep_glu, sweep_norms), "tune.json", summarize)


if __name__ == "__main__":
    main()
