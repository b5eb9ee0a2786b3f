"""Train an HF model with and without tigon (and Liger-Kernel, when installed) in one process,
from the same weights and data: tokens/s, peak memory and losses. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/train_hf.py --shape llama-1b --batch 8 --seq 1024 --steps 20``;
``--batches 4 8 16 32`` sweeps the batch size (each implementation until it runs out of memory)
and plots tokens/s and peak memory against it. An implementation followed by ``+compile``
(``hf+compile``, ``tigon+compile``, ``liger+compile``) runs ``model.compile()`` (``--compile-mode``)
with the batch dimension marked dynamic (one compilation for the whole sweep). ``--isolate`` runs
each implementation in its own process, so that a crash (a peer's illegal memory access) ends
only its own rows. ``--timed-tokens`` sets the timed steps per batch (at least 3) instead of
``--steps``, so that large batches do not take much longer than small ones. ``--merge A.json B.json
--out DIR`` joins sweeps of one shape run in separate calls (a device call's time limit) into one
JSON, table and plot, without a GPU.

bf16 weights, AdamW (fused by default), gradient checkpointing, random tokens (labels =
inputs). Peak memory is torch.cuda.max_memory_allocated during the warm-up steps (weights,
gradients, optimizer state, activations), split into forward+backward and optimizer step.
Tokens/s over the timed steps (after --warmup steps; at least 2).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256.
    "llama-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                               max_position_embeddings=4096)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                                   max_position_embeddings=4096)),
    # Gemma-2-2B: head_dim 256, final logit softcap 30, GeGLU (gelu tanh).
    "gemma2-2b": ("gemma2", dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True,
                                 max_position_embeddings=4096)),
    # Llama-3.1-8B.
    "llama-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                               max_position_embeddings=4096)),
}


def add_setup_args(parser, default_shape="llama-1b"):
    """--shape, --batch, --seq and --impls: the training setup every script built on this one takes."""
    parser.add_argument("--shape", default=default_shape, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--impls", default="hf,tigon",
                        help="comma-separated: hf, tigon, liger, each optionally with +compile (e.g. tigon+compile)")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    return parser


def build_model(model_type, shape_kwargs, impl="hf", state=None, chunk_budget=None, compile_mode="default"):
    """The bf16 model on the GPU (weights from `state` when given), patched by `impl` ("hf":
    not at all, "tigon", "liger"; "+compile": then ``model.compile(mode=compile_mode)``), with
    gradient checkpointing, in train mode: (model, report)."""
    impl, _, compiled = impl.partition("+")
    from transformers import AutoConfig, AutoModelForCausalLM

    import tigon

    config = AutoConfig.for_model(model_type, **shape_kwargs)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    report = None
    if impl == "tigon":
        report = str(tigon.patch(model, chunk_budget=chunk_budget))
    elif impl == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        report = "liger-kernel: _apply_liger_kernel_to_instance (its defaults)"
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    if compiled:
        if compiled != "compile":
            raise ValueError(f"unknown implementation suffix +{compiled} (only +compile)")
        model.compile(mode=None if compile_mode == "default" else compile_mode)
        report = (report + "; " if report else "") + f"torch.compile (mode {compile_mode})"
    return model, report


def training_step(impl, model_type, shape_kwargs, batch, seq, seed=0):
    """(model, step): a freshly built model (build_model, seed ``seed``) and one AdamW training
    step on a fixed random batch, for the profiling scripts."""
    torch.manual_seed(seed)
    model, _ = build_model(model_type, shape_kwargs, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.ids = ids
    return model, step


# A compiled implementation keeps its model from one batch size to the next (weights reloaded
# from the same state, a new optimizer): a new model would be compiled again (its modules and
# patched forwards are new objects to torch.compile's guards), a minute or more per batch size.
_COMPILED_MODELS: dict = {}


def run(impl, model_type, shape_kwargs, state, args, batch):
    import tigon

    if impl in _COMPILED_MODELS:
        model, report = _COMPILED_MODELS[impl]
        model.load_state_dict(state)
    else:
        model, report = build_model(model_type, shape_kwargs, impl, state,
                                    args.chunk_mib * 2**20 if args.chunk_mib else None, args.compile_mode)
        if impl.endswith("+compile"):
            _COMPILED_MODELS[impl] = model, report
    steps = args.steps if not args.timed_tokens else max(3, -(-args.timed_tokens // (batch * args.seq)))
    config = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.adamw == "fused",
                            foreach=args.adamw == "foreach")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (batch, args.seq), device="cuda", generator=gen)
               for _ in range(args.warmup + steps)]
    if impl.endswith("+compile"):  # one compilation for every batch size
        for ids in batches:
            torch._dynamo.mark_dynamic(ids, 0)
    torch.cuda.synchronize()
    losses, start, peak_fb, peak_opt, first_step_s = [], None, 0, 0, None
    first_start = time.perf_counter()  # the first step's time includes torch.compile's
    for i, ids in enumerate(batches):
        timed = i >= args.warmup
        if i == 1:
            torch.cuda.synchronize()
            first_step_s = time.perf_counter() - first_start
        if i == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if not timed:  # peaks from the warm-up steps (reading them syncs)
            torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not timed:
            peak_fb = max(peak_fb, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not timed:
            peak_opt = max(peak_opt, torch.cuda.max_memory_allocated())
        losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if impl.endswith("+compile"):  # what torch.compile made of the model (graph breaks: 0 is one graph)
        from torch._dynamo.utils import counters

        compiled = dict(graph_breaks=sum(counters["graph_break"].values()),
                        graph_break_reasons=sorted(counters["graph_break"])[:5])
    else:
        compiled = {}
    result = dict(impl=impl, batch=batch, tokens_per_s=batch * args.seq * steps / seconds, step_s=seconds / steps,
                  steps=steps, first_step_s=first_step_s, **compiled,
                  peak_gib=max(peak_fb, peak_opt) / 2**30, peak_fwd_bwd_gib=peak_fb / 2**30,
                  peak_optimizer_gib=peak_opt / 2**30, losses=[float(x) for x in losses], report=report)
    del model, opt, batches
    torch.cuda.empty_cache()
    if impl not in _COMPILED_MODELS:
        tigon.unpatch()
    return result


def run_or_oom(impl, model_type, shape_kwargs, state, args, batch):
    """run(), or a row saying the batch did not fit (or the implementation failed)."""
    import gc
    import importlib

    # Liger's instance patching also swaps module-level functions (RoPE): restore the modeling
    # module afterwards, so that later plain-HF runs stay plain.
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = dict(vars(modeling))
    try:
        result = run(impl, model_type, shape_kwargs, state, args, batch)
        saved = dict(vars(modeling))  # a kept compiled model keeps its patches
        return result
    except torch.OutOfMemoryError:
        error = "out of memory"
    except Exception as exc:  # e.g. a peer that does not support this transformers version
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        for name, value in saved.items():
            if vars(modeling).get(name) is not value:
                setattr(modeling, name, value)
    _COMPILED_MODELS.pop(impl, None)
    gc.collect()
    torch.cuda.empty_cache()
    if impl.startswith("tigon"):
        import tigon

        tigon.unpatch()
    return dict(impl=impl, batch=batch, error=error)


def plot_sweep(results, path, title, names=None):
    """tokens/s and peak memory against the batch size, one line per implementation (``names``:
    legend names of the implementations before their "+compile")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    names = names or {"hf": "HF", "tigon": "HF + tigon", "liger": "HF + Liger-Kernel"}
    colours = {"hf": "#7f7f7f", "torchtune": "#7f7f7f", "tigon": "#d62728", "liger": "#2ca02c"}
    for impl in dict.fromkeys(r["impl"] for r in results):
        ok = [r for r in results if r["impl"] == impl and "error" not in r]
        if not ok:
            continue
        base, _, compiled = impl.partition("+")
        style = dict(color=colours.get(base), linestyle="--" if compiled else "-", marker="s" if compiled else "o",
                     label=names.get(base, base) + (" + torch.compile" if compiled else ""))
        xs = [r["batch"] for r in ok]
        ax_t.plot(xs, [r["tokens_per_s"] for r in ok], **style)
        ax_m.plot(xs, [r["peak_gib"] for r in ok], **style)
        oom = [r["batch"] for r in results if r["impl"] == impl and r.get("error") == "out of memory"]
        if oom:
            ax_m.axvline(min(oom), color=colours.get(base), linestyle=":", linewidth=1)
    ax_t.set_ylabel("tokens / s (higher is better)")
    ax_m.set_ylabel("peak memory, GiB (lower is better)")
    for ax in (ax_t, ax_m):
        ax.set_xlabel("batch size (sequences); dotted: first batch out of memory")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = add_setup_args(argparse.ArgumentParser())
    p.add_argument("--batches", type=int, nargs="*", help="a batch-size sweep (each implementation until OOM)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timed-tokens", type=int, default=None,
                   help="timed steps per batch = this many tokens / (batch x seq), at least 3 (instead of --steps)")
    p.add_argument("--isolate", action="store_true", help="each implementation in its own process")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adamw", default="fused", choices=["fused", "foreach", "for-loop"],
                   help="torch AdamW implementation (foreach keeps temporaries the size of the weights)")
    p.add_argument("--chunk-mib", type=int, default=None, help="tigon's FLCE chunk budget (default 512 MiB)")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these sweep JSONs (one shape) into --out")
    args = p.parse_args()
    if args.merge:
        return merge_sweeps(args)
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first step compiles and allocates)")
    if args.isolate and "," in args.impls:
        return run_isolated(args)
    if "," in args.impls and "+compile" in args.impls:
        p.error("compiled implementations keep their patched model between batch sizes: run them with --isolate")
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape_kwargs = SHAPES[args.shape]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape_kwargs), dtype=torch.bfloat16)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    batches = args.batches or [args.batch]
    print(f"{args.shape}: {n_params / 1e9:.2f}B parameters, batch {batches} x {args.seq}, {torch.cuda.get_device_name()}",
          flush=True)
    results, failed = [], set()
    for batch in batches:
        for impl in args.impls.split(","):
            if impl in failed:
                continue
            r = run_or_oom(impl, model_type, shape_kwargs, state, args, batch)
            results.append(r)
            save(args, n_params, results)
            if "error" in r:
                failed.add(impl)
                print(f"{impl:6s} batch {batch}: {r['error']}", flush=True)
                continue
            print(f"{impl:6s} batch {batch}: {r['tokens_per_s']:9.0f} tokens/s, {r['step_s'] * 1e3:7.1f} ms/step, "
                  f"peak {r['peak_gib']:6.2f} GiB, (fwd+bwd {r['peak_fwd_bwd_gib']:.2f}, optimizer step "
                  f"{r['peak_optimizer_gib']:.2f}), losses {' '.join(f'{x:.4f}' for x in r['losses'][:6])}", flush=True)
            if r["report"] and batch == batches[0]:
                print(r["report"])
        base = next((r for r in results if r["impl"] == "hf" and r["batch"] == batch and "error" not in r), None)
        for r in results:
            if base and r["batch"] == batch and r["impl"] != "hf" and "error" not in r:
                print(f"  {r['impl']} / hf at batch {batch}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
                      f"{100 * r['peak_gib'] / base['peak_gib']:.0f}% of the peak memory; first losses "
                      f"{base['losses'][0]:.4f} vs {r['losses'][0]:.4f}")
    save(args, n_params, results, final=True)
    print_table(results)


