"""A training step's GPU memory, counted without a GPU: the step runs on the meta device (shapes
and dtypes, no data, no kernels) under a dispatch mode that adds every new storage's bytes while
it lives, rounded as CUDA's caching allocator rounds a block (512 bytes). What it counts is what
``torch.cuda.max_memory_allocated`` reads for the same step: parameters, gradients, optimizer
state, saved activations and every transient, in the order autograd frees them.

On meta, SDPA would take its math path and keep the [B, heads, T, T] attention matrix; the
step runs with ``planning_attention`` instead, which allocates what the GPU's fused kernels keep
(q, k, v, the output and the log-sum-exp; an additive mask where one is given) and their
backward's fp32 accumulator. tigon's ops take meta tensors (their registered fake
implementations give the output shapes); ``tigon.planning.prediction`` adds their internal workspaces.
"""

from __future__ import annotations

import contextlib
import weakref
from array import array
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tigon.ambient import PLANNING, thread_flag
from tigon.ops._common import OP_BODIES

ALLOCATION_ROUNDING = 512  # bytes: CUDA's caching allocator rounds every block up to this


def allocated_bytes(nbytes: int) -> int:
    """What the caching allocator counts for a request of ``nbytes``."""
    return -(-nbytes // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING


@dataclass
class Allocation:
    """One allocation: its bytes, the op that made it, the first output's shape and dtype."""

    bytes: int
    op: str
    shape: tuple
    dtype: torch.dtype
    phase: str


@dataclass
class MemoryTrace:
    """Live bytes after every allocation and free (``timeline``, with the phase each event fell
    in), the peak and where it happened, and the largest single allocation."""

    peak: int = 0
    peak_phase: str = ""
    timeline: array = field(default_factory=lambda: array("q"))
    phases: list = field(default_factory=list)  # (index into timeline where a phase starts, phase)
    largest: Allocation | None = None

    def from_phase(self, phase: str) -> array:
        """The timeline from the first event of ``phase`` on (the step without its setup)."""
        start = next((i for i, name in self.phases if name == phase), 0)
        return self.timeline[start:]


class AllocationTracker(TorchDispatchMode):
    """Counts the live bytes of every storage created under it (and of those given to
    ``track``), freeing them when the storage dies. Storages are keyed by identity, so views,
    in-place ops and aliases count once."""

    def __init__(self, keep_timeline: bool = True):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.trace = MemoryTrace()
        self.phase = ""
        self.keep_timeline = keep_timeline

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.trace.phases.append((len(self.trace.timeline), phase))

    def track(self, t: torch.Tensor, op: str = "") -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = allocated_bytes(storage.nbytes())
        self.live[key] = nbytes
        self._moved(nbytes)
        largest = self.trace.largest
        if op and self.phase in ("forward", "backward") and (largest is None or nbytes > largest.bytes):
            self.trace.largest = Allocation(nbytes, op, tuple(t.shape), t.dtype, self.phase)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        if nbytes:
            self._moved(-nbytes)

    def _moved(self, delta: int) -> None:
        self.current += delta
        if self.keep_timeline:
            self.trace.timeline.append(self.current)
        if self.current > self.trace.peak:
            self.trace.peak = self.current
            self.trace.peak_phase = self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = OP_BODIES.get(func.name()) if func.namespace == "tigon" else None
        if body is not None:  # the op's own allocations counted too, its launches skipped
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, name)
        return out


# ---- attention as the GPU's fused kernels hold it ----

class _PlanningAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask):
        b, h, t, _ = q.shape
        # The kernels write the output [B, T, H, D] and hand it back transposed: HF's
        # transpose(1, 2).contiguous() after attention is then no copy.
        out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, h, t, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # dq in fp32
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del accumulator, delta
        return dq, dk, dv, None


def planning_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """Stands in for ``F.scaled_dot_product_attention`` in a planning trace: no [T, T] matrix
    (flash / cuDNN / memory-efficient attention keep q, k, v, the output and the log-sum-exp);
    a boolean mask is kept as the additive mask the GPU path converts it to."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask
        if attn_mask.dtype == torch.bool:
            mask = torch.empty(attn_mask.shape, dtype=query.dtype, device=query.device)
    return _PlanningAttention.apply(query, key, value, mask)


@contextlib.contextmanager
def planning_step():
    """A planning trace's block: tigon.ambient.planning() is True and SDPA is planning_attention."""
    with thread_flag(PLANNING), planning_attention_installed():
        yield


@contextlib.contextmanager
def planning_attention_installed():
    """``torch.nn.functional.scaled_dot_product_attention`` is ``planning_attention`` for the
    block (HF's SDPA attention looks it up at each call)."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = planning_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
