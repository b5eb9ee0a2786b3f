from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from tests.helpers import DEVICE, DTYPES, pick, randn, rel_err
from tigon import functional as TF
from tigon.nn import (
    TigonGeGLUMLP,
    TigonReLUSquaredMLP,
    TigonSwiGLUMLP,
    TigonTiledGeGLUMLP,
    TigonTiledSwiGLUMLP,
)
from tigon.ops import glu_mlp

# 7 tokens in 3 shards: 3, 3, 1.
BATCH, TOKENS, HIDDEN, INTER = pick(2, 2), pick(7, 3001), pick(24, 1024), pick(40, 2816)
# fp32 sums in another order (shards, the kernels' column slices) than the untiled reference: at
# the GPU sizes (6002 tokens, I 2816) they differ by up to ~1e-4 absolute on the H100.
FP32_TOL = pick(dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=2e-4))
# Matmuls: in fp32 they may run in tf32 on the GPU.
TOL = {torch.float32: 1e-3, torch.bfloat16: 1.5e-2}


class TorchMLP(nn.Module):
    """The MLPs in plain torch: gated (gate_proj, up_proj, down_proj) or ReLU² (up_proj, down_proj)."""

    def __init__(self, activation, bias=False):
        super().__init__()
        self.activation = activation
        if activation != "relu2":
            self.gate_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=bias)

    def forward(self, x):
        if self.activation == "relu2":
            return self.down_proj(torch.relu(self.up_proj(x)).square())
        act = F.silu if self.activation == "silu" else lambda a: F.gelu(a, approximate="tanh")
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


def make_mlp(kind, dtype):
    """(the MLP under test, its float64 twin in plain torch)."""
    modules = {
        "tigon swiglu": lambda: TigonSwiGLUMLP(hidden_size=HIDDEN, intermediate_size=INTER),
        "tigon geglu": lambda: TigonGeGLUMLP(hidden_size=HIDDEN, intermediate_size=INTER),
        "tigon relu2, bias": lambda: TigonReLUSquaredMLP(HIDDEN, INTER, bias=True),
        "torch swiglu, bias": lambda: TorchMLP("silu", bias=True),
    }
    activation = {"tigon swiglu": "silu", "tigon geglu": "gelu_tanh", "tigon relu2, bias": "relu2",
                  "torch swiglu, bias": "silu"}[kind]
    mlp = modules[kind]().to(DEVICE)
    twin = TorchMLP(activation, bias="bias" in kind).to(DEVICE)
    twin.load_state_dict(mlp.state_dict())
    return mlp.to(dtype), twin.double()


def outputs_and_grads(fn, module, x, cotangent):
    out = fn(x)
    return [out, *torch.autograd.grad(out, [x, *module.parameters()], cotangent.to(out.dtype))]


def check_tiled(mlp, twin, dtype, num_shards, what, x=None):
    """tiled_mlp(mlp) against the float64 twin, outputs and the gradients of x and of every
    parameter, within TOL and not much worse than mlp untiled at the same precision."""
    x = randn((BATCH, TOKENS, HIDDEN), dtype, requires_grad=True) if x is None else x
    x64 = x.detach().double().requires_grad_(True)
    cotangent = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)
    ours = outputs_and_grads(lambda x: TF.tiled_mlp(mlp, x, num_shards), mlp, x, cotangent)
    untiled = outputs_and_grads(mlp, mlp, x, cotangent)
    ref = outputs_and_grads(twin, twin, x64, cotangent)
    for i, (o, u, r) in enumerate(zip(ours, untiled, ref, strict=True)):
        assert o.shape == r.shape and o.dtype == u.dtype, (what, i)
        err, untiled_err = rel_err(o, r), rel_err(u, r)
        assert err <= TOL[dtype], f"{what}: item {i} relative error {err:.3g} (untiled: {untiled_err:.3g})"
        assert err <= max(2 * untiled_err, 1e-5 if dtype == torch.float32 else 5e-3), (
            f"{what}: item {i} relative error {err:.3g}, untiled {untiled_err:.3g}")


