"""How much of a training step the GPU waits for the host: benchmarks/train_hf.py's setup, HF vs
HF + tigon. For each, per step:

- wall: the step as it runs (forward, backward, AdamW), synchronizing at the end;
- GPU: the same step queued behind a long ``torch.cuda._sleep`` so the host runs ahead, minus
  the sleep: the GPU's own time for the step. wall - GPU is time the GPU sat idle waiting for
  the host (launches, Python) or for a host sync;
- the same for the forward alone (autograd on, graph dropped).

HF's mask creation syncs the host once a step (its packed-sequence check on position_ids), which
would stop the host from running ahead; ``--no-mask-sync`` replaces that check by "not packed"
(true for these batches) in both runs, and the GPU column always uses it. CUDA only:
``PYTHONPATH=src python benchmarks/tuning/host_bound.py --shape llama-1b``.
"""

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: train_hf
from train_hf import SHAPES, add_setup_args, training_step  # noqa: E402


@contextlib.contextmanager
def no_packed_sequence_sync():
    """HF's find_packed_sequence_indices returns None ("not packed") without reading the GPU."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def sleep_ms_calibrated():
    """cycles of torch.cuda._sleep per millisecond on this GPU."""
    cycles = 10_000_000
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def timed(fn, repeats, sleep_cycles=0):
    """Mean wall ms of fn() (synchronized) over repeats, with a GPU sleep queued first when
    sleep_cycles > 0 (the caller subtracts it)."""
    total = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        fn()
        torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / repeats * 1e3


def main():
    p = add_setup_args(argparse.ArgumentParser())
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    import tigon

    model_type, kw = SHAPES[args.shape]
    per_ms = sleep_ms_calibrated()
    print(f"{args.shape}, batch {args.batch} x {args.seq}, {torch.cuda.get_device_name()}; ms per step", flush=True)
    for impl in args.impls.split(","):
        print(measure(impl, model_type, kw, args, per_ms), flush=True)
        torch.cuda.empty_cache()
        tigon.unpatch()


def measure(impl, model_type, kw, args, per_ms):
    model, step = training_step(impl, model_type, kw, args.batch, args.seq)

    def forward():  # with autograd on, as in training; the graph is dropped
        model(input_ids=step.ids, labels=step.ids)

    for _ in range(3):
        step()
    wall = timed(step, args.repeats)
    with no_packed_sequence_sync():
        wall_nosync = timed(step, args.repeats)
        sleep = timed(lambda: None, 2, int(400 * per_ms))
        gpu = timed(step, args.repeats, int(400 * per_ms)) - sleep
        fwd_wall = timed(forward, args.repeats)
        fwd_gpu = timed(forward, args.repeats, int(200 * per_ms)) - timed(lambda: None, 2, int(200 * per_ms))
    return (f"{impl:6s} step: wall {wall:6.1f} (without HF's mask sync {wall_nosync:6.1f}), GPU {gpu:6.1f}, "
            f"GPU idle {wall - gpu:5.1f} ({(wall - gpu) / wall:4.0%}); forward alone: wall {fwd_wall:6.1f}, "
            f"GPU {fwd_gpu:6.1f}")


if __name__ == "__main__":
    main()
