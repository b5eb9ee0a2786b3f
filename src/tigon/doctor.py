"""``tigon doctor``: whether tigon's kernels are correct, and how fast, on the machine at hand.

Four parts, each reported as a table, then a one-line verdict:

1. The environment: python, torch, triton, transformers, CUDA, the GPU and its capability, and
   whether the kernels run compiled for the GPU or in Triton's interpreter on the CPU.
2. Every op of the suite (``tigon.bench.cases.OP_NAMES``) forward and backward at two small
   shapes (the second odd-sized) against a float64 run of its ``tigon.reference`` formula: the
   largest relative error (Frobenius) over its outputs and input gradients, under random
   cotangents, must be within the op's tolerance (the test suite's). Outputs are NaN-poisoned
   before the kernels write them; NaN or inf never passes. On a GPU in bf16 (what training runs
   in), in the interpreter in fp32 (bf16 there is emulated, slower, and rounded otherwise than
   the GPU rounds).
3. On a GPU only: fwd+bwd time of tigon against torch eager (the reference formula in the inputs'
   dtype, as ``tigon bench`` times it: its cases, ``tigon.bench.layer_cases`` /
   ``loss_cases``) and against torch.compile of that, as speed ratios, at the first shape (the
   compile happens there once). Measured, never a pass/fail.
4. A tiny random model of each family row (``tigon.tiny_models``) patched with ``tigon.patch``
   takes one training step next to HF's own model with the same weights and batch: the loss and
   all gradients of the patched model must be as close to HF's as HF's own run is to an exact one
   (float64; fp32 for bf16 runs) times SPREAD_FACTOR, never held tighter than FLOOR[dtype]; every
   gradient finite, none missing, and the row's pieces patched.

``run(...)`` returns the whole result as a dict (what ``--json`` writes); ``main`` is the command.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import inspect
import json
import math
import multiprocessing
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

import tigon.nn
from tigon import __version__, reference, tiny_models
from tigon import functional as TF
from tigon.api import patch
from tigon.bench import layer_cases, loss_cases
from tigon.bench.cases import OP_NAMES
from tigon.bench.harness import Row, gpu_ms, measure
from tigon.extras import installed_version
from tigon.ops import _common
from tigon.ops._common import interpreter_enabled
from tigon.patching import FAMILIES, unpatch

# ---- the environment ----


# The optional packages whose versions the environment lists (the peers tigon is compared with).
OPTIONAL_PACKAGES = ("trl", "peft", "liger-kernel", "cut-cross-entropy", "matplotlib")


def environment() -> dict:
    """The versions and the device: python, tigon, torch, triton, transformers, CUDA, the GPU (name,
    compute capability, memory, count), where the kernels run, and the optional packages'
    versions (``packages``; None: not installed). ``tigon env`` prints the same facts."""
    import triton

    facts = {"python": platform.python_version(), "platform": platform.platform(), "tigon": __version__,
             "torch": torch.__version__, "triton": triton.__version__,
             "transformers": installed_version("transformers"), "cuda": torch.version.cuda, "gpu": None,
             "capability": None, "gpu_memory_gib": None, "gpus": 0, "executable": sys.executable,
             "packages": {name: installed_version(name) for name in OPTIONAL_PACKAGES}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    if interpreter_enabled():
        facts["kernels"] = "interpreted"  # Triton's interpreter, on the CPU
    elif facts["gpu"]:
        facts["kernels"] = "compiled"
    else:
        facts["kernels"] = "cannot run"
    return facts


# ---- the op checks ----

# Relative error bounds against float64 (tests/helpers.py's TOL and each op's test's own).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2}
MATMUL_TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}  # fp32 matmuls may run in tf32 on the GPU


@dataclass(frozen=True)
class OpCheck:
    """How one op of OP_NAMES is checked: ``inputs(shape, dtype, device, gen)`` makes its inputs
    (the tensors that want gradients require them), ``ours(*inputs)`` runs tigon, ``ref(*inputs)``
    the float64 reference; ``shapes[device kind]``: (the timed shape, an odd one); ``bench(shape)``:
    ``tigon bench``'s cases at a shape (GPU timing); ``label(shape)``: the shape as printed;
    ``tol``: the tolerance by dtype (default TOL)."""

    inputs: Callable
    ours: Callable
    ref: Callable
    shapes: dict
    bench: Callable
    tol: dict | None = None
    label: Callable = lambda shape: "x".join(map(str, shape))
    args: tuple[str, ...] | None = None  # the inputs' names (default: the reference function's parameters')


def _randn(gen, shape, dtype, device, scale=1.0, shift=0.0, grad=True):
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(scale).add_(shift).to(dtype)
    return t.requires_grad_(grad)


def _norm_inputs(kind):
    def make(shape, dtype, device, gen):
        n = shape[-1]
        x = _randn(gen, shape, dtype, device, shift=2.0 if kind == "layer" else 0.0)
        w = _randn(gen, (n,), dtype, device, scale=0.1, shift=1.0)
        if kind == "rms":
            return [x, w]
        if kind == "add":
            return [x, _randn(gen, shape, dtype, device), w]
        return [x, w, _randn(gen, (n,), dtype, device, scale=0.1)]
    return make


def _dyt_inputs(shape, dtype, device, gen):
    n = shape[-1]
    return [_randn(gen, shape, dtype, device), _randn(gen, (1,), dtype, device, scale=0.0, shift=0.5),
            _randn(gen, (n,), dtype, device, scale=0.1, shift=1.0), _randn(gen, (n,), dtype, device, scale=0.1)]


def _poly_inputs(shape, dtype, device, gen):
    return [_randn(gen, shape, dtype, device), _randn(gen, (3,), dtype, device, scale=0.1, shift=1 / 3),
            _randn(gen, (1,), dtype, device, scale=0.1)]


def _group_norm_inputs(shape, dtype, device, gen):
    n, c, side, groups = shape
    return [_randn(gen, (n, c, side, side), dtype, device, shift=1.0),
            _randn(gen, (c,), dtype, device, scale=0.1, shift=1.0), _randn(gen, (c,), dtype, device, scale=0.1), groups]


def _rows_inputs(count, scale=2.0):
    """``count`` tensors of the shape, the first (an activation's input) scaled by ``scale``."""
    def make(shape, dtype, device, gen):
        return [_randn(gen, shape, dtype, device, scale=scale)] + [_randn(gen, shape, dtype, device)
                                                                   for _ in range(count - 1)]
    return make


def _rope_inputs(shape, dtype, device, gen):
    batch, hq, hk, tokens, dim = shape
    # HF's layout: [B, T, H*D] projections viewed and transposed to [B, H, T, D].
    q = _randn(gen, (batch, tokens, hq, dim), dtype, device, grad=False).transpose(1, 2).requires_grad_()
    k = _randn(gen, (batch, tokens, hk, dim), dtype, device, grad=False).transpose(1, 2).requires_grad_()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    freqs = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)[None]
    return [q, k, emb.cos().to(dtype), emb.sin().to(dtype)]


