"""MoE experts, forward + backward in bf16: tigon's grouped GEMMs vs HF's expert loop (eager), HF's
grouped_mm path and Liger-Kernel's fused MoE, on two real layers. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/bench_moe.py [--quick] [--out DIR] [--profile [IMPL ...]]``.

Layers (``--tokens`` T = 8192 by default; --quick: 4096 and fewer repeats):
- mixtral-8x7b: E 8, K 2, H 4096, I 14336 (``MixtralExperts``; router weights fp32, as Mixtral's)
- qwen3-30b-a3b: E 128, K 8, H 2048, I 768 (``Qwen3MoeExperts``; router weights bf16, as Qwen3's)
The routing comes from a random router: softmax of random logits, top-k, renormalised.

Per implementation: median ms of the forward and of forward + backward (CUDA events, after a
warm-up); FLOPs counted exactly: forward 2 TK H 2I + 2 TK I H (TK = T K pairs), backward twice
that; TFLOP/s of forward + backward and its fraction of the H100's dense bf16 rate (989 TFLOP/s);
peak memory allocated during one forward + backward beyond the inputs (and, separately, beyond
the gradients too); the relative (Frobenius) error of the output and of each gradient (hidden
states, routing weights, gate_up_proj, down_proj) against HF's eager loop, and against the same
loop in fp32 (weights and inputs upcast: the bf16 loop's own error shows there too). The script
checks itself: it exits 1 when tigon fails, or when one of its errors against the fp32 loop is
more than --error-factor times the bf16 loop's (plus 1e-3).

``--profile``: one forward + backward of each listed implementation (tigon when none is named)
under torch.profiler, then its top GPU kernels. Tiles: TIGON_MOE_TILES (see
tigon.ops.moe_experts; benchmarks/tuning/tune_moe.py sweeps it). ``--device cpu`` (with
TRITON_INTERPRET=1): a smoke test of this script with tiny layers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

H100_DENSE_BF16_TFLOPS = 989.0
LAYERS = {  # name: (HF module, experts E, top-k K, hidden H, intermediate I, router weights' dtype)
    "mixtral-8x7b": ("mixtral", 8, 2, 4096, 14336, torch.float32),
    "qwen3-30b-a3b": ("qwen3_moe", 128, 8, 2048, 768, torch.bfloat16),
}
TINY = {"mixtral-8x7b": (5, 2, 40, 36), "qwen3-30b-a3b": (9, 4, 24, 20)}  # --device cpu: E, K, H, I
IMPLS = ("tigon", "hf eager loop", "hf grouped_mm", "liger")


def hf_experts(family, experts, top_k, hidden, inter, implementation):
    """HF's experts module of the family, its forward set to ``implementation``."""
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import (
            MixtralConfig,
            MixtralExperts,
        )

        config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k)
        with torch.device("meta"):  # the weights are the caller's
            module = MixtralExperts(config)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeConfig,
            Qwen3MoeExperts,
        )

        config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                num_experts_per_tok=top_k)
        with torch.device("meta"):
            module = Qwen3MoeExperts(config)
    module.config._experts_implementation = implementation
    return module


def grouped_mm_available() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return "grouped_mm" in ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False


def liger_fused_moe():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        return LigerFusedMoEFunction
    except Exception:  # noqa: BLE001 (not installed, or its import fails on this machine)
        return None


def make_layer(name, tokens, device, seed=0):
    """Inputs (leaves requiring grad) and the experts' weights of layer ``name``."""
    family, experts, top_k, hidden, inter, w_dtype = LAYERS[name]
    if device == "cpu":
        experts, top_k, hidden, inter = TINY[name]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(torch.bfloat16)

    x = randn(tokens, hidden).requires_grad_()
    logits = torch.randn(tokens, experts, device=device, generator=g)
    top = torch.softmax(logits, -1).topk(top_k, -1)
    weights = (top.values / top.values.sum(-1, keepdim=True)).to(w_dtype).requires_grad_()
    # Scaled so that gate, up and the output are O(1): the errors below mean something.
    gate_up = torch.nn.Parameter(randn(experts, 2 * inter, hidden, scale=hidden**-0.5))
    down = torch.nn.Parameter(randn(experts, hidden, inter, scale=inter**-0.5))
    dims = SimpleNamespace(family=family, experts=experts, top_k=top_k, hidden=hidden, inter=inter, tokens=tokens)
    return dims, x, top.indices, weights, gate_up, down


