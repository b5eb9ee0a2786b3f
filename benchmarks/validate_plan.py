"""The memory planner against the GPU: for each shape, sequence length and batch, the peak that
``tigon.planning.predict_step`` predicts and the peak one measures (torch.cuda.max_memory_allocated
over two training steps: the optimizer's state is created in the first), for HF and for HF +
tigon, with the error in percent. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/validate_plan.py --shapes llama-1b --seqs 512 1024 --tokens 4096 16384``.

The setup is benchmarks/train_hf.py's (bf16 weights, random init, random tokens, labels =
inputs, SDPA), with ``--optimizer`` (adamw: fused AdamW; sgd: no state) and ``--checkpointing``
(none, all, or a number of decoder layers). The batch sizes are ``--tokens`` / seq. A step that
runs out of memory is recorded as OOM next to its prediction, with the allocator's message. One
model a shape: HF's steps first, then the same model patched by tigon. ``--report A.json B.json
--out DIR`` (no GPU) writes DIR/validation.md: every row, and the error by shape and setup.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from train_hf import SHAPES, make_batches, new_model  # next to this script

import tigon
from tigon.hf_model import set_checkpointing
from tigon.planning import predict_step
from tigon.shapes import shape_config

GiB = 2**30


def measure(model, batch, seq, optimizer, n_checkpointed, steps=2):
    """(peak allocated bytes over ``steps`` training steps, None), or out of memory: (None, what
    the allocator said: the request, what was allocated)."""
    set_checkpointing(model, n_checkpointed)
    gen = torch.Generator(device="cuda").manual_seed(0)
    opt = None
    try:
        inputs = make_batches(model, steps, batch, seq, gen)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (torch.optim.AdamW(params, lr=1e-5, fused=True) if optimizer == "adamw"
               else torch.optim.SGD(params, lr=1e-5))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for x in inputs:
            model(**x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), None
    except torch.OutOfMemoryError as exc:
        peak = torch.cuda.max_memory_allocated() / GiB
        return None, f"{str(exc).splitlines()[0]} (peak allocated before it {peak:.2f} GiB)"
    finally:
        for p in model.parameters():
            p.grad = None
        del opt
        gc.collect()
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["llama-1b", "qwen2.5-0.5b", "gemma2-2b"], choices=list(SHAPES))
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens a step (batch x seq)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--checkpointing", default="none", help="none, all, or a number of decoder layers")
    p.add_argument("--impls", default="hf,tigon")
    p.add_argument("--out", default="validate_plan")
    p.add_argument("--report", nargs="+", metavar="JSON", help="write validation.md from these results (no GPU)")
    args = p.parse_args()
    if args.report:
        write_report(args.report, args.out)
        return
    checkpointing = args.checkpointing if args.checkpointing in ("none", "all") else int(args.checkpointing)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes:
        model_type, kwargs = SHAPES[shape]
        config = shape_config(shape)
        torch.manual_seed(0)
        model = new_model(model_type, kwargs)
        model.config.use_cache = False
        model.train()
        n_layers = len(model.model.layers)
        n_ckpt = {"none": 0, "all": n_layers}.get(checkpointing, checkpointing)
        for impl in args.impls.split(","):
            if impl == "tigon":
                tigon.patch(model)
            for seq in args.seqs:
                for batch in sorted({max(1, tokens // seq) for tokens in args.tokens}):
                    t0 = time.perf_counter()
                    try:
                        predicted = predict_step(config, batch, seq, tigon=impl == "tigon", checkpointing=n_ckpt,
                                                 optimizer=args.optimizer)
                    except Exception as exc:  # a model the meta trace cannot run: said, and the sweep goes on
                        print(f"{shape:13s} {impl:6s} T {seq:5d} B {batch:4d}: no prediction "
                              f"({type(exc).__name__}: {str(exc)[:200]})", flush=True)
                        continue
                    plan_s = time.perf_counter() - t0
                    measured, oom = measure(model, batch, seq, args.optimizer, n_ckpt)
                    error = None if measured is None else 100 * (predicted.peak - measured) / measured
                    row = dict(shape=shape, impl=impl, seq=seq, batch=batch, checkpointing=checkpointing,
                               optimizer=args.optimizer, predicted_gib=predicted.peak / GiB,
                               measured_gib=None if measured is None else measured / GiB, error_pct=error,
                               predicted_phase=predicted.peak_phase, plan_s=plan_s, oom=oom)
                    rows.append(row)
                    shown = "OOM" if measured is None else f"{measured / GiB:7.2f}"
                    err = "" if error is None else f"{error:+6.1f}%"
                    print(f"{shape:13s} {impl:6s} T {seq:5d} B {batch:4d}: predicted {predicted.peak / GiB:7.2f} GiB "
                          f"({predicted.peak_phase}), measured {shown} GiB {err}  (plan {plan_s:.1f}s)", flush=True)
                    if oom:
                        print(f"    {oom}", flush=True)
            tigon.unpatch()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    name = "_".join(args.shapes) + f"_{args.optimizer}_{args.checkpointing}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    if errors:
        print(f"{len(errors)} measured, {len(rows) - len(errors)} out of memory; |error| max {max(errors):.1f}%, "
              f"mean {sum(errors) / len(errors):.1f}%")


def write_report(paths, out):
    """validation.md: a summary (max and mean |error| by shape, setup and implementation) and
    every row."""
    rows, devices = [], set()
    for path in paths:
        data = json.load(open(path))
        devices.add(f"{data['device']}, torch {data['torch']}")
        rows += data["rows"]
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["optimizer"], str(r["checkpointing"]), r["impl"]), []).append(r)
    lines = [f"# Memory planner: predicted vs measured peak ({'; '.join(sorted(devices))})", "",
             "| shape | optimizer | checkpointing | impl | steps measured | out of memory | max abs error | "
             "mean abs error |", "|---|---|---|---|---|---|---|---|"]
    for (shape, optimizer, ckpt, impl), group in groups.items():
        errors = [abs(r["error_pct"]) for r in group if r["error_pct"] is not None]
        lines.append(f"| {shape} | {optimizer} | {ckpt} | {impl} | {len(errors)} | {len(group) - len(errors)} | "
                     f"{max(errors, default=0):.1f}% | {sum(errors) / max(len(errors), 1):.1f}% |")
    lines += ["", "| shape | optimizer | checkpointing | impl | seq | batch | predicted GiB | measured GiB | error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = "OOM" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}"
        error = "" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        lines.append(f"| {r['shape']} | {r['optimizer']} | {r['checkpointing']} | {r['impl']} | {r['seq']} | "
                     f"{r['batch']} | {r['predicted_gib']:.2f} | {measured} | {error} |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:len(groups) + 4]))


if __name__ == "__main__":
    main()
