"""Where the peak memory of a training step goes: the peak allocated memory between
consecutive module hooks (forward and backward of every decoder layer, the embedding, the
final norm) during one step of benchmarks/train_hf.py's setup, with what was allocated there.
Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/memory_peak.py --shape llama-1b [--impl tigon|hf]``.

``--trace`` instead records the allocator's history over the step (no module hooks, which
hold tensors of their own) and lists what was live at the step's peak: the blocks allocated
during the step, grouped by size and by the first tigon / transformers / benchmark frame that
allocated them, and the allocation that reached the peak.
"""

from __future__ import annotations

import argparse

import torch
from train_hf import SHAPES, build_model  # next to this script

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


def _origin(frames):
    """The first frame of ours or HF's (innermost first) as 'file:line function'."""
    for f in frames or ():
        name = f.get("filename", "")
        if any(k in name for k in ("/tigon/", "/transformers/", "benchmarks/")):
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "autograd / torch internals"


def peak_from_trace(snapshot, baseline):
    """Replay the allocator trace: (peak bytes, live step allocations at the peak as
    {addr: (size, frames)}, the allocation that set the peak)."""
    live, current, peak, at_peak, peak_event = {}, baseline, baseline, {}, None
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, event.get("frames"))
            current += size
            if current > peak:
                peak, at_peak, peak_event = current, dict(live), event
        elif action == "free_completed":
            live.pop(addr, None)
            current -= size
    return peak, at_peak, peak_event


def trace_step(model, opt, ids, top, stacks=False):
    """One step under the allocator's history. Python stacks (``stacks``) failed inside
    checkpoint recomputation on torch 2.11 (a SystemError from Function.apply), so by default
    only sizes are recorded and the live blocks at the peak are listed in allocation order."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc" if stacks else None,
                                             stacks="python")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, live, event = peak_from_trace(snapshot, baseline)
    measured = torch.cuda.max_memory_allocated()
    print(f"held before the step {baseline / GiB:.3f} GiB; step peak {peak / GiB:.3f} GiB from the trace, "
          f"{measured / GiB:.3f} GiB measured")
    print(f"the peak was reached by a {event['size'] / 2**20:.1f} MiB allocation at {_origin(event.get('frames'))}")
    groups = {}
    for size, frames in live.values():
        key = (round(size / 2**20, 1), _origin(frames))
        groups[key] = groups.get(key, 0) + 1
    total = sum(size for size, _ in live.values())
    print(f"live step allocations at the peak: {total / GiB:.3f} GiB in {len(live)} blocks; the largest groups:")
    rows = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])
    for (mib, origin), n in rows[:top]:
        print(f"  {n:4d} x {mib:8.1f} MiB = {n * mib:8.1f} MiB  {origin}")
    order = [round(size / 2**20) for size, _ in live.values() if size >= 2**20]
    print(f"live step blocks >= 1 MiB at the peak, in allocation order (MiB): {order}")


class OpProbe:
    """Memory at entry, peak inside and at exit of every call of a module-level function (an op
    of tigon.ops, looked up by name at call time; monkeypatched for the profiled step)."""

    def __init__(self, module, name, phase):
        self.rows = []
        self.module, self.name, self.saved = module, name, getattr(module, name)
        setattr(module, name, self._wrap(phase, self.saved))

    def _wrap(self, phase, original):
        def run(*args):
            torch.cuda.synchronize()
            entry = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = original(*args)
            torch.cuda.synchronize()
            self.rows.append((phase, entry, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
            return out
        return run

    def restore(self):
        setattr(self.module, self.name, self.saved)

    def report(self, name, top):
        print(f"{name}: calls with the highest peaks (GiB: at entry, peak inside, at exit), in call order")
        ranked = sorted(range(len(self.rows)), key=lambda i: -self.rows[i][2])[:top]
        for i in sorted(ranked):
            phase, entry, peak, exit_ = self.rows[i]
            print(f"  call {i:3d} {phase:8s} {entry / GiB:7.3f} {peak / GiB:7.3f} {exit_ / GiB:7.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    p.add_argument("--impl", default="tigon")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--detail", nargs="*", default=["layer0.mlp bwd start", "layer0.mlp bwd end"],
                   help="hook events at which to list the live blocks by size")
    p.add_argument("--trace", action="store_true", help="list what is live at the step's peak (allocator trace)")
    p.add_argument("--mlp-slice-mib", type=int, default=None,
                   help="override the checkpointed MLP's slice budget (tigon.ops.glu_mlp.MLP_SLICE_BUDGET_BYTES)")
    args = p.parse_args()
    if args.mlp_slice_mib:
        from tigon.ops import glu_mlp

        glu_mlp.MLP_SLICE_BUDGET_BYTES = args.mlp_slice_mib * 2**20
    model_type, kw = SHAPES[args.shape]
    torch.manual_seed(0)
    model, _ = build_model(model_type, kw, args.impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    for _ in range(2):  # optimizer state exists from here on
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if args.trace:
        print(f"{args.impl} {args.shape} batch {args.batch}x{args.seq}, mlp slice budget "
              f"{args.mlp_slice_mib or 'default'} MiB")
        trace_step(model, opt, ids, args.top)
        if args.impl == "tigon":
            from tigon.ops import glu_mlp

            probes = {name: OpProbe(glu_mlp, name, phase) for name, phase in (
                ("glu_down_op", "forward"), ("glu_down_backward_op", "backward"),
                ("glu_mlp_op", "forward"), ("glu_mlp_backward_op", "backward"))}
            torch.cuda.reset_peak_memory_stats()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for name, probe in probes.items():
                probe.restore()
                if probe.rows:
                    probe.report(f"{name} (the MLP)", 8)
        return
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