def implementations(dims, index, gate_up, down, names):
    """name -> fn(x, weights, gate_up, down) for the implementations available here."""
    import tigon.functional as TF

    fns = {}

    def hf(implementation):
        module = hf_experts(dims.family, dims.experts, dims.top_k, dims.hidden, dims.inter, implementation)
        module.gate_up_proj, module.down_proj = gate_up, down  # the shared leaves (parameters)
        return lambda x, w, *_: module(x, index, w)

    if "tigon" in names:
        fns["tigon"] = lambda x, w, gate_up, down: TF.moe_experts(x, index, w, gate_up, down)
    if "hf eager loop" in names:
        fns["hf eager loop"] = hf("eager")
    if "hf grouped_mm" in names and grouped_mm_available():
        fns["hf grouped_mm"] = hf("grouped_mm")
    liger = liger_fused_moe()
    if "liger" in names and liger is not None:
        index32 = index.to(torch.int32)
        fns["liger"] = lambda x, w, gate_up, down: liger.apply(x, gate_up, down, index32, w)
    return fns


def flops(dims):
    pairs = dims.tokens * dims.top_k
    forward = 2 * pairs * dims.hidden * 2 * dims.inter + 2 * pairs * dims.inter * dims.hidden
    return forward, 3 * forward


def timed(step, reps, on_gpu):
    """Median ms of step() over reps calls (CUDA events on the GPU)."""
    times = []
    for _ in range(reps):
        if on_gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(fn, leaves, cotangent, reps, on_gpu):
    def forward():
        return fn(*leaves)

    def full():
        for t in leaves:
            t.grad = None
        forward().backward(cotangent)

    start = time.perf_counter()
    full()  # warm-up: compiles tigon's kernels, Liger's autotuning, ...
    if on_gpu:
        torch.cuda.synchronize()
    row = {"first_call_s": time.perf_counter() - start}
    if on_gpu:
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        full()
        torch.cuda.synchronize()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
        row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["peak_beyond_grads_mb"] = row["peak_mb"] - grads / 2**20
    row["fwd_ms"] = timed(forward, reps, on_gpu)
    row["full_ms"] = timed(full, reps, on_gpu)
    return row


def outputs_and_grads(fn, leaves, cotangent):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(cotangent)
    return [out.detach().float()] + [t.grad.detach().float() for t in leaves]


def fp32_loop(dims, index, leaves, cotangent):
    """Output and gradients of HF's loop on fp32 copies of the inputs (full fp32 matmuls)."""
    module = hf_experts(dims.family, dims.experts, dims.top_k, dims.hidden, dims.inter, "eager")
    x, w, gate_up, down = (t.detach().float().requires_grad_() for t in leaves)
    module.gate_up_proj, module.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return outputs_and_grads(lambda x, w, *_: module(x, index, w), [x, w, module.gate_up_proj, module.down_proj],
                                 cotangent.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def print_profile(fn, leaves, cotangent, top=15):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(cotangent)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=80), flush=True)


GRAD_NAMES = ("output", "d hidden_states", "d top_k_weights", "d gate_up_proj", "d down_proj")


