"""Host cost per call of tigon's ops: forward + backward on tiny tensors, where the GPU work is
negligible and the time is what the host spends (Python checks, Triton launches, autograd),
next to the same computation in eager torch. CUDA only:
``PYTHONPATH=src python benchmarks/host_overhead.py``."""

import torch
import torch.nn.functional as F

import tigon.functional as TF
from tigon.bench.harness import host_us_per_call


def fwd_bwd(op, *inputs):
    def run():
        out = op(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


def main():
    dev, dt = "cuda", torch.bfloat16
    tokens, hidden, inter, vocab = 16, 256, 512, 1024

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dt).requires_grad_()

    x, w = leaf(tokens, hidden), leaf(hidden)
    a, b = leaf(tokens, inter), leaf(tokens, inter)
    wg, wu, wd = leaf(inter, hidden, scale=0.05), leaf(inter, hidden, scale=0.05), leaf(hidden, inter, scale=0.05)
    head = leaf(vocab, hidden, scale=0.05)
    target = torch.randint(0, vocab, (tokens,), device=dev)
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    q = leaf(1, 4, tokens, 64)
    k = leaf(1, 2, tokens, 64)
    cos = torch.randn(1, tokens, 64, device=dev, dtype=dt)
    sin = torch.randn(1, tokens, 64, device=dev, dtype=dt)

    def rms_ref(x, w):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * w

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return torch.cat((-t2, t1), -1)

    cases = [
        ("rms_norm", fwd_bwd(lambda: TF.rms_norm(x, w)), fwd_bwd(lambda: rms_ref(x, w))),
        ("rope", fwd_bwd(lambda: sum(t.sum() for t in TF.apply_rotary_pos_emb(q, k, cos, sin))),
         fwd_bwd(lambda: sum((t * cos[:, None] + rot(t) * sin[:, None]).sum() for t in (q, k)))),
        ("swiglu", fwd_bwd(lambda: TF.swiglu(a, b)), fwd_bwd(lambda: F.silu(a) * b)),
        ("glu_down_proj", fwd_bwd(lambda: TF.glu_down_proj(a * 1, b * 1, wd, reuse_inputs=True)),
         fwd_bwd(lambda: F.linear(F.silu(a) * b, wd))),
        ("glu_mlp", fwd_bwd(lambda: TF.glu_mlp(x, wg, wu, wd)),
         fwd_bwd(lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd))),
        ("flce", fwd_bwd(lambda: TF.fused_linear_cross_entropy(x, head, target)),
         fwd_bwd(lambda: F.cross_entropy(F.linear(x, head).float(), target))),
        ("embedding", fwd_bwd(lambda: TF.embedding(ids, head)), fwd_bwd(lambda: F.embedding(ids, head))),
    ]
    print(f"host cost per forward+backward call, tiny tensors ({tokens} tokens), microseconds")
    for name, ours, eager in cases:
        print(f"  {name:14s} tigon {host_us_per_call(ours):7.1f}   eager torch {host_us_per_call(eager):7.1f}", flush=True)


if __name__ == "__main__":
    main()
