"""The ``tigon`` command: ``tigon env``, ``tigon demo``, ``tigon bench``, ``tigon plan``, ``tigon doctor``,
``tigon --version``.

Without a CUDA GPU, tigon's Triton kernels can only run in Triton's interpreter; importing tigon
turns it on there (tigon.ambient.interpret_kernels_without_gpu) unless TRITON_INTERPRET is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tigon.extras import MissingExtra, require_extra


def _cuda_available() -> bool:
    import torch  # does not import triton

    return torch.cuda.is_available()


def env_report() -> str:
    """``tigon env``: tigon.doctor.environment() (the one owner of these facts) as lines."""
    from tigon.doctor import environment

    env = environment()
    lines = [f"python        {env['python']} ({env['executable']})"]
    versions = {name: env[name] for name in ("tigon", "torch", "triton", "transformers")} | env["packages"]
    lines += [f"{name:13s} {version or 'not installed'}" for name, version in versions.items()]
    if env["gpu"]:
        lines.append(f"GPU           {env['gpu']}, {env['gpu_memory_gib']:.0f} GiB, compute capability "
                     f"{env['capability']}, {env['gpus']} device(s), CUDA {env['cuda']}")
    else:
        lines.append("GPU           none visible to torch")
    lines.append({
        "interpreted": "kernels       interpreted by Triton on the CPU (TRITON_INTERPRET=1): correct, slow; "
                       "for tests and the CPU demo",
        "compiled": f"kernels       compiled by Triton {env['triton']} for the GPU",
        "cannot run": "kernels       cannot run: no GPU and Triton's interpreter is off (TRITON_INTERPRET=0; "
                      "unset it, or set it to 1)",
    }[env["kernels"]])
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr ("tigon plan: error: argument --seq: ..."),
    without the usage block; exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class BadArgument(Exception):
    """A command-line argument found bad after parsing (a model that gives no config, options
    that do not go together): main reports it as argparse reports a bad value, exit status 2."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"argument {argument}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _memory_size(text: str) -> int:
    from tigon.sizes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 80GiB, 80GB or 85899345920 (bytes), "
                                         f"got {text!r}") from None


def _checkpointing(text: str):
    if text in ("none", "all"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"'none', 'all' or a number of layers (0 or more), got {text!r}")
    return value


