"""Launch sweep of the cross-entropy kernel (forward with the in-place gradient), H100 notes in
benchmarks/NOTES.md. Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/tuning/tune_cross_entropy.py``.

Counts the floor as reading the logits once and writing the gradient once; the kernel reads
each row twice, the second time hopefully from L2, so the fraction shows how much of that
second read L2 absorbed. The grid is either one program a row or a persistent grid of a few
programs an SM (fewer rows in flight, so a row may still be in L2 for its second pass).
"""

import torch
from triton.testing import do_bench

from tigon.ops._cross_entropy_common import CrossEntropyOptions, cross_entropy_norms
from tigon.ops.cross_entropy import cross_entropy_kernel


def main():
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6
    x = y = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw:.0f} GB/s, {sms} SMs")
    for rows, vocab in ((8192, 128256), (1664, 128256), (4096, 151936), (16384, 32000)):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        norms = cross_entropy_norms(target, CrossEntropyOptions())
        loss = torch.empty(rows, device="cuda", dtype=torch.float32)
        floor_ms = 2 * rows * vocab * 2 / bw / 1e6
        results = []
        for per_sm in (None, 2):  # 1, 2 and 4 an SM were tried: no faster (NOTES.md)
            programs = rows if per_sm is None else min(rows, per_sm * sms)
            for block, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32)):

                def run():  # noqa: B023 - called at once
                    cross_entropy_kernel[(programs,)](
                        logits, vocab, logits, vocab, target, norms, norms, loss, loss, target,
                        rows, vocab, -100, 0.0, 0.0, 1.0,
                        HAS_WEIGHT=False, HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
                        COMPUTE_GRAD=True, COMPUTE_ARGMAX=False, TOKEN_SCALING=False, BLOCK_V=block,
                        num_warps=warps)

                try:
                    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"   skip {per_sm} {block} {warps}: {type(e).__name__}")
                    continue
                results.append((ms, per_sm, block, warps))
        results.sort()
        print(f"{rows}x{vocab}: floor {floor_ms:.3f} ms (read once + write once)")
        for ms, per_sm, block, warps in results[:8]:
            print(f"   {ms:.3f} ms ({100 * floor_ms / ms:.0f}% of floor) programs/SM {per_sm or 'row'}, "
                  f"BLOCK_V {block}, {warps} warps")


if __name__ == "__main__":
    main()
