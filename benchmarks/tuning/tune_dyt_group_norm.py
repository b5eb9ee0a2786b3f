"""Launch-shape sweep for DyT and GroupNorm at the op benchmark's shapes (bf16).

Run on a CUDA machine (repo root): ``PYTHONPATH=src python benchmarks/tuning/tune_dyt_group_norm.py OUT_DIR``.
Times tigon's forward and backward (partial sums and their reduction included) under each
launch shape through their ``config`` arguments, with do_bench (median, L2 flushed), against
the byte floor at the measured copy bandwidth; prints the default shape's time beside the
best. The defaults in tigon/ops/dyt.py and group_norm.py are chosen from its output.
"""

from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

from tigon.ops import dyt, group_norm
from tigon.ops._common import next_pow2
from tigon.ops.dyt import DytConfig
from tigon.ops.group_norm import GroupNormConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_kernels  # noqa: E402 (this folder: the sweeps' runner and copy bandwidth)

DT = torch.bfloat16


def bench(fn, *args, **kwargs):
    return float(do_bench(lambda: fn(*args, **kwargs), warmup=10, rep=50, return_mode="median"))


def record(results, kernel, shape, cfg, ms, floor_ms, default):
    results.append({"kernel": kernel, "shape": shape, "config": list(cfg), "ms": ms, "frac": floor_ms / ms,
                    "default": default})


def sweep_dyt(results, bw):
    for m, n in ((16384, 1024), (16384, 4096), (16384, 8192)):
        x = torch.randn(m, n, device="cuda", dtype=DT)
        dy = torch.randn_like(x)
        alpha = torch.full((1,), 0.5, device="cuda", dtype=DT)
        gamma = torch.randn(n, device="cuda", dtype=DT)
        beta = torch.randn(n, device="cuda", dtype=DT)
        shape = f"{m}x{n}"
        default = dyt.dyt_forward_config(n)
        for block_n in (1024, 2048, 4096):
            for elements in (2048, 4096, 8192):
                for warps in (4, 8, 16):
                    cfg = DytConfig(max(1, elements // block_n), min(block_n, n), warps, 1)
                    if cfg.block_m * cfg.block_n < warps * 32 * 4:
                        continue
                    t = bench(dyt.dyt_forward, x, alpha, gamma, beta, config=cfg)
                    record(results, "dyt_fwd", shape, cfg, t, 2 * m * n * 2 / bw / 1e6, cfg == default)
        default = dyt.dyt_backward_config(n, 2)
        for block_n in (512, 1024, 2048):
            for elements in (4096, 8192, 16384):
                for warps, per_sm in ((4, 4), (8, 2), (8, 1), (16, 1)):
                    cfg = DytConfig(max(1, elements // block_n), min(block_n, n), warps, per_sm)
                    if cfg.block_m * cfg.block_n < warps * 32 * 4:
                        continue
                    try:
                        t = bench(dyt.dyt_backward, dy, x, alpha, gamma, beta, True, True, True, config=cfg)
                    except Exception as exc:  # noqa: BLE001 (out of resources: skip the shape)
                        print("skip dyt bwd", shape, cfg, type(exc).__name__, file=sys.stderr)
                        continue
                    record(results, "dyt_bwd", shape, cfg, t, 3 * m * n * 2 / bw / 1e6, cfg == default)
        print(f"dyt {shape} done", file=sys.stderr, flush=True)


def sweep_group_norm(results, bw):
    for n, c, side, groups in ((32, 512, 32, 32), (32, 512, 64, 32), (32, 512, 128, 32)):
        x = torch.randn(n, c, side, side, device="cuda", dtype=DT) + 1
        dy = torch.randn_like(x)
        w = torch.randn(c, device="cuda", dtype=DT)
        b = torch.randn(c, device="cuda", dtype=DT)
        cpg, cols = c // groups, side * side
        _, mean, rstd = group_norm.group_norm_forward(x, groups, w, b, 1e-5)
        shape = f"N{n} C{c} {side}x{side} G{groups}"
        for backward in (False, True):
            default = group_norm.group_norm_config(n, groups, cpg, cols, x.device, backward)
            configs = [GroupNormConfig("tiles", 0, 0, 0)]
            if cpg * cols <= group_norm.GROUP_TILE_MAX:
                configs += [GroupNormConfig("one_tile", next_pow2(cpg), next_pow2(cols), w_) for w_ in (4, 8, 16, 32)]
            for tile in (4096, 8192, 16384, 32768):
                block_s = min(next_pow2(cols), tile)
                configs += [GroupNormConfig("group", min(next_pow2(cpg), tile // block_s), block_s, w_)
                            for w_ in (8, 16, 32)]
            # Fewer groups in flight (programs looping over groups): more of the second pass in L2.
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            configs += [default._replace(max_programs=p) for p in (sms, 3 * sms // 4, sms // 2, sms // 3)
                        if default.plan != "tiles"]
            for cfg in configs:
                try:
                    if backward:
                        t = bench(group_norm.group_norm_backward, dy, x, groups, w, b, mean, rstd, True, True,
                                  config=cfg)
                    else:
                        t = bench(group_norm.group_norm_forward, x, groups, w, b, 1e-5, config=cfg)
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the shape)
                    print("skip group_norm", shape, cfg, type(exc).__name__, file=sys.stderr)
                    continue
                floor = (3 if backward else 2) * x.numel() * 2 / bw / 1e6
                record(results, "gn_bwd" if backward else "gn_fwd", shape, cfg, t, floor, cfg == default)
        print(f"group_norm {shape} done", file=sys.stderr, flush=True)


def summarize(results):
    keys = sorted({(r["kernel"], r["shape"]) for r in results})
    for key in keys:
        rows = [r for r in results if (r["kernel"], r["shape"]) == key]
        best = min(rows, key=lambda r: r["ms"])
        default = next((r for r in rows if r["default"]), None)
        line = f"{key[0]:7s} {key[1]:22s} best {best['ms']:.4f} ms ({100 * best['frac']:.0f}%) {best['config']}"
        if default is not None:
            line += f" | default {default['ms']:.4f} ms ({100 * default['frac']:.0f}%) {default['config']}"
        print(line)


def main():
    tune_kernels.run_sweeps((sweep_dyt, sweep_group_norm), "tune_dyt_group_norm.json", summarize)


if __name__ == "__main__":
    main()