_MLP_LAYERS = {"glu": ("gate_proj", "up_proj", "down_proj"), "relu2": ("up_proj", "down_proj")}
_MLP_ARGS = {kind: ("x", *(f"{layer}.weight" for layer in layers)) for kind, layers in _MLP_LAYERS.items()}


def _mlp_inputs(kind):
    """x [tokens..., H] and the MLP's weights as nn.Parameters (gate [I, H], up [I, H], down [H, I])."""
    def make(shape, dtype, device, gen):
        *tokens, hidden, inter = shape
        x = _randn(gen, (*tokens, hidden), dtype, device)
        shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        scales = {"gate_proj": 2 * hidden**-0.5, "up_proj": hidden**-0.5, "down_proj": inter**-0.5}
        return [x, *(torch.nn.Parameter(_randn(gen, shapes[name], dtype, device, scale=scales[name], grad=False))
                     for name in _MLP_LAYERS[kind])]
    return make


def _mlp_module(cls, kind, params, **kwargs):
    """A tigon MLP module whose layers' weights are ``params`` themselves (built on the meta device,
    then given them), so that gradients reach them, a recomputing backward included."""
    hidden, inter = params[-1].shape
    with torch.device("meta"):
        module = cls(hidden, inter, **kwargs) if kind == "relu2" else cls(hidden_size=hidden, intermediate_size=inter,
                                                                           **kwargs)
    for name, p in zip(_MLP_LAYERS[kind], params):
        getattr(module, name).weight = p
    return module


def _mlp(cls_name, kind, **kwargs):
    def call(x, *params):

        return _mlp_module(getattr(tigon.nn, cls_name), kind, params, **kwargs)(x)
    return call


def _targets(gen, rows, vocab, device):
    t = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    t[::3] = -100  # some rows ignored
    return t


def _ce_inputs(shape, dtype, device, gen):
    rows, vocab = shape
    return [_randn(gen, shape, dtype, device, scale=3.0), _targets(gen, rows, vocab, device)]


def _vocab_parallel_inputs(shape, dtype, device, gen):
    """One rank's shard of ``width`` ids from ``start`` (no process group: this process is the rank):
    the logits, the global targets, the same local to the shard, and start."""
    rows, width, start = shape
    local = _targets(gen, rows, width, device)
    return [_randn(gen, (rows, width), dtype, device, scale=3.0), torch.where(local == -100, local, local + start),
            local, start]


def _flce_inputs(shape, dtype, device, gen):
    rows, hidden, vocab = shape
    return [_randn(gen, (rows, hidden), dtype, device), _randn(gen, (vocab, hidden), dtype, device,
                                                               scale=hidden**-0.5), _targets(gen, rows, vocab, device)]


def _distribution_inputs(log_first):
    def make(shape, dtype, device, gen):
        a, b = (_randn(gen, shape, torch.float32, device, scale=2.0, grad=False) for _ in range(2))
        first = torch.log_softmax(a, -1) if log_first else torch.softmax(a, -1)
        return [first.to(dtype).requires_grad_(), torch.softmax(b, -1).to(dtype).requires_grad_()]
    return make


def _moe_inputs(shape, dtype, device, gen):
    tokens, experts, top_k, hidden, inter = shape
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    index = scores.argsort(-1)[:, :top_k]  # distinct experts per token, as a router's top-k
    weights = torch.rand(tokens, top_k, generator=gen, device=device).to(dtype).requires_grad_()
    return [_randn(gen, (tokens, hidden), dtype, device), index, weights,
            _randn(gen, (experts, 2 * inter, hidden), dtype, device, scale=hidden**-0.5),
            _randn(gen, (experts, hidden, inter), dtype, device, scale=inter**-0.5)]


def _bench(builder_name, *args, **kwargs):
    """shape -> ``tigon.bench``'s cases at that shape (``builder(shapes, *args)``; no Liger)."""
    def cases(shape):

        builder = getattr(layer_cases, builder_name, None) or getattr(loss_cases, builder_name)
        return builder([shape], *args, **kwargs)
    return cases