def run_isolated(args, script=__file__):
    """Each implementation in a child process running ``script`` (same weights: the seed fixes
    them), results merged in the order of --impls; a child that dies leaves a row saying so."""
    import subprocess
    import sys
    import tempfile

    results, n_params, device = [], None, None
    for impl in args.impls.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            argv = [a for a in sys.argv[1:] if a != "--isolate"]
            if "--impls" in argv:
                argv[argv.index("--impls") + 1] = impl
            else:
                argv += ["--impls", impl]
            if "--out" in argv:
                j = argv.index("--out")
                argv[j + 1] = tmp
            else:
                argv += ["--out", tmp]
            proc = subprocess.run([sys.executable, script, *argv])
            name = f"train_{args.shape}" + ("_batch_sweep" if args.batches else "")
            path = os.path.join(tmp, f"{name}.json")
            child = json.load(open(path)) if os.path.exists(path) else {}
        n_params, device = child.get("params", n_params), child.get("device", device)
        rows = child.get("results", [])
        results += rows
        if proc.returncode != 0:
            done = {r["batch"] for r in rows}
            nxt = [b for b in (args.batches or [args.batch]) if b not in done][:1]
            results += [dict(impl=impl, batch=b, error=f"process died (exit code {proc.returncode})") for b in nxt]
        save(args, n_params or 0, results, device=device or "unknown GPU")
    save(args, n_params or 0, results, final=True, device=device or "unknown GPU")
    print_table(results)


