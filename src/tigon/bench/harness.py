"""Time and memory of one implementation of one op, and the GPU's two ceilings.

Every implementation is measured the same way: median of CUDA-event timings
(``triton.testing.do_bench``, which flushes L2 between repeats, warm-up excluded) of the
forward, the backward (graph retained) and forward+backward; and the peak memory allocated
during one forward+backward above what was allocated before it (inputs excluded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    dtype: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    full_ms: float | None = None  # fwd+bwd dispatched eagerly from Python: includes host overhead
    graph_ms: float | None = None  # the same fwd+bwd replayed as one CUDA graph: GPU time
    peak_mb: float | None = None
    grads_mb: float | None = None  # the gradients fwd+bwd returns (counted in peak_mb)
    bytes_full: int | None = None  # fewest bytes fwd+bwd must move (each input read once, output written once)
    flops_full: int | None = None
    gbps: float | None = None  # bytes_full / GPU time (graph_ms, else full_ms)
    tflops: float | None = None
    frac_of_limit: float | None = None  # of the measured copy bandwidth (or matmul rate for flops-bound ops)
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self):
        return asdict(self)


_GENERATOR = None


def generator(device="cuda") -> torch.Generator:
    """The harness's own CUDA generator: a graph capture that fails inside some implementation
    can leave the default generator unusable; inputs and cotangents never depend on it."""
    global _GENERATOR
    if _GENERATOR is None:
        _GENERATOR = torch.Generator(device=device)
        _GENERATOR.manual_seed(0)
    return _GENERATOR


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def _bench(fn, grad_to_none=None, repeats=30):
    """Median ms; at least ~`repeats` timed repeats however long one call is."""
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end)
    return float(do_bench(fn, warmup=max(25, 3 * estimate), rep=max(100 * repeats / 30, repeats * estimate),
                          grad_to_none=grad_to_none, return_mode="median"))


def _graph_ms(full: Callable, leaves: list, repeats: int = 30) -> float:
    """fwd+bwd captured once as a CUDA graph, then timed by replay: GPU time without host overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as CUDA graph capture asks
        for _ in range(3):
            for t in leaves:
                t.grad = None
            full()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        full()
    ms = _bench(graph.replay, repeats=repeats)
    del graph
    for t in leaves:
        t.grad = None
    return ms