def _functional(name, **kwargs):
    def call(*args):

        return getattr(TF, name)(*args, **kwargs)
    return call


def _reference(name, *fixed, **kwargs):

    def call(*args):
        return getattr(reference, name)(*args, *fixed, **kwargs)

    call.args = tuple(inspect.signature(getattr(reference, name)).parameters)
    return call


ROW_SHAPES = {"cpu": [(8, 64), (3, 5, 37)], "gpu": [(4096, 4096), (3, 333, 1001)]}
WIDE_ROWS = {"cpu": [(8, 64), (5, 37)], "gpu": [(4096, 8192), (333, 1001)]}
MLP_SHAPES = {"cpu": [(16, 24, 40), (2, 5, 24, 40)], "gpu": [(4096, 2048, 5632), (1, 333, 1000, 2752)]}
LOGIT_SHAPES = {"cpu": [(8, 300), (9, 1001)], "gpu": [(4096, 32000), (333, 50257)]}


def _op_checks() -> dict[str, OpCheck]:
    return {
        "rms_norm": OpCheck(_norm_inputs("rms"), _functional("rms_norm"), _reference("rms_norm_ref"), ROW_SHAPES,
                            _bench("norm_cases", None)),
        "layer_norm": OpCheck(_norm_inputs("layer"), _functional("layer_norm"), _reference("layer_norm_ref"),
                              ROW_SHAPES, _bench("norm_cases", None)),
        "fused_add_rms_norm": OpCheck(_norm_inputs("add"), _functional("fused_add_rms_norm"),
                                      _reference("fused_add_rms_norm_ref"), ROW_SHAPES, _bench("norm_cases", None)),
        "group_norm": OpCheck(_group_norm_inputs, lambda x, w, b, g: _functional("group_norm")(x, g, w, b),
                              lambda x, w, b, g: _reference("group_norm_ref")(x, g, w, b),
                              {"cpu": [(2, 8, 4, 4), (3, 10, 5, 5)], "gpu": [(8, 512, 32, 32), (3, 96, 17, 6)]},
                              _bench("group_norm_cases", None),
                              label=lambda s: f"N{s[0]} C{s[1]} {s[2]}x{s[2]} G{s[3]}", args=("x", "weight", "bias")),
        "dyt": OpCheck(_dyt_inputs, _functional("dyt"), _reference("dyt_ref"), ROW_SHAPES,
                       _bench("dyt_poly_norm_cases", None)),
        "poly_norm": OpCheck(_poly_inputs, _functional("poly_norm"), _reference("poly_norm_ref"), ROW_SHAPES,
                             _bench("dyt_poly_norm_cases", None), tol={torch.float32: 1e-5, torch.bfloat16: 3e-2}),
        "swiglu": OpCheck(_rows_inputs(2), _functional("swiglu"), _reference("glu_ref", "silu"), WIDE_ROWS,
                          _bench("glu_cases", None)),
        "geglu": OpCheck(_rows_inputs(2), _functional("geglu"), _reference("glu_ref", "gelu_tanh"), WIDE_ROWS,
                         _bench("glu_cases", None)),
        "rope": OpCheck(_rope_inputs, _functional("apply_rotary_pos_emb"), _reference("rope_ref"),
                        {"cpu": [(1, 4, 2, 8, 16), (2, 3, 1, 7, 10)], "gpu": [(4, 32, 8, 1024, 128),
                                                                           (1, 5, 1, 333, 64)]},
                        _bench("rope_cases", None), label=lambda s: f"B{s[0]} Hq{s[1]} Hk{s[2]} T{s[3]} D{s[4]}"),
        "swiglu_mlp": OpCheck(_mlp_inputs("glu"), _mlp("TigonSwiGLUMLP", "glu"), _reference("glu_mlp_ref"),
                              MLP_SHAPES, _bench("mlp_cases", None), tol=MATMUL_TOL,
                              label=lambda s: f"T{math.prod(s[:-2])} H{s[-2]} I{s[-1]}", args=_MLP_ARGS["glu"]),
        "cross_entropy": OpCheck(_ce_inputs, _functional("cross_entropy"), _reference("cross_entropy_ref"),
                                 LOGIT_SHAPES, _bench("cross_entropy_cases", None, False),
                                 label=lambda s: f"N{s[0]} V{s[1]}"),
        "relu_squared": OpCheck(_rows_inputs(1), _functional("relu_squared"), _reference("relu_squared_ref"),
                                WIDE_ROWS, _bench("relu_squared_cases", None)),
        "relu_squared_mlp": OpCheck(_mlp_inputs("relu2"), _mlp("TigonReLUSquaredMLP", "relu2"),
                                    _reference("relu_squared_mlp_ref"),
                                    {"cpu": MLP_SHAPES["cpu"], "gpu": [(4096, 2048, 8192), (1, 333, 1000, 2000)]},
                                    _bench("relu_squared_mlp_cases"), tol=MATMUL_TOL,
                                    label=lambda s: f"T{math.prod(s[:-2])} H{s[-2]} I{s[-1]}",
                                    args=_MLP_ARGS["relu2"]),
        # [B, T, H] in ceil(T / H) shards of the token axis (the default), as the bench's case.
        "tiled_mlp": OpCheck(_mlp_inputs("glu"), _mlp("TigonTiledSwiGLUMLP", "glu"), _reference("glu_mlp_ref"),
                             {"cpu": [(1, 50, 16, 24), (2, 21, 8, 24)], "gpu": [(1, 8192, 1024, 2816),
                                                                               (2, 3001, 1024, 2816)]},
                             lambda s: _bench("tiled_mlp_cases", None)(s[1:]),
                             tol={torch.float32: 1e-3, torch.bfloat16: 1.5e-2},
                             label=lambda s: f"B{s[0]} T{s[1]} H{s[2]} I{s[3]}, {-(-s[1] // s[2])} shards",
                             args=_MLP_ARGS["glu"]),
        "vocab_parallel_cross_entropy": OpCheck(
            _vocab_parallel_inputs,
            lambda x, target, local, start: _functional("vocab_parallel_cross_entropy", vocab_start=start)(x, target),
            lambda x, target, local, start: _reference("cross_entropy_ref")(x, local),
            {"cpu": [(9, 300, 0), (7, 300, 17)], "gpu": [(4096, 16032, 0), (333, 16032, 64128)]},
            lambda s: _bench("vocab_parallel_ce_cases", None)(s[:2]), label=lambda s: f"N{s[0]} V_r{s[1]} from {s[2]}",
            args=("logits",)),
        "fused_linear_cross_entropy": OpCheck(
            _flce_inputs, _functional("fused_linear_cross_entropy"), _reference("fused_linear_cross_entropy_ref"),
            {"cpu": [(8, 32, 300), (9, 24, 1001)], "gpu": [(4096, 2048, 32000), (333, 1000, 50257)]},
            _bench("flce_cases", None, None, grad_output_variant=False),
            tol={torch.float32: 1e-4, torch.bfloat16: 2e-2}, label=lambda s: f"N{s[0]} H{s[1]} V{s[2]}"),
        "softmax": OpCheck(_rows_inputs(1), _functional("softmax"), _reference("softmax_ref"), WIDE_ROWS,
                           _bench("row_activation_cases", None)),
        "sparsemax": OpCheck(_rows_inputs(1), _functional("sparsemax"), _reference("sparsemax_ref"), WIDE_ROWS,
                             _bench("row_activation_cases", None)),
        "kl_div": OpCheck(_distribution_inputs(True), _functional("kl_div"), _reference("kl_div_ref"), LOGIT_SHAPES,
                          _bench("distribution_loss_cases", None), label=lambda s: f"N{s[0]} V{s[1]}"),
        "tvd": OpCheck(_distribution_inputs(False), _functional("tvd"), _reference("tvd_ref"), LOGIT_SHAPES,
                       _bench("distribution_loss_cases", None), label=lambda s: f"N{s[0]} V{s[1]}"),
        "moe_experts": OpCheck(_moe_inputs, _functional("moe_experts"), _reference("moe_experts_ref"),
                               {"cpu": [(13, 5, 2, 24, 20), (11, 6, 3, 40, 36)],
                                "gpu": [(4096, 64, 8, 2048, 768), (333, 9, 2, 1000, 376)]},
                               lambda s: _bench("moe_cases", None)((*s, torch.bfloat16, False)),
                               tol={torch.float32: 1e-4, torch.bfloat16: 1.2e-2},
                               label=lambda s: f"T{s[0]} E{s[1]} K{s[2]} H{s[3]} I{s[4]}"),
    }


