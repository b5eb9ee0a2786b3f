"""``tigon bench --host``: host time and kernel launches per forward + backward call of the hot ops
at launch-bound sizes (16 tokens), where the GPU's work is negligible and the time is what the host
spends (Python, checks, dispatch, launches): tigon (its direct eager path), tigon through torch's
dispatcher (the path traced and moded calls take), Liger-Kernel (when installed) and eager torch.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

import tigon.functional as TF
from tigon.bench.harness import host_us_per_call
from tigon.ops import _internals

TOKENS, HIDDEN, INTERMEDIATE, VOCAB, HEAD_DIM = 16, 256, 512, 1024, 64
IMPLS = ("tigon", "tigon via dispatcher", "Liger", "torch eager")


def fwd_bwd(op: Callable) -> Callable:
    """A call of ``op()`` then backward of the sum of its (first) output."""
    def run():
        out = op()
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


def _liger():
    """Liger-Kernel's autograd Functions by op name ({} without Liger)."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return {}
    return dict(rms_norm=LigerRMSNormFunction, layer_norm=LigerLayerNormFunction, rope=LigerRopeFunction,
                swiglu=LigerSiLUMulFunction, cross_entropy=LigerCrossEntropyFunction,
                fused_linear_cross_entropy=LigerFusedLinearCrossEntropyFunction)


def cases(device, dtype=torch.bfloat16) -> dict[str, dict[str, Callable]]:
    """{op: {implementation: a fwd+bwd call}} on leaf tensors of launch-bound sizes."""
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    x, w, b = leaf(TOKENS, HIDDEN), leaf(HIDDEN), leaf(HIDDEN)
    gate, up = leaf(TOKENS, INTERMEDIATE), leaf(TOKENS, INTERMEDIATE)
    q, k = leaf(1, 4, TOKENS, HEAD_DIM), leaf(1, 2, TOKENS, HEAD_DIM)
    cos = torch.randn(1, TOKENS, HEAD_DIM, device=device, dtype=dtype)
    sin = torch.randn(1, TOKENS, HEAD_DIM, device=device, dtype=dtype)
    logits, head = leaf(TOKENS, VOCAB), leaf(VOCAB, HIDDEN, scale=0.05)
    target = torch.randint(0, VOCAB, (TOKENS,), device=device)

    def rotate(t):
        t1, t2 = t.chunk(2, -1)
        return torch.cat((-t2, t1), -1)

    def rms_norm_torch():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w

    ours = dict(
        rms_norm=lambda: TF.rms_norm(x, w),
        layer_norm=lambda: TF.layer_norm(x, w, b),
        rope=lambda: torch.cat([t.flatten() for t in TF.apply_rotary_pos_emb(q, k, cos, sin)]),
        swiglu=lambda: TF.swiglu(gate, up),
        cross_entropy=lambda: TF.cross_entropy(logits, target),
        fused_linear_cross_entropy=lambda: TF.fused_linear_cross_entropy(x, head, target),
    )
    torch_ops = dict(
        rms_norm=rms_norm_torch,
        layer_norm=lambda: F.layer_norm(x, (HIDDEN,), w, b),
        rope=lambda: torch.cat([(t * cos[:, None] + rotate(t) * sin[:, None]).flatten() for t in (q, k)]),
        swiglu=lambda: F.silu(gate) * up,
        cross_entropy=lambda: F.cross_entropy(logits.float(), target),
        fused_linear_cross_entropy=lambda: F.cross_entropy(F.linear(x, head).float(), target),
    )
    liger = _liger()
    theirs = {}
    if liger:
        theirs = dict(
            rms_norm=lambda: liger["rms_norm"].apply(x, w, 1e-6),
            layer_norm=lambda: liger["layer_norm"].apply(x, w, b, 1e-5),
            rope=lambda: torch.cat([t.flatten() for t in liger["rope"].apply(q, k, cos, sin)]),
            swiglu=lambda: liger["swiglu"].apply(gate, up),
            cross_entropy=lambda: liger["cross_entropy"].apply(logits, target, None),  # weight: no default
            fused_linear_cross_entropy=lambda: liger["fused_linear_cross_entropy"].apply(x, head, target),
        )
    out = {}
    for op, call in ours.items():
        row = {"tigon": fwd_bwd(call), "tigon via dispatcher": fwd_bwd(call)}
        if op in theirs:
            row["Liger"] = fwd_bwd(theirs[op])
        row["torch eager"] = fwd_bwd(torch_ops[op])
        out[op] = row
    return out


def kernel_launches(fn: Callable, device) -> int | None:
    """GPU kernels one call launches (torch.profiler's CUDA kernel events); None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
               and "Memset" not in e.name)


def measure(device="cuda", n: int = 300, launches: bool = True, warmup: int = 20, repeats: int = 5) -> list[dict]:
    """One row per (op, implementation): host microseconds per fwd+bwd call, the best of
    ``repeats`` rounds of ``n`` calls (``rounds_us``: every round's), and kernel launches per call.
    An op's implementations take turns within each round, in an order that rotates from round to
    round, so that the host's drift (seconds to minutes; up to 40% between runs on the H200's)
    reaches each of them alike and their ratios hold."""
    rows = []
    lean = _internals.lean_eager_enabled()

    @contextlib.contextmanager
    def path_of(impl):  # "tigon via dispatcher" runs with the direct eager path off
        _internals.set_lean_eager(lean and impl != "tigon via dispatcher")
        try:
            yield
        finally:
            _internals.set_lean_eager(lean)

    for op, impls in cases(device).items():
        names = list(impls)
        rounds = {impl: [] for impl in names}
        for impl in names:
            with path_of(impl):
                host_us_per_call(impls[impl], 1, warmup, 1, device)  # compiles and warms each before any round
        for r in range(repeats):
            for impl in names[r % len(names):] + names[:r % len(names)]:
                with path_of(impl):
                    rounds[impl].append(host_us_per_call(impls[impl], n, 0, 1, device))
        for impl in names:
            with path_of(impl):
                count = kernel_launches(impls[impl], device) if launches else None
            rows.append(dict(op=op, impl=impl, host_us=min(rounds[impl]), rounds_us=rounds[impl], launches=count))
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: microseconds (launches) per call, an op a row; tigon's ratio to Liger's."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    lines = ["| op (fwd + bwd, 16 tokens) | " + " | ".join(impls) + " | tigon / Liger |",
             "|---" * (len(impls) + 2) + "|"]
    for op in dict.fromkeys(r["op"] for r in rows):
        cell = {r["impl"]: r for r in rows if r["op"] == op}
        texts = [f"{cell[i]['host_us']:.0f} us" + (f" ({cell[i]['launches']})" if cell[i]["launches"] is not None
                                                     else "") if i in cell else "" for i in impls]
        ratio = f"{cell['tigon']['host_us'] / cell['Liger']['host_us']:.2f}x" if "Liger" in cell else "n/a"
        lines.append(f"| {op} | " + " | ".join(texts) + f" | {ratio} |")
    return "\n".join(lines)


def run(out: str, device="cuda") -> str:
    """Measure, print and write ``out``/host.json and host.md; returns the table."""
    rows = measure(device)
    text = table(rows)
    os.makedirs(out, exist_ok=True)
    name = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"
    with open(os.path.join(out, "host.json"), "w") as f:
        json.dump(dict(device=name, torch=torch.__version__, rows=rows), f, indent=1)
    with open(os.path.join(out, "host.md"), "w") as f:
        f.write(f"Host time per call, microseconds (kernel launches), {name}\n\n{text}\n")
    print(text)
    return text
