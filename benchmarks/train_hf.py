"""Train an HF model with and without tigon (and Liger-Kernel, when installed) in one process,
from the same weights and data: tokens/s, peak memory and losses. Run on a CUDA machine:
``PYTHONPATH=src python benchmarks/train_hf.py --shape llama-1b --batch 8 --seq 1024 --steps 20``;
``--batches 4 8 16 32`` sweeps the batch size (each implementation until it runs out of memory)
and plots tokens/s and peak memory against it; ``--seqs 512 1024 2048`` sweeps the sequence length
at ``--batch`` instead (the Liger paper's figure). ``--impls`` takes ``tigon`` (``tigon.patch(model)``
after building) and ``tigon-class`` (``tigon.patch_<family>()`` before building, as Liger's users do). An implementation
followed by ``+compile``
(``hf+compile``, ``tigon+compile``, ``liger+compile``) runs ``model.compile()`` (``--compile-mode``)
with the batch dimension marked dynamic (one compilation for the whole sweep). ``--isolate`` runs
each implementation in its own process, so that a crash (a peer's illegal memory access) ends
only its own rows. ``--timed-tokens`` sets the timed steps per batch (at least 3) instead of
``--steps``, so that large batches do not take much longer than small ones. ``--merge A.json B.json
--out DIR`` joins sweeps of one shape run in separate calls (a device call's time limit) into one
JSON, table and plot, without a GPU.

Several GPUs: ``torchrun --nproc-per-node N benchmarks/train_hf.py --parallel fsdp2 ...`` (or
``ddp``) trains data-parallel: ``--batch`` sequences per GPU, each rank's rows of one global batch
of N x ``--batch`` (the batches a single GPU at ``--batch`` N x b sees, so the losses compare with
a one-GPU run); FSDP2 shards each decoder layer and the root (``fully_shard``). tokens/s is per
GPU, the peak is the largest over the GPUs, a step's loss the mean over the ranks; rank 0 prints
and writes the JSON.

bf16 weights (``--dtype``), AdamW (fused by default), gradient checkpointing (``--checkpointing``), random init from
one seed, the same seeded batches for every implementation. Text shapes: random tokens (labels =
inputs). Vision-language shapes (``qwen2.5-vl-3b``): each sequence is one ``--image-size`` image
(patches, grid and placeholder tokens as the model's processor makes them, vision start/end
around the placeholders at the start) then random text; labels = input_ids with the image's
tokens set to -100. Tokens/s count every token of input_ids (text and image placeholders).
Peak memory is torch.cuda.max_memory_allocated during the warm-up steps (weights,
gradients, optimizer state, activations), split into forward+backward and optimizer step.
Tokens/s over the timed steps (after --warmup steps; at least 2). The table ends with each
implementation's first 3 losses (the JSON keeps every step's). Without CUDA (a CPU smoke run
under ``TRITON_INTERPRET=1``, e.g. with the hidden ``--tiny`` configs) peaks read 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tigon.shapes import SHAPES  # the model shapes, shared with `tigon plan`

# --tiny (hidden): the same families at toy size, for a CPU smoke run under TRITON_INTERPRET=1
# (special tokens inside the vocabulary; mrope_section: the 8 frequencies of head_dim 16).
TINY_SHAPES = {
    "qwen2.5-vl-3b": ("qwen2_5_vl", dict(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        tie_word_embeddings=True)),
    "llama-8b": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=160, vocab_size=512)),
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    intermediate_size=128, norm_topk_prob=True, vocab_size=512)),
}
TINY_IMAGE_SIZE = 56  # 4 x 4 patches of 14, merged 2 x 2: 4 image tokens

# Vision-language model types: built as image-text-to-text models, trained on image + text batches.
VISION_LANGUAGE = {"qwen2_5_vl"}

# Liger-Kernel's patch function per model type (applied to the model instance, its defaults).
LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
                 "gemma2": "apply_liger_kernel_to_gemma2", "qwen2_5_vl": "apply_liger_kernel_to_qwen2_5_vl",
                 "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARALLEL = ("none", "ddp", "fsdp2")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def add_setup_args(parser, default_shape="llama-1b"):
    """--shape, --batch, --seq and --impls: the training setup every script built on this one takes."""
    parser.add_argument("--shape", default=default_shape, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--impls", default="hf,tigon",
                        help="comma-separated: hf, tigon (instance patch), tigon-class (class patch before "
                             "building), liger, each optionally with +compile (e.g. tigon+compile)")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    return parser


def new_model(model_type, shape_kwargs, dtype=torch.bfloat16):
    """The HF model of `shape_kwargs`, randomly initialised (from torch's global seed) on DEVICE, with
    SDPA attention: a *ForCausalLM, or the image-text-to-text class of a vision-language type."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, **shape_kwargs)
    auto = AutoModelForImageTextToText if model_type in VISION_LANGUAGE else AutoModelForCausalLM
    with torch.device(DEVICE):
        return auto.from_config(config, dtype=dtype, attn_implementation="sdpa")


def initial_state(model_type, shape_kwargs, dtype=torch.bfloat16, seed=0):
    """(state dict on the CPU, parameter count) of new_model after ``torch.manual_seed(seed)``:
    the weights every implementation (and every --isolate child) starts from."""
    torch.manual_seed(seed)
    model = new_model(model_type, shape_kwargs, dtype)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    del model
    _empty_cache()
    return state, n_params


def liger_skip_reason(model_type):
    """Why Liger-Kernel cannot patch `model_type` here (not installed, no patch function), or None."""
    name = LIGER_PATCHES.get(model_type)
    if name is None:
        return f"no Liger-Kernel patch function is known for model type {model_type}"
    try:
        import liger_kernel.transformers as liger
    except ImportError as exc:
        return f"liger-kernel is not installed ({exc})"
    if getattr(liger, name, None) is None:
        from importlib.metadata import version

        return f"liger-kernel {version('liger-kernel')} has no {name}"
    return None


def build_model(model_type, shape_kwargs, impl="hf", state=None, chunk_budget=None, compile_mode="default",
                dtype=torch.bfloat16, checkpointing="all", memory_budget=None):
    """The model (new_model; weights from `state` when given), patched by `impl` ("hf":
    not at all, "tigon": ``tigon.patch(model)``, "tigon-class": ``tigon.patch_<family>()`` before
    building, "liger"; "+compile": then ``model.compile(mode=compile_mode)``), with
    HF's gradient checkpointing on every decoder layer (``checkpointing`` "all"), on none
    ("none"), or as tigon's memory planner picks within ``memory_budget`` ("auto": tigon only),
    in train mode: (model, report)."""
    impl, _, compiled = impl.partition("+")
    import tigon

    if checkpointing == "auto" and impl != "tigon":  # the planner patches a built model
        raise RuntimeError("skipped: --checkpointing auto is tigon's (tigon.patch(checkpointing='auto'))")
    report = None
    if impl == "tigon-class":  # as Liger's users patch: the family's classes, before building
        family = tigon.patching.BY_MODEL_TYPE[model_type]
        report = "class patch: " + str(getattr(tigon, f"patch_{family.name}")())
    model = new_model(model_type, shape_kwargs, dtype)
    if state is not None:
        model.load_state_dict(state)
    if impl == "tigon":
        auto = dict(checkpointing="auto", memory_budget=memory_budget) if checkpointing == "auto" else {}
        report = str(tigon.patch(model, chunk_budget=chunk_budget, **auto))
    elif impl == "liger":
        reason = liger_skip_reason(model_type)
        if reason:
            raise RuntimeError(f"skipped: {reason}")
        import liger_kernel.transformers as liger

        getattr(liger, LIGER_PATCHES[model_type])(model=model)
        report = f"liger-kernel: {LIGER_PATCHES[model_type]}(model=model) (its defaults)"
    if checkpointing == "all":
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    if compiled:
        if compiled != "compile":
            raise ValueError(f"unknown implementation suffix +{compiled} (only +compile)")
        model.compile(mode=None if compile_mode == "default" else compile_mode)
        report = (report + "; " if report else "") + f"torch.compile (mode {compile_mode})"
    return model, report


def make_batches(model, n, batch, seq, generator, image_size=448):
    """`n` training batches (keyword arguments of `model`'s forward) of `batch` sequences of `seq`
    tokens, drawn from `generator`. Text models: random tokens, labels = input_ids. Vision-language
    models: image_text_batch."""
    config = model.config
    if config.model_type in VISION_LANGUAGE:
        return [image_text_batch(model, batch, seq, generator, image_size) for _ in range(n)]
    vocab = config.get_text_config().vocab_size
    ids = [torch.randint(0, vocab, (batch, seq), device=DEVICE, generator=generator) for _ in range(n)]
    return [dict(input_ids=x, labels=x) for x in ids]


def image_text_batch(model, batch, seq, generator, image_size):
    """One Qwen2.5-VL-style batch: per sequence one image_size x image_size image, as its processor
    gives it (pixel_values [batch * grid_h * grid_w, 3 * temporal_patch * patch**2] float32, grid
    (1, h, w) per image: an image is one temporal patch), input_ids <|vision_start|>, the image
    token once per merged patch, <|vision_end|>, then random text tokens (below the special ids);
    labels = input_ids with those image tokens -100; mm_token_type_ids (1 on image tokens) where
    the forward takes it (the 3D RoPE positions need it)."""
    import inspect

    config = model.config
    vision = config.vision_config
    unit = vision.patch_size * vision.spatial_merge_size
    if image_size % unit:
        raise ValueError(f"--image-size {image_size} is not a multiple of patch x spatial merge = {unit}")
    side = image_size // vision.patch_size
    n_image = side * side // vision.spatial_merge_size**2  # image tokens after the 2x2 merge
    if seq < n_image + 3:
        raise ValueError(f"--seq {seq} leaves no text after the image's {n_image + 2} tokens")
    special = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    ids = torch.randint(0, min(special), (batch, seq), device=DEVICE, generator=generator)
    ids[:, 0] = config.vision_start_token_id
    ids[:, 1:1 + n_image] = config.image_token_id
    ids[:, 1 + n_image] = config.vision_end_token_id
    labels = ids.clone()
    labels[:, :n_image + 2] = -100
    pixels = torch.randn(batch * side * side, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
                         device=DEVICE, generator=generator)
    inputs = dict(input_ids=ids, labels=labels, pixel_values=pixels,
                  image_grid_thw=torch.tensor([[1, side, side]] * batch, device=DEVICE))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).long()
    return inputs


