"""RoPE fwd+bwd time by input layout: q / k as HF makes them (transposed views of [B, T, H, D],
leaves) vs contiguous [B, H, T, D] leaves vs transposed views that are not leaves (as inside a
model). CUDA only: ``PYTHONPATH=src python benchmarks/rope_layouts.py``."""

import torch
from triton.testing import do_bench

from tigon import functional as TF


def tables(tokens, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
    freqs = torch.arange(tokens, device="cuda", dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)[None]
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def main():
    batch, hq, hk, tokens, dim = 4, 32, 8, 8192, 128
    cos, sin = tables(tokens, dim)
    n = batch * tokens * (hq + hk) * dim
    for layout in ("transposed leaf", "contiguous leaf", "transposed non-leaf"):
        base_q = torch.randn(batch, tokens, hq, dim, device="cuda", dtype=torch.bfloat16)
        base_k = torch.randn(batch, tokens, hk, dim, device="cuda", dtype=torch.bfloat16)
        if layout == "transposed leaf":
            q, k = base_q.transpose(1, 2).requires_grad_(), base_k.transpose(1, 2).requires_grad_()
            leaves = [q, k]
        elif layout == "contiguous leaf":
            q, k = base_q.transpose(1, 2).contiguous().requires_grad_(), base_k.transpose(1, 2).contiguous().requires_grad_()
            leaves = [q, k]
        else:
            pq, pk = base_q.requires_grad_(), base_k.requires_grad_()
            leaves = [pq, pk]
        gq = torch.randn(batch, hq, tokens, dim, device="cuda", dtype=torch.bfloat16)
        gk = torch.randn(batch, hk, tokens, dim, device="cuda", dtype=torch.bfloat16)

        def step():
            for t in leaves:
                t.grad = None
            if layout == "transposed non-leaf":
                qq, kk = leaves[0].transpose(1, 2), leaves[1].transpose(1, 2)
            else:
                qq, kk = q, k
            oq, ok = TF.apply_rotary_pos_emb(qq, kk, cos, sin)
            torch.autograd.backward([oq, ok], [gq, gk])

        fwd = do_bench(lambda: TF.apply_rotary_pos_emb(q if layout != "transposed non-leaf" else leaves[0].transpose(1, 2),
                                                       k if layout != "transposed non-leaf" else leaves[1].transpose(1, 2),
                                                       cos, sin), rep=300, return_mode="median")
        full = do_bench(step, rep=300, return_mode="median")
        print(f"{layout:20s}: fwd {fwd:.3f} ms, fwd+bwd {full:.3f} ms = {4 * n * 2 / full / 1e6:.0f} GB/s "
              f"(fewest bytes {4 * n * 2 / 1e6:.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