@functools.cache
def op_checks() -> dict[str, OpCheck]:
    """The check of every op of OP_NAMES, in its order (ValueError when one has none)."""

    checks = _op_checks()
    missing = [op for op in OP_NAMES if op not in checks]
    if missing:
        raise ValueError(f"tigon doctor has no check for the ops {missing} of OP_NAMES")
    return {op: checks[op] for op in OP_NAMES}


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _float64_copies(inputs):
    return [t.detach().double().requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]


def _input_grads(outs, inputs, cotangents):
    """The gradients of the inputs that require one (None where unused), under ``cotangents``."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outs, cotangents) if isinstance(o, torch.Tensor) and o.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref| (Frobenius, in float64); inf when out has a NaN or an inf."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return math.inf
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


@contextlib.contextmanager
def _poisoned_outputs():
    """Kernel outputs NaN-filled before the kernels write them (as the tests run): an element a
    kernel forgets shows."""

    before = _common._POISON_OUTPUTS
    _common.set_poison_outputs(True)
    try:
        yield
    finally:
        _common.set_poison_outputs(before)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def check_op(op: str, shape: tuple, dtype: torch.dtype, device: str) -> dict:
    """One op at one shape: outputs and input gradients against float64. Returns the check's row."""
    spec = op_checks()[op]
    tol = (spec.tol or TOL)[dtype]
    row = {"op": op, "shape": spec.label(shape), "dtype": str(dtype).removeprefix("torch."), "max_error": None,
           "worst": None, "tolerance": tol, "passed": False, "error": None, "errors": {}}
    gen = torch.Generator(device=device).manual_seed(_seed(op, shape))
    try:
        inputs = spec.inputs(shape, dtype, device, gen)
        ref_in = _float64_copies(inputs)
        ref_out = _as_tuple(spec.ref(*ref_in))
        cotangents = [torch.randn(r.shape, generator=gen, device=device, dtype=torch.float64) for r in ref_out]
        ref_grads = _input_grads(ref_out, ref_in, cotangents)
    except Exception as exc:  # the doctor's own inputs or reference: reported, the other checks still run
        row["error"] = f"reference failed: {_first_line(exc)}"
        return row
    try:
        with _poisoned_outputs():
            ours_out = _as_tuple(spec.ours(*inputs))
            ours_grads = _input_grads(ours_out, inputs, cotangents)
    except Exception as exc:
        row["error"] = _first_line(exc)
        return row
    names = [f"output {i}" if len(ref_out) > 1 else "output" for i in range(len(ref_out))]
    args = spec.args or getattr(spec.ref, "args", ())
    names += [f"grad of {args[i] if i < len(args) else f'input {i}'}"
              for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    worst, worst_name = 0.0, None
    for name, o, r in zip(names, [*ours_out, *ours_grads], [*ref_out, *ref_grads]):
        if r is None and o is None:
            continue
        if o is None:
            row["error"] = f"{name}: missing"
        elif r is None:
            row["error"] = f"{name}: given, but the reference has none"
        elif o.shape != r.shape:
            row["error"] = f"{name}: shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        if row["error"]:
            return row
        err = row["errors"][name] = relative_error(o, r)
        if not err <= worst:  # NaN-safe: the first non-finite error stays the worst
            worst, worst_name = err, name
    row.update(max_error=worst, worst=worst_name, passed=worst <= tol)
    return row


# ---- timing (GPU) ----

TIMED_IMPLS = ("tigon", "torch eager", "torch.compile")


def time_op(op: str, shape: tuple, compile: bool = True) -> dict:
    """fwd+bwd of tigon, torch eager and (unless ``compile`` is False) torch.compile on ``tigon
    bench``'s case of ``op`` at ``shape``, measured as ``tigon bench`` measures (tigon.bench.harness:
    GPU time by CUDA-graph replay, and the time dispatched eagerly from Python, host included), and
    tigon's speed ratios by GPU time (eager ms / tigon ms, ...)."""
    spec = op_checks()[op]
    row = {"op": op, "shape": spec.label(shape), "dtype": "bfloat16", "ms": {}, "dispatched_ms": {},
           "measure_s": {}, "errors": {}, "vs_eager": None, "vs_compile": None}
    try:
        case = next(c for c in spec.bench(shape) if c.op == op)
    except Exception as exc:
        row["errors"]["case"] = _first_line(exc)
        return row
    for impl in TIMED_IMPLS:
        if impl == "torch.compile" and not compile:
            continue
        start = time.perf_counter()
        measured = measure(case.impls[impl], case.make_inputs(), Row(op, row["shape"], impl, "bfloat16"),
                           grad_output=case.grad_output, quick=True)
        row["measure_s"][impl] = time.perf_counter() - start  # the whole measurement, a compile included
        if measured.error:  # a baseline that fails here is reported, not fatal
            row["errors"][impl] = measured.error
            continue
        row["ms"][impl], row["dispatched_ms"][impl] = gpu_ms(measured), measured.full_ms
    ms = row["ms"]
    if "tigon" in ms:
        if "torch eager" in ms:
            row["vs_eager"] = ms["torch eager"] / ms["tigon"]
        if "torch.compile" in ms:
            row["vs_compile"] = ms["torch.compile"] / ms["tigon"]
    torch.cuda.empty_cache()
    return row


# ---- the families ----

# tigon's distance from HF's run may be SPREAD_FACTOR times HF's own from the exact run, or
# FLOOR[dtype] (relative): the bounds of tests/integration/test_patching.py's assert_trains_like.
SPREAD_FACTOR = 4.0
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
# Rows without a model of their own (a vision tower), checked inside a model of another row.
HOSTED_BY = {"pixtral": "mistral3"}
TEXT_BATCH = {"cpu": (2, 8), "gpu": (4, 64)}  # (rows, tokens) of the text rows' batch


def _expected_pieces(family) -> set[str]:
    """What patching a model of the row must install (as the family tests assert)."""
    if family.conditional_generation:
        return {"loss", "rms_norm"}
    rows = {"rms_norm": family.rms_norms, "layer_norm": family.layer_norms,
            "swiglu": (*family.mlps, *family.relu2_mlps, family.experts), "rope": (family.rope,)}
    return {"loss"} | {piece for piece, names in rows.items() if any(names)}


def _build(family, device):
    """(fp32 model, input_ids, labels, other inputs, model type) of a family row's tiny model."""

    host = FAMILIES[HOSTED_BY.get(family.name, family.name)]
    model_type = host.model_types[0]
    if host.conditional_generation:
        model = tiny_models.tiny_vlm(model_type, device)
        ids, labels, extra = tiny_models.vlm_batch(model, device)
    else:
        model = tiny_models.tiny_model(model_type, "tiny", device)
        rows, tokens = TEXT_BATCH["gpu" if device == "cuda" else "cpu"]
        ids, labels = tiny_models.text_batch(model.config.vocab_size, rows, tokens, device)
        extra = {}
    return model, ids, labels, extra, model_type


def _train_step(model, ids, labels, extra, dtype, optimizer=False):
    """One training step's forward and backward (and, with ``optimizer``, an AdamW update):
    (loss, gradients by parameter name)."""
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in extra.items()}
    model.train()
    out = model(input_ids=ids, labels=labels, **inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if optimizer:
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6).step()
    return out.loss.item(), grads


