"""Where a training step's time goes, HF vs HF + tigon: torch.profiler over two steps of
benchmarks/train_hf.py's setup; prints wall time, GPU busy time, kernel launches per step and the
top kernels, and the host syncs one step makes (torch.cuda.set_sync_debug_mode). CUDA only:
``PYTHONPATH=src python benchmarks/tuning/profile_step.py --shape qwen2.5-0.5b``."""

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


def main():
    p = add_setup_args(argparse.ArgumentParser(), default_shape="qwen2.5-0.5b")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--cprofile", type=int, default=0,
                   help="also print the top N Python functions of one step by own time (cProfile)")
    p.add_argument("--no-torch-profile", action="store_true", help="skip torch.profiler (timing and cProfile only)")
    args = p.parse_args()
    import tigon

    model_type, kw = SHAPES[args.shape]
    for impl in args.impls.split(","):
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
        start = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"{impl}: unprofiled wall {(time.perf_counter() - start) / 5 * 1e3:.1f} ms/step", flush=True)
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
