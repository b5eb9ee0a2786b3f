"""What every op shares: argument checks, output allocation and launch sizes.

Kernels run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(``TRITON_INTERPRET=1`` set before triton is imported); that is how the test suite runs
every kernel on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import NamedTuple

import torch
import triton

# When set (the test suite sets it), every output buffer starts as NaN instead of
# uninitialised memory, so an element a kernel forgot to write fails the comparison.
_POISON_OUTPUTS = os.environ.get("TIGON_POISON_OUTPUTS", "0") == "1"


def set_poison_outputs(enabled: bool) -> None:
    """Fill every kernel output with NaN before the kernel writes it (a testing aid)."""
    global _POISON_OUTPUTS
    _POISON_OUTPUTS = bool(enabled)


# Triton reads TRITON_INTERPRET when it decorates the kernels (at tigon's import), so it is
# read once here too.
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_enabled() -> bool:
    return _INTERPRETER


# ---- kernel launches ----
#
# Triton's ``kernel[grid](...)`` binds and specializes every argument and looks its compiled
# kernel up on each call: ~30 us of host time per launch on an H100 machine's host, against
# ~9 us for calling the compiled kernel itself (benchmarks/host_overhead.py). A checkpointed
# Llama-1B training step launches ~300 of tigon's kernels. ``launch`` keeps the compiled kernel
# per (kernel, device, argument specialization, constexprs) and calls it directly after the first
# launch, which goes through Triton (and compiles). The key is at least as fine as Triton's own
# specialization: tensors by dtype and 16-byte alignment, ints by ==1, %16 and 32-bit range.
# Off under the interpreter, with launch hooks set (profilers), or with TIGON_FAST_LAUNCH=0.

_FAST_LAUNCH = os.environ.get("TIGON_FAST_LAUNCH", "1") == "1" and not _INTERPRETER
_LAUNCHES: dict = {}
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


class _Uncached(Exception):
    pass


def _arg_spec(a):
    kind = type(a)
    if kind is int:
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63
    if kind is float:
        return float
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if kind is bool:
        return bool, a
    raise _Uncached


_PLAIN_OPTIONS = (int, bool, float, str, type(None))


def _options_key(options):
    items = tuple(options.items())
    for _, value in items:
        if type(value) not in _PLAIN_OPTIONS:  # a runtime argument by keyword: not cached
            raise _Uncached
    return items


def _hook_set(hook) -> bool:
    # Triton >= 3.5 keeps hooks in a HookChain (set when its list of calls is not empty).
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    """Launch hooks (profilers) are set, or this Triton keeps them elsewhere: launch through it."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "launch_enter_hook"):
        return True
    return _hook_set(runtime.launch_enter_hook) or _hook_set(getattr(runtime, "launch_exit_hook", None))


def fast_launch_enabled() -> bool:
    return _FAST_LAUNCH


def set_fast_launch(enabled: bool) -> None:
    """Turn the cached launch path on or off (off: every launch goes through Triton's own)."""
    global _FAST_LAUNCH
    _FAST_LAUNCH = bool(enabled) and not _INTERPRETER


def launch(kernel, grid, *args, **options) -> None:
    """``kernel[grid](*args, **options)``: runtime arguments positional (in the kernel's order),
    constexprs and num_warps / num_stages by keyword."""
    if not _FAST_LAUNCH or _launch_hooks_set():
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, tuple(map(_arg_spec, args)), _options_key(options))
        entry = _LAUNCHES.get(key)
    except _Uncached:  # an argument kind Triton specializes otherwise
        kernel[grid](*args, **options)
        return
    if entry is None:
        compiled = kernel[grid](*args, **options)  # compiles if needed, and launches
        if compiled is None:
            return
        params = list(inspect.signature(kernel.fn).parameters.values())[len(args):]
        tail = tuple(options[p.name] if p.name in options else p.default for p in params)
        _LAUNCHES[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail)
        return
    run, function, metadata, tail = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_raw_stream(device),
        function, metadata, None, None, None, *args, *tail)


@contextlib.contextmanager
def thread_flag(local, value: bool = True):
    """``local.on = value`` (a threading.local) for the block, then what it was before."""
    before = getattr(local, "on", False)
    local.on = value
    try:
        yield
    finally:
        local.on = before


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python, cheaper per call than triton's."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def capturing() -> bool:
    """True while a CUDA graph is being captured: host syncs (value checks) must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer a kernel will fill (NaN-filled when poisoning is on)."""
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """NaN-fill a buffer that a kernel is about to overwrite in place (when poisoning is on)."""
    if _POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


def check_tensor(name: str, t, *, ndim=None, min_ndim=None, floating=True) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a usable kernel input."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if floating and t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"{name} has dtype {t.dtype}; tigon kernels take float32, float16 or bfloat16")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    if t.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU: tigon kernels run on CUDA tensors, or on CPU tensors only under "
            "the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
        )
    raise ValueError(f"{name} is on device {t.device}; tigon kernels run on CUDA tensors")


def check_same_device(**tensors) -> None:
    """All given tensors (None entries skipped) must sit on one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_same_dtype(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, last_dim] with unit stride along the last dim (copies only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def matmul_dtype(x: torch.Tensor, **weights) -> torch.dtype:
    """The dtype an op's matmuls run in: autocast's when it is on, else x's, which each of
    ``weights`` must then share (as F.linear requires)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
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


def _checkpoint_pack_hook():
    """The pack hook of the innermost torch.utils.checkpoint (non-reentrant) region we are in,
    unwrapped, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])
    name = getattr(pack, "__qualname__", "")
    return pack if ("_checkpoint_hook" in name or "_recomputation_hook" in name) else None


def under_checkpoint() -> bool:
    """True inside a non-reentrant torch.utils.checkpoint region (its forward or its
    recomputation), where what a Function saves is dropped and recomputed later."""
    try:
        return _checkpoint_pack_hook() is not None
    except Exception:  # checkpoint's internals moved: behave as outside
        return False


def checkpoint_recompute_stops_after(n_saved: int) -> bool:
    """True when this is checkpoint's recomputation and it stops (its early stop) as soon as the
    next ``n_saved`` tensors are saved: then the caller's output is never read, only what it
    saves. Reads checkpoint's private state; anything unexpected gives False (compute as usual)."""
    try:
        pack = _checkpoint_pack_hook()
        if pack is None or "_recomputation_hook" not in pack.__qualname__:
            return False
        cells = dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in pack.__closure__)))
        frame, gid = cells["target_frame_ref"](), cells["gid"]
        return bool(frame.early_stop) and len(frame.weak_holders) - frame.recomp_counter[gid] == n_saved
    except Exception:
        return False


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

    Measured on an H100 (benchmarks/tune_kernels.py, bf16, rows of 896 to 8192): the forward
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


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, n_tasks: int, per_sm: int) -> int:
    """Programs for a persistent grid: a few per SM on the GPU, a handful in the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = _multiprocessor_count(index) * per_sm
    else:
        limit = 2  # small, so the interpreter exercises programs that loop over several tasks
    return max(1, min(limit, n_tasks))