def _flat(grads, names):
    return torch.cat([grads[n].flatten().double() for n in names])


@contextlib.contextmanager
def _quiet():
    """No warnings and no transformers log lines: the tiny configs' own (a token id past the tiny
    vocab, a missing optional kernel, complex RoPE buffers cast to float64) would bury the report."""
    import warnings

    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)


def check_family(name: str, device: str, dtype: torch.dtype) -> dict:
    """A tiny model of the row ``name`` patched with tigon.patch against HF's own, one training
    step each: the row of the check (status "passed", "failed" or "skipped" with the reason)."""
    with _quiet():
        return _check_family(name, device, dtype)


def _check_family(name: str, device: str, dtype: torch.dtype) -> dict:

    family = FAMILIES[name]
    row = {"family": name, "model": None, "dtype": str(dtype).removeprefix("torch."), "status": "failed",
           "loss": None, "hf_loss": None, "loss_diff": None, "loss_tolerance": None, "grads_diff": None,
           "grads_tolerance": None, "pieces": [], "reason": None}
    try:
        model, ids, labels, extra, model_type = _build(family, device)
    except tiny_models.ModelUnavailable as exc:
        row.update(status="skipped", reason=str(exc))
        return row
    except Exception as exc:  # HF refuses the tiny config (its options changed): nothing of tigon's to check
        row.update(status="skipped", reason=f"transformers {installed_version('transformers')} cannot build the tiny "
                                            f"model: {_first_line(exc)}")
        return row
    row["model"] = type(model).__name__ + (f" (its {name} tower)" if name in HOSTED_BY else "")
    row["model_type"] = model_type
    exact_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    exact = copy.deepcopy(model).to(exact_dtype)
    if exact_dtype == torch.float64 and getattr(exact.config, "_experts_implementation", "eager") != "eager":
        exact.set_experts_implementation("eager")  # HF's grouped-matmul experts take no float64
    ours = copy.deepcopy(model).to(dtype)
    hf = model.to(dtype)
    try:
        hf_loss, hf_grads = _train_step(hf, ids, labels, extra, dtype)
        exact_loss, exact_grads = _train_step(exact, ids, labels, extra, exact_dtype)
    except Exception as exc:  # HF's own model fails here: nothing of tigon's to check
        row.update(status="skipped", reason=f"HF's {type(model).__name__} fails unpatched in transformers "
                                             f"{installed_version('transformers')}: {_first_line(exc)}")
        return row
    del exact, hf
    try:
        report = patch(ours)
        row["pieces"] = sorted(report.pieces())
        with _poisoned_outputs():
            loss, grads = _train_step(ours, ids, labels, extra, dtype, optimizer=True)
    except Exception as exc:
        row["reason"] = f"patched model: {_first_line(exc)}"
        return row
    finally:
        unpatch(ours)
    floor = FLOOR[dtype]
    hf_err = abs(hf_loss - exact_loss) / abs(exact_loss)
    row.update(loss=loss, hf_loss=hf_loss, loss_diff=abs(loss - hf_loss) / abs(hf_loss),
               loss_tolerance=max(SPREAD_FACTOR * hf_err, floor))
    problems = []
    missing = sorted(set(hf_grads) - set(grads))
    if missing:
        problems.append(f"no gradient for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    not_finite = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    if not_finite:
        problems.append(f"non-finite gradient of {', '.join(not_finite[:3])}{' ...' if len(not_finite) > 3 else ''}")
    names = [n for n in hf_grads if n in grads]
    if names:
        hf_flat, exact_flat = _flat(hf_grads, names), _flat(exact_grads, names)
        row["grads_diff"] = relative_error(_flat(grads, names), hf_flat)
        row["grads_tolerance"] = max(SPREAD_FACTOR * relative_error(hf_flat, exact_flat), floor)
        if not row["grads_diff"] <= row["grads_tolerance"]:
            problems.append(f"gradients {row['grads_diff']:.1e} from HF's > {row['grads_tolerance']:.1e}")
    if not row["loss_diff"] <= row["loss_tolerance"]:
        problems.insert(0, f"loss {row['loss_diff']:.1e} from HF's > {row['loss_tolerance']:.1e}")
    unpatched = sorted(_expected_pieces(FAMILIES[HOSTED_BY.get(name, name)]) - set(row["pieces"]))
    if name in HOSTED_BY:  # the hosted row's own classes
        classes = (*family.rms_norms, *family.layer_norms, *family.mlps, *family.vision_mlps)
        unpatched += [c for c in classes if not any(what.startswith(c) for _, what, _ in report.replaced)]
    if unpatched:
        problems.append(f"not patched: {', '.join(unpatched)}")
    row.update(status="failed" if problems else "passed", reason="; ".join(problems) or None)
    return row


# ---- the command ----


def _progress(total: int, enabled: bool):
    """(update(label), close()): a tqdm bar on stderr when tqdm is installed and stderr is a
    terminal, else a line on stderr per step; nothing when not ``enabled``."""
    if not enabled:
        return (lambda label: None), (lambda: None)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(total=total, desc="tigon doctor", unit="check", leave=False)

        def update(label):
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        return update, bar.close
    done = [0]

    def line(label):
        done[0] += 1
        print(f"tigon doctor: [{done[0]}/{total}] {label}", file=sys.stderr, flush=True)

    return line, (lambda: None)


def _timed(check, *args) -> dict:
    """check(*args)'s row, with the seconds it took."""
    start = time.perf_counter()
    row = check(*args)
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


class CannotRun(RuntimeError):
    """tigon's kernels cannot run on this machine (no CUDA GPU, and Triton's interpreter is off)."""


def choose(names, known, what: str) -> list[str] | None:
    """The names given for ``what`` (None: the default; ["all"]; ["none"]: nothing), in order
    without repeats; ValueError, as argparse words a bad choice, for names not in ``known``."""
    if names is None:
        return None
    names = list(names)
    if names == ["all"]:
        return list(known)
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"invalid {what}: {', '.join(map(repr, unknown))} (choose from "
                         f"{', '.join(map(repr, known))}; or all, or none)")
    return list(dict.fromkeys(names))


