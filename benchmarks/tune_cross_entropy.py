"""Launch sweep of the cross-entropy kernel (forward with the in-place gradient), H100 notes in
benchmarks/NOTES.md. Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/tune_cross_entropy.py``.

Counts the floor as reading the logits once and writing the gradient once; the kernel reads
each row twice, the second time hopefully from L2, so the fraction shows how much of that
second read L2 absorbed.
"""

import torch
from triton.testing import do_bench

from tigon.ops.cross_entropy import cross_entropy_kernel, cross_entropy_norms


def main():
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6
    x = y = None
    print(f"copy bandwidth {bw:.0f} GB/s")
    for rows, vocab in ((8192, 128256), (4096, 151936), (16384, 32000)):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        norms = cross_entropy_norms(target, None, -100, "mean")
        loss = torch.empty(rows, device="cuda", dtype=torch.float32)
        floor_ms = 2 * rows * vocab * 2 / bw / 1e6
        results = []
        for block in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                if block // (warps * 32) < 4:
                    continue

                def run():
                    cross_entropy_kernel[(rows,)](
                        logits, vocab, logits, vocab, target, norms, norms, loss, loss, loss,
                        vocab, -100, 0.0, 0.0, 1.0,
                        HAS_WEIGHT=False, HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
                        COMPUTE_GRAD=True, COMPUTE_ACCURACY=False, BLOCK_V=block, num_warps=warps)

                ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                results.append((ms, block, warps))
        results.sort()
        print(f"{rows}x{vocab}: floor {floor_ms:.3f} ms (read once + write once)")
        for ms, block, warps in results[:5]:
            print(f"   {ms:.3f} ms ({100 * floor_ms / ms:.0f}% of floor) BLOCK_V {block}, {warps} warps")


if __name__ == "__main__":
    main()
