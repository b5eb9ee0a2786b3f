"""Train an HF model with and without tigon in one process, from the same weights and data:
tokens/s, peak memory and losses. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/train_hf.py --shape llama-1b --batch 8 --seq 1024 --steps 20``.

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
}


def run(impl, model_type, shape_kwargs, state, args):
    from transformers import AutoConfig, AutoModelForCausalLM

    import tigon

    config = AutoConfig.for_model(model_type, **shape_kwargs)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state)
    report = None
    if impl == "tigon":
        report = str(tigon.patch(model, chunk_budget=args.chunk_mib * 2**20 if args.chunk_mib else None))
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.adamw == "fused",
                            foreach=args.adamw == "foreach")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=gen)
               for _ in range(args.warmup + args.steps)]
    torch.cuda.synchronize()
    losses, start, peak_fb, peak_opt = [], None, 0, 0
    for i, ids in enumerate(batches):
        timed = i >= args.warmup
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
    result = dict(impl=impl, tokens_per_s=args.batch * args.seq * args.steps / seconds, step_s=seconds / args.steps,
                  peak_gib=max(peak_fb, peak_opt) / 2**30, peak_fwd_bwd_gib=peak_fb / 2**30,
                  peak_optimizer_gib=peak_opt / 2**30, losses=[float(x) for x in losses], report=report)
    del model, opt, batches
    torch.cuda.empty_cache()
    tigon.unpatch()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adamw", default="fused", choices=["fused", "foreach", "for-loop"],
                   help="torch AdamW implementation (foreach keeps temporaries the size of the weights)")
    p.add_argument("--impls", default="hf,tigon")
    p.add_argument("--chunk-mib", type=int, default=None, help="tigon's FLCE chunk budget (default 512 MiB)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape_kwargs = SHAPES[args.shape]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape_kwargs), dtype=torch.bfloat16)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"{args.shape}: {n_params / 1e9:.2f}B parameters, batch {args.batch} x {args.seq}, {torch.cuda.get_device_name()}",
          flush=True)
    results = []
    for impl in args.impls.split(","):
        r = run(impl, model_type, shape_kwargs, state, args)
        results.append(r)
        print(f"{impl:6s}: {r['tokens_per_s']:9.0f} tokens/s, {r['step_s'] * 1e3:7.1f} ms/step, peak {r['peak_gib']:6.2f} GiB,"
              f" (fwd+bwd {r['peak_fwd_bwd_gib']:.2f}, optimizer step {r['peak_optimizer_gib']:.2f}),"
              f" losses {' '.join(f'{x:.4f}' for x in r['losses'][:6])}", flush=True)
        if r["report"]:
            print(r["report"])
    if len(results) == 2:
        a, b = results
        print(f"{b['impl']} / {a['impl']}: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x tokens/s, "
              f"{100 * b['peak_gib'] / a['peak_gib']:.0f}% of the peak memory; first losses "
              f"{a['losses'][0]:.4f} vs {b['losses'][0]:.4f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"train_{args.shape}.json"), "w") as f:
            json.dump(dict(shape=args.shape, args=vars(args), device=torch.cuda.get_device_name(),
                           torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