@pytest.mark.parametrize("kind", ["tigon swiglu", "tigon geglu", "tigon relu2, bias", "torch swiglu, bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_mlp_matches_reference(kind, dtype):
    mlp, twin = make_mlp(kind, dtype)
    check_tiled(mlp, twin, dtype, 3, f"tiled {kind}")


@pytest.mark.parametrize("num_shards", [None, 100])
def test_tiled_mlp_shard_counts(num_shards):
    """None (ceil(T / H): one shard here) and more shards than tokens (one token each)."""
    mlp, twin = make_mlp("torch swiglu, bias", torch.float32)
    check_tiled(mlp, twin, torch.float32, num_shards, f"num_shards={num_shards}")


def test_tiled_mlp_strided_and_2d_inputs():
    """x as a row-padded view, and as [T, H] (two shards of 4 and 3 tokens)."""
    mlp, twin = make_mlp("tigon swiglu", torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, non_contiguous=True, requires_grad=True)
    check_tiled(mlp, twin, torch.float32, 2, "strided x", x=x)
    x = randn((TOKENS, HIDDEN), torch.float32, requires_grad=True)
    check_tiled(mlp, twin, torch.float32, 2, "x [T, H]", x=x)


def test_default_num_shards_is_tokens_over_hidden():
    from tigon.ops.tiled_mlp import default_num_shards

    assert default_num_shards(torch.empty(2, 4096, 1024, device="meta")) == 4
    assert default_num_shards(torch.empty(4097, 1024, device="meta")) == 5
    assert default_num_shards(torch.empty(3, 1024, device="meta")) == 1


EVENTS = []


class Probe(torch.autograd.Function):
    """Identity that appends ("forward" | "backward", tag) to EVENTS when autograd runs it."""

    @staticmethod
    def forward(ctx, h, tag):
        ctx.tag = tag
        EVENTS.append(("forward", tag))
        return h.clone()

    @staticmethod
    def backward(ctx, dh):
        EVENTS.append(("backward", ctx.tag))
        return dh, None


def test_tiled_mlp_recomputes_and_backpropagates_one_shard_at_a_time():
    """The forward runs every shard once; the backward recomputes a shard, runs its backward,
    and only then recomputes the next (last shard first): one shard's activations at a time."""
    mlp, _ = make_mlp("torch swiglu, bias", torch.float32)

    def probed(shard):
        return mlp(Probe.apply(shard, round(float(shard[0, 0, 0].detach()), 4)))

    EVENTS.clear()
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    out = TF.tiled_mlp(probed, x, 3)
    tags = [tag for _, tag in EVENTS]
    assert EVENTS == [("forward", tag) for tag in tags] and len(set(tags)) == 3
    EVENTS.clear()
    out.backward(torch.ones_like(out))
    assert EVENTS == [(kind, tag) for tag in reversed(tags) for kind in ("forward", "backward")]


def test_tiled_tigon_mlp_keeps_only_its_input_and_skips_the_recomputed_matmuls(monkeypatch):
    """Inside each shard's checkpoint the Tigon gated MLP takes glu_mlp_input_only, whose
    recomputation (checkpoint's early stop right after it) returns without its matmuls."""
    calls = []
    op = glu_mlp.glu_mlp_op
    monkeypatch.setattr(glu_mlp, "glu_mlp_op", lambda *args: calls.append(args[9]) or op(*args))
    mlp, twin = make_mlp("tigon swiglu", torch.float32)
    tiled = TigonTiledSwiGLUMLP(hidden_size=HIDDEN, intermediate_size=INTER, num_shards=3).to(DEVICE)
    tiled.load_state_dict(mlp.state_dict())
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    cotangent = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)
    got = outputs_and_grads(tiled, tiled, x, cotangent)
    want = outputs_and_grads(twin, twin, x64, cotangent)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= 1e-5
    assert calls == [True] * 3 + [False] * 3  # the forward's 3 shards, then their recomputations


def test_tiled_mlp_accumulates_into_existing_grads():
    mlp, _ = make_mlp("tigon swiglu", torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    cotangent = randn(x.shape, torch.float32)
    want = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], cotangent)
    leaves = [x, *mlp.parameters()]
    before = [torch.randn_like(t) for t in leaves]
    for t, b in zip(leaves, before):
        t.grad = b.clone()
    TF.tiled_mlp(mlp, x, 3).backward(cotangent)
    for t, b, w in zip(leaves, before, want):
        torch.testing.assert_close(t.grad, b + w, **FP32_TOL)


