"""Where a training step's time goes, HF vs HF + tigon: torch.profiler over two steps of
benchmarks/train_hf.py's setup; prints wall time, GPU busy time, kernel launches per step and the
top kernels, and the host syncs one step makes (torch.cuda.set_sync_debug_mode). ``--op-host-time``:
the host time spent inside each of tigon's custom ops per step (their Python implementations,
timed around the function the dispatcher calls; a compiled graph calls them the same way), and
the rest of the step. ``--mlp-slice-budget-mib``: the glu_mlp backward's slice budget (tuning).
CUDA only: ``PYTHONPATH=src python benchmarks/tuning/profile_step.py --shape qwen2.5-0.5b``."""

import argparse
import collections
import os
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: train_hf
from train_hf import SHAPES, add_setup_args, training_step  # noqa: E402


def print_cprofile(step, top):
    """One step under cProfile: the functions with the most own time, and tigon's by total."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    for sort, restrict in (("tottime", [top]), ("cumulative", [top]), ("cumulative", ["tigon/", top])):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(*restrict)
        text = "\n".join(line for line in buf.getvalue().splitlines() if line.strip())
        print(text.replace("/usr/local/lib/python3", "").replace("site-packages/", ""), flush=True)


def time_custom_ops():
    """Wrap the function every tigon custom op's dispatcher entry calls with a host timer:
    returns {op name: [calls, seconds]}, reset by the caller."""
    from torch._library.custom_ops import CustomOpDef

    import tigon.ops

    totals = {}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("tigon.ops."):
            continue
        for op in vars(module).values():
            if not isinstance(op, CustomOpDef) or op._name in totals:
                continue
            totals[op._name] = entry = [0, 0.0]
            for device, fn in list(op._backend_fns.items()):
                def timed_fn(*args, _fn=fn, _entry=entry, **kwargs):
                    start = time.perf_counter()
                    try:
                        return _fn(*args, **kwargs)
                    finally:
                        _entry[0] += 1
                        _entry[1] += time.perf_counter() - start
                op._backend_fns[device] = timed_fn
    assert tigon.ops  # imported for its registrations
    return totals


def print_op_host_time(impl, step, totals, steps=5):
    for entry in totals.values():
        entry[:] = [0, 0.0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    inside = sum(s for _, s in totals.values()) / steps
    print(f"{impl}: wall {wall * 1e3:.1f} ms/step, inside tigon's ops (host) {inside * 1e3:.1f} ms/step, "
          f"{sum(c for c, _ in totals.values()) // steps} op calls/step", flush=True)
    for name, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        if calls:
            print(f"  {name:45s} {calls // steps:4d} calls {seconds / steps * 1e3:7.2f} ms/step "
                  f"{seconds / calls * 1e6:7.1f} us/call", flush=True)


def main():
    p = add_setup_args(argparse.ArgumentParser(), default_shape="qwen2.5-0.5b")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--cprofile", type=int, default=0,
                   help="also print the top N Python functions of one step by own time (cProfile)")
    p.add_argument("--no-torch-profile", action="store_true", help="skip torch.profiler (timing and cProfile only)")
    p.add_argument("--op-host-time", action="store_true", help="host time inside each tigon op per step")
    p.add_argument("--mlp-slice-budget-mib", type=int, default=None, help="glu_mlp's backward slice budget")
    args = p.parse_args()
    import tigon
    import tigon.ops.glu_mlp

    if args.mlp_slice_budget_mib:
        tigon.ops.glu_mlp.MLP_SLICE_BUDGET_BYTES = args.mlp_slice_budget_mib * 2**20
    totals = time_custom_ops() if args.op_host_time else None

    model_type, kw = SHAPES[args.shape]
    # Liger's patch changes HF's modeling classes for the rest of the process: its runs go last
    # (a tigon run after it would find LigerSwiGLUMLP, not the model's MLP).
    impls = sorted(args.impls.split(","), key=lambda impl: impl.startswith("liger"))
    for impl in impls:
        step = training_step(impl, model_type, kw, args.batch, args.seq)[1]

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        syncs = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[str(w.message)[:60] + " @ " + f"{w.filename.split('/')[-1]}:{w.lineno}"] += 1
        print(f"{impl}: {sum(syncs.values())} host syncs in one step: {dict(syncs)}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"{impl}: unprofiled wall {(time.perf_counter() - start) / 5 * 1e3:.1f} ms/step, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        if totals is not None and impl.startswith("tigon"):
            print_op_host_time(impl, step, totals)
        if args.cprofile:
            print_cprofile(step, args.cprofile)
        if args.no_torch_profile:
            step = None
            torch.cuda.empty_cache()
            tigon.unpatch()
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 2
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(getattr(e, "device_time_total", 0) for e in kernels) / 2 / 1e3
        print(f"{impl}: wall {wall * 1e3:.1f} ms/step, GPU kernels {busy:.1f} ms/step, "
              f"{len(kernels) // 2} kernels/step", flush=True)
        try:
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top)
        except Exception:
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top)
        print("\n".join(table.splitlines()[: args.top + 4]), flush=True)
        step = None
        torch.cuda.empty_cache()
        tigon.unpatch()


if __name__ == "__main__":
    main()