def default_workers(device: str) -> int:
    """Processes that run the checks side by side. On a GPU a first run's time is Triton's and
    inductor's compiles, one CPU core each, so the checks spread over half the cores (at most 8);
    the compiled kernels land in their on-disk caches, which every process shares. In the
    interpreter: 1 (the checks run in this process)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2)) if device == "cuda" else 1


def _warm_compile(op: str, shape: tuple) -> dict:
    """One fwd+bwd of ``tigon bench``'s torch.compile case of ``op`` at ``shape``: fills inductor's
    and Triton's on-disk caches for the timing, which then runs alone in the first process."""
    case = next(c for c in op_checks()[op].bench(shape) if c.op == op)
    inputs = case.make_inputs()
    outs = [o for o in _as_tuple(case.impls["torch.compile"](*inputs))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    torch.cuda.synchronize()
    return {}


def _run_task(task: tuple) -> dict:
    """One check: ("op", op, shape, dtype name, device), ("family", name, device, dtype name) or
    ("warm", op, shape), with its seconds; a worker process's entry point."""
    kind, *args = task
    if kind == "op":
        op, shape, dtype, device = args
        return _timed(check_op, op, shape, getattr(torch, dtype), device)
    if kind == "family":
        name, device, dtype = args
        return _timed(check_family, name, device, getattr(torch, dtype))
    try:
        return _warm_compile(*args)
    except Exception:  # the timing reports what fails; warming only saves time
        return {}


def _run_tasks(tasks: list[tuple], workers: int, update) -> list[dict]:
    """Each task's row, in order; in ``workers`` spawned processes when more than 1."""
    checks = op_checks()
    labels = [f"{task[1]} {checks[task[1]].label(task[2])}" if task[0] == "op" else
              f"family {task[1]}" if task[0] == "family" else f"warming torch.compile: {task[1]}" for task in tasks]
    if workers <= 1:
        rows = []
        for task, label in zip(tasks, labels):
            update(label)
            rows.append(_run_task(task))
        return rows
    rows = [None] * len(tasks)
    # spawn, not fork: the first process has CUDA initialised.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            update(labels[i])
            rows[i] = future.result()
    return rows


def run(ops=None, families=None, compile=True, progress=True, workers=None) -> dict:
    """Run the doctor: ``ops`` (names of OP_NAMES, or ["all"] / ["none"]; None: all), ``families``
    (names of FAMILIES, or ["all"] / ["none"]; None: all), torch.compile timed on a GPU unless
    ``compile`` is False, the checks in ``workers`` processes (None: default_workers). Returns
    everything as a dict: environment, settings, ops, timings, families, seconds, failed,
    skipped, verdict, status (the exit status: 0 when every check passed). ValueError for an
    unknown name; CannotRun where the kernels cannot run."""

    start = time.perf_counter()
    checks = op_checks()
    ops = choose(ops, list(checks), "op")
    families = choose(families, list(FAMILIES), "family")
    env = environment()
    if env["kernels"] == "cannot run":
        raise CannotRun("tigon's kernels cannot run here: torch sees no CUDA GPU and Triton's interpreter is off "
                        "(TRITON_INTERPRET=0; unset it, or set it to 1)")
    device = "cpu" if env["kernels"] == "interpreted" else "cuda"
    kind = "gpu" if device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    ops = list(checks) if ops is None else ops
    families = list(FAMILIES) if families is None else families
    workers = default_workers(device) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    timed = device == "cuda"
    seconds = {"environment": time.perf_counter() - start}
    hf = installed_version("transformers")
    op_tasks = [("op", op, shape, dtype_name, device) for op in ops for shape in checks[op].shapes[kind]]
    family_tasks = [("family", name, device, dtype_name) for name in families] if hf else []
    warm_tasks = [("warm", op, checks[op].shapes[kind][0]) for op in ops] if timed and compile and workers > 1 else []
    total = len(op_tasks) + len(family_tasks) + len(warm_tasks) + (len(ops) if timed else 0)
    update, close = _progress(total, progress)
    result = {"doctor_version": 1, "environment": env,
              "settings": {"device": device, "dtype": dtype_name, "ops": ops, "families": families,
                           "timed": timed, "compile": compile and timed, "workers": workers},
              "ops": [], "timings": [], "families": []}
    try:
        mark = time.perf_counter()
        rows = _run_tasks(op_tasks + family_tasks + warm_tasks, workers, update)
        result["ops"] = rows[:len(op_tasks)]
        result["families"] = rows[len(op_tasks):len(op_tasks) + len(family_tasks)] if hf else [
            {"family": name, "status": "skipped", "reason": 'transformers is not installed: pip install "tigon[hf]"'}
            for name in families]
        seconds["checks"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if timed:  # alone on the GPU, after the checks
            for op in ops:
                shape = checks[op].shapes[kind][0]
                update(f"timing {op}")
                result["timings"].append(time_op(op, shape, compile))
        seconds["timing"] = time.perf_counter() - mark
    finally:
        close()
    seconds["total"] = time.perf_counter() - start
    result["seconds"] = seconds
    failed = [f"{r['op']} {r['shape']}" for r in result["ops"] if not r["passed"]]
    failed += [f"family {r['family']}" for r in result["families"] if r["status"] == "failed"]
    skipped = [f"family {r['family']}" for r in result["families"] if r["status"] == "skipped"]
    passed = sum(r["passed"] for r in result["ops"]) + sum(r["status"] == "passed" for r in result["families"])
    if not failed and not passed:
        verdict = "nothing was checked" + (f" ({len(skipped)} skipped)" if skipped else "")
    elif failed:
        verdict = f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed: {', '.join(failed)}"
    else:
        verdict = (f"tigon is healthy here: {passed} checks passed"
                   + (f", {len(skipped)} skipped" if skipped else "") + f" in {seconds['total']:.0f} s")
    result.update(failed=failed, skipped=skipped, verdict=verdict, status=1 if failed else 0)
    return result


# ---- the report ----


def _sci(value) -> str:
    if value is None:
        return "—"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.1e}"


def _ratio(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows]]


