"""The ``tigon`` command: ``tigon env``, ``tigon demo``, ``tigon bench``, ``tigon plan``, ``tigon --version``.

Without a CUDA GPU, tigon's Triton kernels can only run in Triton's interpreter, which Triton
reads from TRITON_INTERPRET when it is first imported; the console script (``tigon_cli``) sets
it before tigon, and so triton, is imported.
"""

from __future__ import annotations

import argparse
import platform
import sys


def _cuda_available() -> bool:
    import torch  # does not import triton

    return torch.cuda.is_available()


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_report() -> str:
    cuda = _cuda_available()
    import torch
    import triton

    from tigon.ops._common import interpreter_enabled

    lines = [f"python        {platform.python_version()} ({sys.executable})"]
    for name in ("tigon", "torch", "triton", "transformers", "trl", "peft", "liger-kernel", "cut-cross-entropy",
                 "matplotlib"):
        lines.append(f"{name:13s} {_version(name) or 'not installed'}")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU           {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                     f"{props.major}.{props.minor}, {torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}")
    else:
        lines.append("GPU           none visible to torch")
    if interpreter_enabled():
        lines.append("kernels       interpreted by Triton on the CPU (TRITON_INTERPRET=1): correct, slow; "
                     "for tests and the CPU demo")
    elif cuda:
        lines.append(f"kernels       compiled by Triton {triton.__version__} for the GPU")
    else:
        lines.append("kernels       cannot run: no GPU and Triton's interpreter is off (set TRITON_INTERPRET=1 "
                     "before importing tigon)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from tigon import __version__
    from tigon.bench.ops import OP_NAMES, unknown_op_error

    parser = argparse.ArgumentParser(prog="tigon", description="Fused Triton kernels for LLM training.")
    parser.add_argument("--version", action="version", version=f"tigon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="versions, GPU, and whether kernels run compiled or interpreted")
    demo = sub.add_parser("demo", help="fine-tune a small Llama-style model with plain HF and with tigon, and compare")
    demo.add_argument("--steps", type=int, help="optimizer steps per run (default: 300 on a GPU, 12 on the CPU)")
    demo.add_argument("--quick", action="store_true", help="a few steps only (a smoke test)")
    demo.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    demo.add_argument("--out", default="tigon_demo", help="folder for demo.json and loss_curves.png")
    demo.add_argument("--no-progress", action="store_true")
    bench = sub.add_parser("bench", help="time and memory of every op vs torch eager / compile / Liger / CCE (GPU)")
    bench.add_argument("ops", nargs="*", metavar="op", help=f"ops to measure (default: all): {', '.join(OP_NAMES)}")
    bench.add_argument("--quick", action="store_true", help="one size per op")
    bench.add_argument("--out", default="tigon_bench", help="folder for ops.json, ops.csv, ops.md and the plots")
    bench.add_argument("--verbose", action="store_true", help="print every implementation's result as it comes")
    bench.add_argument("--memory-timeline", action="store_true",
                       help="instead of the ops: one training step's memory over time, HF vs tigon, with the "
                            "planner's prediction (PNG)")
    bench.add_argument("--model", default="llama-1b",
                       help="--memory-timeline's model: a shape name, a config folder or a hub id (default llama-1b)")
    bench.add_argument("--batch", type=int, default=8, help="--memory-timeline's batch size (default 8)")
    bench.add_argument("--seq", type=int, default=1024, help="--memory-timeline's sequence length (default 1024)")
    plan = sub.add_parser("plan", help="predict a training step's peak memory from a config; recommend batch size "
                                       "and activation checkpointing for a GPU")
    plan.add_argument("model", help="a hub id, a folder with config.json, a config.json, or a shape name "
                                    "(llama-1b, qwen2.5-0.5b, gemma2-2b, llama-8b, ...)")
    plan.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    plan.add_argument("--batch", type=int, help="sequences per step (default: the recommended batch)")
    plan.add_argument("--gpu-memory", help="the GPU's memory, e.g. 80GiB (default: this machine's GPU, else 80GiB)")
    plan.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "sgd"])
    plan.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and activations")
    plan.add_argument("--checkpointing", help="predict with this checkpointing: none, all, or a number of layers "
                                              "(default: the recommended one)")
    plan.add_argument("--no-tigon", action="store_true", help="plain HF only")
    plan.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)

    if args.command == "env":
        print(env_report())
        return 0
    if args.command == "plan":
        return _plan(args, plan)
    if args.command == "bench" and not args.memory_timeline:
        error = unknown_op_error(args.ops)
        if error:  # before the GPU check: a typo is reported on any machine
            bench.error(f"argument op: {error}")
    cuda = _cuda_available()
    if args.command == "demo":
        if args.device == "cuda" and not cuda:
            parser.error("--device cuda: torch sees no CUDA GPU")
        from tigon.demo import run_demo

        run_demo(args.out, steps=args.steps, quick=args.quick, device=args.device, progress=not args.no_progress)
        return 0
    if args.command == "bench":
        if not cuda:
            print("tigon bench measures GPU kernels: torch sees no CUDA GPU here (`tigon demo` runs on the CPU).",
                  file=sys.stderr)
            return 2
        if args.memory_timeline:
            from tigon.bench.memory_timeline import run as run_timeline

            run_timeline(args.model, args.batch, args.seq, args.out)
            print(f"wrote {args.out}/memory_timeline.png and memory_timeline.json")
            return 0
        from tigon.bench.ops import run

        run(args.ops or None, args.quick, args.out, args.verbose)
        return 0
    return 2


def _plan(args, parser) -> int:
    import json

    import torch

    from tigon.planner import default_gpu_memory, parse_bytes, plan

    for name in ("seq", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"argument --{name}: must be a positive integer, got {value}")
    checkpointing = args.checkpointing
    if checkpointing is not None and checkpointing not in ("none", "all"):
        if not checkpointing.isdigit():
            parser.error(f"argument --checkpointing: 'none', 'all' or a number of layers, got {checkpointing!r}")
        checkpointing = int(checkpointing)
    if args.gpu_memory is not None:
        try:
            gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
        except (TypeError, ValueError) as exc:
            parser.error(f"argument --gpu-memory: {exc}")
    else:
        gpu_memory = default_gpu_memory() or parse_bytes("80GiB")
    progress = _trace_progress()
    result = plan(args.model, args.seq, batch=args.batch, gpu_memory=gpu_memory, optimizer=args.optimizer,
                  tigon=not args.no_tigon, dtype=getattr(torch, args.dtype), checkpointing=checkpointing,
                  progress=progress)
    progress.close()
    print(result.report())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _trace_progress():
    """A callable counting traced steps on stderr (tqdm when installed), with close()."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():
        class _Silent:
            def __call__(self):
                pass

            def close(self):
                pass

        return _Silent()
    bar = tqdm(desc="tracing training steps on the meta device", unit="step", leave=False)

    class _Bar:
        def __call__(self):
            bar.update(1)

        def close(self):
            bar.close()

    return _Bar()


if __name__ == "__main__":
    sys.exit(main())
