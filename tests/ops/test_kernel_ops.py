"""The ops registered through ``kernel_op`` (``torch.library.triton_op`` on the GPU) under
torch.compile with dynamic shapes: eager's values and gradients at two batch sizes from one
compilation. On the GPU, with Inductor, the generated code launches tigon's kernels itself: no
call of a ``torch.ops.tigon`` op is left in it (on the CPU the ops are plain custom ops run by
the interpreter, and "aot_eager" stands in for Inductor)."""

import pytest
import torch

import tigon.functional as TF
from tests.helpers import ON_GPU, pick, randn
from tests.ops.test_rope import hf_cos_sin
from tigon.ops._common import KERNEL_OPS

BACKEND = pick(cpu="aot_eager", gpu="inductor")
HIDDEN = pick(cpu=37, gpu=896)


def norm_case(batch, casting="llama"):
    x = randn((batch, 5, HIDDEN), torch.float32, shift=1.0, requires_grad=True)
    w = randn((HIDDEN,), torch.float32, shift=1.0, requires_grad=True)
    offset = 1.0 if casting == "gemma" else 0.0
    return lambda x, w: TF.rms_norm(x * 2.0, w, 1e-6, offset, casting), [x, w]


def fused_add_case(batch):
    x, r = (randn((batch, 5, HIDDEN), torch.float32, requires_grad=True) for _ in range(2))
    w = randn((HIDDEN,), torch.float32, shift=1.0, requires_grad=True)

    def fn(x, r, w):
        y, s = TF.fused_add_rms_norm(x * 1.5, r, w)
        return y + 0.5 * s
    return fn, [x, r, w]


