"""The memory planner: the batch size and activation checkpointing that fit a memory budget at
the best estimated tokens/s (``recommend``), and ``tigon plan``'s answer for HF and HF + tigon
(``plan``: a MemoryPlan, with its printed report). Each candidate step is predicted on the meta
device (tigon.planning.prediction); the config comes from tigon.planning.model_config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tigon.planning.model_config import load_config
from tigon.planning.prediction import ASSUMED_FLOPS, STEP_OVERHEAD_S, StepMemory, StepTracer, predict_step
from tigon.sizes import GiB, parse_bytes

# Of the budget, what allocations may take: the rest is the CUDA context, cuBLAS's and NCCL's
# workspaces outside the allocator, and room for the caching allocator's fragmentation.
USABLE_FRACTION = 0.92


@dataclass
class Recommendation:
    """The batch size and checkpointing with the best estimated tokens/s within the budget."""

    step: StepMemory
    budget: int

    def __str__(self):
        s = self.step
        return (f"batch {s.batch} x {s.seq} tokens, checkpointing {s.checkpointing}: peak {s.peak / GiB:.2f} GiB "
                f"(+ {(s.required - s.peak) / GiB:.2f} allocator headroom) of {self.budget / GiB:.2f} usable, "
                f"~{s.estimated_tokens_per_s / 1e3:.0f}K tokens/s (estimate)")


def usable_bytes(gpu_memory) -> int:
    """What allocations may take of a GPU with ``gpu_memory`` (USABLE_FRACTION of it)."""
    return int(parse_bytes(gpu_memory, "gpu_memory") * USABLE_FRACTION)


def default_gpu_memory() -> int | None:
    """The current CUDA device's total memory, or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def _largest_fitting_batch(tracer: StepTracer, seq: int, n: int, budget: int, max_batch: int):
    """(largest batch whose step fits ``budget`` with ``n`` checkpointed layers, its step, the
    step at about half that batch) by doubling then bisection; (0, None, None) when batch 1 does not fit."""
    steps = {}

    def fits(b):
        steps[b] = tracer.trace(b, seq, n)
        return steps[b].required <= budget

    if not fits(1):
        return 0, None, None
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > max(1, lo // 64):  # within 1.5%: the tokens/s estimate is no finer
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    half = min(steps, key=lambda b: abs(b - lo / 2))
    return lo, steps[lo], steps[half]


def recommend(model_or_config, seq: int, budget: int, *, tigon: bool = True, batch: int | None = None,
              optimizer: str = "adamw", dtype: torch.dtype = torch.bfloat16, max_batch: int = 4096,
              patch_options=None, progress=None) -> Recommendation | None:
    """The (batch, checkpointed decoder layers) with the best estimated tokens/s whose
    predicted peak fits ``budget`` bytes (the batch fixed when given); None when nothing fits.
    The largest batch is found by tracing with no layer and with every layer checkpointed; the
    peak is affine in the number of checkpointed layers (each keeps the same) and, at those
    batch sizes, in the batch, which places the layer counts between; the choice is traced to
    confirm it. ``progress``: called after each traced step."""
    tracer = StepTracer(model_or_config, tigon=tigon, optimizer=optimizer, dtype=dtype, patch_options=patch_options,
                        progress=progress)
    n_layers = len(tracer.layers)
    if batch is not None:  # the fewest checkpointed layers that fit
        none, every = tracer.trace(batch, seq, 0), tracer.trace(batch, seq, n_layers)
        if none.required <= budget:
            return Recommendation(none, budget)
        if every.required > budget:
            return None
        n = max(1, math.ceil(n_layers * (none.required - budget) / max(none.required - every.required, 1)))
        while n < n_layers:
            step = tracer.trace(batch, seq, n)
            if step.required <= budget:
                return Recommendation(step, budget)
            n += 1
        return Recommendation(every, budget)
    b_none, top_none, half_none = _largest_fitting_batch(tracer, seq, 0, budget, max_batch)
    b_all, top_all, half_all = _largest_fitting_batch(tracer, seq, n_layers, budget, max_batch)
    if top_all is None and top_none is None:
        return None

    def affine(top, half):  # required(b) = a + b * slope from two traced batch sizes
        slope = (top.required - half.required) / (top.batch - half.batch) if top.batch != half.batch else 0.0
        return top.required - top.batch * slope, slope

    candidates = [(b_none, 0)] if b_none else []
    if top_all is not None:
        candidates.append((b_all, n_layers))
    if top_none is not None and top_all is not None and b_all > b_none + 1:
        (a0, s0), (a1, s1) = affine(top_none, half_none), affine(top_all, half_all)
        for n in range(1, n_layers):
            f = n / n_layers
            a, slope = a0 + f * (a1 - a0), s0 + f * (s1 - s0)
            b = min(max_batch, int((budget - a) // slope)) if slope > 0 else max_batch
            if b > b_none:
                candidates.append((b, n))

    def speed(c):
        b, n = c
        return b * seq / (STEP_OVERHEAD_S + tracer.flop_model.flops(b, seq, n) / ASSUMED_FLOPS)

    for b, n in sorted(candidates, key=speed, reverse=True):
        if (b, n) == (b_none, 0):
            return Recommendation(top_none, budget)
        if (b, n) == (b_all, n_layers):
            return Recommendation(top_all, budget)
        step = tracer.trace(b, seq, n)
        while step.required > budget and b > 1:  # the affine estimate was short: step down
            b -= max(1, b // 32)
            step = tracer.trace(b, seq, n)
        if step.required <= budget and speed((b, n)) >= speed((b_none, 0)):
            return Recommendation(step, budget)
    return Recommendation(top_none if top_none is not None else top_all, budget)


@dataclass
class MemoryPlan:
    """``tigon plan``'s answer: the predicted step at the batch asked for (or the recommended
    one) for HF and for HF + tigon, and each one's recommendation within the budget."""

    model: str
    seq: int
    budget: int | None
    hf: StepMemory | None
    tigon: StepMemory | None
    hf_recommendation: Recommendation | None
    tigon_recommendation: Recommendation | None

    def to_dict(self) -> dict:
        """The numbers as plain values (bytes), for JSON."""
        def step(s):
            if s is None:
                return None
            return dict(batch=s.batch, seq=s.seq, tigon=s.tigon, checkpointed_layers=s.checkpointed_layers,
                        n_layers=s.n_layers, optimizer=s.optimizer, parameters=s.parameters, gradients=s.gradients,
                        optimizer_state=s.optimizer_state, activations=s.activations,
                        layer_activations=s.layer_activations, peak=s.peak, peak_phase=s.peak_phase,
                        largest=s.largest_description(), estimated_tokens_per_s=s.estimated_tokens_per_s)

        return dict(model=self.model, seq=self.seq, budget=self.budget, hf=step(self.hf), tigon=step(self.tigon),
                    hf_recommendation=step(self.hf_recommendation.step) if self.hf_recommendation else None,
                    tigon_recommendation=step(self.tigon_recommendation.step) if self.tigon_recommendation else None)

    def report(self) -> str:
        lines = [f"{self.model}, sequences of {self.seq} tokens"]
        steps = [(name, s) for name, s in (("HF", self.hf), ("HF + tigon", self.tigon)) if s is not None]
        if steps:
            lines.append(f"predicted training step ({steps[0][1].optimizer}), GiB:")
            labels = ["batch", "checkpointing"] + [label for label, _ in steps[0][1].breakdown()]
            columns = [[str(s.batch), s.checkpointing] + [v for _, v in s.breakdown()] for _, s in steps]
            width = max(map(len, labels)) + 2
            col = max(14, *(len(v) + 2 for c in columns for v in c))
            lines.append(" " * width + "".join(f"{name:>{col}s}" for name, _ in steps))
            for i, label in enumerate(labels):
                lines.append(f"{label:<{width}s}" + "".join(f"{c[i]:>{col}s}" for c in columns))
            for name, s in steps:
                lines.append(f"largest single allocation, {name}: {s.largest_description()}")
        if self.budget is not None:
            lines.append(f"recommended within {self.budget / GiB:.1f} GiB usable "
                         f"({USABLE_FRACTION:.0%} of the GPU's memory):")
            for name, step, rec in (("HF", self.hf, self.hf_recommendation),
                                    ("HF + tigon", self.tigon, self.tigon_recommendation)):
                if step is not None:
                    lines.append(f"  {name:11s} {rec if rec else 'nothing fits (batch 1, every layer checkpointed)'}")
        return "\n".join(lines)


def plan(model_or_config, seq: int, *, batch: int | None = None, gpu_memory=None, optimizer: str = "adamw",
         tigon: bool = True, hf: bool = True, dtype: torch.dtype = torch.bfloat16, checkpointing=None,
         patch_options=None, progress=None) -> MemoryPlan:
    """Predict a training step's memory for HF and for HF + tigon and recommend, for each, the
    batch size (``batch`` when given) and checkpointing that maximise estimated tokens/s within
    ``gpu_memory`` (bytes or '80GiB'; default: this machine's GPU; None without one: no
    recommendation). The predicted steps are at ``batch``, else at the recommended batch, else 1."""
    config = load_config(model_or_config)
    if gpu_memory is None:
        gpu_memory = default_gpu_memory()
    budget = usable_bytes(gpu_memory) if gpu_memory is not None else None
    kw = dict(optimizer=optimizer, dtype=dtype, patch_options=patch_options)
    out = {}
    for name, on in (("hf", hf), ("tigon", tigon)):
        if not on:
            out[name] = out[name + "_rec"] = None
            continue
        rec = (recommend(config, seq, budget, tigon=name == "tigon", batch=batch, progress=progress, **kw)
               if budget else None)
        out[name + "_rec"] = rec
        if batch is None and checkpointing is None and rec is not None:
            out[name] = rec.step
        else:
            out[name] = predict_step(config, batch or 1, seq, tigon=name == "tigon", checkpointing=checkpointing, **kw)
    name = getattr(config, "_name_or_path", "") or config.model_type
    return MemoryPlan(name, seq, budget, out["hf"], out["tigon"], out["hf_rec"], out["tigon_rec"])
