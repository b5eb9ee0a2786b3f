"""Every place tigon reaches into torch's or Triton's private internals, and its switch.

Each reach has a measured reason and a fallback to public behaviour when the internals move or
when ``TIGON_PRIVATE_APIS=0`` is set (before tigon is imported):

- ``launch``: calls Triton's compiled kernel directly after the first launch of a
  specialization (~9 us instead of ~30 us of host time a launch on an H100 host; a
  checkpointed Llama-1B step launches ~300 kernels). Off: every launch goes through Triton's
  ``kernel[grid](...)``. Also off with ``TIGON_FAST_LAUNCH=0``, under the interpreter and while
  Triton launch hooks (profilers) are set.
- ``under_checkpoint`` / ``checkpoint_recompute_stops_after`` / ``in_checkpoint_recomputation``:
  read torch.utils.checkpoint's saved-tensor hooks, so the gated MLP keeps only its input under
  checkpointing and skips its matmuls in the recomputation (Llama-1B: half of HF's peak memory;
  torchtune's per-layer compile: 3 of the MLP's 14 matmuls). Off: never under checkpoint (the
  MLP keeps gate and up, as outside checkpointing), never skipped.
- ``graph_retained``: asks autograd whether the running backward keeps the graph, so a
  gradient formed in the forward pass is scaled in place (no copy) when it is not. Off: always
  "retained" (a fresh scaled copy every backward: exact, one more [N, V] or [V, H] buffer).
- ``engine_will_run``: whether autograd will run a node in this backward (the tied-embedding
  gradient slot). Off: never (the head and the embedding each return their own gradient).
- ``assert_on_device``: ``torch._assert_async``, a check of tensor data that a traced graph
  runs on the device (a host sync cannot be traced): RoPE's positions under torch.compile. Off:
  not checked there (eager calls still check on the host).
- Not in this file, one of transformers': ``tigon.patching`` wraps
  ``transformers.masking_utils._ignore_causal_mask_sdpa`` so that a patched model's SDPA keeps
  ``is_causal=True`` under torch.compile (see ``make_ignore_causal_mask_sdpa``). Off: HF's mask.
- ``triton_imported_before_interpreter``: recognises Triton's library as compiled code when
  TRITON_INTERPRET=1 came too late, for a clear error (no effect on results).
- ``plain_eager_call``: reads torch's mode stacks (dispatch modes, torch-function modes,
  torch.func transforms), so that an op call none of them would see runs its body and autograd
  formula directly (``tigon.ops._common.TigonOp``) instead of through torch's dispatcher. Off
  (also with ``TIGON_LEAN_EAGER=0``): every call goes through the dispatcher.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton

PRIVATE_APIS = os.environ.get("TIGON_PRIVATE_APIS", "1") != "0"

# Triton reads TRITON_INTERPRET when it decorates the kernels (at tigon's import), so it is
# read once here too.
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_enabled() -> bool:
    return _INTERPRETER


@functools.cache
def triton_imported_before_interpreter() -> bool:
    """TRITON_INTERPRET=1 was set after triton was first imported (transformers imports it):
    tigon's kernels are then interpreted but Triton's own library (tl.sigmoid, ...) is compiled
    code, and the first kernel fails deep inside the interpreter."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        return not isinstance(tl.standard.sigmoid, InterpretedFunction)
    except Exception:  # Triton's layout moved: assume it is consistent
        return False


# ---- kernel launches ----
#
# Triton's ``kernel[grid](...)`` binds and specializes every argument and looks its compiled
# kernel up on each call: ~30 us of host time per launch on an H100 machine's host, against
# ~9 us for calling the compiled kernel itself (benchmarks/tuning/host_overhead.py). A checkpointed
# Llama-1B training step launches ~300 of tigon's kernels. ``launch`` keeps the compiled kernel
# per (kernel, device, argument specialization, constexprs) and calls it directly after the first
# launch, which goes through Triton (and compiles). The key is at least as fine as Triton's own
# specialization: tensors by dtype and 16-byte alignment, ints by ==1, %16 and 32-bit range.
# Off under the interpreter, with launch hooks set (profilers), or with TIGON_FAST_LAUNCH=0.