def measure(fn: Callable, inputs: list, row: Row, limits: dict | None = None, grad_output: float | None = None,
            quick: bool = False) -> Row:
    """Fill row with fwd / bwd / full / graph ms and peak MB of fn(*inputs) on the current device.
    The backward gets random cotangents, or every element equal to ``grad_output`` when given
    (1.0: what ``loss.backward()`` passes to a scalar loss). quick: ~10 repeats instead of ~30,
    and the backward's time taken as fwd+bwd minus fwd rather than timed on its own."""
    repeats = 10 if quick else 30
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    try:
        outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
        cotangents = [torch.randn(o.shape, device=o.device, dtype=o.dtype, generator=generator())
                      if grad_output is None else torch.full(o.shape, grad_output, device=o.device, dtype=o.dtype)
                      for o in outs]

        def full():
            torch.autograd.backward([o for o in _outputs(fn(*inputs)) if o.requires_grad], cotangents)

        row.fwd_ms = _bench(lambda: fn(*inputs), repeats=repeats)
        row.full_ms = _bench(full, grad_to_none=leaves, repeats=repeats)
        try:
            if quick:
                raise RuntimeError("not timed on its own")
            outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
            row.bwd_ms = _bench(lambda: torch.autograd.backward(outs, cotangents, retain_graph=True),
                                grad_to_none=leaves)
        except RuntimeError:  # some compiled graphs refuse a retained second backward
            row.bwd_ms = row.full_ms - row.fwd_ms
        outs = None  # release the retained graph
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        full()
        torch.cuda.synchronize()
        row.peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        # Gradients written over their own input (in-place implementations) are no new memory.
        row.grads_mb = sum(t.grad.numel() * t.grad.element_size() for t in leaves
                           if t.grad is not None
                           and t.grad.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                           ) / 2**20
        for t in leaves:
            t.grad = None
        try:
            row.graph_ms = _graph_ms(full, leaves, repeats)
        except Exception as exc:  # not capturable (a host sync inside): eager times only
            row.extra["graph_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # a peer that fails on a shape is reported, not fatal
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return row
    return fill_rates(row, limits)


def fill_rates(row: Row, limits: dict | None) -> Row:
    """Achieved GB/s (TFLOP/s for flops-counted ops) over GPU time, and its fraction of the limit."""
    gpu_ms = row.graph_ms or row.full_ms
    if row.bytes_full and gpu_ms:
        row.gbps = row.bytes_full / gpu_ms / 1e6
        if limits and limits.get("copy_gbps"):
            row.frac_of_limit = row.gbps / limits["copy_gbps"]
    if row.flops_full and gpu_ms:
        row.tflops = row.flops_full / gpu_ms / 1e9
        if limits and limits.get("matmul_tflops"):
            row.frac_of_limit = row.tflops / limits["matmul_tflops"]
    return row


def measure_limits(device="cuda") -> dict:
    """The two ceilings, measured: device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    n = 2**30  # 2 GiB of bf16 each way: far past L2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    src = dst = None
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = _bench(lambda: a @ b)
    a = b = None
    torch.cuda.empty_cache()
    return {
        "copy_gbps": 2 * n * 2 / copy_ms / 1e6,
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
        "gpu": torch.cuda.get_device_name(),
    }


def host_us_per_call(fn: Callable, n: int = 300, warmup: int = 20, repeats: int = 1, device="cuda") -> float:
    """Microseconds per call of ``fn`` over ``n`` calls, synchronizing ``device`` only at the ends:
    on tiny tensors this is the host's cost (Python, launches), not the GPU's. With ``repeats``,
    the best of that many runs of ``n`` (the host's cost without the machine's other work)."""
    import time

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def gpu_ms(row: Row) -> float | None:
    """GPU time of fwd+bwd: the CUDA-graph replay, else the eager-dispatch time."""
    return row.graph_ms or row.full_ms


def speedups(rows: list[Row]) -> dict:
    """(op, shape, impl) -> torch eager's GPU ms / this row's, for rows with both."""
    eager = {(r.op, r.shape): gpu_ms(r) for r in rows if r.impl == "torch eager" and not r.error and gpu_ms(r)}
    return {(r.op, r.shape, r.impl): eager[(r.op, r.shape)] / gpu_ms(r)
            for r in rows if not r.error and gpu_ms(r) and (r.op, r.shape) in eager}


def markdown_table(rows: list[Row]) -> str:
    """One line per (op, shape, impl).

    "GPU ms" is the fwd+bwd CUDA-graph replay (kernel time); "eager ms" the same dispatched
    from Python (host overhead included). Speed-up, achieved rate and fraction of the limit are
    from GPU ms, relative to torch eager of the same op and shape.
    """
    ratio = speedups(rows)
    lines = [
        "| op | shape | impl | fwd ms | bwd ms | fwd+bwd eager ms | fwd+bwd GPU ms | vs eager | peak MB "
        "| peak - grads MB | achieved | of limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.op} | {r.shape} | {r.impl} | failed: {r.error} | | | | | | | | |")
            continue
        speed = f"{ratio[(r.op, r.shape, r.impl)]:.2f}x" if (r.op, r.shape, r.impl) in ratio else ""
        achieved = f"{r.gbps:.0f} GB/s" if r.gbps else (f"{r.tflops:.0f} TFLOP/s" if r.tflops else "")
        frac = f"{100 * r.frac_of_limit:.0f}%" if r.frac_of_limit else ""
        graph = f"{r.graph_ms:.3f}" if r.graph_ms else "n/a"
        extra = f"{r.peak_mb - r.grads_mb:.0f}" if r.grads_mb is not None and r.peak_mb is not None else ""
        ms = [f"{v:.3f}" if v is not None else "" for v in (r.fwd_ms, r.bwd_ms, r.full_ms)]
        peak = f"{r.peak_mb:.0f}" if r.peak_mb is not None else ""
        lines.append(
            f"| {r.op} | {r.shape} | {r.impl} | {ms[0]} | {ms[1]} | {ms[2]} | {graph} "
            f"| {speed} | {peak} | {extra} | {achieved} | {frac} |"
        )
    return "\n".join(lines)
