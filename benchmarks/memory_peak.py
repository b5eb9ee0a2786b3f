"""Where the peak memory of a training step goes: the peak allocated memory between
consecutive module hooks (forward and backward of every decoder layer, the embedding, the
final norm) during one step of benchmarks/train_hf.py's setup, with what was allocated there.
Run on a CUDA machine: ``PYTHONPATH=src:benchmarks python benchmarks/memory_peak.py --shape llama-1b [--impl tigon|hf]``.
"""

from __future__ import annotations

import argparse

import torch
from train_hf import SHAPES, build_model  # benchmarks/ must be on sys.path

GiB = 2**30


class Probe:
    """Peak allocated memory per segment between hook events."""

    def __init__(self, detail=()):
        self.rows = []
        self.last = "start"
        self.detail = set(detail)
        self.blocks = {}

    def mark(self, name):
        torch.cuda.synchronize()
        if name in self.detail:
            self.blocks[name] = live_blocks()
        self.rows.append((self.last, name, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
        torch.cuda.reset_peak_memory_stats()
        self.last = name

    def attach(self, module, name):
        module.register_forward_pre_hook(lambda *a: self.mark(f"{name} fwd start"))
        module.register_forward_hook(lambda *a: self.mark(f"{name} fwd end"))
        module.register_full_backward_pre_hook(lambda *a: self.mark(f"{name} bwd start"))
        module.register_full_backward_hook(lambda *a: self.mark(f"{name} bwd end"))


def live_blocks():
    """Allocated blocks by size (MiB, rounded) -> count, from the caching allocator's snapshot."""
    sizes = {}
    for seg in torch.cuda.memory_snapshot():
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                mib = round(block["size"] / 2**20, 1)
                sizes[mib] = sizes.get(mib, 0) + 1
    return sizes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    p.add_argument("--impl", default="tigon")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--detail", nargs="*", default=["layer0.mlp bwd start", "layer0.mlp bwd end"],
                   help="hook events at which to list the live blocks by size")
    args = p.parse_args()
    model_type, kw = SHAPES[args.shape]
    torch.manual_seed(0)
    model, _ = build_model(model_type, kw, args.impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    for _ in range(2):  # optimizer state exists from here on
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    probe = Probe(args.detail)
    inner = model.get_decoder()
    probe.attach(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        probe.attach(layer, f"layer{i}")
    for name, sub in inner.layers[0].named_modules():  # finer segments inside layer 0
        if name and "." not in name.replace("self_attn.", "").replace("mlp.", ""):
            probe.attach(sub, f"layer0.{name}")
    probe.attach(inner.norm, "final norm")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    probe.mark("step start")
    loss = model(input_ids=ids, labels=ids).loss
    probe.mark("loss computed")
    loss.backward()
    probe.mark("backward done")
    opt.step()
    probe.mark("optimizer step done")
    rows = sorted(probe.rows, key=lambda r: -r[2])
    print(f"{args.impl} {args.shape}: segments with the highest peaks (GiB: peak, allocated at the segment's end)")
    for before, after, peak, alloc in rows[:args.top]:
        print(f"  {peak / GiB:6.2f} {alloc / GiB:6.2f}  {before} -> {after}")
    for name, sizes in probe.blocks.items():
        total = sum(mib * n for mib, n in sizes.items()) / 1024
        big = ", ".join(f"{n} x {mib:g}" for mib, n in sorted(sizes.items(), reverse=True) if mib >= 1)
        print(f"live blocks at {name}: {total:.2f} GiB; MiB sizes >= 1: {big}")


if __name__ == "__main__":
    main()