@pytest.mark.parametrize("kind", ["tigon swiglu", "torch swiglu, bias"])
def test_tiled_mlp_second_backward_over_retained_graph(kind):
    mlp, _ = make_mlp(kind, torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    loss = (TF.tiled_mlp(mlp, x, 3) * randn(x.shape, torch.float32)).sum()
    loss.backward(retain_graph=True)
    leaves = [x, *mlp.parameters()]
    once = [t.grad.clone() for t in leaves]
    loss.backward()
    for t, g in zip(leaves, once):
        torch.testing.assert_close(t.grad, 2 * g, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_over_a_closure_with_weights_that_are_not_leaves():
    """A callable over tensors it closes over (one computed from a leaf): their gradients flow as
    in the untiled call (torch.autograd.grad, not only .grad)."""
    w1 = randn((INTER, HIDDEN), torch.float32, scale=HIDDEN**-0.5, requires_grad=True)
    w2 = randn((HIDDEN, INTER), torch.float32, scale=INTER**-0.5, requires_grad=True)
    scale = randn((), torch.float32, shift=1.0, requires_grad=True)

    def mlp(h):
        return F.linear(torch.relu(F.linear(h, w1 * scale)), w2)

    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    cotangent = randn(x.shape, torch.float32)
    got = torch.autograd.grad(TF.tiled_mlp(mlp, x, 3), [x, w1, w2, scale], cotangent)
    want = torch.autograd.grad(mlp(x), [x, w1, w2, scale], cotangent)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32_TOL)


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_tiled_mlp_replays_dropout(preserve_rng_state):
    """out = dropout(x) * w: the gradient of x uses the forward's mask when the RNG state is
    replayed (the default); without it each shard's recomputation draws a new mask. With a
    cotangent of ones, dx = mask * 2 * w exactly (no rounding to blur a mask's difference). x and
    w lie in [0.5, 1.5), never 0 (randn can draw an exact 0: a kept element would read as dropped)."""
    w = (torch.rand(HIDDEN, device=DEVICE) + 0.5).requires_grad_()
    x = (torch.rand(BATCH, TOKENS, HIDDEN, device=DEVICE) + 0.5).requires_grad_()
    out = TF.tiled_mlp(lambda h: F.dropout(h, 0.5, training=True) * w, x, 3, preserve_rng_state=preserve_rng_state)
    (dx,) = torch.autograd.grad(out, [x], torch.ones_like(out))
    kept = out.detach() != 0  # the forward's mask (x and w are nonzero)
    replayed = torch.equal(dx, torch.where(kept, 2.0 * w.detach(), 0.0))
    assert replayed == preserve_rng_state


def test_tiled_mlp_without_grad():
    mlp, _ = make_mlp("tigon relu2, bias", torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    with torch.no_grad():
        out, want = TF.tiled_mlp(mlp, x, 3), mlp(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, want, **FP32_TOL)


def test_tiled_mlp_inside_a_checkpointed_layer():
    mlp, twin = make_mlp("tigon swiglu", torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    cotangent = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)

    def layer(h):
        return h + TF.tiled_mlp(mlp, h * 1.5, 3)

    out = checkpoint_module.checkpoint(layer, x, use_reentrant=False)
    got = torch.autograd.grad(out, [x, *mlp.parameters()], cotangent.float())
    want = torch.autograd.grad(x64 + twin(x64 * 1.5), [x64, *twin.parameters()], cotangent)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-3


def test_tiled_mlp_compiles_without_graph_breaks():
    """torch.compile (default dynamism: the second length recompiles with a dynamic token count)
    traces the shards' checkpoints in one graph a length, with eager's loss and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    mlp, _ = make_mlp("tigon swiglu", torch.float32)

    def loss(x):
        return (TF.tiled_mlp(mlp, x * 1.5, 3) ** 2).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter)
    for tokens in (TOKENS, TOKENS + 4):
        x = randn((BATCH, tokens, HIDDEN), torch.float32, requires_grad=True)
        leaves = [x, *mlp.parameters()]
        want = [loss(x), *torch.autograd.grad(loss(x), leaves)]
        got = [compiled(x), *torch.autograd.grad(compiled(x), leaves)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **FP32_TOL)
    assert counter.frame_count == 2  # one graph a length: no graph break
    torch._dynamo.reset()


@pytest.mark.parametrize("cls, untiled", [(TigonTiledSwiGLUMLP, TigonSwiGLUMLP), (TigonTiledGeGLUMLP, TigonGeGLUMLP)])
def test_tiled_modules_are_the_untiled_ones_in_shards(cls, untiled):
    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act=untiled.default_activation)
    ours = cls(config, num_shards=3).to(DEVICE)
    plain = untiled(config).to(DEVICE)
    plain.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(plain.state_dict()) and ours.num_shards == 3
    assert "num_shards=3" in repr(ours)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32, requires_grad=True)
    cotangent = randn(x.shape, torch.float32)
    got = outputs_and_grads(ours, ours, x, cotangent)
    want = outputs_and_grads(plain, plain, x, cotangent)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **FP32_TOL)
    with pytest.raises(ValueError, match="num_shards must be a positive int"):
        cls(config, num_shards=0)
    with pytest.raises(ValueError, match="computes"):
        cls(hidden_size=HIDDEN, intermediate_size=INTER, activation="silu" if cls is TigonTiledGeGLUMLP else "gelu")


def test_tiled_mlp_bad_arguments():
    mlp, _ = make_mlp("torch swiglu, bias", torch.float32)
    x = randn((BATCH, TOKENS, HIDDEN), torch.float32)
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="num_shards must be a positive int"):
            TF.tiled_mlp(mlp, x, bad)
    with pytest.raises(TypeError, match="mlp must be a module or callable"):
        TF.tiled_mlp(x, x)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        TF.tiled_mlp(mlp, [1.0])
    with pytest.raises(ValueError, match=r"x must be \[..., T, H\]"):
        TF.tiled_mlp(mlp, x[0, 0])
    with pytest.raises(TypeError, match="preserve_rng_state must be a bool"):
        TF.tiled_mlp(mlp, x, preserve_rng_state=None)
    with pytest.raises(ValueError, match="token by token"):
        TF.tiled_mlp(lambda h: h.sum(-2, keepdim=True), x, 3)
    with pytest.raises(TypeError, match="mlp must return a tensor"):
        TF.tiled_mlp(lambda h: (h, h), x, 3)


@pytest.mark.gpu
def test_tiled_mlp_peak_memory_is_a_shards():
    """bf16 TigonSwiGLUMLP at 32768 tokens (H 1024, I 4096): the untiled MLP keeps gate and up
    ([T, I] each) and forms [T, slice] transients; in 32 shards the MLP's activations are a
    shard's, and the peak is what every version needs (x's and the output's gradients)."""

    def peak_mb(fn, x, cotangent):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x).backward(cotangent)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    mlp = TigonSwiGLUMLP(hidden_size=1024, intermediate_size=4096).to(DEVICE, torch.bfloat16)
    x = randn((32768, 1024), torch.bfloat16, requires_grad=True)
    cotangent = randn(x.shape, torch.bfloat16)
    untiled = peak_mb(mlp, x, cotangent)
    tiled = peak_mb(lambda x: TF.tiled_mlp(mlp, x), x, cotangent)  # ceil(32768 / 1024) = 32 shards
    activations_mb = 2 * 32768 * 4096 * 2 / 2**20  # gate and up: 512 MiB
    assert tiled < untiled - 0.75 * activations_mb, (tiled, untiled)