def merge_sweeps(args):
    """The rows of several sweep JSONs of one shape, in the order given, saved as one sweep."""
    parts = [json.load(open(path)) for path in args.merge]
    shapes = {part["shape"] for part in parts}
    if len(shapes) != 1:
        raise SystemExit(f"--merge: the JSONs are of different shapes {sorted(shapes)}")
    args.shape = shapes.pop()
    args.seq = parts[0]["args"]["seq"]
    args.batches = sorted({r["batch"] for part in parts for r in part["results"]})
    results = [r for part in parts for r in part["results"]]
    save(args, parts[0]["params"], results, final=True, device=parts[0]["device"])
    print_table(results)


def print_table(results):
    """tokens/s / peak GiB per batch (rows) and implementation (columns), as markdown."""
    impls = list(dict.fromkeys(r["impl"] for r in results))
    print("| batch | " + " | ".join(impls) + " |")
    print("|---" * (len(impls) + 1) + "|")
    for batch in sorted({r["batch"] for r in results}):
        cells = []
        for impl in impls:
            r = next((r for r in results if r["impl"] == impl and r["batch"] == batch), None)
            cells.append("" if r is None else r["error"] if "error" in r else
                         f"{r['tokens_per_s']:,.0f} / {r['peak_gib']:.1f}")
        print(f"| {batch} | " + " | ".join(cells) + " |")


def save(args, n_params, results, final=False, device=None):
    """The JSON after every run (a cut-off sweep keeps what it measured), and the plot at the end.
    ``device``: the GPU's name when this process has not touched CUDA (--isolate's parent)."""
    if not args.out:
        return
    device = device or torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    name = f"train_{args.shape}" + ("_batch_sweep" if args.batches else "")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(shape=args.shape, params=n_params, args=vars(args), device=device,
                       torch=torch.__version__, results=results), f, indent=1)
    if args.batches and final:
        plot_sweep(results, os.path.join(args.out, f"{name}.png"),
                   f"{args.shape} ({n_params / 1e9:.2f}B), seq {args.seq}, bf16, AdamW, gradient checkpointing, "
                   f"{device}")


if __name__ == "__main__":
    main()
