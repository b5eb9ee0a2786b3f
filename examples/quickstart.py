"""Run every public tigon op and loss once, forward and backward, and compare it with plain PyTorch.

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
from tigon import losses  # noqa: E402
from tigon.nn import TigonSwiGLUMLP  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
torch.manual_seed(0)
if device == "cuda":
    tokens, hidden, inter, heads, kv_heads, head_dim, vocab = 4096, 2048, 5632, 16, 4, 128, 32000
else:
    tokens, hidden, inter, heads, kv_heads, head_dim, vocab = 24, 64, 96, 4, 2, 16, 300


def leaf(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=device) * scale + shift).to(dtype).requires_grad_()


def compare(name, ours, ref, inputs, grad_outputs="random"):
    """Relative error of tigon's outputs and input gradients against PyTorch in fp32."""
    out = ours(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    grads_out = [torch.randn_like(o) if grad_outputs == "random" else torch.ones_like(o) for o in out]
    grads = torch.autograd.grad(out, inputs, grads_out)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ref_out = ref(*ref_in)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    ref_grads = torch.autograd.grad(ref_out, ref_in, [g.float() for g in grads_out])
    err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip((*out, *grads), (*ref_out, *ref_grads)))
    print(f"{name:26s} max relative error vs fp32 torch (outputs and gradients): {err:.1e}")
    assert err < 2e-2, name


def rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_ref(q, k, cos, sin):
    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def token_logps(logits, target):
    """log p(target) per position, 0 where target is -100."""
    mask = target != -100
    lp = torch.gather(logits.log_softmax(-1), -1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return lp * mask


print(f"tigon kernels on {device}" + (" (Triton interpreter)" if device == "cpu" else ""))

# ---- norms, activations, RoPE, MLP, embedding ----
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
compare("apply_rotary_pos_emb", lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin),
        lambda q, k: rope_ref(q, k, cos, sin), [q, k])
wg, wu = leaf(inter, hidden, scale=hidden**-0.5), leaf(inter, hidden, scale=hidden**-0.5)
wd = leaf(hidden, inter, scale=inter**-0.5)
compare("glu_down_proj", lambda a, g, wd: TF.glu_down_proj(a * 1, g * 1, wd, inplace=True),
        lambda a, g, wd: (F.silu(a) * g) @ wd.t(), [a, g, wd])
