"""What every op shares: argument checks, output allocation and launch sizes.

Kernels run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(``TRITON_INTERPRET=1`` set before triton is imported); that is how the test suite runs
every kernel on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from typing import NamedTuple

import torch

from tigon.ops._internals import (
    interpreter_enabled,
    plain_eager_call,
    triton_imported_before_interpreter,
)

# When set (the test suite sets it), every output buffer starts as NaN instead of
# uninitialised memory, so an element a kernel forgot to write fails the comparison.
_POISON_OUTPUTS = os.environ.get("TIGON_POISON_OUTPUTS", "0") == "1"


def set_poison_outputs(enabled: bool) -> None:
    """Fill every kernel output with NaN before the kernel writes it (a testing aid)."""
    global _POISON_OUTPUTS
    _POISON_OUTPUTS = bool(enabled)


# Ops whose bodies only check arguments, allocate and launch tigon's kernels are registered with
# torch.library.triton_op: torch.compile then traces the body and Inductor launches the kernels
# from its generated code, so a compiled step runs none of tigon's Python per call (~130-580 us
# a call on the H100's host as opaque custom ops). TIGON_TRITON_OPS=0 (before tigon is
# imported) registers them as plain custom ops instead, for comparison.
_TRITON_OPS = os.environ.get("TIGON_TRITON_OPS", "1") != "0"
KERNEL_OPS: list[str] = []  # the names registered through kernel_op, in registration order
# Every tigon op's Python body by qualified name ("tigon::rms_norm"): a memory-planning trace
# (tigon.planning.memory_trace) runs it on meta tensors, so that the buffers it allocates are counted
# (launches on meta tensors do nothing), where the fake implementation would give outputs only.
OP_BODIES: dict = {}


class TigonOp:
    """One of tigon's ops: the torch.library op (``library_op``: what torch.compile, fake tensors,
    torch.func, DTensor and dispatch modes see, and what opcheck takes) and, for a plain eager call
    (``tigon.ops._internals.plain_eager_call``), the same body and the autograd formula given to
    ``register_autograd`` run directly through one autograd.Function, without torch's dispatcher.
    Both paths run one definition. Ops that mutate an argument, take lists of tensors (which
    autograd.Function would not see) or are called with keywords always take the dispatcher."""

    def __init__(self, library_op, body, mutates_args):
        self.library_op, self._body = library_op, body
        parameters = inspect.signature(body, eval_str=True).parameters.values()
        self._direct = not mutates_args and not any(_is_tensor_list(p.annotation) for p in parameters)
        self._function = None  # the autograd.Function of the eager path, once a formula is registered

    def __call__(self, *args, **kwargs):
        if kwargs or not self._direct or not plain_eager_call(args):
            return self.library_op(*args, **kwargs)
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._body(*args)
        if self._function is None:  # no autograd formula: the dispatcher says so
            return self.library_op(*args)
        return self._function.apply(*args)

    def register_autograd(self, backward, *, setup_context):
        self.library_op.register_autograd(backward, setup_context=setup_context)
        body = self._body

        class EagerFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                out = body(*args)
                setup_context(ctx, args, out)
                return out

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        EagerFunction.__name__ = EagerFunction.__qualname__ = f"{self.library_op._name.replace('::', '_')}_eager"
        self._function = EagerFunction

    def __getattr__(self, name):  # register_fake, _opoverload, ...: the library op's
        return getattr(self.library_op, name)


def _is_tensor_list(annotation) -> bool:
    """Whether a schema annotation is a list of tensors (list[Tensor], Optional[list[Tensor]], ...);
    list[int] (strides, sizes) is not."""
    text = str(annotation).lower()
    return "list" in text and "tensor" in text


def custom_op(name: str, *, mutates_args=()):
    """Decorator: ``torch.library.custom_op(name)`` as a TigonOp, the body recorded in OP_BODIES."""

    def decorator(fn):
        OP_BODIES[name] = fn
        return TigonOp(torch.library.custom_op(name, mutates_args=mutates_args)(fn), fn, mutates_args)

    return decorator


def kernel_op(name: str, *, mutates_args=()):
    """Decorator: a TigonOp over ``torch.library.triton_op(name)``, or ``torch.library.custom_op(name)`` under
    the interpreter (torch.compile would trace the body with fake tensors into kernels the
    interpreter cannot launch) or with TIGON_TRITON_OPS=0. Eager calls run the same body either
    way. The body launches through ``tigon.ops._internals.launch``; a fake implementation is
    registered on the result as for any custom op."""
    KERNEL_OPS.append(name)
    register = torch.library.triton_op if _TRITON_OPS and not interpreter_enabled() else torch.library.custom_op

    def decorator(fn):
        @functools.wraps(fn)
        def body(*args, **kwargs):
            return _owned_outputs(fn(*args, **kwargs))

        # The schema is inferred from fn's signature, its annotations resolved where fn lives.
        body.__signature__ = inspect.signature(fn, eval_str=True)
        OP_BODIES[name] = body
        return TigonOp(register(name, mutates_args=mutates_args)(body), body, mutates_args)

    return decorator


def _owned_outputs(out):
    """The op's outputs, none of them an autograd view: a body that returns ``y.view(x.shape)``
    of its own buffer would otherwise hand autograd a "view created inside a custom Function",
    which refuses in-place updates (``norm(h) += residual``). detach() keeps the storage and
    drops the view relation; traced calls are left as they are (the compiler owns aliasing)."""
    if torch.compiler.is_compiling():
        return out
    if isinstance(out, torch.Tensor):
        return out.detach() if out._is_view() else out
    if isinstance(out, tuple):
        return tuple(t.detach() if isinstance(t, torch.Tensor) and t._is_view() else t for t in out)
    return out


# Bytes of logits one chunk of a chunked loss may hold (fused linear cross entropy, the
# post-training losses): the one default every chunked op uses. 512 MiB keeps FLCE within
# 1.07x of its three matmuls on an H100 at BT 8192, H 4096, V 128256 (benchmarks/tuning).
DEFAULT_CHUNK_BUDGET = 512 * 2**20


def chunk_budget_bytes(chunk_budget) -> int:
    """``chunk_budget`` (bytes, or None for the default) checked: a positive integer."""
    if chunk_budget is None:
        return DEFAULT_CHUNK_BUDGET
    if isinstance(chunk_budget, bool) or not isinstance(chunk_budget, int) or chunk_budget <= 0:
        raise ValueError(f"chunk_budget must be a positive number of bytes (or None for "
                         f"{DEFAULT_CHUNK_BUDGET // 2**20} MiB), got {chunk_budget!r}")
    return chunk_budget


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python, cheaper per call than triton's."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def capturing() -> bool:
    """True while a CUDA graph is being captured: host syncs (value checks) must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer a kernel will fill (when poisoning is on: NaN-filled, an integer
    buffer filled with its dtype's lowest value)."""
    if _POISON_OUTPUTS and dtype != torch.bool:
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """NaN-fill a buffer that a kernel is about to overwrite in place (when poisoning is on)."""
    if _POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_kernel_device_types = None  # the device types kernels run on here, found at the first check


def _kernel_devices() -> tuple:
    global _kernel_device_types
    if _kernel_device_types is None:
        cpu_ok = interpreter_enabled() and not triton_imported_before_interpreter()
        _kernel_device_types = ("cuda", "meta", "cpu") if cpu_ok else ("cuda", "meta")
    return _kernel_device_types


def check_tensor(name: str, t, *, ndim=None, min_ndim=None, floating=True) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a usable kernel input."""
    # The accepted case first, in few attribute reads: it runs several times per op call.
    if (type(t) in _PLAIN_TENSOR_TYPES and (not floating or t.dtype in KERNEL_DTYPES)
            and (ndim is None or t.ndim == ndim) and (min_ndim is None or t.ndim >= min_ndim)
            and t.device.type in _kernel_devices()):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if floating and t.dtype not in KERNEL_DTYPES:
        # float64 included: the kernels compute in fp32, which a float64 caller would not expect.
        raise TypeError(f"{name} has dtype {t.dtype}; tigon kernels take float32, float16 or bfloat16 "
                        "(they compute in float32; use torch's own op for float64)")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device.type in ("cuda", "meta"):  # meta: a memory-planning trace (fake implementations only)
        return
    if t.device.type == "cpu" and interpreter_enabled():
        if triton_imported_before_interpreter():
            raise RuntimeError(
                "Triton's interpreter was turned on (TRITON_INTERPRET=1) after triton had been imported "
                "(transformers, for one, imports it), so Triton's own functions are compiled code and the "
                "interpreter cannot run tigon's kernels: import tigon before transformers and triton (it "
                "turns the interpreter on when there is no GPU), or set TRITON_INTERPRET=1 in the shell")
        return
    if t.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU: tigon kernels run on CUDA tensors, or on CPU tensors only under "
            "Triton's interpreter (TRITON_INTERPRET=1 in the shell; with no GPU, importing tigon before "
            "triton turns it on)"
        )
    raise ValueError(f"{name} is on device {t.device}; tigon kernels run on CUDA tensors")


def check_tensor_args(**named) -> None:
    """Each given argument is a tensor (None entries skipped): checked before an op call, whose
    schema would refuse anything else with an error not naming the argument."""
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def contiguous_or_none(t):
    """t with unit strides (a copy of a strided or expanded one), or None: what a kernel
    reading t by index (norm weights) takes."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def or_empty(t, like):
    """t, or an empty tensor of ``like``'s dtype and device in its place: a custom op's
    output that was not computed (custom ops return no None)."""
    return t if t is not None else like.new_empty(0)


def fake_grad(param, needed, like):
    """A fake implementation's gradient output for ``param``: its shape when ``needed`` and
    param is given, else empty (as ``or_empty``)."""
    return param.new_empty(param.shape) if needed and param is not None else like.new_empty(0)


def traced(*tensors) -> bool:
    """True while torch.compile, AOTAutograd or make_fx traces this code (they set is_compiling or
    hand it functional / fake tensor subclasses). A backward then stays functional: no reads of
    autograd's private state, no in-place writes into saved tensors, no kernel launched outside
    a custom op. Eager code on plain tensors may do all three."""
    return torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in tensors)


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``. Plain tensors and parameters are told apart
    by their type, without importing torch.distributed.tensor (torch.distributed may be unavailable)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not isinstance(t, torch.Tensor):
        return False
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def check_same_device(**tensors) -> None:
    """All given tensors (None entries skipped) must sit on one device."""
    _check_same("device", ValueError, "is on", tensors)


