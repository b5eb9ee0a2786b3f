"""torchtune's full fine-tuning step with and without torch.compile, Liger-Kernel and tigon:
the study of PyTorch's blog post "Peak Performance, Minimized Memory: Optimizing torchtune's
performance with torch.compile & Liger Kernel" reproduced on one GPU. Run on a CUDA machine with
torchtune installed:
``PYTHONPATH=src python benchmarks/train_torchtune.py --batches 16 32 64 128 256 512 --isolate --out DIR``.

The step is the one of torchtune's ``full_finetune_single_device`` recipe: Llama-3.2-1B built by
torchtune (random init, bf16), activation checkpointing of every layer, packed data (torchtune's
``PackedDataset`` and ``padded_collate_packed``: document masks), the recipe's label shift and
token-count loss scaling, fused AdamW. Implementations:

- ``torchtune``: eager, torchtune's chunked cross entropy (8 chunks, as its configs);
- ``torchtune+compile``: the recipe's ``compile: True`` (each layer compiled, the loss's CE compiled);
- ``liger+compile``: as the study: the decoder returns its normed hidden state and Liger's fused
  linear cross entropy takes the output weight (the rest is torchtune's, compiled);
- ``tigon+compile``: ``tigon.torchtune.patch`` and ``loss_for``, compiled the recipe's way;
- ``tigon``: tigon eager.

The data are synthetic documents a model can learn (each follows a rule of its own over 4096
token ids, with noise), so the loss curves (``--curve-batch``) go down. Peak memory is
torch.cuda.max_memory_allocated during the warm-up steps; tokens/s counts every position of the
packed batch (batch x seq; a row's ``pack_fill`` is the fraction that is not padding).
``--tiny`` runs a two-layer model (a smoke test, CPU under TRITON_INTERPRET=1 included).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_hf import plot_sweep, print_table, run_isolated, save  # noqa: E402

IMPLS = ("torchtune", "torchtune+compile", "liger+compile", "tigon+compile", "tigon")
NAMES = {"torchtune": "torchtune", "liger": "torchtune + Liger-Kernel (the study's)", "tigon": "torchtune + tigon"}
IGNORE_INDEX = -100
CHUNKS = 8  # the output chunks of torchtune's CEWithChunkedOutputLoss in its configs


def build_model(tiny: bool, device):
    """Llama-3.2-1B (or a two-layer model of its kind) as torchtune builds it, bf16, seed 0, its
    matrices drawn from N(0, 0.02) as HF's Llama initialises them (torchtune's builders expect a
    checkpoint: their N(0, 1) embedding, tied to the output, starts the loss near 100)."""
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2, llama3_2_1b

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16), torch.device(device):
        if tiny:
            model = llama3_2(vocab_size=8192, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128,
                             max_seq_len=2048, intermediate_dim=256)
        else:
            model = llama3_2_1b()
    if device != "meta":
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.02)
    return model


class StudyLoss(torch.nn.Module):
    """The study's Liger integration: Liger's fused linear cross entropy of the decoder's hidden
    state [b*s, d] and its output weight, called as the recipe calls its loss."""

    def __init__(self, model):
        super().__init__()
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        import tigon.torchtune

        self.weight = lambda: tigon.torchtune.output_weight(model)  # not a submodule: the loss owns no parameters
        self.loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden, labels):
        return self.loss(self.weight(), hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


def setup(impl: str, model):
    """The model made ready as the recipe's setup does for ``impl`` (activation checkpointing,
    compile, the patch), and its loss: (model, loss_fn, report)."""
    from torchtune import modules, training

    base, _, compiled = impl.partition("+")
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if compiled:
        training.compile_model(model, verbose=False)
    if base == "torchtune":
        loss_fn = modules.loss.CEWithChunkedOutputLoss(num_output_chunks=CHUNKS, ignore_index=IGNORE_INDEX)
        model.set_num_output_chunks(CHUNKS)
        report = f"torchtune: CEWithChunkedOutputLoss ({CHUNKS} chunks)"
    elif base == "liger":
        model.unembed = lambda h: model.norm(h)  # the study's decoder: the hidden state, not logits
        loss_fn = StudyLoss(model)
        report = "Liger-Kernel's fused linear cross entropy on the decoder's hidden state (the study's integration)"
    elif base == "tigon":
        import tigon.torchtune

        report = str(tigon.torchtune.patch(model))
        loss_fn = tigon.torchtune.loss_for(model, ignore_index=IGNORE_INDEX)
    else:
        raise ValueError(f"unknown implementation {impl!r}: one of {', '.join(IMPLS)}")
    if compiled:
        if base != "liger":  # Liger's loss is its Triton kernels, outside torch.compile
            loss_fn = training.compile_loss(loss_fn, verbose=False)
        report += "; torch.compile as the recipe's compile: True (each layer, and the loss)"
    return model, loss_fn, report


def synthetic_packs(n_packs: int, seq: int, vocab: int, seed: int = 0):
    """torchtune's PackedDataset of synthetic documents (lengths seq/16 to 25 seq/32: 32-400 at
    seq 512): each document walks
    t -> (a t + c) mod 4096 with its own a, c, a tenth of its tokens random."""
    from torchtune.datasets import PackedDataset

    g = torch.Generator().manual_seed(seed)
    span = min(4096, vocab)
    docs, total = [], 0
    while total < n_packs * seq:
        n = int(torch.randint(max(2, seq // 16), seq * 25 // 32 + 1, (1,), generator=g))
        a, c = (int(v) for v in torch.randint(1, span, (2,), generator=g))
        t = [int(torch.randint(0, span, (1,), generator=g))]
        for _ in range(n - 1):
            t.append((a * t[-1] + c) % span)
        noise = torch.rand(n, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, span, (n,), generator=g), torch.tensor(t)).tolist()
        docs.append(dict(tokens=tokens, labels=tokens))
        total += n
    return PackedDataset(docs, max_seq_len=seq, max_packs=n_packs, split_across_pack=False)


def batches(packs, batch: int, n: int, device):
    """n collated batches (tokens, labels, input_pos, document mask) of ``batch`` packs each, on
    the device, taken round the pack pool."""
    from torchtune.data import padded_collate_packed

    out, start = [], 0
    for _ in range(n):
        rows = [packs[(start + i) % len(packs)] for i in range(batch)]
        start += batch
        b = padded_collate_packed(rows)
        out.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()})
    return out


def train_step(model, loss_fn, opt, batch):
    """The recipe's step (one micro-batch): shifted labels, loss x tokens, backward, gradients
    scaled by 1 / tokens, optimizer step. Returns the loss (a tensor; no host sync)."""
    from torchtune import training

    batch = dict(batch)
    labels = batch.pop("labels")
    n_tokens = (labels != IGNORE_INDEX).sum()
    out = model(**batch)
    labels = torch.hstack((labels[..., 1:], torch.full_like(labels[..., :1], IGNORE_INDEX)))
    if not isinstance(out, list):
        labels = labels.reshape(-1)
        out = out.reshape(-1, out.size(-1))
    loss = loss_fn(out, labels)
    del out
    (loss * n_tokens).backward()
    training.scale_grads(model, 1 / n_tokens)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


_MODELS: dict = {}  # impl -> (model, loss_fn, report, initial state): kept across batch sizes


def run(impl: str, args, packs, batch: int, steps: int | None = None):
    """Warm-up and timed steps of ``impl`` at ``batch``: a result row (the JSON's)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if impl not in _MODELS:
        model = build_model(args.tiny, device)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        _MODELS[impl] = (*setup(impl, model), state)
    model, loss_fn, report, state = _MODELS[impl]
    model.load_state_dict(state)
    model.train()
    curve = steps is not None
    if steps is None:
        steps = args.steps if not args.timed_tokens else max(3, -(-args.timed_tokens // (batch * args.seq)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")
    data = batches(packs, batch, args.warmup + steps, device)
    fill = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in data) / (len(data) * batch * args.seq)
    on_gpu = device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    losses, peak, start, first_step_s = [], 0, None, None
    first_start = time.perf_counter()
    for i, b in enumerate(data):
        if i == 1:
            sync()
            first_step_s = time.perf_counter() - first_start
        if i == args.warmup:
            sync()
            start = time.perf_counter()
        if on_gpu and i < args.warmup:
            torch.cuda.reset_peak_memory_stats()
        losses.append(train_step(model, loss_fn, opt, b))
        if on_gpu and i < args.warmup:
            peak = max(peak, torch.cuda.max_memory_allocated())
    sync()
    seconds = time.perf_counter() - start
    if on_gpu and batch in (args.profile_batch or ()) and not curve:
        profile_step(impl, args, functools.partial(train_step, model, loss_fn, opt, data[-1]), batch)
    from torch._dynamo.utils import counters

    del opt, data
    if on_gpu:
        torch.cuda.empty_cache()
    return dict(impl=impl, batch=batch, tokens_per_s=batch * args.seq * steps / seconds, step_s=seconds / steps,
                steps=steps, first_step_s=first_step_s, peak_gib=peak / 2**30, pack_fill=fill,
                graph_breaks=sum(counters["graph_break"].values()),
                graph_break_reasons=sorted(counters["graph_break"])[:5],
                losses=[float(x) for x in losses], report=report)


# Kernel families by name, for the profile's summary (the first match counts).
KERNEL_KINDS = (
    ("matmul (cuBLAS / CUTLASS)", ("gemm", "cutlass", "nvjet", "xmma", "splitk")),
    ("attention (flex)", ("flex", "attention", "fmha")),
    ("Inductor's fused kernels", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("Liger-Kernel", ("liger", "_ce_kernel", "element_mul")),
    ("tigon's kernels", ("_kernel",)),
)


def profile_step(impl, args, step, batch):
    """One more step under torch.profiler: its wall time, the GPU's busy time (kernels only,
    by family; the rest of the wall time the GPU waited for the host) and the top kernels, as
    a text file in --profile-dir."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_kind, by_name = {}, {}
    for e in kernels:
        name = e.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name for key in keys)), "other (copies, fills, ...)")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time_total / 1e3
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / 1e3
    busy = sum(by_kind.values())
    lines = [f"{impl}, batch {batch} x {args.seq}, one step under the profiler: wall {wall_ms:.1f} ms, GPU busy "
             f"{busy:.1f} ms ({100 * busy / wall_ms:.0f}%), {len(kernels)} kernels"]
    lines += [f"  {kind:32s} {ms:9.1f} ms" for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines += ["top kernels:"] + [f"  {ms:9.2f} ms  {name[:110]}"
                                 for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]]
    os.makedirs(args.profile_dir, exist_ok=True)
    path = os.path.join(args.profile_dir, f"profile_{impl.replace('+', '_')}_batch{batch}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:8]), flush=True)


def run_or_oom(impl, args, packs, batch, steps=None):
    try:
        return run(impl, args, packs, batch, steps)
    except torch.OutOfMemoryError:
        error = "out of memory"
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    _MODELS.pop(impl, None)
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(impl=impl, batch=batch, error=error)


def plot_loss_curves(results, path, title):
    """The loss at every step of the ``curve`` rows, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.get("curve") and "error" not in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["impl"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS[:4]), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timed-tokens", type=int, default=None,
                   help="timed steps per batch = this many tokens / (batch x seq), at least 3 (instead of --steps)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--curve-batch", type=int, default=None, help="also record a loss curve at this batch size")
    p.add_argument("--curve-steps", type=int, default=30)
    p.add_argument("--profile-batch", type=int, nargs="+", default=None,
                   help="profile one more step at these batch sizes (GPU busy time by kernel family, a text file)")
    p.add_argument("--profile-dir", default=".", help="where --profile-batch writes (default: here)")
    p.add_argument("--tiny", action="store_true", help="a two-layer model (smoke test)")
    p.add_argument("--isolate", action="store_true", help="each implementation in its own process")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these JSONs (separate calls) into --out")
    args = p.parse_args()
    args.shape = "torchtune-llama3.2-1b" + ("-tiny" if args.tiny else "")
    args.batch = args.batches[0]
    if args.merge:
        parts = [json.load(open(path)) for path in args.merge]
        results = [r for part in parts for r in part["results"]]
        args.batches = sorted({r["batch"] for r in results})
        return finish(args, parts[0]["params"], results, parts[0]["device"])
    for impl in args.impls.split(","):
        if impl not in IMPLS:
            p.error(f"--impls: unknown implementation {impl!r}: one of {', '.join(IMPLS)}")
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first step compiles and allocates)")
    if args.isolate and "," in args.impls:
        run_isolated(args, script=__file__)  # prints the table
        return finish(args, *saved_rows(args), table=False)
    if "," in args.impls and "+compile" in args.impls:
        p.error("compiled implementations keep their model between batch sizes: run them with --isolate")
    vocab = 8192 if args.tiny else 128256
    packs = synthetic_packs(max(args.batches + [(args.curve_batch or 0) * args.curve_steps]), args.seq, vocab)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    n_params = sum(p.numel() for p in build_model(args.tiny, "meta").parameters())
    print(f"{args.shape}: {n_params / 1e9:.2f}B parameters, batch {args.batches} x {args.seq}, {device}", flush=True)
    results = []
    for impl in args.impls.split(","):
        for batch in args.batches:
            r = run_or_oom(impl, args, packs, batch)
            results.append(r)
            print_row(r)
            save(args, n_params, results, device=device)
            if "error" in r:
                break
        if args.curve_batch:
            r = run_or_oom(impl, args, packs, args.curve_batch, steps=args.curve_steps)
            r["curve"] = True
            results.append(r)
            print_row(r)
            save(args, n_params, results, device=device)
        _MODELS.pop(impl, None)
    finish(args, n_params, results, device)


def print_row(r):
    if "error" in r:
        print(f"{r['impl']:18s} batch {r['batch']}: {r['error']}", flush=True)
    else:
        print(f"{r['impl']:18s} batch {r['batch']}{' (curve)' if r.get('curve') else ''}: "
              f"{r['tokens_per_s']:9.0f} tokens/s, {r['step_s'] * 1e3:7.1f} ms/step, peak {r['peak_gib']:6.2f} GiB, "
              f"graph breaks {r['graph_breaks']}, losses {' '.join(f'{x:.3f}' for x in r['losses'][:4])} .. "
              f"{r['losses'][-1]:.3f}", flush=True)


def saved_rows(args):
    """(params, results, device) of the JSON ``save`` wrote (the isolated children's rows)."""
    with open(os.path.join(args.out, f"train_{args.shape}_batch_sweep.json")) as f:
        saved = json.load(f)
    return saved["params"], saved["results"], saved["device"]


def finish(args, n_params, results, device, table=True):
    """The sweep's JSON, table and tokens/s + memory plot (curve rows left out), and the loss curves."""
    order = {impl: i for i, impl in enumerate(IMPLS)}
    results = sorted(results, key=lambda r: order.get(r["impl"], len(IMPLS)))
    sweep = [r for r in results if not r.get("curve")]
    if args.out:
        save(args, n_params, results, device=device)
        plot_sweep(sweep, os.path.join(args.out, f"train_{args.shape}_batch_sweep.png"),
                   f"torchtune Llama-3.2-1B full fine-tuning step, packed seq {args.seq}, bf16, fused AdamW, "
                   f"activation checkpointing, {device}", names=NAMES)
        if any(r.get("curve") for r in results):
            batch = next(r["batch"] for r in results if r.get("curve"))
            plot_loss_curves(results, os.path.join(args.out, f"train_{args.shape}_loss_curves.png"),
                             f"loss curves at batch {batch} x {args.seq}, same data and init, {device}")
    if table:
        print_table(sweep)


if __name__ == "__main__":
    main()