compare("glu_mlp", lambda x, wg, wu, wd: TF.glu_mlp(x, wg, wu, wd),
        lambda x, wg, wu, wd: (F.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t(), [x, wg, wu, wd])
ids = torch.randint(0, 997, (tokens,), device=device)
ids[: tokens // 2] = 5  # a frequent token: its rows are summed in fp32
compare("embedding", lambda table: TF.embedding(ids, table), lambda table: F.embedding(ids, table),
        [leaf(997, hidden)])
mlp = TigonSwiGLUMLP(hidden_size=hidden, intermediate_size=inter).to(device, dtype)
mlp(x).sum().backward()
print(f"{'TigonSwiGLUMLP':26s} forward+backward ran; printed as {mlp.__class__.__name__}({mlp.extra_repr()})")

# ---- cross entropy, fused linear cross entropy, per-token log-probs, JSD ----
head = leaf(vocab, hidden, scale=hidden**-0.5 * 4)
labels = torch.randint(0, vocab, (tokens,), device=device)
labels[::5] = -100
logits = leaf(tokens, vocab, scale=3.0)
compare("cross_entropy", lambda z: TF.cross_entropy(z, labels), lambda z: F.cross_entropy(z, labels), [logits],
        grad_outputs="ones")
compare("fused_linear_cross_entropy", lambda x, w: TF.fused_linear_cross_entropy(x, w, labels),
        lambda x, w: F.cross_entropy(x @ w.t(), labels), [x, head], grad_outputs="ones")
compare("linear_token_logps", lambda x, w: TF.linear_token_logps(x, w, labels),
        lambda x, w: token_logps(x @ w.t(), labels), [x, head])
teacher_head = leaf(vocab, hidden, scale=hidden**-0.5 * 4).detach()  # a different model


def gkd(s, t, beta=0.5):
    """TRL's generalised JSD per row of log-probabilities (fp32)."""
    m = torch.logsumexp(torch.stack((s + torch.log(torch.tensor(1 - beta)), t + torch.log(torch.tensor(beta)))), 0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


compare("linear_jsd", lambda x, w: TF.linear_jsd(x, w, x.detach(), teacher_head),
        lambda x, w: gkd((x @ w.t()).log_softmax(-1), (x.detach() @ teacher_head.float().t()).log_softmax(-1)),
        [x, head])
student_lp = leaf(tokens, vocab, scale=2.0).detach().float().log_softmax(-1).to(dtype).requires_grad_()
teacher_lp = torch.randn(tokens, vocab, device=device).log_softmax(-1).to(dtype)
compare("jsd (log-probabilities)", lambda s: TF.jsd(s, teacher_lp, labels),
        lambda s: (gkd(s, teacher_lp.float()) * (labels != -100)).sum() / (labels != -100).sum(), [student_lp],
        grad_outputs="ones")

# ---- post-training losses from hidden states (tigon.losses) against full-logit torch ----
pairs, seq = 2, tokens // 4
hs = leaf(2 * pairs, seq, hidden)
ref_hs = hs.detach() + 0.05 * torch.randn_like(hs)
pref_labels = torch.randint(0, vocab, (2 * pairs, seq), device=device)
pref_labels[:, : seq // 3] = -100  # the prompt


def seq_logps(h, w, average=False):
    lp = token_logps(h @ w.t(), pref_labels)
    n = (pref_labels != -100).sum(-1)
    return lp.sum(-1) / n if average else lp.sum(-1), lp


def nll(h, w):
    lp = token_logps(h[:pairs] @ w.t(), pref_labels[:pairs])
    return -lp.sum() / (pref_labels[:pairs] != -100).sum()


def dpo_ref(h, w):
    lp, _ = seq_logps(h, w)
    ref, _ = seq_logps(ref_hs.float(), w.detach())
    margin = (lp[:pairs] - ref[:pairs]) - (lp[pairs:] - ref[pairs:])
    return -F.logsigmoid(0.1 * margin).mean()


def orpo_ref(h, w):
    lp, _ = seq_logps(h, w, average=True)
    c, r = lp[:pairs], lp[pairs:]
    log_odds = (c - r) - (torch.log1p(-c.exp()) - torch.log1p(-r.exp()))
    return nll(h, w) - 0.1 * F.logsigmoid(log_odds).mean()


def cpo_ref(h, w):
    lp, _ = seq_logps(h, w)
    return -F.logsigmoid(0.1 * (lp[:pairs] - lp[pairs:])).mean() + nll(h, w)


def simpo_ref(h, w):
    lp, _ = seq_logps(h, w, average=True)
    return -F.logsigmoid(2.0 * (lp[:pairs] - lp[pairs:]) - 0.5).mean()


desirable = torch.tensor([True, False, True, False], device=device)


def kto_ref(h, w):
    lp, _ = seq_logps(h, w)
    return torch.where(desirable, 1 - torch.sigmoid(0.1 * (lp - 0.02)), 1 - torch.sigmoid(0.1 * (0.02 - lp))).mean()


def first(fn):
    return lambda *a: fn(*a)[0]


compare("dpo_loss", first(lambda h, w: losses.dpo_loss(h, w, pref_labels, ref_x=ref_hs, ref_weight=w.detach())),
        dpo_ref, [hs, head], grad_outputs="ones")
compare("orpo_loss", first(lambda h, w: losses.orpo_loss(h, w, pref_labels)), orpo_ref, [hs, head],
        grad_outputs="ones")
compare("cpo_loss", first(lambda h, w: losses.cpo_loss(h, w, pref_labels)), cpo_ref, [hs, head],
        grad_outputs="ones")
compare("simpo_loss", first(lambda h, w: losses.simpo_loss(h, w, pref_labels)), simpo_ref, [hs, head],
        grad_outputs="ones")
compare("kto_loss", first(lambda h, w: losses.kto_loss(h, w, pref_labels, desirable, kl=0.02)), kto_ref, [hs, head],
        grad_outputs="ones")
token_mask = (pref_labels != -100).reshape(-1)


def jsd_ref(h, w):
    s = (h.reshape(-1, hidden) @ w.t()).log_softmax(-1)
    t = (ref_hs.reshape(-1, hidden).float() @ teacher_head.float().t()).log_softmax(-1)
    return (gkd(s, t) * token_mask).sum() / token_mask.sum()


compare("fused_linear_jsd", first(lambda h, w: losses.fused_linear_jsd(h, w, ref_hs, teacher_head, pref_labels)),
        jsd_ref, [hs, head], grad_outputs="ones")
compare("jsd_loss", lambda z: losses.jsd_loss(z, (ref_hs.reshape(-1, hidden) @ teacher_head.t()).float(),
                                              pref_labels.reshape(-1)),
        lambda z: (gkd(z.log_softmax(-1), (ref_hs.reshape(-1, hidden).float() @ teacher_head.float().t())
                       .log_softmax(-1)) * token_mask).sum() / token_mask.sum(),
        [leaf(2 * pairs * seq, vocab)], grad_outputs="ones")
print("every op and loss matches PyTorch")