_FAST_LAUNCH = PRIVATE_APIS and os.environ.get("TIGON_FAST_LAUNCH", "1") == "1" and not interpreter_enabled()
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
    _FAST_LAUNCH = bool(enabled) and not interpreter_enabled()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def launch(kernel, grid, *args, **options) -> None:
    """``kernel[grid](*args, **options)``: runtime arguments positional (in the kernel's order),
    constexprs and num_warps / num_stages by keyword. While torch.compile traces an op body (its
    tensors are functional / fake subclasses), the launch is recorded through
    ``torch.library.wrap_triton`` for Inductor to emit. The first argument (a tensor in every
    tigon kernel) tells which: one type check a launch on the eager path. On meta tensors (a
    memory-planning trace: shapes only, the outputs already allocated) nothing is launched."""
    if type(args[0]) not in _PLAIN_TENSORS:
        torch.library.wrap_triton(kernel)[grid](*args, **options)
        return
    if args[0].is_meta:
        return
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


def graph_retained() -> bool:
    """True when the running backward keeps the graph (``retain_graph=True`` or
    ``create_graph=True``), or when torch cannot say: a Function whose gradient was formed in
    the forward pass must then return a fresh tensor and leave its saved buffer as it is, since
    that buffer will be read again. When the graph is freed after this backward, the buffer can
    be scaled in place and handed to autograd (which may adopt it as ``.grad``) at no cost."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if probe is None or not PRIVATE_APIS:
        return True
    try:
        return bool(probe())
    except RuntimeError:  # not inside a backward (a direct call): assume the worst
        return True


def _checkpoint_pack_hook():
    """The pack hook of the innermost torch.utils.checkpoint (non-reentrant) region we are in,
    unwrapped, or None."""
    if not PRIVATE_APIS:
        return None
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
        pack = _recomputation_pack_hook()
        if pack is None:
            return False
        cells = dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in pack.__closure__)))
        frame, gid = cells["target_frame_ref"](), cells["gid"]
        return bool(frame.early_stop) and len(frame.weak_holders) - frame.recomp_counter[gid] == n_saved
    except Exception:
        return False


def _recomputation_pack_hook():
    """The pack hook of checkpoint's recomputation when one is running (in the backward), else None."""
    pack = _checkpoint_pack_hook()
    return pack if pack is not None and "_recomputation_hook" in pack.__qualname__ else None


def in_checkpoint_recomputation() -> bool:
    """True while a non-reentrant torch.utils.checkpoint recomputes its region (in the backward);
    False elsewhere, and when checkpoint's internals moved."""
    try:
        return _recomputation_pack_hook() is not None
    except Exception:
        return False


def engine_will_run(node) -> bool:
    """Whether the running backward will execute autograd node ``node`` (False outside the
    engine, e.g. under a functorch transform, or with private APIs off)."""
    if not PRIVATE_APIS:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail the run (a device-side assert, no host sync) unless the one-element bool tensor
    ``condition`` holds; for traced code, where reading the value on the host is impossible."""
    if PRIVATE_APIS:
        torch._assert_async(condition, message)


# ---- eager calls without the dispatcher ----
#
# A call of a torch.library op from Python goes through torch's dispatcher and torch.library's
# Python layers (schema, autograd kernel, redispatch): ~130 us of host time a call on a CPU host
# here, against ~15 us for the op's body called directly and ~20 us more for an autograd.Function
# around it (scratch measurement, benchmarks/NOTES.md). A call that no mode, transform or tensor
# subclass would intercept may skip it: ``plain_eager_call`` says whether one would.

_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_LEAN_EAGER_POSSIBLE = None not in (_dispatch_modes, _function_mode_on, _functorch_level)  # else torch moved them
_LEAN_EAGER = PRIVATE_APIS and os.environ.get("TIGON_LEAN_EAGER", "1") == "1" and _LEAN_EAGER_POSSIBLE


def lean_eager_enabled() -> bool:
    return _LEAN_EAGER


def set_lean_eager(enabled: bool) -> None:
    """Turn the direct eager path of tigon's ops on or off (off: every call through torch's dispatcher)."""
    global _LEAN_EAGER
    _LEAN_EAGER = bool(enabled) and _LEAN_EAGER_POSSIBLE


def plain_eager_call(args) -> bool:
    """Whether an op call with ``args`` is plain eager: not traced by torch.compile, no dispatch
    mode (fake tensors, FlopCounterMode, a memory-planning trace), no torch-function mode, no
    torch.func transform, and every tensor argument a plain torch.Tensor / nn.Parameter (no
    DTensor, no functional or fake tensor), so that torch's dispatcher would run the op's own
    body and autograd formula, which the caller may then run directly."""
    if not _LEAN_EAGER or torch.compiler.is_compiling():
        return False
    if _dispatch_modes() or _function_mode_on() or _functorch_level() is not None:
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TENSORS:
            return False
    return True