def layer_norm_case(batch):
    x = randn((batch, 5, HIDDEN), torch.float32, shift=2.0, requires_grad=True)
    w = randn((HIDDEN,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((HIDDEN,), torch.float32, requires_grad=True)
    return lambda x, w, b: TF.layer_norm(x, w, b), [x, w, b]


def glu_case(batch):
    a, b = (randn((batch, 5, 3 * HIDDEN), torch.float32, requires_grad=True) for _ in range(2))
    return lambda a, b: TF.glu(a * 1.0, b, "silu"), [a, b]


def relu_squared_case(batch):
    x = randn((batch, 5, 3 * HIDDEN), torch.float32, requires_grad=True)
    return lambda x: TF.relu_squared(x * 2.0 - 0.5), [x]


def rope_case(batch, positions=False):
    hq, hk, tokens, dim = 4, 2, 6, 16
    proj_q = randn((batch, tokens, hq * dim), torch.float32, requires_grad=True)
    proj_k = randn((batch, tokens, hk * dim), torch.float32, requires_grad=True)
    cos, sin = hf_cos_sin(1, 11 if positions else tokens, dim, torch.float32)
    pos = torch.arange(3, 3 + tokens, device=proj_q.device)[None] if positions else None
    if positions:
        cos, sin = cos[0], sin[0]

    def fn(proj_q, proj_k):
        b = proj_q.shape[0]
        q = proj_q.view(b, tokens, hq, dim).transpose(1, 2)
        k = proj_k.view(b, tokens, hk, dim).transpose(1, 2)
        out_q, out_k = TF.apply_rotary_pos_emb(q, k, cos, sin, position_ids=pos)
        return torch.cat([out_q.flatten(), out_k.flatten()])
    return fn, [proj_q, proj_k]


def group_norm_case(batch):
    x = randn((batch, 6, HIDDEN), torch.float32, shift=2.0, requires_grad=True)
    w = randn((6,), torch.float32, shift=1.0, requires_grad=True)
    b = randn((6,), torch.float32, requires_grad=True)
    return lambda x, w, b: TF.group_norm(x, 3, w, b), [x, w, b]


def dyt_case(batch):
    x = randn((batch, 5, HIDDEN), torch.float32, requires_grad=True)
    alpha = randn((1,), torch.float32, shift=0.5, requires_grad=True)
    gamma = randn((HIDDEN,), torch.float32, shift=1.0, requires_grad=True)
    beta = randn((HIDDEN,), torch.float32, requires_grad=True)
    return lambda x, a, g, b: TF.dyt(x * 2.0, a, g, b), [x, alpha, gamma, beta]


def poly_norm_case(batch):
    x = randn((batch, 5, HIDDEN), torch.float32, requires_grad=True)
    w = randn((3,), torch.float32, shift=0.3, requires_grad=True)
    b = randn((1,), torch.float32, requires_grad=True)
    return lambda x, w, b: TF.poly_norm(x, w, b), [x, w, b]


def row_softmax_case(batch, op):
    x = randn((batch, 5, HIDDEN), torch.float32, scale=2.0, requires_grad=True)
    return lambda x: getattr(TF, op)(x * 1.5, -1), [x]


def kl_div_case(batch, reduction):
    x, t = (randn((batch, 5, HIDDEN), torch.float32, requires_grad=True) for _ in range(2))
    return lambda x, t: TF.kl_div(torch.log_softmax(x, -1), torch.softmax(t, -1), reduction=reduction), [x, t]


def tvd_case(batch, reduction):
    p, q = (randn((batch, 5, HIDDEN), torch.float32, requires_grad=True) for _ in range(2))

    def fn(p, q):
        labels = torch.arange(p.shape[0] * p.shape[1], device=p.device) % 3 - 1  # every third row ignored
        return TF.tvd(torch.softmax(p, -1), torch.softmax(q, -1), labels, reduction=reduction, ignore_index=-1)
    return fn, [p, q]


def vocab_parallel_ce_case(batch):
    """One rank, a shard starting at id 3: the sharded kernels (no collective)."""
    x = randn((batch, 5, HIDDEN), torch.float32, scale=2.0, requires_grad=True)

    def fn(x):
        rows = torch.arange(x.shape[0] * x.shape[1], device=x.device)
        target = torch.where(rows % 4 == 1, -100, 3 + rows * 7 % HIDDEN)
        return TF.vocab_parallel_cross_entropy(x * 1, target, vocab_start=3, reduction="none", label_smoothing=0.1)
    return fn, [x]


def moe_experts_case(batch):
    """Mixtral-style experts; the routing a function of the token's position (some pairs to E:
    no expert), so the token count is the one dynamic size (K 3: no batch size shares its value)."""
    experts, inter = 4, 24
    x = randn((batch, 5, HIDDEN), torch.float32, requires_grad=True)
    w = randn((batch, 5, 3), torch.float32, requires_grad=True)
    gate_up = randn((experts, 2 * inter, HIDDEN), torch.float32, scale=HIDDEN**-0.5, requires_grad=True)
    down = randn((experts, HIDDEN, inter), torch.float32, scale=inter**-0.5, requires_grad=True)

    def fn(x, w, gate_up, down):
        token = torch.arange(x.shape[0] * x.shape[1], device=x.device).view(x.shape[0], x.shape[1], 1)
        slots = torch.tensor([[1, 0], [3, 1], [2, 3]], device=x.device)
        index = (token * slots[:, 0] + slots[:, 1]) % (experts + 1)
        return TF.moe_experts(x * 1.0, index, w, gate_up, down)
    return fn, [x, w, gate_up, down]


def cross_entropy_case(batch, reduction):
    """Every fourth row ignored; with z-loss and smoothing (the kernel's float arguments)."""
    x = randn((batch, 5, HIDDEN), torch.float32, scale=2.0, requires_grad=True)

    def fn(x):
        rows = torch.arange(x.shape[0] * x.shape[1], device=x.device)
        target = torch.where(rows % 4 == 1, -100, rows * 7 % HIDDEN)
        return TF.cross_entropy(x * 1.0, target.view(x.shape[:-1]), reduction=reduction, label_smoothing=0.1,
                                lse_square_scale=1e-3)
    return fn, [x]


def embedding_case(batch):
    """Repeated ids (the backward's sorted runs), one row of padding_idx."""
    weight = randn((11, HIDDEN), torch.float32, requires_grad=True)

    def fn(weight):
        ids = (torch.arange(batch * 5, device=weight.device) * 3 % 11).view(batch, 5)
        return TF.embedding(ids, weight * 1.0, padding_idx=4)
    return fn, [weight]


def glu_down_case(batch):
    a, b = (randn((batch, 5, 3 * HIDDEN), torch.float32, requires_grad=True) for _ in range(2))
    w = randn((HIDDEN, 3 * HIDDEN), torch.float32, scale=0.1, requires_grad=True)
    return lambda a, b, w: TF.glu_down_proj(a * 1.0, b, w, activation="gelu_tanh"), [a, b, w]


def glu_mlp_case(batch):
    x = randn((batch, 5, HIDDEN), torch.float32, requires_grad=True)
    wg, wu = (randn((3 * HIDDEN, HIDDEN), torch.float32, scale=HIDDEN**-0.5, requires_grad=True) for _ in range(2))
    wd = randn((HIDDEN, 3 * HIDDEN), torch.float32, scale=(3 * HIDDEN) ** -0.5, requires_grad=True)
    return lambda x, wg, wu, wd: TF.glu_mlp(x * 1.0, wg, wu, wd, "silu"), [x, wg, wu, wd]


CASES = {
    "cross_entropy mean": (lambda b: cross_entropy_case(b, "mean"), {"tigon::cross_entropy"}),
    "cross_entropy none": (lambda b: cross_entropy_case(b, "none"), {"tigon::cross_entropy"}),
    "embedding": (embedding_case, {"tigon::embedding", "tigon::embedding_backward"}),
    "glu_down": (glu_down_case, {"tigon::glu_down", "tigon::glu_down_backward"}),
    "glu_mlp": (glu_mlp_case, {"tigon::glu_mlp", "tigon::glu_mlp_backward"}),
    "group_norm": (group_norm_case, {"tigon::group_norm", "tigon::group_norm_backward"}),
    "dyt": (dyt_case, {"tigon::dyt", "tigon::dyt_backward"}),
    "poly_norm": (poly_norm_case, {"tigon::poly_norm", "tigon::poly_norm_backward"}),
    "rms_norm": (norm_case, {"tigon::rms_norm", "tigon::rms_norm_backward"}),
    "rms_norm gemma": (lambda b: norm_case(b, "gemma"), {"tigon::rms_norm", "tigon::rms_norm_backward"}),
    "fused_add_rms_norm": (fused_add_case, {"tigon::fused_add_rms_norm", "tigon::rms_norm_backward"}),
    "layer_norm": (layer_norm_case, {"tigon::layer_norm", "tigon::layer_norm_backward"}),
    "glu": (glu_case, {"tigon::glu", "tigon::glu_backward"}),
    "relu_squared": (relu_squared_case, {"tigon::relu_squared", "tigon::relu_squared_backward"}),
    "rope": (rope_case, {"tigon::rope", "tigon::rope_backward"}),
    "rope, position_ids": (lambda b: rope_case(b, positions=True), {"tigon::rope", "tigon::rope_backward"}),
    "moe_experts": (moe_experts_case, {"tigon::moe_experts", "tigon::moe_experts_backward"}),
    "vocab_parallel_cross_entropy": (vocab_parallel_ce_case, {"tigon::vocab_parallel_cross_entropy_stats",
                                                              "tigon::vocab_parallel_cross_entropy"}),
    "softmax": (lambda b: row_softmax_case(b, "softmax"), {"tigon::softmax", "tigon::softmax_backward"}),
    "sparsemax": (lambda b: row_softmax_case(b, "sparsemax"), {"tigon::sparsemax", "tigon::sparsemax_backward"}),
    "kl_div batchmean": (lambda b: kl_div_case(b, "batchmean"), {"tigon::kl_div"}),
    "kl_div none": (lambda b: kl_div_case(b, "none"), {"tigon::kl_div", "tigon::kl_div_backward"}),
    "tvd mean, labels": (lambda b: tvd_case(b, "mean"), {"tigon::tvd"}),
    "tvd none, labels": (lambda b: tvd_case(b, "none"), {"tigon::tvd", "tigon::tvd_backward"}),
}


# Cases of plain custom ops (opaque to Inductor: see tigon.ops.moe_experts), not kernel_op's.
OPAQUE = {"moe_experts"}


def test_every_kernel_op_has_a_case():
    covered = set().union(*(ops for name, (_, ops) in CASES.items() if name not in OPAQUE))
    assert covered == set(KERNEL_OPS)


def outputs_and_grads(fn, inputs, cotangent_seed):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed)).to(out)
    grads = torch.autograd.grad(out, leaves, cotangent)
    return [out.detach(), *grads]


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_op_compiles_to_eager_values_once_for_every_batch(case):
    from torch._dynamo.testing import CompileCounterWithBackend

    make, _ = CASES[case]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    fn, _ = make(2)
    compiled = torch.compile(fn, backend=counter, dynamic=True)
    codes, frames_after_first = [], None
    for batch in (2, 3):
        _, inputs = make(batch)
        want = outputs_and_grads(fn, inputs, batch)
        if ON_GPU and batch == 2:
            from torch._inductor.utils import run_and_get_code

            got, codes = run_and_get_code(outputs_and_grads, compiled, inputs, batch)
        else:
            got = outputs_and_grads(compiled, inputs, batch)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        frames_after_first = frames_after_first or counter.frame_count
    assert counter.frame_count == frames_after_first, "a new batch size compiled again"
    if ON_GPU and case not in OPAQUE:
        code = "\n".join(codes)
        assert "torch.ops.tigon" not in code, "Inductor called a tigon op instead of launching its kernels"
        assert "_kernel" in code
    torch._dynamo.reset()


SAVES_OUTPUT = {"softmax", "sparsemax"}  # ops whose backward reads their output


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_op_outputs_take_in_place_updates(case):
    """An op's output may be updated in place before the backward (``norm(h) += residual``, as
    Gemma 4's audio tower does): the gradients are those of the out-of-place update."""
    make, _ = CASES[case]
    fn, inputs = make(2)

    def updated_in_place(*leaves):
        out = fn(*leaves)
        out.mul_(3.0)
        return out

    want = outputs_and_grads(lambda *leaves: fn(*leaves) * 3.0, inputs, 0)
    if case in SAVES_OUTPUT:  # as torch.softmax's: the backward reads the output, which changed
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            outputs_and_grads(updated_in_place, inputs, 0)
        return
    got = outputs_and_grads(updated_in_place, inputs, 0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