def check_same_dtype(**tensors) -> None:
    """All given tensors (None entries skipped) must have one dtype."""
    _check_same("dtype", TypeError, "has dtype", tensors)


def _check_same(attr: str, error: type, verb: str, tensors: dict) -> None:
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        value = getattr(t, attr)
        if first is None:
            first_name, first = name, value
        elif value != first:
            raise error(f"{name} {verb} {value} but {first_name} {verb} {first}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, last_dim] with unit stride along the last dim (copies only if it must)."""
    x2 = x if x.ndim == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``; nothing on meta (a memory-planning
    trace), which autocast does not know."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def matmul_dtype(x: torch.Tensor, **weights) -> torch.dtype:
    """The dtype an op's matmuls run in: autocast's when it is on, else x's, which each of
    ``weights`` must then share (as F.linear requires)."""
    device_type = x.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for name, w in weights.items():
        if w is not None and w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but the input has {x.dtype} (and autocast is off)")
    return x.dtype


def accumulate_mm(acc, a, b, first=False):
    """acc += a @ b, with fp32 accumulation inside the matmul; acc may be fp32 for bf16 a, b.
    With ``first``, acc = a @ b: acc is not read (it may hold anything, no zero fill needed)."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)  # no zero fill, no read of acc: ~2 |acc| bytes saved
        else:
            acc.addmm_(a, b)
    elif acc.is_cuda:  # beta=0: the input is ignored, NaN included (torch.addmm's contract)
        torch.addmm(acc, a, b, beta=0 if first else 1, out_dtype=acc.dtype, out=acc)
    elif first:
        torch.mm(a.to(acc.dtype), b.to(acc.dtype), out=acc)
    else:
        acc.add_(torch.mm(a.to(acc.dtype), b.to(acc.dtype)))


# Kept, not saved: the ops keep their parameters (weights) and constant tables (RoPE's cos /
# sin) as ctx attributes instead of ctx.save_for_backward. Under torch.utils.checkpoint every
# saved tensor goes through a Python pack hook in the forward, again in the recomputation, and
# an unpack hook in the backward (~10 us each on a slow host, ~14 per Llama layer and step);
# parameters are alive anyway and are not recomputed. What is saved is what checkpointing may
# drop: activations.


# Largest row a one-block-per-row kernel holds in registers (fp32: 256 KiB per program at
# 32 warps); wider rows would spill, so they are refused rather than silently slow.
MAX_FUSED_ROW = 65536


class RowConfig(NamedTuple):
    block_m: int  # rows per program (per loop step, in the persistent backward)
    block_n: int  # the row, padded to a power of two
    num_warps: int
    programs_per_sm: int  # persistent grid size, for the backward


def row_block_config(n_cols: int, backward: bool = False, name: str = "hidden size") -> RowConfig:
    """Launch shape of the kernels that keep whole rows in registers.

    Measured on an H100 (benchmarks/tuning/tune_kernels.py, bf16, rows of 896 to 8192): the forward
    reaches 92-94% of copy bandwidth with ~4K elements a program and a warp per ~1K elements.
    The persistent backward needs more bytes in flight: for rows up to 1024, 4 warps and 8
    programs an SM (78-89%); for longer rows ~16K elements a step, 16 warps, 2 programs an SM
    (88-91%), against 55-60% for the forward's shape.
    """
    block_n = next_pow2(n_cols)
    if block_n > MAX_FUSED_ROW:
        raise ValueError(f"{name} {n_cols} is larger than the supported maximum {MAX_FUSED_ROW}")
    if not backward:
        block_m = max(1, min(64, 4096 // block_n))
        return RowConfig(block_m, block_n, max(4, min(32, block_m * block_n // 1024)), 1)
    if block_n <= 1024:
        return RowConfig(max(1, min(64, 4096 // block_n)), block_n, 4, 8)
    block_m = max(1, 16384 // block_n)
    if block_m * block_n > 16384:
        return RowConfig(block_m, block_n, 32, 1)
    return RowConfig(block_m, block_n, 16, 2)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, n_tasks: int, per_sm: int) -> int:
    """Programs for a persistent grid: a few per SM on the GPU, a handful in the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = _multiprocessor_count(index) * per_sm
    else:
        limit = 2  # small, so the interpreter exercises programs that loop over several tasks
    # sym_min / sym_max: n_tasks may be symbolic (a traced op body), and must stay so.
    return torch.sym_max(1, torch.sym_min(limit, n_tasks))
