"""``tigon bench --memory-timeline``: one training step's allocated memory over time, HF and HF
+ tigon side by side (CUDA's allocator history, ``torch.cuda.memory._record_memory_history``),
with the memory planner's predicted timeline and peak drawn over each.

The model is built from its config with random weights (bf16, SDPA), trained with fused AdamW
on random tokens; the step recorded is the second (the optimizer's state exists). HF runs first,
then the same model patched by tigon.
"""

from __future__ import annotations

import gc
import json
import os

import torch

GiB = 2**30


def _allocated_series(snapshot, baseline: int) -> list[int]:
    """Allocated bytes after each alloc / free in the snapshot's trace of the current device."""
    series, current = [baseline], baseline
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        else:
            continue
        series.append(current)
    return series


def record_step(model, batch: int, seq: int, seed: int = 0) -> list[int]:
    """Allocated bytes over the second of two AdamW steps of ``model`` on random tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = [torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen) for _ in range(2)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(ids[0])
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        baseline = torch.cuda.memory_allocated()
        step(ids[1])
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    opt.state.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return _allocated_series(snapshot, baseline)


def run(model_name: str, batch: int, seq: int, out: str) -> dict:
    """Record HF's and tigon's step, predict both, write memory_timeline.json and .png to ``out``."""
    from transformers import AutoModelForCausalLM

    import tigon
    from tigon.planning import load_config, predict_step

    config = load_config(model_name)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    results = {}
    for impl in ("hf", "tigon"):
        if impl == "tigon":
            tigon.patch(model)
        measured = record_step(model, batch, seq)
        predicted = predict_step(config, batch, seq, tigon=impl == "tigon", keep_timeline=True)
        results[impl] = dict(measured=measured, predicted=list(predicted.trace.from_phase("forward")),
                             predicted_peak=predicted.peak, measured_peak=max(measured))
        print(f"{impl:6s} measured peak {max(measured) / GiB:6.2f} GiB, predicted {predicted.peak / GiB:6.2f} GiB "
              f"({100 * (predicted.peak - max(measured)) / max(measured):+.1f}%)", flush=True)
    tigon.unpatch(model)
    title = f"{model_name}, batch {batch} x {seq}, bf16, AdamW, {torch.cuda.get_device_name()}"
    summary = {impl: dict(measured_peak_gib=r["measured_peak"] / GiB, predicted_peak_gib=r["predicted_peak"] / GiB)
               for impl, r in results.items()}
    with open(os.path.join(out, "memory_timeline.json"), "w") as f:
        json.dump(dict(title=title, model=model_name, batch=batch, seq=seq, summary=summary,
                       measured={k: _thin(r["measured"]) for k, r in results.items()},
                       predicted={k: _thin(r["predicted"]) for k, r in results.items()}), f)
    plot(results, title, os.path.join(out, "memory_timeline.png"))
    return summary


def _thin(series, points: int = 4000) -> list[int]:
    """At most ``points`` values of ``series``, each the maximum of its stretch (peaks kept)."""
    if len(series) <= points:
        return list(series)
    step = len(series) / points
    return [max(series[int(i * step):max(int((i + 1) * step), int(i * step) + 1)]) for i in range(points)]


def plot(results: dict, title: str, path: str) -> None:
    """HF and tigon side by side: measured allocated GiB over the step (x: fraction of the
    step's allocation events), the planner's predicted timeline and peak over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    names = {"hf": "HF", "tigon": "HF + tigon"}
    for ax, (impl, r) in zip(axes, results.items()):
        for key, style, label in (("measured", dict(color="tab:blue", lw=1.4), "measured (CUDA allocator)"),
                                  ("predicted", dict(color="tab:orange", lw=1.0, alpha=0.8), "predicted (tigon plan)")):
            series = _thin(r[key])
            xs = [i / max(len(series) - 1, 1) for i in range(len(series))]
            ax.plot(xs, [v / GiB for v in series], label=label, **style)
        ax.axhline(r["predicted_peak"] / GiB, color="tab:orange", ls="--", lw=1,
                   label=f"predicted peak {r['predicted_peak'] / GiB:.2f} GiB")
        ax.axhline(r["measured_peak"] / GiB, color="tab:blue", ls=":", lw=1,
                   label=f"measured peak {r['measured_peak'] / GiB:.2f} GiB")
        ax.set_title(names[impl])
        ax.set_xlabel("progress through one training step (allocation events)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("allocated memory (GiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
