"""Ambient state: what changes an op or a patched forward without being passed to it, listed in
one place: the per-thread states below and the label-check policy. A per-thread state is a
``ThreadFlag`` (on / off) or a ``ThreadValue``: each exists in every thread from its first
access, so that torch.compile's guards on it read the same before and after a first call sets
it. Nothing here imports the rest of tigon."""

from __future__ import annotations

import collections
import contextlib
import os
import threading

import torch


class ThreadFlag(threading.local):
    """A per-thread flag, off in every thread until ``thread_flag`` sets it. Each thread's
    value exists from its first access (threading.local runs __init__ per thread), so that
    torch.compile's guards on it read the same before and after a first call sets it."""

    def __init__(self):
        self.on = False


def thread_flag(local: ThreadFlag, value: bool = True):
    """``local.on = value`` for the block, then what it was before."""
    return _set_for_block(local, "on", value)


class ThreadValue(threading.local):
    """A per-thread value, ``default`` in every thread until ``thread_value`` sets it."""

    def __init__(self, default=None):
        self.value = default


def thread_value(local: ThreadValue, value):
    """``local.value = value`` for the block, then what it was before."""
    return _set_for_block(local, "value", value)


@contextlib.contextmanager
def _set_for_block(local, attribute: str, value):
    before = getattr(local, attribute)
    setattr(local, attribute, value)
    try:
        yield
    finally:
        setattr(local, attribute, before)


# ---- every per-thread state ----

# A memory-planning trace is running (tigon.planning.memory_trace.planning_step): code that
# refuses meta tensors in normal use (tigon's MoE experts leave meta weights to HF's forward)
# takes them there.
PLANNING = ThreadFlag()
# Label checks queue instead of waiting for the GPU (deferred_label_checks, below).
DEFERRED_LABEL_CHECKS = ThreadFlag()
# The labels were checked once for the block (tigon.ops._cross_entropy_common.labels_checked): the
# linear_token_logps calls inside skip their own checks.
LABELS_CHECKED = ThreadFlag()
# While torch.compile traces a training call of a model whose decoder layers HF checkpoints
# (set by the patched causal-LM forward and tigon.torchtune): the compiler traces those regions
# without the hooks that tell an eager call so (tigon.ops.glu_mlp.gated_mlp).
CHECKPOINTED_LAYERS = ThreadFlag()
# A patched attention module's forward is running: a module-wide RoPE dispatcher runs tigon's
# RoPE (tigon.patching.rope.make_rope_dispatcher), HF's otherwise.
ROPE_SCOPE = ThreadFlag()
# A patched causal-LM forward runs on positions HF generates itself (nothing packed): HF's
# packed-sequence check answers without reading the GPU.
GENERATED_POSITIONS = ThreadFlag()
# The dict the capturing output head writes the causal-LM loss into (None: a plain head).
HEAD_CAPTURE = ThreadValue(None)
# The open accumulate_head_grads blocks of tigon.ops.linear_token_logps, innermost last.
HEAD_GRAD_BLOCKS = ThreadValue(())
# The tied-gradient slot of the embedding / FLCE op call in progress (tigon.ops.embedding).
TIED_GRAD_SLOT = ThreadValue(None)


def planning() -> bool:
    """True inside a memory-planning trace (this thread)."""
    return PLANNING.on


# ---- the label-check policy ----
#
# Cross entropy, FLCE, the vocabulary-parallel losses and the MoE router's expert ids check
# their labels against the range: one host sync a call (a clear error instead of a kernel
# reading outside the row). TIGON_CHECK_LABELS=0 skips it, as does CUDA-graph capture;
# out-of-range labels then give a NaN loss. Inside ``deferred_label_checks()`` (the patched HF
# models' loss, tigon.torchtune) a CUDA call does not wait: it queues the check, and a later
# call raises once the result has arrived; the call with the bad label gives a NaN loss meanwhile.
CHECK_LABELS = os.environ.get("TIGON_CHECK_LABELS", "1") != "0"
MAX_PENDING_LABEL_CHECKS = 8  # beyond this the oldest check waits for its result
_PENDING_LABEL_CHECKS: collections.deque = collections.deque()


def deferred_label_checks():
    """Inside the block, label checks on CUDA do not sync the host with the GPU (see above)."""
    return thread_flag(DEFERRED_LABEL_CHECKS)


def resolve_label_checks(wait: bool = False) -> None:
    """Raise for a queued label check that found a bad label: those whose result has arrived,
    or all of them with ``wait=True``."""
    while _PENDING_LABEL_CHECKS and (wait or _PENDING_LABEL_CHECKS[0][0].query()):
        event, found, n_classes, ignore_index = _PENDING_LABEL_CHECKS.popleft()
        event.synchronize()
        if found[0]:
            _PENDING_LABEL_CHECKS.clear()
            raise ValueError(f"target held {int(found[1])}, outside [0, {n_classes}) and not ignore_index="
                             f"{ignore_index}, in an earlier call (checked without waiting for the GPU; that "
                             "call's loss was NaN)")


def queue_label_check(stats, n_classes, ignore_index) -> None:
    """Queue the check of ``stats`` (int64 [2] on the GPU: bad labels found, the largest of them)."""
    resolve_label_checks()
    found = torch.empty(2, dtype=torch.int64, pin_memory=True)
    found.copy_(stats, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _PENDING_LABEL_CHECKS.append((event, found, n_classes, ignore_index))
    if len(_PENDING_LABEL_CHECKS) > MAX_PENDING_LABEL_CHECKS:
        _PENDING_LABEL_CHECKS[0][0].synchronize()
        resolve_label_checks()


def interpret_kernels_without_gpu() -> None:
    """Turn on Triton's interpreter (``TRITON_INTERPRET=1``) when torch sees no CUDA GPU and the
    user has not set the variable either way. Triton reads it when each kernel is defined, so
    this runs before tigon defines any (first thing in ``tigon/__init__``); Triton's own library
    is defined when triton is first imported, so it works only when tigon comes before triton
    (transformers imports it): otherwise the first kernel call says so (ops._common.check_tensor).
    Without a GPU the interpreter is the only way a Triton kernel runs: slow (numpy), exact, and
    what the tests use on the CPU."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