def _writable(folder: str) -> bool:
    """Whether ``folder`` (or, where it does not exist yet, its nearest existing parent) takes new files."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def _output_folder(text: str) -> str:
    """A folder to write into (created when missing), checked before any work is done."""
    if not text:
        raise argparse.ArgumentTypeError("give a folder (created when missing)")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file; give a folder (created when missing)")
    if not _writable(text):
        raise argparse.ArgumentTypeError(f"cannot create or write files in {text}")
    return text


def _output_file(text: str) -> str:
    """A file to write, checked before any work is done: its folder exists and takes files."""
    folder = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"give a file to write, got the folder {text!r}" if text else
                                         "give a file to write")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}")
    return text


def _model_config(name: str, argument: str):
    """The causal LM config ``name`` gives (tigon.planning.load_config); BadArgument otherwise."""
    from tigon.planning.model_config import ConfigError, check_causal_lm, load_config

    try:
        config = load_config(name)
        check_causal_lm(config)
    except ConfigError as exc:
        raise BadArgument(argument, str(exc)) from None
    return config


# What `tigon bench --memory-timeline` runs without --model, --batch, --seq.
TIMELINE_DEFAULTS = dict(model="llama-1b", batch=8, seq=1024)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``tigon`` parser and its subcommands' parsers by name."""
    from tigon import __version__
    from tigon.bench.ops import OP_NAMES

    parser = _Parser(prog="tigon", description="Fused Triton kernels for LLM training.")
    parser.add_argument("--version", action="version", version=f"tigon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="versions, GPU, and whether kernels run compiled or interpreted")
    demo = sub.add_parser("demo", help="fine-tune a small Llama-style model with plain HF and with tigon, and compare")
    demo.add_argument("--steps", type=_positive_int,
                      help="optimizer steps per run (default: 300 on a GPU, 12 on the CPU)")
    demo.add_argument("--quick", action="store_true", help="a few steps only (a smoke test)")
    demo.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    demo.add_argument("--out", type=_output_folder, default="tigon_demo",
                      help="folder for demo.json and loss_curves.png")
    demo.add_argument("--no-progress", action="store_true")
    bench = sub.add_parser("bench", help="time and memory of every op vs torch eager / compile / Liger / CCE (GPU)")
    bench.add_argument("ops", nargs="*", metavar="op", help=f"ops to measure (default: all): {', '.join(OP_NAMES)}")
    bench.add_argument("--quick", action="store_true", help="one size per op")
    bench.add_argument("--out", type=_output_folder, default="tigon_bench",
                       help="folder for ops.json, ops.csv, ops.md and the plots")
    bench.add_argument("--verbose", action="store_true", help="print every implementation's result as it comes")
    bench.add_argument("--memory-timeline", action="store_true",
                       help="instead of the ops: one training step's memory over time, HF vs tigon, with the "
                            "planner's prediction (PNG)")
    bench.add_argument("--host", action="store_true",
                       help="instead of the ops' GPU time: host microseconds and kernel launches per fwd+bwd call "
                            "at launch-bound sizes, tigon vs tigon through torch's dispatcher vs Liger vs torch "
                            "(host.md, host.json)")
    bench.add_argument("--model", help="--memory-timeline's model: a shape name, a config folder or a hub id "
                                       f"(default {TIMELINE_DEFAULTS['model']})")
    bench.add_argument("--batch", type=_positive_int,
                       help=f"--memory-timeline's batch size (default {TIMELINE_DEFAULTS['batch']})")
    bench.add_argument("--seq", type=_positive_int,
                       help=f"--memory-timeline's sequence length (default {TIMELINE_DEFAULTS['seq']})")
    plan = sub.add_parser("plan", help="predict a training step's peak memory from a config; recommend batch size "
                                       "and activation checkpointing for a GPU")
    plan.add_argument("model", help="a hub id (namespace/name), a folder with config.json, a config.json, or a "
                                    "shape name (llama-1b, qwen2.5-0.5b, gemma2-2b, llama-8b, ...)")
    plan.add_argument("--seq", type=_positive_int, required=True, help="tokens per sequence")
    plan.add_argument("--batch", type=_positive_int, help="sequences per step (default: the recommended batch)")
    plan.add_argument("--gpu-memory", type=_memory_size,
                      help="the GPU's memory, e.g. 80GiB (default: this machine's GPU, else 80GiB)")
    plan.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "sgd"])
    plan.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and activations")
    plan.add_argument("--checkpointing", type=_checkpointing,
                      help="predict with this checkpointing: none, all, or a number of layers "
                           "(default: the recommended one)")
    plan.add_argument("--no-tigon", action="store_true", help="plain HF only")
    plan.add_argument("--json", metavar="PATH", type=_output_file, help="also write the numbers as JSON")
    doctor_help = ("check tigon on this machine: every op against float64, its speed vs torch eager and "
                   "torch.compile (GPU), one training step of a tiny model of each family")
    doctor = sub.add_parser("doctor", help=doctor_help, description=doctor_help + "; exit status 0 when all pass")
    doctor.add_argument("--ops", nargs="+", metavar="OP",
                        help=f"ops to check (default: all; 'none': no op): {', '.join(OP_NAMES)}")
    doctor.add_argument("--families", nargs="+", metavar="FAMILY",
                        help="family rows to patch and train a step (names of tigon.FAMILIES; default: all; "
                             "'none': no family)")
    doctor.add_argument("--no-compile", action="store_true",
                        help="time tigon against torch eager only, not torch.compile (saves its compiles)")
    doctor.add_argument("--json", metavar="PATH", type=lambda text: text if text == "-" else _output_file(text),
                        help="also write everything (versions included) as JSON, for bug reports ('-': stdout)")
    doctor.add_argument("--workers", type=_positive_int,
                        help="processes that run the checks side by side (default: half the cores, at most 8, on a "
                             "GPU, where the time is Triton's compiles; 1 in the interpreter)")
    doctor.add_argument("--no-progress", action="store_true")
    return parser, dict(env=env, demo=demo, bench=bench, plan=plan, doctor=doctor)