def markdown(rows, meta):
    title = (f"MoE experts, fwd+bwd bf16, {meta['device']}, T {meta['tokens']} tokens; torch {meta['torch']}, "
             f"triton {meta['triton']}, transformers {meta['transformers']}, liger {meta['liger']}")
    lines = [title, "",
             "| layer | impl | fwd ms | fwd+bwd ms | TFLOP/s | of 989 | peak MB | max rel err vs loop | vs fp32 loop |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layer']} | {r['impl']} | {r['error']} | | | | | | |")
            continue
        err = max(r["rel_err"].values()) if r.get("rel_err") else float("nan")
        err32 = max(r["rel_err_vs_fp32"].values()) if r.get("rel_err_vs_fp32") else float("nan")
        lines.append(f"| {r['layer']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['full_ms']:.2f} | {r['tflops']:.0f} | "
                     f"{r['frac_of_h100']:.2f} | {r.get('peak_mb', float('nan')):.0f} | {err:.2e} | {err32:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", nargs="*", choices=list(LAYERS), default=list(LAYERS))
    p.add_argument("--impls", nargs="*", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--tokens", type=int, default=None, help="T (default 8192; --quick 4096)")
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 10; --quick 3)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--error-factor", type=float, default=1.5,
                   help="tigon's error vs the fp32 loop may be this many times the bf16 loop's (+ 1e-3)")
    p.add_argument("--profile", nargs="*", default=None, metavar="IMPL")
    p.add_argument("--out", default=None, help="folder for moe.json and moe.md")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test with tiny layers (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    tokens = args.tokens or (4096 if args.quick else 8192) if on_gpu else (args.tokens or 13)
    reps = args.reps or (3 if args.quick or not on_gpu else 10)
    profile = set(args.profile if args.profile else ["tigon"]) if args.profile is not None else set()
    import transformers
    import triton

    liger = liger_fused_moe()
    meta = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "tokens": tokens, "reps": reps,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "liger": getattr(sys.modules.get("liger_kernel"), "__version__", "installed") if liger else None,
            "tiles": os.environ.get("TIGON_MOE_TILES")}
    print(json.dumps(meta), flush=True)
    rows, failures = [], []
    for layer in args.layers:
        dims, x, index, weights, gate_up, down = make_layer(layer, tokens, args.device)
        leaves = [x, weights, gate_up, down]
        cotangent = torch.randn(x.shape, device=args.device, generator=torch.Generator(args.device).manual_seed(1)
                                ).to(x.dtype)
        fwd_flops, full_flops = flops(dims)
        fns = implementations(dims, index, gate_up, down, set(args.impls) | {"hf eager loop"})
        reference = outputs_and_grads(fns["hf eager loop"], leaves, cotangent)
        exact = fp32_loop(dims, index, leaves, cotangent)
        loop_err = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, reference, exact)}
        for impl in (i for i in args.impls if i in fns):
            fn = fns[impl]
            row = {"layer": layer, "impl": impl, "E": dims.experts, "K": dims.top_k, "H": dims.hidden,
                   "I": dims.inter, "T": tokens, "fwd_flops": fwd_flops, "full_flops": full_flops}
            try:
                got = reference if impl == "hf eager loop" else outputs_and_grads(fn, leaves, cotangent)
                row["rel_err"] = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, got, reference)}
                row["rel_err_vs_fp32"] = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, got, exact)}
                got = None
                row.update(measure(fn, leaves, cotangent, reps, on_gpu))
                row["tflops"] = full_flops / row["full_ms"] / 1e9
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["frac_of_h100"] = row["tflops"] / H100_DENSE_BF16_TFLOPS
            except Exception as exc:  # noqa: BLE001 (a peer failing: OOM, missing kernel; reported)
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                if impl == "tigon":
                    failures.append(f"{layer} tigon: {row['error']}")
            # (Not on the CPU: Triton's interpreter truncates fp32 -> bf16, the GPU rounds to nearest.)
            if impl == "tigon" and "rel_err_vs_fp32" in row and on_gpu:
                for n, err in row["rel_err_vs_fp32"].items():
                    if not err <= args.error_factor * loop_err[n] + 1e-3:
                        failures.append(f"{layer} tigon: {n} relative error vs the fp32 loop {err:.3g}, the bf16 "
                                        f"loop's {loop_err[n]:.3g}")
            rows.append(row)
            if "error" in row:
                print(f"{layer:14s} {impl:14s} {row['error']}", flush=True)
            else:
                errs = " ".join(f"{n.split()[-1]} {e:.1e}/{row['rel_err_vs_fp32'][n]:.1e}"
                                for n, e in row["rel_err"].items())
                print(f"{layer:14s} {impl:14s} fwd {row['fwd_ms']:8.2f} ms  fwd+bwd {row['full_ms']:8.2f} ms  "
                      f"{row['tflops']:6.1f} TFLOP/s ({row['frac_of_h100']:.2f} of 989)  "
                      f"peak {row.get('peak_mb', float('nan')):8.0f} MB  err vs loop / fp32 loop: {errs}", flush=True)
            if impl in profile and on_gpu and "error" not in row:
                print_profile(fn, leaves, cotangent)
            if on_gpu:
                torch.cuda.empty_cache()
        del fns, leaves, x, weights, gate_up, down, reference, exact
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe.json"), "w") as f:
            json.dump({"meta": meta, "args": vars(args), "rows": rows, "failures": failures}, f, indent=1)
        with open(os.path.join(args.out, "moe.md"), "w") as f:
            f.write(markdown(rows, meta))
    for failure in failures:
        print(f"CHECK FAILED: {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
