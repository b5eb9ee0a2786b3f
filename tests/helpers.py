"""Compare a tigon op with a float64 torch reference, forward and backward.

``check_op`` runs the op on inputs of the dtype under test, the reference on float64 copies of
the same (already rounded) inputs, and torch eager on the test-dtype inputs. Each output and
each input gradient must be NaN-free, within ``TOL[dtype]`` of the float64 result (relative
Frobenius error), and not much worse than eager torch at the same precision.
"""

from __future__ import annotations

import contextlib
import os

import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    DEVICE = None
ON_GPU = DEVICE == "cuda"


def _interpreter_rounds_bf16_to_nearest() -> bool:
    """Triton's interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest even.

    Truncation doubles the rounding error of every bf16 output, so kernels tested in the
    interpreter would look twice as inexact as they are on the GPU. Make the interpreter round
    like the GPU. Returns False if triton's internals moved (the checks then allow for it).
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    if getattr(original, "_tigon_rtne", False):
        return True

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert_float._tigon_rtne = True
    interpreter._convert_float = convert_float
    return True


BF16_ROUNDS_TO_NEAREST = ON_GPU or (DEVICE == "cpu" and _interpreter_rounds_bf16_to_nearest())

# Relative error bounds against float64 (no matmul involved: no tf32).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# Below this, being worse than eager torch is rounding noise, not a bug.
NOISE_FLOOR = {torch.float32: 2e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}

DTYPES = [torch.float32, torch.bfloat16]


def pick(cpu, gpu):
    """Small cases in the interpreter, realistic ones on the GPU."""
    return gpu if ON_GPU else cpu


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


def randn(shape, dtype, *, non_contiguous=False, scale=1.0, shift=0.0, requires_grad=False):
    """Random tensor on DEVICE.

    non_contiguous gives a row-padded view (row stride > last dim), or, for a single row, a
    view with last-dim stride 2.
    """
    shape = tuple(shape)
    if non_contiguous:
        wide = shape[:-1] + (shape[-1] + 5,)
        t = (torch.randn(wide, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)[..., : shape[-1]]
        if t.is_contiguous():
            wide = shape[:-1] + (2 * shape[-1],)
            t = (torch.randn(wide, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)[..., ::2]
        assert not t.is_contiguous()
    else:
        t = (torch.randn(shape, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)
    return t.requires_grad_(requires_grad)


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _grads(fn, inputs, cotangents):
    outs = _as_tuple(fn(*inputs))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outs, cotangents) if o.requires_grad]
    grads = (torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
             if pairs else [])
    return outs, grads


def _copy_inputs(inputs, dtype=None):
    copies = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            c = t.detach().to(dtype) if dtype is not None else t.detach().clone()
            copies.append(c.requires_grad_(t.requires_grad))
        else:
            copies.append(t)
    return copies


def check_op(fn, ref, inputs, *, dtype, tol=None, what="op", backward=True, worse_than_eager=2.0,
             noise_floor=None):
    """fn(*inputs) vs ref(*float64 copies) vs ref(*inputs) (eager at the test precision).

    Outputs and the gradients of every input with requires_grad=True (under random
    cotangents, not ones) are compared. Returns the errors, for messages.
    """
    tol = tol if tol is not None else TOL[dtype]
    floor = noise_floor if noise_floor is not None else NOISE_FLOOR[dtype]
    worse_factor = worse_than_eager * (1.0 if BF16_ROUNDS_TO_NEAREST or dtype != torch.bfloat16 else 1.5)
    ours_in = _copy_inputs(inputs)
    ref_in = _copy_inputs(inputs, torch.float64)
    eager_in = _copy_inputs(inputs)
    with torch.no_grad():
        probe = _as_tuple(ref(*_copy_inputs(inputs, torch.float64)))
    cotangents = [torch.randn(p.shape, device=p.device, dtype=torch.float64) for p in probe]
    if backward:
        ours_out, ours_g = _grads(fn, ours_in, cotangents)
        ref_out, ref_g = _grads(ref, ref_in, cotangents)
        eager_out, eager_g = _grads(ref, eager_in, cotangents)
    else:
        with torch.no_grad():
            ours_out, ref_out, eager_out = (_as_tuple(f(*i))
                                            for f, i in ((fn, ours_in), (ref, ref_in), (ref, eager_in)))
        ours_g = ref_g = eager_g = []
    errors = {}
    names = [f"output{i}" for i in range(len(ref_out))] + [f"grad{i}" for i in range(len(ref_g))]
    for name, o, r, e in zip(names, list(ours_out) + list(ours_g), list(ref_out) + list(ref_g),
                             list(eager_out) + list(eager_g)):
        if r is None:
            assert o is None, f"{what}: {name} should have no gradient"
            continue
        assert o is not None, f"{what}: {name} is missing"
        assert o.shape == r.shape, f"{what}: {name} has shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        assert o.dtype == e.dtype, f"{what}: {name} has dtype {o.dtype}, eager torch gives {e.dtype}"
        err, eager_err = rel_err(o, r), rel_err(e, r)
        errors[name] = err
        assert err <= tol, f"{what}: {name} relative error {err:.3g} > {tol:.3g} (eager torch: {eager_err:.3g})"
        assert err <= max(worse_factor * eager_err, floor), (
            f"{what}: {name} relative error {err:.3g} is worse than eager torch's {eager_err:.3g}"
        )
    return errors


def check_module(ours, theirs, inputs, *, dtype, tol=None, what="module"):
    """Our module (theirs' weights loaded) vs theirs, as functions of (inputs..., parameters...).

    Gradients of the inputs that require grad and of every parameter are compared.
    """
    from torch.func import functional_call

    ours.load_state_dict(theirs.state_dict())
    names = [n for n, _ in theirs.named_parameters()]
    params = [p.detach().to(device=DEVICE, dtype=dtype).requires_grad_(True) for _, p in theirs.named_parameters()]
    ours, theirs = ours.to(DEVICE), theirs.to(DEVICE)
    n_in = len(inputs)

    def call(module):
        return lambda *args: functional_call(module, dict(zip(names, args[n_in:])), tuple(args[:n_in]))

    return check_op(call(ours), call(theirs), [*inputs, *params], dtype=dtype, tol=tol, what=what)


def recording_backend():
    """(ops, backend): a torch.compile backend that runs the graph as traced and adds the target
    of every function call in it and in its subgraphs (checkpointed regions) to ``ops``."""
    ops = set()

    def backend(gm, example_inputs):
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                ops.update(str(n.target) for n in sub.graph.nodes if n.op == "call_function")
        return gm.forward

    return ops, backend


def launches_take_turns(monkeypatch):
    """Triton's interpreter is not thread-safe: every kernel launch of tigon's ops takes turns under
    one lock (everything else runs concurrently). Each op module binds ``launch`` at import, so
    each module's name is patched."""
    import sys
    import threading

    from tigon.ops import _internals

    lock = threading.Lock()
    unlocked = _internals.launch

    def launch(*args, **kwargs):
        with lock:
            return unlocked(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name.startswith("tigon.ops.") and module is not _internals
                and getattr(module, "launch", None) is unlocked):
            monkeypatch.setattr(module, "launch", launch)


def run_in_threads(target, barriers=(), n=2):
    """target(i) for i in range(n), each in a thread of its own; re-raises what one raised (after
    aborting ``barriers``, so that the other threads stop waiting at them)."""
    import threading

    errors = []

    def run(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 -- re-raised by the calling thread
            errors.append(e)
            for barrier in barriers:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# ---- several ranks (torch.distributed) ----

def run_on_ranks(cases_of, world: int = 2, timeout_s: int = 300) -> list[dict]:
    """Each rank's {case name: "ok" or what failed}, from one job of ``world`` processes: gloo on
    the CPU (forked: no second import of torch, Triton and tigon), NCCL on ``world`` GPUs
    (spawned: CUDA cannot be forked once initialised; skipped with fewer GPUs). ``cases_of(rank,
    device)``, a module-level function, gives the rank's cases as {name: zero-argument callable
    returning "ok" or a description}; a case that raises is reported and the others still run.
    Every rank must run the same cases in the same order (they make collectives)."""
    import json
    import socket
    import tempfile

    import pytest
    import torch.multiprocessing as mp

    if ON_GPU and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks on the GPU need {world} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        job = mp.start_processes(_rank_main, args=(port, out_dir, world, cases_of), nprocs=world, join=False,
                                 start_method="spawn" if ON_GPU else "fork")
        for _ in range(timeout_s):
            if job.join(timeout=1):
                break
        else:
            for process in job.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish within {timeout_s} s")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def _rank_main(rank, port, out_dir, world, cases_of):
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from tigon.ops._common import set_poison_outputs

    set_poison_outputs(True)
    torch.set_num_threads(1)  # a forked child's first parallel region would hang in OpenMP
    device = torch.device("cuda", rank) if ON_GPU else torch.device("cpu")
    if ON_GPU:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    results = {}
    try:
        for name, case in cases_of(rank, device).items():
            try:
                results[name] = case()
            except Exception as e:  # reported, and the other cases still run
                results[name] = f"{type(e).__name__}: {e}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def fp32_matmul_settings():
    """torch's process-wide fp32 precision settings (TF32 or IEEE for matmuls and cuDNN)."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, getattr(torch.backends, "fp32_precision", None))


@contextlib.contextmanager
def fp32_matmul_settings_kept():
    """Restore torch's fp32 precision settings after the block (HF's TrainingArguments with
    torch_compile=True turns TF32 on for the process)."""
    before = fp32_matmul_settings()
    try:
        yield
    finally:
        precision, matmul_tf32, cudnn_tf32, overall = before
        if overall is not None:
            torch.backends.fp32_precision = overall
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
