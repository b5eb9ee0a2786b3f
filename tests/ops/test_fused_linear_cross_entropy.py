import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn
from tests.ops.test_cross_entropy import check_compiled, make_target, narrow_blocks, opcheck_all_succeed, option_args
from tigon import functional as TF
from tigon.nn import TigonFusedLinearCrossEntropyLoss
from tigon.ops.fused_linear_cross_entropy import chunk_rows_for_budget
from tigon.reference import cross_entropy_ref, fused_linear_cross_entropy_ref

# (rows, hidden, vocab)
SHAPES = pick(cpu=[(37, 24, 301), (10, 16, 9000)], gpu=[(4096, 2048, 32000), (1000, 1024, 128256)])
# A budget of a few rows of logits forces several chunks; None is the default (one chunk here).
BUDGETS = {"chunked": lambda rows, vocab, elt: 8 * vocab * elt, "default": lambda rows, vocab, elt: None}


def run_case(shape, dtype, w_dtype=None, bias=False, reduction="mean", ignore="some", budget="chunked",
             frozen=False, **opts):
    n, h, v = shape
    x = randn((n, h), dtype, requires_grad=True)
    w = randn((v, h), w_dtype or dtype, scale=h**-0.5 * 3, requires_grad=not frozen)
    b = randn((v,), w_dtype or dtype, scale=0.5, requires_grad=True) if bias else None
    target = make_target(n, v, ignore)
    chunk_budget = BUDGETS[budget](n, v, x.element_size())
    # bf16: logits are rounded once more than in eager torch (the chunk buffer), and the stored
    # gradients are rescaled by grad_output in the backward: allow two roundings.
    check_op(lambda x, w, b: TF.fused_linear_cross_entropy(x, w, target, b, reduction=reduction,
                                                          chunk_budget=chunk_budget, **opts),
             lambda x, w, b: fused_linear_cross_entropy_ref(x, w, target, b, reduction=reduction, **opts),
             [x, w, b], dtype=dtype, tol=1e-4 if dtype == torch.float32 else 2e-2,
             what=f"flce[{reduction}, {ignore}, {budget}, bias={bias}, {sorted(opts)}]",
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_flce_matches_torch(shape, dtype, reduction, ignore, budget):
    run_case(shape, dtype, reduction=reduction, ignore=ignore, budget=budget)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_with_bias(dtype, reduction):
    run_case(SHAPES[0], dtype, bias=True, reduction=reduction)


@pytest.mark.parametrize("option", ["label_smoothing", "ce_weight", "z_loss", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_cross_entropy_options(option, dtype):
    v = SHAPES[0][2]
    opts = {"label_smoothing": dict(label_smoothing=0.1),
            "ce_weight": dict(weight=(torch.rand(v, device=DEVICE) + 0.5).to(dtype)),
            "z_loss": dict(lse_square_scale=1e-3),
            "softcap": dict(softcap=3.0)}[option]
    n, h, _ = SHAPES[0]
    x = randn((n, h), dtype, requires_grad=True)
    w = randn((v, h), dtype, scale=h**-0.5 * 3, requires_grad=True)
    target = make_target(n, v)
    ours = dict(opts)
    if "weight" in ours:
        ours["ce_weight"] = ours.pop("weight")
    check_op(lambda x, w: TF.fused_linear_cross_entropy(x, w, target, chunk_budget=8 * v * 4, **ours),
             lambda x, w: fused_linear_cross_entropy_ref(x, w, target, **opts), [x, w], dtype=dtype,
             tol=1e-4 if dtype == torch.float32 else 2e-2, what=f"flce[{option}]",
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_masked_vocabulary(monkeypatch, dtype):
    """A bias of -inf over the first blocks of the vocabulary (a masked vocabulary): loss and
    gradients as torch's (the cross-entropy kernel's online log-sum-exp once formed
    exp(-inf + inf) there: NaN)."""
    narrow_blocks(monkeypatch)
    n, h, v = SHAPES[0]
    x = randn((n, h), dtype, requires_grad=True)
    w = randn((v, h), dtype, scale=h**-0.5 * 3, requires_grad=True)
    b = randn((v,), dtype, scale=0.5)
    b[:v // 2] = float("-inf")
    b.requires_grad_()
    target = torch.randint(v // 2, v, (n,), device=DEVICE)
    target[::3] = -100
    check_op(lambda x, w, b: TF.fused_linear_cross_entropy(x, w, target, b, chunk_budget=8 * v * 4),
             lambda x, w, b: fused_linear_cross_entropy_ref(x, w, target, b), [x, w, b], dtype=dtype,
             tol=1e-4 if dtype == torch.float32 else 2e-2, what="flce[masked]",
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0)


def test_flce_frozen_head_and_fp32_weight_with_bf16_x():
    run_case(SHAPES[0], torch.float32, frozen=True)
    run_case(SHAPES[0], torch.bfloat16, w_dtype=torch.float32)


def test_flce_fp32_dw_accumulator_matches():
    n, h, v = SHAPES[0]
    x = randn((n, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, scale=0.3, requires_grad=True)
    target = make_target(n, v)
    check_op(lambda x, w: TF.fused_linear_cross_entropy(x, w, target, chunk_budget=8 * v * 4,
                                                       accum_dtype=torch.float32),
             lambda x, w: fused_linear_cross_entropy_ref(x, w, target), [x, w], dtype=torch.float32, tol=1e-4,
             noise_floor=2e-5)


def test_flce_tied_embeddings_accumulate_both_gradients():
    """The head weight is also the embedding table: both uses reach weight.grad."""
    n, h, v = 12, 16, 50
    w = randn((v, h), torch.float32, scale=0.5, requires_grad=True)
    ids = torch.randint(0, v, (n,), device=DEVICE)
    target = make_target(n, v)

    def model(w, loss_fn):
        x = torch.tanh(w[ids] * 2.0)
        return loss_fn(x, w)

    model(w, lambda x, w: TF.fused_linear_cross_entropy(x, w, target, chunk_budget=4 * v * 4)).backward()
    w64 = w.detach().double().requires_grad_()
    model(w64, lambda x, w: fused_linear_cross_entropy_ref(x, w, target)).backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_flce_3d_input_and_token_accuracy():
    b, t, h, v = 2, 7, 16, 40
    x = randn((b, t, h), torch.float32)
    w = randn((v, h), torch.float32)
    target = torch.randint(0, v, (b, t), device=DEVICE)
    loss, z, acc = TF.fused_linear_cross_entropy(x, w, target, lse_square_scale=1e-2, return_z_loss=True,
                                                return_token_accuracy=True)
    logits = x.double() @ w.double().t()
    torch.testing.assert_close(loss.double(), cross_entropy_ref(logits.reshape(-1, v), target.reshape(-1),
                                                                lse_square_scale=1e-2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z.double(), 1e-2 * torch.logsumexp(logits, -1).pow(2).mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(acc.double(), (logits.argmax(-1) == target).double().mean())
    rows = TF.fused_linear_cross_entropy(x, w, target, reduction="none")
    assert rows.shape == (b, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_module_called_with_x_weight_target_bias(dtype):
    n, h, v = SHAPES[0]
    x = randn((2, n, h), dtype, requires_grad=True)
    w = randn((v, h), dtype, scale=h**-0.5 * 3, requires_grad=True)
    b = randn((v,), dtype, scale=0.5, requires_grad=True)
    target = make_target(2 * n, v, "some").view(2, n)
    module = TigonFusedLinearCrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-3, chunk_budget=8 * v * 4)
    assert "chunk_budget" in repr(module)
    check_op(lambda x, w, b: module(x, w, target, bias=b),
             lambda x, w, b: fused_linear_cross_entropy_ref(x.reshape(-1, h), w, target.reshape(-1), b,
                                                            label_smoothing=0.1, lse_square_scale=1e-3),
             [x, w, b], dtype=dtype, tol=1e-4 if dtype == torch.float32 else 2e-2, what="flce module",
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0)


def test_chunk_rows_for_budget():
    assert chunk_rows_for_budget(2048, 128256, 2, 512 * 2**20) == 2048  # fits: one chunk
    rows = chunk_rows_for_budget(8192, 128256, 2, 512 * 2**20)
    assert rows * 128256 * 2 <= 512 * 2**20 and rows % 64 == 0 and 8192 / rows <= 5
    assert chunk_rows_for_budget(100, 1000, 4, 4000 * 30) == 25  # 30 rows fit: four even chunks of 25
    assert chunk_rows_for_budget(5, 10**6, 4, 1) == 1  # never zero


def test_flce_bad_inputs():
    x = randn((4, 8), torch.float32)
    w = randn((10, 8), torch.float32)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="weight has shape"):
        TF.fused_linear_cross_entropy(x, randn((10, 7), torch.float32), y)
    with pytest.raises(ValueError, match="target has 3 elements but x has 4 rows"):
        TF.fused_linear_cross_entropy(x, w, y[:3])
    with pytest.raises(ValueError, match="bias has 9 entries"):
        TF.fused_linear_cross_entropy(x, w, y, bias=randn((9,), torch.float32))
    with pytest.raises(ValueError, match="target holds 10"):
        TF.fused_linear_cross_entropy(x, w, torch.tensor([0, 10, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="reduction"):
        TF.fused_linear_cross_entropy(x, w, y, reduction="mean_tokens")


def test_flce_under_no_grad_computes_the_loss_only(monkeypatch):
    from tigon.ops import fused_linear_cross_entropy as flce

    seen = []
    original = flce.flce_chunks

    def spy(*args, **kwargs):
        seen.append((kwargs["need_dx"], kwargs["need_dw"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(flce, "flce_chunks", spy)
    x = randn((9, 8), torch.float32, requires_grad=True)
    w = randn((20, 8), torch.float32, requires_grad=True)
    target = make_target(9, 20)
    with torch.no_grad():
        loss = TF.fused_linear_cross_entropy(x, w, target)
    assert seen == [(False, False)]
    torch.testing.assert_close(loss.double(),
                               fused_linear_cross_entropy_ref(x.detach().double(), w.detach().double(), target),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cross_entropy_and_flce_capture_in_a_cuda_graph():
    """No host sync inside: both can be captured and replayed (the label check is skipped)."""
    n, h, v = 256, 128, 5000
    x = randn((n, h), torch.bfloat16, requires_grad=True)
    w = randn((v, h), torch.bfloat16, scale=h**-0.5, requires_grad=True)
    target = make_target(n, v)
    ce_weight = torch.rand(v, device=DEVICE) + 0.5

    def step():
        a = TF.fused_linear_cross_entropy(x, w, target, ce_weight=ce_weight, label_smoothing=0.1)
        b = TF.cross_entropy(x.float() @ w.float().t(), target, inplace=False)
        (a + b).backward()
        return a, b

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [t.detach().clone() for t in step()]
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        torch.testing.assert_close(got, want)


def test_flce_zero_rows_and_bad_options():
    w = randn((20, 8), torch.float32, requires_grad=True)
    x = randn((0, 8), torch.float32, requires_grad=True)
    loss = TF.fused_linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))
    rows = TF.fused_linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE), reduction="none")
    assert rows.shape == (0,)
    x = randn((4, 8), torch.float32)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    for budget in (0, -1, 1.5):
        with pytest.raises(ValueError, match="chunk_budget must be a positive number of bytes"):
            TF.fused_linear_cross_entropy(x, w, y, chunk_budget=budget)
    with pytest.raises(ValueError, match="accum_dtype"):
        TF.fused_linear_cross_entropy(x, w, y, accum_dtype=torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_backward_over_a_retained_graph_is_exact(reduction):
    """The gradients formed in the forward pass are scaled by grad_output in the backward: over a
    retained graph every backward must see them unscaled (x, a leaf, whose .grad autograd may
    adopt; W; the bias)."""
    n, h, v = 13, 8, 50
    x = randn((n, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, requires_grad=True)
    b = randn((v,), torch.float32, requires_grad=True)
    target = make_target(n, v)

    def half_loss(fn, x, w, b):
        out = fn(x, w, target, b, reduction=reduction)
        return 0.5 * (out.sum() if reduction == "none" else out)

    loss = half_loss(lambda *a, **k: TF.fused_linear_cross_entropy(*a, **k, chunk_budget=4 * v * 4), x, w, b)
    for _ in range(3):
        loss.backward(retain_graph=True)
    refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    half_loss(fused_linear_cross_entropy_ref, *refs).backward()
    for ours, ref in zip((x, w, b), refs):
        torch.testing.assert_close(ours.grad.double(), 3 * ref.grad, rtol=1e-5, atol=1e-7)


def test_flce_token_scaling_predicted_tokens_and_strided_target():
    n, h, v = 12, 8, 300
    x = randn((n, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, scale=1.0, requires_grad=True)
    target = make_target(2 * n, v)[::2]

    def scaled_ref(x, w):
        rows = fused_linear_cross_entropy_ref(x, w, target, reduction="none")
        valid = target != -100
        return (rows * torch.exp(-rows).detach() * valid).sum() / valid.sum()

    check_op(lambda x, w: TF.fused_linear_cross_entropy(x, w, target, use_token_scaling=True, chunk_budget=4 * v * 4),
             scaled_ref, [x, w], dtype=torch.float32, tol=1e-4, noise_floor=2e-5)
    _, predicted = TF.fused_linear_cross_entropy(x, w, target, return_predicted_tokens=True)
    expected = torch.where(target != -100, (x.detach().double() @ w.detach().double().t()).argmax(-1), -1)
    assert torch.equal(predicted, expected)


# ---- the custom ops: opcheck, torch.compile, eager gradient buffers ----

FLCE_OPCHECK_CASES = {
    "mean": dict(),
    "none, class weights, accuracy": dict(reduction="none", weight="random", return_token_accuracy=True),
    "sum, z-loss, smoothing, predicted": dict(reduction="sum", lse_square_scale=1e-2, return_z_loss=True,
                                              label_smoothing=0.1, return_predicted_tokens=True),
}


@pytest.mark.parametrize("case", list(FLCE_OPCHECK_CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_flce_op_passes_opcheck(case, bias):
    """Schema, autograd registration, fake implementation and AOTAutograd (dynamic shapes), over
    several chunks, x [3, 5, H]."""
    from tigon.ops import fused_linear_cross_entropy_op

    h, v = 6, 13
    options = dict(FLCE_OPCHECK_CASES[case])
    if options.get("weight") == "random":
        options["weight"] = torch.rand(v, device=DEVICE) + 0.5
    x = randn((3, 5, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, scale=0.5, requires_grad=True)
    b = randn((v,), torch.float32, requires_grad=True) if bias else None
    target = make_target(15, v).view(3, 5)
    opcheck_all_succeed(fused_linear_cross_entropy_op,
                        (x, w, target, b, *option_args(**options), 4 * v * 4, None, True, True, bias))
    # Frozen head, fp32 dW accumulator for bf16 weights.
    opcheck_all_succeed(fused_linear_cross_entropy_op,
                        (x.detach().bfloat16().requires_grad_(), w.detach().bfloat16(), target,
                         None if b is None else b.detach().bfloat16(), *option_args(**options), 4 * v * 2,
                         torch.float32, True, False, False))


def test_flce_backward_op_passes_opcheck():
    """tigon::fused_linear_cross_entropy_backward (reduction "none"), checked with grad mode off:
    a backward, with no autograd formula of its own (no double backward)."""
    from tigon.ops import fused_linear_cross_entropy_backward_op

    h, v = 6, 13
    x = randn((3, 5, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, scale=0.5, requires_grad=True)
    b = randn((v,), torch.float32, requires_grad=True)
    grad_loss = torch.rand(15, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        for bias, ce_weight in ((b, None), (None, torch.rand(v, device=DEVICE) + 0.5)):
            opcheck_all_succeed(fused_linear_cross_entropy_backward_op,
                                (grad_loss, x, w, make_target(15, v).view(3, 5), bias,
                                 *option_args(reduction="none", weight=ce_weight), 4 * v * 4, None, True, True,
                                 bias is not None))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_flce_compiles_without_graph_breaks(reduction, bias):
    """Compiled (aot_eager, dynamic shapes): eager's loss and gradients, one graph; the backward
    scales the saved gradients out of place there ("none": recomputes)."""
    h, v = 8, 37
    ce_weight = torch.rand(v, device=DEVICE) + 0.5

    def fn(x, w, b, t):
        return TF.fused_linear_cross_entropy(torch.tanh(x), w, t, b, reduction=reduction, ce_weight=ce_weight,
                                             chunk_budget=4 * v * 4)

    shapes = [[randn((n, 5, h), torch.float32, requires_grad=True),
               randn((v, h), torch.float32, scale=0.5, requires_grad=True),
               randn((v,), torch.float32, requires_grad=bias),
               make_target(n * 5, v).view(n, 5)] for n in (2, 3)]
    check_compiled(fn, shapes[0], shapes=shapes)


def test_flce_gradients_formed_in_the_forward_are_scaled_in_place_and_adopted(monkeypatch):
    """Eager, graph freed after the backward: dx and dW formed in the forward are scaled by
    grad_output in place and become x.grad and w.grad: no second buffer of either."""
    from tigon.ops import fused_linear_cross_entropy as flce

    formed = []  # data pointers only: a reference kept here would make autograd copy the buffer

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        formed.append((out[3].data_ptr(), out[4].data_ptr()))
        return out

    original = flce.flce_chunks
    monkeypatch.setattr(flce, "flce_chunks", spy)
    n, h, v = 13, 8, 50
    x = randn((n, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, requires_grad=True)
    target = make_target(n, v)
    (0.5 * TF.fused_linear_cross_entropy(x, w, target, chunk_budget=4 * v * 4)).backward()
    assert formed == [(x.grad.data_ptr(), w.grad.data_ptr())]
    refs = [t.detach().double().requires_grad_() for t in (x, w)]
    (0.5 * fused_linear_cross_entropy_ref(*refs, target)).backward()
    for ours, ref in zip((x, w), refs):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


def test_flce_option_errors_name_the_argument_before_the_op():
    x = randn((4, 8), torch.float32)
    w = randn((10, 8), torch.float32)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        TF.fused_linear_cross_entropy(x, w, y, ignore_index=None)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        TF.fused_linear_cross_entropy(x, w, y, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="chunk_budget must be a positive number of bytes"):
        TF.fused_linear_cross_entropy(x, w, y, chunk_budget="1G")
