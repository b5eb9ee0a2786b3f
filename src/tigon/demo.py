"""``tigon demo``: fine-tune a small Llama-style model on a text corpus shipped with the package,
once with plain Hugging Face transformers and once patched by tigon, from the same weights and
batches, and compare tokens/s, peak memory and the loss curves.

No network: the corpus is the first ~600 KB of Tiny Shakespeare (Shakespeare's plays, public
domain; the text of karpathy/char-rnn's data/tinyshakespeare), and the tokenizer is a
byte-level BPE trained on it at start-up. On a GPU the model is bf16 with fused AdamW and a
Llama-3-sized 128,256-row head (the tokenizer uses only its first ids: the head's size is what
the loss kernels work on). Without a GPU a tiny model runs on the CPU with tigon's kernels
interpreted by Triton: a check that both runs train alike, not a speed comparison.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from importlib import resources

import torch

CORPUS = "tiny_shakespeare.txt.gz"


@dataclass
class DemoConfig:
    device: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # rows of the lm_head (>= the tokenizer's ids)
    tokenizer_vocab: int
    batch: int
    seq: int
    steps: int
    lr: float
    dtype: str

    @classmethod
    def for_device(cls, device: str, steps: int | None = None, quick: bool = False) -> DemoConfig:
        if device == "cuda":
            return cls(device, hidden=1024, layers=12, heads=16, kv_heads=4, intermediate=4096, vocab=128256,
                       tokenizer_vocab=8192, batch=8, seq=1024, steps=steps or (20 if quick else 300), lr=1e-3,
                       dtype="bfloat16")
        return cls(device, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=160, vocab=2048,
                   tokenizer_vocab=2048, batch=4, seq=64, steps=steps or (4 if quick else 12), lr=3e-3,
                   dtype="float32")


def read_corpus() -> str:
    with resources.files("tigon").joinpath("demo_data", CORPUS).open("rb") as raw, gzip.open(raw, "rt",
                                                                                             encoding="utf-8") as f:
        return f.read()


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE of at most vocab_size ids trained on text (HF ``tokenizers``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tok


def make_batches(ids: torch.Tensor, cfg: DemoConfig, device: str, seed: int = 0) -> list[torch.Tensor]:
    """cfg.steps batches of cfg.batch random windows of cfg.seq tokens (the same for both runs)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - cfg.seq - 1, (cfg.steps, cfg.batch), generator=gen)
    windows = starts[..., None] + torch.arange(cfg.seq)
    return [ids[w].to(device) for w in windows]


def build_model(cfg: DemoConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate,
                         vocab_size=cfg.vocab, max_position_embeddings=max(2048, cfg.seq),
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(cfg.device):
        model = LlamaForCausalLM(config)
    return model.to(getattr(torch, cfg.dtype))


def train(impl: str, cfg: DemoConfig, state: dict, batches: list, progress: bool = True) -> dict:
    """One run ("hf" or "tigon") from `state`: losses per step, tokens/s, peak memory."""
    import tigon

    model = build_model(cfg)
    model.load_state_dict(state)
    report = tigon.patch(model) if impl == "tigon" else None
    model.train()
    cuda = cfg.device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=cuda)
    warmup = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    bar = _progress(len(batches), f"{'HF' if impl == 'hf' else 'HF + tigon':>10}", progress)
    losses, timed_tokens, timed_s = [], 0, 0.0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, ids in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        value = loss.detach().item()  # a host sync: the step is done
        elapsed = time.perf_counter() - start
        if step >= min(3, len(batches) - 1):  # the first steps compile kernels and warm the allocator
            timed_tokens += ids.numel()
            timed_s += elapsed
        losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del model, opt
    if impl == "tigon":
        tigon.unpatch()
    return dict(impl=impl, losses=losses, tokens_per_s=timed_tokens / timed_s if timed_s else None, peak_gib=peak,
                report=str(report) if report is not None else None)


def _progress(total, desc, enabled):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        tqdm = None
    if tqdm is None or not enabled:
        class _Quiet:
            def update(self, n):
                pass

            def set_postfix(self, **kw):
                pass

            def close(self):
                pass
        return _Quiet()
    return tqdm(total=total, desc=desc, unit="step", leave=True)


def plot_losses(results: list[dict], cfg: DemoConfig, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, style in zip(results, ("-", "--")):
        label = "HF" if r["impl"] == "hf" else "HF + tigon"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=label, linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary(results: list[dict], cfg: DemoConfig) -> str:
    hf, tg = results
    lines = [f"{'':12s} {'tokens/s':>10s} {'peak memory':>12s} {'first loss':>11s} {'final loss':>11s}"]
    for r in results:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "n/a"
        lines.append(f"{'HF' if r['impl'] == 'hf' else 'HF + tigon':12s} {tps:>10s} {peak:>12s} "
                     f"{r['losses'][0]:11.4f} {r['losses'][-1]:11.4f}")
    diffs = [abs(a - b) for a, b in zip(hf["losses"], tg["losses"])]
    tail = diffs[-50:]
    if cfg.device == "cuda":
        lines.append(f"tigon: {tg['tokens_per_s'] / hf['tokens_per_s']:.2f}x the tokens/s, "
                     f"{100 * tg['peak_gib'] / hf['peak_gib']:.0f}% of the peak memory; losses differ by "
                     f"{sum(tail) / len(tail):.4f} on average over the last {len(tail)} steps (largest difference "
                     f"{max(diffs):.4f}: two bf16 runs drift apart step by step, as two HF runs with different "
                     f"kernels would)")
    else:
        lines.append(f"CPU run: tigon's kernels ran in Triton's interpreter, so its speed here means nothing; "
                     f"largest loss difference over {len(hf['losses'])} steps {max(diffs):.2e}")
    return "\n".join(lines)


def run_demo(out_dir: str = "tigon_demo", steps: int | None = None, quick: bool = False, device: str | None = None,
             progress: bool = True) -> dict:
    """The whole demo; returns (and writes to out_dir) the results. device: "cuda", "cpu" or None (auto)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DemoConfig.for_device(device, steps, quick)
    text = read_corpus()
    tok = train_tokenizer(text, cfg.tokenizer_vocab)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (tigon kernels interpreted by Triton)"
    print(f"tigon demo on {where}: Llama-style model, hidden {cfg.hidden}, {cfg.layers} layers, head of "
          f"{cfg.vocab} rows, {cfg.dtype}; corpus {len(text):,} characters = {ids.numel():,} tokens "
          f"(BPE, {tok.get_vocab_size()} ids); {cfg.steps} steps of {cfg.batch} x {cfg.seq} tokens", flush=True)
    batches = make_batches(ids, cfg, device)
    model = build_model(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    del model
    results = [train(impl, cfg, state, batches, progress) for impl in ("hf", "tigon")]
    text_summary = summary(results, cfg)
    print(text_summary)
    os.makedirs(out_dir, exist_ok=True)
    title = (f"tigon demo: Llama-style {n_params / 1e6:.3g}M params, {cfg.batch}x{cfg.seq} tokens/step, "
             f"{where.split(' (')[0]}")
    plot = plot_losses(results, cfg, os.path.join(out_dir, "loss_curves.png"), title)
    record = dict(config=asdict(cfg), params=n_params, device=where, torch=torch.__version__, results=results)
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out_dir}/demo.json" + (f" and {plot}" if plot else " (install matplotlib for the loss plot)"))
    return record
