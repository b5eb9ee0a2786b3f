"""Ambient state: per-thread flags that change what an op or a patched forward does without
being passed to it. ``ThreadFlag`` is the type every such flag uses: each exists in every thread
from its first access (off), so that torch.compile's guards on it read the same before and
after a first call sets it."""

from __future__ import annotations

import contextlib
import threading


class ThreadFlag(threading.local):
    """A per-thread flag, off in every thread until ``thread_flag`` sets it. Each thread's
    value exists from its first access (threading.local runs __init__ per thread), so that
    torch.compile's guards on it read the same before and after a first call sets it."""

    def __init__(self):
        self.on = False


@contextlib.contextmanager
def thread_flag(local: ThreadFlag, value: bool = True):
    """``local.on = value`` for the block, then what it was before."""
    before = local.on
    local.on = value
    try:
        yield
    finally:
        local.on = before


# Inside a memory-planning trace (tigon.planning.memory_trace.planning_step): code that refuses meta
# tensors in normal use (tigon's MoE experts leave meta weights to HF's forward) takes them there.
PLANNING = ThreadFlag()


def planning() -> bool:
    """True inside a memory-planning trace (this thread)."""
    return PLANNING.on