def report(result: dict) -> str:
    """The result of ``run`` as text: the environment, the op table, the family table, the verdict."""
    env, settings = result["environment"], result["settings"]
    lines = ["tigon doctor", ""]
    versions = " · ".join(f"{name} {env[name] or 'not installed'}"
                          for name in ("tigon", "python", "torch", "triton", "transformers"))
    lines.append(f"  {versions}")
    if settings["device"] == "cuda":
        lines.append(f"  GPU: {env['gpu']} (compute capability {env['capability']}, {env['gpu_memory_gib']} GiB, "
                     f"{env['gpus']} device{'s' if env['gpus'] != 1 else ''}), CUDA {env['cuda']}; kernels compiled "
                     f"by Triton; checks in {settings['dtype']}")
    else:
        lines.append(f"  no GPU: kernels run in Triton's interpreter on the CPU (correct, slow); checks in "
                     f"{settings['dtype']} (bf16 is emulated there)")
    lines.append("")
    if result["ops"]:
        lines.append("ops: forward and backward against a float64 reference (largest relative error over outputs "
                     "and input gradients)")
        timings = {t["op"]: t for t in result["timings"]}
        rows = []
        for r in result["ops"]:
            t = timings.get(r["op"]) if r["shape"] == (timings.get(r["op"]) or {}).get("shape") else None
            status = "ok" if r["passed"] else "FAIL"
            error = _sci(r["max_error"]) if r["error"] is None else f"error: {r['error']}"
            rows.append([r["op"], r["shape"], r["dtype"], error, _sci(r["tolerance"]), status,
                         _ratio(t and t["vs_eager"]), _ratio(t and t["vs_compile"])])
        lines += ["  " + line for line in _table(["op", "shape", "dtype", "max error", "tolerance", "pass",
                                                   "vs eager", "vs compile"], rows)]
        if settings["timed"]:
            lines.append("  vs eager / vs compile: fwd+bwd GPU time (CUDA-graph replay, as `tigon bench` measures) of "
                         "torch eager (the reference formula in bf16) / of torch.compile of it, over tigon's; above "
                         "1x tigon is faster; the times dispatched from Python (host included) are in --json")
            if not settings["compile"]:
                lines.append("  (torch.compile not timed: --no-compile)")
            failed = [f"{t['op']} ({impl}: {err})" for t in result["timings"] for impl, err in t["errors"].items()]
            if failed:
                lines.append(f"  not timed: {'; '.join(failed)}")
            slower = [t["op"] for t in result["timings"] if t["vs_eager"] is not None and t["vs_eager"] < 1]
            if slower:
                lines.append(f"  slower than torch eager here: {', '.join(slower)}")
        else:
            lines.append("  vs eager / vs compile: — (Triton's interpreter runs the kernels on the CPU in numpy: its "
                         "timings say nothing of the GPU's)")
        lines.append("")
    if result["families"]:
        lines.append("families: a tiny model of each row patched with tigon.patch, one training step next to HF's own "
                     "(loss and all gradients, relative to HF's)")
        rows = []
        for r in result["families"]:
            if r["status"] == "skipped":
                rows.append([r["family"], "—", "—", "—", "—", "—", "—", "skipped", r["reason"]])
                continue
            rows.append([r["family"], r.get("model") or "—", r["dtype"], _sci(r["loss_diff"]),
                         _sci(r["loss_tolerance"]), _sci(r["grads_diff"]), _sci(r["grads_tolerance"]),
                         "ok" if r["status"] == "passed" else "FAIL", r["reason"] or " ".join(r["pieces"])])
        lines += ["  " + line for line in _table(["family", "model", "dtype", "loss diff", "loss tol", "grads diff",
                                                   "grads tol", "pass", "patched / why not"], rows)]
        lines.append(f"  tol: {SPREAD_FACTOR:g}x HF's own distance from an exact run ("
                     f"{'float64' if settings['dtype'] == 'float32' else 'fp32'}), at least "
                     f"{_sci(FLOOR[getattr(torch, settings['dtype'])])}")
        lines.append("")
    sec = result["seconds"]
    lines.append("time: " + ", ".join(f"{part} {sec[part]:.0f} s" for part in ("checks", "timing", "total")
                                      if part in sec and (part != "timing" or settings["timed"])))
    lines.append(result["verdict"])
    return "\n".join(lines)


def _strict(value):
    """``value`` with its non-finite floats as strings ("inf", "nan"): strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def write_json(result: dict, path: str) -> None:
    """The result as strict JSON (non-finite numbers as strings) to ``path`` ("-": stdout)."""
    text = json.dumps(_strict(result), indent=1, default=str, allow_nan=False)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def main(ops=None, families=None, compile=True, json_path=None, progress=True, workers=None) -> int:
    """``tigon doctor``: run, print the report (on stderr when the JSON goes to stdout), write the
    JSON when asked; the exit status (0: every check passed)."""
    result = run(ops, families, compile, progress, workers)
    print(report(result), file=sys.stderr if json_path == "-" else sys.stdout, flush=True)
    if json_path:
        write_json(result, json_path)
        if json_path != "-":
            print(f"wrote {json_path}")
    return result["status"]