def main(argv=None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except BadArgument as exc:  # the one place a bad argument found after parsing becomes exit status 2
        commands[args.command].error(str(exc))
    except MissingExtra as exc:  # one line naming the extra to install, not a traceback
        print(f"{commands[args.command].prog}: error: {exc}", file=sys.stderr)
        return 1


def _env(args) -> int:
    print(env_report())
    return 0


def _demo(args) -> int:
    if args.device == "cuda" and not _cuda_available():
        raise BadArgument("--device", "torch sees no CUDA GPU here; use --device cpu, or leave --device out")
    require_extra("demo", "tigon demo")
    from tigon.demo import run_demo

    run_demo(args.out, steps=args.steps, quick=args.quick, device=args.device, progress=not args.no_progress)
    return 0


def _bench(args) -> int:
    from tigon.bench.ops import unknown_op_error

    # Before the GPU check: a typo is reported on any machine.
    if args.host:
        for flag, given in (("op", args.ops), ("--quick", args.quick), ("--memory-timeline", args.memory_timeline),
                            *((f"--{name}", getattr(args, name) is not None) for name in TIMELINE_DEFAULTS)):
            if given:
                raise BadArgument(flag, "does not apply to --host (it measures its own fixed set of ops): drop one "
                                        "or the other")
    elif args.memory_timeline:
        for flag, given in (("op", args.ops), ("--quick", args.quick), ("--verbose", args.verbose)):
            if given:
                raise BadArgument(flag, f"{'op names apply' if flag == 'op' else 'applies'} to the op suite, not "
                                        f"to --memory-timeline: drop one or the other")
        for name, default in TIMELINE_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        _model_config(args.model, "--model")
    else:
        for name in TIMELINE_DEFAULTS:
            if getattr(args, name) is not None:
                raise BadArgument(f"--{name}", "applies only with --memory-timeline: add it, or drop "
                                               f"--{name}")
        error = unknown_op_error(args.ops)
        if error:
            raise BadArgument("op", error)
    if not _cuda_available():
        print("tigon bench measures GPU kernels: torch sees no CUDA GPU here (`tigon demo` runs on the CPU).",
              file=sys.stderr)
        return 2
    if args.host:
        from tigon.bench.host import run as run_host

        run_host(args.out)
        print(f"wrote {args.out}/host.md and host.json")
        return 0
    if args.memory_timeline:
        from tigon.bench.memory_timeline import run as run_timeline

        run_timeline(args.model, args.batch, args.seq, args.out)
        print(f"wrote {args.out}/memory_timeline.png and memory_timeline.json")
        return 0
    from tigon.bench.ops import run

    run(args.ops or None, args.quick, args.out, args.verbose)
    return 0


def _plan(args) -> int:
    import json

    import torch

    require_extra("hf", "tigon plan")
    from tigon.planning import default_gpu_memory, plan
    from tigon.sizes import parse_bytes

    config = _model_config(args.model, "model")
    gpu_memory = args.gpu_memory or default_gpu_memory() or parse_bytes("80GiB")
    progress = _trace_progress(searching=args.batch is None)
    result = plan(config, args.seq, batch=args.batch, gpu_memory=gpu_memory, optimizer=args.optimizer,
                  tigon=not args.no_tigon, dtype=getattr(torch, args.dtype), checkpointing=args.checkpointing,
                  progress=progress)
    progress.close()
    print(result.report())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _doctor(args) -> int:
    from tigon import doctor
    from tigon.bench.cases import OP_NAMES
    from tigon.patching import FAMILIES

    # Before any work: a typo is reported at once, as argparse reports a bad value.
    for flag, names, known, what in (("--ops", args.ops, OP_NAMES, "op"),
                                     ("--families", args.families, FAMILIES, "family")):
        try:
            doctor.choose(names, list(known), what)
        except ValueError as exc:
            raise BadArgument(flag, str(exc)) from None
    try:
        return doctor.main(args.ops, args.families, compile=not args.no_compile, json_path=args.json,
                           progress=not args.no_progress, workers=args.workers)
    except doctor.CannotRun as exc:
        print(f"tigon doctor: {exc}", file=sys.stderr)
        return 2


_COMMANDS = dict(env=_env, demo=_demo, bench=_bench, plan=_plan, doctor=_doctor)


def _trace_progress(searching: bool):
    """A callable counting traced steps on stderr, with close(): a tqdm bar on a terminal, else
    (piped, logged) a line when tracing starts and one every PROGRESS_EVERY_S seconds."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(desc="tracing training steps on the meta device", unit="step", leave=False)

        class _Bar:
            def __call__(self):
                bar.update(1)

            def close(self):
                bar.close()

        return _Bar()
    return _ProgressLines(searching)


PROGRESS_EVERY_S = 10.0


class _ProgressLines:
    def __init__(self, searching: bool):
        self.steps, self.start = 0, time.monotonic()
        self.last = self.start
        what = "searching batch sizes and checkpointing" if searching else "predicting the step"
        print(f"tigon plan: {what}: tracing training steps on the meta device (a second or so each)...",
              file=sys.stderr, flush=True)

    def __call__(self):
        self.steps += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"tigon plan: {self._steps()} traced ({now - self.start:.0f} s)", file=sys.stderr, flush=True)

    def close(self):
        print(f"tigon plan: {self._steps()} traced in {time.monotonic() - self.start:.0f} s", file=sys.stderr,
              flush=True)

    def _steps(self) -> str:
        return f"{self.steps} step{'' if self.steps == 1 else 's'}"


if __name__ == "__main__":
    sys.exit(main())
