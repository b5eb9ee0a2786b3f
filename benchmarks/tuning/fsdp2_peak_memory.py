"""FSDP2's peak memory per step, and what is live at it: the Llama-3.1-8B shape at B x 2048 a GPU
(``B``, default 32), each implementation of ``IMPLS`` (default tigon,liger) built, sharded
(``train_hf.data_parallel``) and trained two steps in turn in one process. Rank 0 prints the
first and second step's ``max_memory_allocated``, the memory allocated before the second step
(weights, AdamW state), and the allocations live at the second step's peak grouped by size
(the allocator's history without stacks: recording Python stacks made the checkpointed layers'
recomputation fail inside autograd, a SystemError, with torch 2.11). Run on 2 GPUs:

    B=32 torchrun --nproc-per-node 2 benchmarks/tuning/fsdp2_peak_memory.py
"""
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_hf  # noqa: E402


def live_at_peak(trace):
    """(rise at the peak in bytes, the allocations live then) of one device's allocator trace."""
    total = peak = 0
    peak_i = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        if total > peak:
            peak, peak_i = total, i
    live = {}
    for e in trace[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, live


def main():
    batch = int(os.environ.get("B", "32"))
    top = int(os.environ.get("TOP", "3"))
    train_hf.init_distributed()
    rank, _ = train_hf.rank_and_world()
    model_type, shape = train_hf.SHAPES["llama-8b"]
    for impl in os.environ.get("IMPLS", "tigon,liger").split(","):
        start = time.time()
        torch.manual_seed(0)
        model, _ = train_hf.build_model(model_type, shape, impl)
        model = train_hf.data_parallel(model, "fsdp2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, shape["vocab_size"], (batch, 2048), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(0))
        torch.cuda.reset_peak_memory_stats()
        for step in range(2):
            if step == 1:
                first_peak = torch.cuda.max_memory_allocated()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if rank == 0:
                    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                             max_entries=2_000_000)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if rank == 0:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            rise, live = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
            by_size = defaultdict(lambda: [0, 0])
            for e in live.values():
                group = by_size[e["size"]]
                group[0] += e["size"]
                group[1] += 1
            print(f"=== {impl} batch {batch}: first step's peak {first_peak / 2**30:.2f} GiB, second step's "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, allocated before the step "
                  f"{before / 2**30:.2f} GiB, peak rise in the step {rise / 2**30:.2f} GiB, "
                  f"{time.time() - start:.0f} s")
            for size, (total, n) in sorted(by_size.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"  {total / 2**30:7.2f} GiB  {n:5d} x {size / 2**20:8.1f} MiB")
        del model, opt
        torch.cuda.empty_cache()
        if impl == "tigon":
            import tigon

            tigon.unpatch()


if __name__ == "__main__":
    main()