def training_step(impl, model_type, shape_kwargs, batch, seq, seed=0):
    """(model, step): a freshly built model (build_model, seed ``seed``) and one AdamW training
    step on a fixed random batch (make_batches; ``step.inputs``, ``step.ids``: its input_ids), for
    the profiling scripts."""
    torch.manual_seed(seed)
    model, _ = build_model(model_type, shape_kwargs, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs = make_batches(model, 1, batch, seq, torch.Generator(device=DEVICE).manual_seed(seed))[0]

    def step():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.inputs, step.ids = inputs, inputs["input_ids"]
    return model, step


def init_distributed():
    """Under torchrun (WORLD_SIZE > 1): the default process group (NCCL on the GPU, gloo on the
    CPU) and this rank's GPU; nothing otherwise."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")


def rank_and_world():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def data_parallel(model, parallel):
    """The module to train: ``model`` under DDP, or ``model`` itself sharded in place by FSDP2
    (``fully_shard`` on each decoder layer, then the root: embeddings, final norm and head)."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if DEVICE == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    from tigon.hf_model import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer)
    return fully_shard(model)


def all_reduced(t, op):
    """t reduced over the ranks ("avg" or "max"), on the CPU."""
    import torch.distributed as dist

    _, world = rank_and_world()
    t = t.to(DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return (t / world if op == "avg" else t).cpu()


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes():
    """CUDA's peak allocation since the last reset; 0 without CUDA."""
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _device_name():
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"


# A compiled implementation keeps its model from one batch size to the next (weights reloaded
# from the same state, a new optimizer): a new model would be compiled again (its modules and
# patched forwards are new objects to torch.compile's guards), a minute or more per batch size.
_COMPILED_MODELS: dict = {}


def run(impl, model_type, shape_kwargs, state, args, batch):
    import tigon

    parallel = getattr(args, "parallel", "none")  # scripts building their own args may leave it out

    if impl in _COMPILED_MODELS:
        model, report = _COMPILED_MODELS[impl]
        model.load_state_dict(state)
    else:
        model, report = build_model(model_type, shape_kwargs, impl, state,
                                    args.chunk_mib * 2**20 if args.chunk_mib else None, args.compile_mode,
                                    DTYPES[args.dtype], args.checkpointing, args.memory_budget)
        if impl.endswith("+compile") and parallel == "none":  # a sharded model cannot reload the state
            _COMPILED_MODELS[impl] = model, report
    rank, world = rank_and_world()
    trained = data_parallel(model, parallel) if parallel != "none" else model
    steps = args.steps if not args.timed_tokens else max(3, -(-args.timed_tokens // (batch * args.seq)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.adamw == "fused",
                            foreach=args.adamw == "foreach")
    gen = torch.Generator(device=DEVICE).manual_seed(0)  # the same batches for every implementation
    batches = make_batches(model, args.warmup + steps, batch * world, args.seq, gen, args.image_size)
    if world > 1:  # this rank's rows of each global batch
        batches = [{k: v[rank * batch:(rank + 1) * batch] for k, v in b.items()} for b in batches]
    if impl.endswith("+compile"):  # one compilation for every batch size
        for inputs in batches:
            for x in inputs.values():
                torch._dynamo.mark_dynamic(x, 0)
    _sync()
    losses, start, peak_fb, peak_opt, first_step_s = [], None, 0, 0, None
    first_start = time.perf_counter()  # the first step's time includes torch.compile's
    for i, inputs in enumerate(batches):
        timed = i >= args.warmup
        if i == 1:
            _sync()
            first_step_s = time.perf_counter() - first_start
        if i == args.warmup:
            _sync()
            start = time.perf_counter()
        if not timed:  # peaks from the warm-up steps (reading them syncs)
            _reset_peak()
        if args.compile_mode == "reduce-overhead" and impl.endswith("+compile"):
            torch.compiler.cudagraph_mark_step_begin()  # each step is a new run of the CUDA graphs
        loss = trained(**inputs).loss
        loss.backward()
        if not timed:
            peak_fb = max(peak_fb, _peak_bytes())
            _reset_peak()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not timed:
            peak_opt = max(peak_opt, _peak_bytes())
        losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next run
    _sync()
    seconds = time.perf_counter() - start
    if world > 1:  # the mean loss over the ranks, the slowest rank's time, the largest peak
        losses = list(all_reduced(torch.stack(losses).float(), "avg"))
        seconds, peak_fb, peak_opt = all_reduced(torch.tensor([seconds, peak_fb, peak_opt], dtype=torch.float64), "max")
        seconds, peak_fb, peak_opt = float(seconds), int(peak_fb), int(peak_opt)
    if impl.endswith("+compile"):  # what torch.compile made of the model (graph breaks: 0 is one graph)
        from torch._dynamo.utils import counters

        compiled = dict(graph_breaks=sum(counters["graph_break"].values()),
                        graph_break_reasons=sorted(counters["graph_break"])[:5])
    else:
        compiled = {}
    result = dict(impl=impl, batch=batch, seq=args.seq, world=world, parallel=parallel,
                  tokens_per_s=batch * args.seq * steps / seconds, step_s=seconds / steps,
                  steps=steps, first_step_s=first_step_s, **compiled,
                  peak_gib=max(peak_fb, peak_opt) / 2**30, peak_fwd_bwd_gib=peak_fb / 2**30,
                  peak_optimizer_gib=peak_opt / 2**30, losses=[float(x) for x in losses], report=report)
    del model, trained, opt, batches
    import gc

    gc.collect()  # FSDP2's modules and hooks form reference cycles: their sharded weights would outlive the run
    _empty_cache()
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
        if impl in _COMPILED_MODELS:  # a kept compiled model keeps its patches
            saved = dict(vars(modeling))
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
    _empty_cache()
    if impl.startswith("tigon"):
        import tigon

        tigon.unpatch()
    return dict(impl=impl, batch=batch, seq=args.seq, error=error)


def plot_sweep(results, path, title, names=None, key="batch"):
    """tokens/s and peak memory against the batch size (``key`` "batch") or the sequence length
    ("seq"), one line per implementation (``names``: legend names of the implementations before
    their "+compile")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    names = names or {"hf": "HF", "tigon": "HF + tigon", "tigon-class": "HF + tigon (class patch)",
                      "liger": "HF + Liger-Kernel"}
    colours = {"hf": "#7f7f7f", "torchtune": "#7f7f7f", "tigon": "#d62728", "tigon-class": "#ff7f0e",
               "liger": "#2ca02c"}
    for impl in dict.fromkeys(r["impl"] for r in results):
        ok = [r for r in results if r["impl"] == impl and "error" not in r]
        if not ok:
            continue
        base, _, compiled = impl.partition("+")
        style = dict(color=colours.get(base), linestyle="--" if compiled else "-", marker="s" if compiled else "o",
                     label=names.get(base, base) + (" + torch.compile" if compiled else ""))
        xs = [r[key] for r in ok]
        ax_t.plot(xs, [r["tokens_per_s"] for r in ok], **style)
        ax_m.plot(xs, [r["peak_gib"] for r in ok], **style)
        oom = [r[key] for r in results if r["impl"] == impl and r.get("error") == "out of memory"]
        if oom:
            ax_m.axvline(min(oom), color=colours.get(base), linestyle=":", linewidth=1)
    ax_t.set_ylabel("tokens / s (higher is better)")
    ax_m.set_ylabel("peak memory, GiB (lower is better)")
    for ax in (ax_t, ax_m):
        what = {"batch": "batch size (sequences)", "seq": "sequence length (tokens)"}[key]
        ax.set_xlabel(f"{what}; dotted: first {key} out of memory")
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
    p.add_argument("--seqs", type=int, nargs="*",
                   help="a sequence-length sweep at --batch (each implementation until OOM), as the Liger paper's "
                        "figure")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timed-tokens", type=int, default=None,
                   help="timed steps per batch = this many tokens / (batch x seq), at least 3 (instead of --steps)")
    p.add_argument("--isolate", action="store_true", help="each implementation in its own process")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adamw", default="fused", choices=["fused", "foreach", "for-loop"],
                   help="torch AdamW implementation (foreach keeps temporaries the size of the weights)")
    p.add_argument("--chunk-mib", type=int, default=None, help="tigon's FLCE chunk budget (default 512 MiB)")
    p.add_argument("--checkpointing", default="all", choices=["all", "none", "auto"],
                   help="HF's gradient checkpointing on every decoder layer (default), on none, or as tigon's "
                        "memory planner picks (tigon only)")
    p.add_argument("--memory-budget", default=None, help="--checkpointing auto's budget, e.g. 70GiB (default: 92%% "
                                                         "of the GPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these sweep JSONs (one shape) into --out")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weights and activations")
    p.add_argument("--image-size", type=int, default=None,
                   help=f"vision-language shapes: the side of each sequence's image in pixels (default 448; "
                        f"{TINY_IMAGE_SIZE} with --tiny)")
    p.add_argument("--parallel", default="none", choices=PARALLEL,
                   help="under torchrun: data-parallel over the ranks, FSDP2 (fully_shard) or DDP")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # TINY_SHAPES: a CPU smoke run
    args = p.parse_args()
    if args.image_size is None:
        args.image_size = TINY_IMAGE_SIZE if args.tiny else 448
    if args.tiny and args.shape not in TINY_SHAPES:
        p.error(f"--tiny: no tiny version of {args.shape} (only {', '.join(TINY_SHAPES)})")
    if args.merge:
        return merge_sweeps(args)
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first step compiles and allocates)")
    if args.batches and args.seqs:
        p.error("--batches and --seqs: sweep one of them (the other is --batch or --seq)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (world > 1) != (args.parallel != "none"):
        p.error(f"--parallel {args.parallel} with {world} process(es): run --parallel ddp or fsdp2 under "
                f"torchrun --nproc-per-node N (N > 1), and nothing else without it")
    if world > 1 and args.isolate:
        p.error("--isolate runs one process per implementation: not under torchrun")
    if args.isolate and "," in args.impls:
        return run_isolated(args)
    if "," in args.impls and "+compile" in args.impls:
        p.error("compiled implementations keep their patched model between batch sizes: run them with --isolate")
    init_distributed()
    if rank_and_world()[0] != 0:  # rank 0 reports
        import sys

        sys.stdout = open(os.devnull, "w")
    model_type, shape_kwargs = (TINY_SHAPES if args.tiny else SHAPES)[args.shape]
    state, n_params = initial_state(model_type, shape_kwargs, DTYPES[args.dtype])
    points = sweep_points(args)
    key = swept(args)
    image = f", one {args.image_size}-pixel image per sequence" if model_type in VISION_LANGUAGE else ""
    across = f", {args.parallel} over {world} GPUs (batch per GPU)" if world > 1 else ""
    sizes = f"batch {args.batch} x seq {args.seqs}" if key == "seq" else f"batch {[b for b, _ in points]} x {args.seq}"
    print(f"{args.shape}{' (tiny)' if args.tiny else ''}: {n_params / 1e9:.2f}B parameters, {sizes}"
          f"{image}, {args.dtype}, {_device_name()}{across}", flush=True)
    results, failed = [], set()
    for batch, seq in points:
        args.seq = seq
        point = f"{key} {batch if key == 'batch' else seq}"
        for impl in args.impls.split(","):
            if impl in failed:
                continue
            skip = liger_skip_reason(model_type) if impl.partition("+")[0] == "liger" else None
            r = (dict(impl=impl, batch=batch, seq=seq, error=f"skipped: {skip}") if skip else
                 run_or_oom(impl, model_type, shape_kwargs, state, args, batch))
            results.append(r)
            save(args, n_params, results)
            if "error" in r:
                failed.add(impl)
                print(f"{impl:6s} {point}: {r['error']}", flush=True)
                continue
            print(f"{impl:6s} {point}: {r['tokens_per_s']:9.0f} tokens/s, {r['step_s'] * 1e3:7.1f} ms/step, "
                  f"peak {r['peak_gib']:6.2f} GiB, (fwd+bwd {r['peak_fwd_bwd_gib']:.2f}, optimizer step "
                  f"{r['peak_optimizer_gib']:.2f}), losses {' '.join(f'{x:.4f}' for x in r['losses'][:6])}", flush=True)
            if r["report"] and (batch, seq) == points[0]:
                print(r["report"])
        here = [r for r in results if (r["batch"], r.get("seq", seq)) == (batch, seq)]
        base = next((r for r in here if r["impl"] == "hf" and "error" not in r), None)
        for r in here:
            if base and r["impl"] != "hf" and "error" not in r:
                memory = f"{100 * r['peak_gib'] / base['peak_gib']:.0f}%" if base["peak_gib"] else "n/a"
                print(f"  {r['impl']} / hf at {point}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
                      f"{memory} of the peak memory; first losses {_losses(base)} vs {_losses(r)} "
                      f"(largest relative difference {first_loss_difference(base, r):.1e})")
    save(args, n_params, results, final=True)
    print_table(results, key)


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
            name = f"train_{args.shape}" + sweep_name(args)
            path = os.path.join(tmp, f"{name}.json")
            child = json.load(open(path)) if os.path.exists(path) else {}
        n_params, device = child.get("params", n_params), child.get("device", device)
        rows = child.get("results", [])
        results += rows
        if proc.returncode != 0:
            done = {(r["batch"], r.get("seq", args.seq)) for r in rows}
            nxt = [p for p in sweep_points(args) if p not in done][:1]
            died = f"process died (exit code {proc.returncode})"
            results += [dict(impl=impl, batch=b, seq=t, error=died) for b, t in nxt]
        save(args, n_params or 0, results, device=device or "unknown GPU")
    save(args, n_params or 0, results, final=True, device=device or "unknown GPU")
    print_table(results, swept(args))


def merge_sweeps(args):
    """The rows of several sweep JSONs of one shape, in the order given, saved as one sweep."""
    parts = [json.load(open(path)) for path in args.merge]
    shapes = {part["shape"] for part in parts}
    if len(shapes) != 1:
        raise SystemExit(f"--merge: the JSONs are of different shapes {sorted(shapes)}")
    args.shape = shapes.pop()
    args.seq = parts[0]["args"]["seq"]
    args.dtype = parts[0]["args"].get("dtype", "bfloat16")
    args.parallel = parts[0]["args"].get("parallel", "none")
    args.seqs = parts[0]["args"].get("seqs")
    args.batch = parts[0]["args"]["batch"]
    key = swept(args)
    if key == "seq":
        args.seqs = sorted({r["seq"] for part in parts for r in part["results"]})
    else:
        args.batches = sorted({r["batch"] for part in parts for r in part["results"]})
    results = [r for part in parts for r in part["results"]]
    save(args, parts[0]["params"], results, final=True, device=parts[0]["device"])
    print_table(results, key)


def swept(args) -> str:
    """The row key a sweep varies: "seq" with --seqs, else "batch"."""
    return "seq" if getattr(args, "seqs", None) else "batch"


def sweep_points(args) -> list[tuple[int, int]]:
    """(batch, seq) of each point of the run, in order."""
    if getattr(args, "seqs", None):
        return [(args.batch, seq) for seq in args.seqs]
    return [(batch, args.seq) for batch in args.batches or [args.batch]]


def sweep_name(args) -> str:
    return {"seq": "_seq_sweep", "batch": "_batch_sweep" if args.batches else ""}[swept(args)]


FIRST_LOSSES = 3  # the losses printed side by side: the same weights and batches give the same first losses


def _losses(r):
    return ", ".join(f"{x:.4f}" for x in r["losses"][:FIRST_LOSSES])


def first_loss_difference(base, r):
    """The largest relative difference between the first losses of two runs."""
    pairs = list(zip(base["losses"][:FIRST_LOSSES], r["losses"][:FIRST_LOSSES]))
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)


def first_losses(results, key="batch"):
    """{implementation: {batch (or seq, ``key``): its first FIRST_LOSSES losses}} of the runs that trained."""
    out = {}
    for r in results:
        if r.get("losses"):
            out.setdefault(r["impl"], {})[str(r[key])] = r["losses"][:FIRST_LOSSES]
    return out


def print_table(results, key="batch"):
    """tokens/s / peak GiB per batch or sequence length (``key``; rows) and implementation
    (columns), as markdown, then each implementation's first losses."""
    impls = list(dict.fromkeys(r["impl"] for r in results))
    print("tokens/s (every token of input_ids) / peak GiB:")
    print(f"| {key} | " + " | ".join(impls) + " |")
    print("|---" * (len(impls) + 1) + "|")
    for batch in sorted({r[key] for r in results}):
        cells = []
        for impl in impls:
            r = next((r for r in results if r["impl"] == impl and r[key] == batch), None)
            cells.append("" if r is None else r["error"] if "error" in r else
                         f"{r['tokens_per_s']:,.0f} / {r['peak_gib']:.1f}")
        print(f"| {batch} | " + " | ".join(cells) + " |")
    losses = first_losses(results, key)
    if losses:
        print(f"\nfirst {FIRST_LOSSES} losses:")
        print(f"| {key} | " + " | ".join(impls) + " |")
        print("|---" * (len(impls) + 1) + "|")
        for batch in sorted({r[key] for r in results}):
            cells = [", ".join(f"{x:.4f}" for x in losses.get(impl, {}).get(str(batch), [])) for impl in impls]
            print(f"| {batch} | " + " | ".join(cells) + " |")


def save(args, n_params, results, final=False, device=None):
    """The JSON after every run (a cut-off sweep keeps what it measured), and the plot at the end.
    ``device``: the GPU's name when this process has not touched CUDA (--isolate's parent)."""
    rank, world = rank_and_world()
    if not args.out or rank != 0:
        return
    device = device or _device_name()
    os.makedirs(args.out, exist_ok=True)
    parallel = getattr(args, "parallel", "none")
    world = max([world] + [r.get("world", 1) for r in results])  # --merge: the runs' world
    name = (f"train_{args.shape}" + (f"_{parallel}x{world}" if parallel != "none" else "")
            + sweep_name(args))
    key = swept(args)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(shape=args.shape, params=n_params, args=vars(args), device=device,
                       torch=torch.__version__, first_losses=first_losses(results, key), results=results), f, indent=1)
    if (args.batches or key == "seq") and final:
        dtype = {"float32": "fp32"}.get(getattr(args, "dtype", None), "bf16")
        fixed = f"batch {args.batch}" if key == "seq" else f"seq {args.seq}"
        plot_sweep(results, os.path.join(args.out, f"{name}.png"),
                   f"{args.shape} ({n_params / 1e9:.2f}B), {fixed}, {dtype}, AdamW, checkpointing "
                   f"{getattr(args, 'checkpointing', 'all')}, "
                   f"{device}" + (f"; {parallel} over {world} GPUs, per GPU" if parallel != "none" else ""), key=key)


if __name__ == "__main__":
    main()
