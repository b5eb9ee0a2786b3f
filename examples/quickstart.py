"""Run every tigon op once, forward and backward, and compare it with plain PyTorch.

    python examples/quickstart.py

On a CUDA machine the kernels run compiled on the GPU; without one, this script turns on
Triton's interpreter (slow, small shapes) so the same kernels run on the CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import torch.nn.functional as F  # noqa: E402

import tigon.functional as TF  # noqa: E402
from tigon.nn import TigonSwiGLUMLP  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
torch.manual_seed(0)
tokens, hidden, inter, heads, kv_heads, head_dim = (4096, 2048, 5632, 16, 4, 128) if device == "cuda" else (24, 64, 96, 4, 2, 16)


def leaf(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=device) * scale + shift).to(dtype).requires_grad_()


def compare(name, ours, ref, inputs):
    """Relative error of tigon's output and input gradients against PyTorch in fp32."""
    out = ours(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    grads_out = [torch.randn_like(o) for o in out]
    grads = torch.autograd.grad(out, inputs, grads_out)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ref_out = ref(*ref_in)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    ref_grads = torch.autograd.grad(ref_out, ref_in, [g.float() for g in grads_out])
    err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip((*out, *grads), (*ref_out, *ref_grads)))
    print(f"{name:22s} max relative error vs fp32 torch (outputs and gradients): {err:.1e}")
    assert err < 2e-2, name


def rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_ref(q, k, cos, sin):
    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


print(f"tigon kernels on {device}" + (" (Triton interpreter)" if device == "cpu" else ""))
x = leaf(tokens, hidden)
w = leaf(hidden, scale=0.1, shift=1.0)
compare("rms_norm", TF.rms_norm, rms_ref, [x, w])
r = leaf(tokens, hidden)
compare("fused_add_rms_norm", TF.fused_add_rms_norm, lambda x, r, w: (rms_ref(x + r, w), x + r), [x, r, w])
b = leaf(hidden, scale=0.1)
compare("layer_norm", TF.layer_norm, lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5), [x, w, b])
a, g = leaf(tokens, inter, scale=2.0), leaf(tokens, inter)
compare("swiglu", TF.swiglu, lambda a, g: F.silu(a) * g, [a, g])
compare("geglu", TF.geglu, lambda a, g: F.gelu(a, approximate="tanh") * g, [a, g])
q = leaf(1, tokens, heads, head_dim).detach().transpose(1, 2).requires_grad_()
k = leaf(1, tokens, kv_heads, head_dim).detach().transpose(1, 2).requires_grad_()
freqs = torch.arange(tokens, device=device)[:, None] / 10000 ** (torch.arange(0, head_dim, 2, device=device) / head_dim)
emb = torch.cat((freqs, freqs), -1)[None]
cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
compare("apply_rotary_pos_emb", lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin), lambda q, k: rope_ref(q, k, cos, sin), [q, k])
wg, wu, wd = leaf(inter, hidden, scale=hidden**-0.5), leaf(inter, hidden, scale=hidden**-0.5), leaf(hidden, inter, scale=inter**-0.5)
compare("glu_mlp", lambda x, wg, wu, wd: TF.glu_mlp(x, wg, wu, wd),
        lambda x, wg, wu, wd: (F.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t(), [x, wg, wu, wd])
ids = torch.randint(0, 997, (tokens,), device=device)
ids[: tokens // 2] = 5  # a frequent token: its rows are summed in fp32
compare("embedding", lambda table: TF.embedding(ids, table), lambda table: F.embedding(ids, table), [leaf(997, hidden)])
mlp = TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter).to(device, dtype)
mlp(x).sum().backward()
print(f"{'TigonSwiGLUMLP':22s} forward+backward ran; printed as {mlp.__class__.__name__}({mlp.extra_repr()})")
