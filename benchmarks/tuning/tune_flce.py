"""FLCE chunk-budget sweep: time vs extra memory (the trade-off in
ops/fused_linear_cross_entropy.py), with the 3-matmul floor measured at the same shapes.
Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/tuning/tune_flce.py [--out DIR]``.

Time: median of CUDA-event timings of forward + backward (L2 flushed), label check off (no
host sync). Extra memory: peak allocated during forward + backward beyond the inputs and the
returned gradients. grad_output 1 (loss.backward()) and 0.5 (a loss weight or gradient
accumulation: the stored dx and dW are then rescaled once).
"""

import argparse
import json
import os

os.environ.setdefault("TIGON_CHECK_LABELS", "0")

import torch
from triton.testing import do_bench

from tigon.functional import fused_linear_cross_entropy

MiB = 2**20


def bench(fn):
    return do_bench(fn, warmup=5, rep=300, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--budgets", default="32,64,128,256,512,1024,2048", help="MiB, comma-separated")
    args = parser.parse_args()
    rows_out = []
    torch.manual_seed(0)
    for bt, hidden, vocab in ((8192, 4096, 128256), (4096, 2048, 128256)):
        x = (torch.randn(bt, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(vocab, hidden, device="cuda") * hidden ** -0.5).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, vocab, (bt,), device="cuda")
        dl = torch.randn(bt, vocab, device="cuda", dtype=torch.bfloat16)
        t_fwd = bench(lambda: torch.mm(x.detach(), w.detach().t()))
        t_dx = bench(lambda: torch.mm(dl, w.detach()))
        t_dw = bench(lambda: torch.mm(dl.t(), x.detach()))
        dl = None
        floor = t_fwd + t_dx + t_dw
        flops = 3 * 2 * bt * hidden * vocab
        print(f"BT{bt} H{hidden} V{vocab}: matmuls fwd {t_fwd:.2f} dx {t_dx:.2f} dW {t_dw:.2f} = {floor:.2f} ms "
              f"({flops / floor / 1e9:.0f} TFLOP/s)", flush=True)
        for budget_mib in [int(v) for v in args.budgets.split(",")]:
            for go in (1.0, 0.5):
                def step():
                    x.grad = w.grad = None
                    loss = fused_linear_cross_entropy(x, w, y, chunk_budget=budget_mib * MiB)
                    (loss * go if go != 1.0 else loss).backward()

                step()
                torch.cuda.synchronize()
                x.grad = w.grad = None
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                grads = x.grad.numel() * x.grad.element_size() + w.grad.numel() * w.grad.element_size()
                extra = (torch.cuda.max_memory_allocated() - base - grads) / 1e6
                ms = bench(step)
                row = dict(bt=bt, hidden=hidden, vocab=vocab, budget_mib=budget_mib,
                           grad_output=go, ms=ms, extra_mb=extra, floor_ms=floor, ratio=ms / floor)
                rows_out.append(row)
                print(f"  budget {budget_mib:5d} MiB go {go}: {ms:7.2f} ms "
                      f"({ms / floor:.3f}x floor), extra {extra:7.1f} MB", flush=True)
        x = w = y = None
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flce_budget_sweep.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
