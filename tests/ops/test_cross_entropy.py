import pytest
import torch

from tests.helpers import DEVICE, DTYPES, TOL, check_op, pick, randn, rel_err
from tigon import ambient
from tigon import functional as TF
from tigon.nn import TigonCrossEntropyLoss
from tigon.reference import cross_entropy_ref, wide

# (rows, vocab): vocab not a power of two; the largest spans several BLOCK_V-wide blocks.
SHAPES = pick(cpu=[(9, 300), (12, 10007)], gpu=[(4096, 32000), (1024, 128256), (333, 151936)])


def make_target(n, v, ignore="some", ignore_index=-100):
    t = torch.randint(0, v, (n,), device=DEVICE)
    if ignore == "some":
        t[::3] = ignore_index
    elif ignore == "all":
        t[:] = ignore_index
    return t


def run_case(shape, dtype, reduction="mean", ignore="some", inplace=False, **opts):
    n, v = shape
    logits = randn((n, v), dtype, scale=3.0, requires_grad=True)
    target = make_target(n, v, ignore)
    # The gradient is rounded to the logits' dtype in the forward pass and again when the
    # backward scales it by a grad_output != 1: up to two roundings (2 * 2^-8 in bf16) where
    # eager torch has one.
    check_op(lambda x: TF.cross_entropy(x * 1, target, reduction=reduction, inplace=inplace, **opts),
             lambda x: cross_entropy_ref(x, target, reduction=reduction, **opts),
             [logits], dtype=dtype, what=f"cross_entropy[{reduction}, {ignore}, {sorted(opts)}]",
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_matches_torch(shape, dtype, reduction, ignore, inplace):
    run_case(shape, dtype, reduction, ignore, inplace)


OPTIONS = {
    "label_smoothing": dict(label_smoothing=0.1),
    "weight": dict(weight="random"),
    "weight+smoothing": dict(weight="random", label_smoothing=0.2),
    "z_loss": dict(lse_square_scale=1e-3),
    "softcap": dict(softcap=5.0),
    "everything": dict(weight="random", label_smoothing=0.05, lse_square_scale=1e-4, softcap=4.0),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cross_entropy_options_match_torch(shape, dtype, reduction, option):
    opts = dict(OPTIONS[option])
    if opts.get("weight") == "random":
        opts["weight"] = (torch.rand(shape[1], device=DEVICE) + 0.5).to(dtype)
    run_case(shape, dtype, reduction, "some", **opts)


def test_cross_entropy_not_in_place_leaves_logits_alone():
    logits = randn((6, 77), torch.float32, requires_grad=True)
    before = logits.detach().clone()
    target = make_target(6, 77)
    check_op(lambda x: TF.cross_entropy(x, target, inplace=False), lambda x: cross_entropy_ref(x, target),
             [logits], dtype=torch.float32)
    x = logits.detach().clone().requires_grad_()
    TF.cross_entropy(x, target, inplace=False).backward()
    assert torch.equal(x.detach(), before)


def test_cross_entropy_in_place_reuses_the_logits_buffer_and_bumps_its_version():
    x = randn((5, 64), torch.float32, requires_grad=True)
    target = make_target(5, 64)
    h = x * 1.0  # a non-leaf, like lm_head's output
    version = h._version
    loss = TF.cross_entropy(h, target, inplace=True)
    assert h._version > version  # other saved uses of h now fail loudly, not silently
    loss.backward()
    x64 = x.detach().double().requires_grad_()
    cross_entropy_ref(x64, target).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(h.detach(), x.grad)  # h's memory now holds the gradient


def test_cross_entropy_saved_by_another_op_fails_loudly():
    x = randn((4, 32), torch.float32, requires_grad=True)
    h = torch.sigmoid(x)  # sigmoid saves its output h for its backward
    loss = TF.cross_entropy(h, make_target(4, 32, "none"), inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_z_loss_and_token_accuracy_outputs():
    n, v = 40, 96
    logits = randn((n, v), torch.float32, scale=3.0)
    target = make_target(n, v)
    target[1::3] = logits[1::3].argmax(-1)  # some rows predicted right
    loss, z_loss, accuracy = TF.cross_entropy(logits.clone(), target, lse_square_scale=1e-3, return_z_loss=True,
                                             return_token_accuracy=True)
    valid = target != -100
    lse = torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(z_loss.double(), (1e-3 * lse.pow(2) * valid).sum() / valid.sum(), rtol=1e-5, atol=1e-7)
    expected_acc = ((logits.argmax(-1) == target) & valid).sum() / valid.sum()
    torch.testing.assert_close(accuracy.double(), expected_acc.double())
    torch.testing.assert_close(loss.double(), cross_entropy_ref(logits.double(), target, lse_square_scale=1e-3),
                               rtol=1e-5, atol=1e-6)
    per_row = TF.cross_entropy(logits.clone(), target, reduction="none", return_token_accuracy=True)[1]
    assert torch.equal(per_row, ((logits.argmax(-1) == target) & valid).float())


def test_cross_entropy_nd_input_and_module():
    logits = randn((2, 5, 33), torch.float32, requires_grad=True)
    target = torch.randint(0, 33, (2, 5), device=DEVICE)
    module = TigonCrossEntropyLoss(reduction="none", inplace=False)
    check_op(lambda x: module(x, target),
             lambda x: torch.nn.functional.cross_entropy(wide(x).transpose(1, 2), target, reduction="none"),
             [logits], dtype=torch.float32)


def test_cross_entropy_bad_inputs():
    logits = randn((4, 10), torch.float32)
    with pytest.raises(ValueError, match="target holds 10, outside"):
        TF.cross_entropy(logits, torch.tensor([0, 1, 10, 2], device=DEVICE))
    with pytest.raises(ValueError, match="target holds -3"):
        TF.cross_entropy(logits, torch.tensor([0, -3, -100, 2], device=DEVICE))
    with pytest.raises(ValueError, match="target has shape \\(3,\\)"):
        TF.cross_entropy(logits, torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        TF.cross_entropy(logits, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="reduction"):
        TF.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device=DEVICE), reduction="avg")
    with pytest.raises(ValueError, match="weight has 9 entries"):
        TF.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device=DEVICE), weight=torch.ones(9, device=DEVICE))


def test_unchecked_out_of_range_label_gives_nan_not_a_number(monkeypatch):

    monkeypatch.setattr(ambient, "CHECK_LABELS", False)
    logits = randn((3, 10), torch.float32)
    loss = TF.cross_entropy(logits, torch.tensor([0, 12, 1], device=DEVICE))
    assert torch.isnan(loss)


def test_token_accuracy_ties_take_the_first_maximum_across_blocks():
    """As torch.argmax: with the maximum at columns 5 and 9000 (different BLOCK_V blocks),
    column 5 is the prediction."""
    logits = randn((2, 10007), torch.float32)
    logits[:, 5] = logits[:, 9000] = 50.0
    target = torch.tensor([9000, 5], device=DEVICE)
    per_row = TF.cross_entropy(logits, target, reduction="none", return_token_accuracy=True)[1]
    assert per_row.tolist() == [0.0, 1.0]


# ---- -inf logits (a masked vocabulary) ----

NARROW_BLOCK = 64


def narrow_blocks(monkeypatch):
    """BLOCK_V capped at 64 for the test: rows of a few hundred logits span several blocks (in the
    interpreter a block is otherwise the whole row, up to 16384)."""
    from tigon.ops import cross_entropy as ce

    launch_config = ce.ce_launch_config

    def narrow(n_rows, n_cols, device):
        programs, block, num_warps = launch_config(n_rows, n_cols, device)
        return programs, min(block, NARROW_BLOCK), num_warps

    monkeypatch.setattr(ce, "ce_launch_config", narrow)


def masked_logits(n, v, dtype, block):
    """(logits [n, v] with -inf entries, target [n] on finite ones). Row 0: -inf but its target
    (the last column); rows 1 mod 3: their first blocks (BLOCK_V wide) all -inf; other rows: a
    third of the entries -inf, scattered; the last row ignored."""
    logits = (torch.randn(n, v, device=DEVICE) * 3).to(dtype)
    scattered = torch.rand(n, v, device=DEVICE) < 1 / 3
    scattered[1::3] = False
    scattered[1::3, :max(block, v // 2 // block * block)] = True
    logits[scattered] = float("-inf")
    target = torch.multinomial(logits.isfinite().float(), 1).squeeze(1)
    logits[0, :-1] = float("-inf")
    logits[0, -1] = 1.5
    target[0] = v - 1
    target[-1] = -100
    return logits, target


def check_masked(logits, target, reduction, **opts):
    """tigon against torch in float64 on the same logits: no NaN in the loss or the gradient
    (under a random cotangent); the loss +inf where torch's is (label smoothing over -inf
    logits), else within TOL; the gradient, finite as torch's, within TOL."""
    dtype = logits.dtype
    x = logits.clone().requires_grad_()
    loss = TF.cross_entropy(x, target, reduction=reduction, **opts)
    x64 = logits.double().requires_grad_()
    ref = cross_entropy_ref(x64, target, reduction=reduction, **opts)
    cotangent = torch.randn(ref.shape, device=DEVICE, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, x, cotangent.to(loss.dtype))
    (ref_grad,) = torch.autograd.grad(ref, x64, cotangent)
    assert not loss.isnan().any(), f"NaN loss: {loss}"
    assert not grad.isnan().any(), f"NaN gradient in rows {grad.isnan().any(-1).nonzero().flatten().tolist()}"
    assert ref_grad.isfinite().all()
    assert torch.equal(loss.double().isposinf(), ref.isposinf()), f"loss {loss}, torch {ref}"
    finite = ref.isfinite()
    assert rel_err(loss[finite], ref[finite]) <= TOL[dtype], f"loss {loss}, torch {ref}"
    assert rel_err(grad, ref_grad) <= TOL[dtype]


MASKED_OPTIONS = {"plain": dict(), "z_loss": dict(lse_square_scale=1e-3), "smoothing": dict(label_smoothing=0.1)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", list(MASKED_OPTIONS))
def test_masked_vocabulary_blocks_of_only_minus_inf(monkeypatch, dtype, reduction, option):
    """-inf logits, whole blocks of them before the row's first finite one: loss and gradient as
    torch's (the online log-sum-exp once formed exp(-inf + inf), a NaN loss and row gradient)."""
    narrow_blocks(monkeypatch)
    logits, target = masked_logits(9, 300, dtype, NARROW_BLOCK)
    check_masked(logits, target, reduction, **MASKED_OPTIONS[option])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, option", [(torch.float16, "plain"), (torch.float16, "z_loss"),
                                           (torch.bfloat16, "smoothing")])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_masked_vocabulary_at_the_fuzzed_shape(dtype, option, reduction):
    """The fuzzer's case on the H100: [64, 32000], two 16384-wide blocks a row."""
    from tigon.ops.cross_entropy import ce_launch_config

    block = ce_launch_config(64, 32000, torch.device(DEVICE))[1]
    logits, target = masked_logits(64, 32000, dtype, block)
    check_masked(logits, target, reduction, **MASKED_OPTIONS[option])


def test_no_grad_leaves_logits_untouched():
    logits = randn((6, 50), torch.float32, requires_grad=True)
    before = logits.detach().clone()
    target = make_target(6, 50)
    with torch.no_grad():
        loss = TF.cross_entropy(logits, target)
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(loss.double(), cross_entropy_ref(before.double(), target), rtol=1e-5, atol=1e-6)


def test_in_place_gradient_of_a_leaf_is_adopted_not_copied():
    """The gradient buffer handed to autograd is the logits' own memory, even for a leaf."""
    logits = randn((8, 40), torch.float32, requires_grad=True)
    ptr = logits.data_ptr()
    TF.cross_entropy(logits, make_target(8, 40), inplace=True).backward()
    assert logits.grad.data_ptr() == ptr


def test_deferred_label_check_cpu_stays_immediate():
    """Deferral is for CUDA tensors only; on the CPU the check raises at once."""
    from tigon.ambient import deferred_label_checks

    logits = randn((3, 10), torch.float32).cpu()
    if DEVICE != "cpu":
        pytest.skip("CPU tensors reach the kernels only under the interpreter")
    with deferred_label_checks(), pytest.raises(ValueError, match="target holds 12"):
        TF.cross_entropy(logits, torch.tensor([0, 12, 1]))


@pytest.mark.gpu
def test_deferred_label_check_raises_at_a_later_call():
    """Inside deferred_label_checks a CUDA call does not sync: the bad call's loss is NaN and a
    later call (or resolve_label_checks) raises, naming the label."""
    from tigon.ambient import deferred_label_checks, resolve_label_checks

    logits = randn((3, 10), torch.float32)
    good = torch.tensor([0, 3, 1], device=DEVICE)
    with deferred_label_checks():
        assert torch.isfinite(TF.cross_entropy(logits, good))
        resolve_label_checks(wait=True)  # nothing bad queued: no error
        loss = TF.cross_entropy(logits, torch.tensor([0, 12, -100], device=DEVICE))
        assert torch.isnan(loss)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="target held 12, outside \\[0, 10\\)"):
            TF.cross_entropy(logits, good)
    resolve_label_checks(wait=True)  # the queue is empty after the error


def test_default_leaves_the_callers_logits_alone():
    """As torch.nn.functional.cross_entropy: reading the logits after the loss (an entropy
    metric, say) sees the logits, not their gradient."""
    logits = randn((6, 77), torch.float32, requires_grad=True)
    before = logits.detach().clone()
    loss = TF.cross_entropy(logits, make_target(6, 77))
    assert torch.equal(logits.detach(), before)
    loss.backward()
    assert torch.equal(logits.detach(), before)
    assert TigonCrossEntropyLoss().inplace is False


@pytest.mark.parametrize("inplace", [False, True])
def test_rows_sharing_memory_get_their_own_gradient(inplace):
    """Logits whose rows alias (an expanded [1, V] leaf): the gradient must not be written into
    the memory the rows share; loss and gradient as torch's."""
    base = randn((1, 37), torch.float32, scale=2.0, requires_grad=True)
    target = torch.tensor([1, 2, 3, -100, 30], device=DEVICE)
    loss = TF.cross_entropy(base.expand(5, 37), target, inplace=inplace)
    loss.backward()
    ref_base = base.detach().double().requires_grad_()
    ref = cross_entropy_ref(ref_base.expand(5, 37), target)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base.grad.double(), ref_base.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_over_a_retained_graph_is_exact(inplace, reduction):
    """0.5 * loss backward three times over a retained graph: 1.5x one backward, for a leaf
    (whose .grad autograd may adopt) and a non-leaf's upstream parameter."""
    w = randn((7, 40), torch.float32, requires_grad=True)
    h = randn((9, 7), torch.float32)
    target = make_target(9, 40)

    def losses(fn):
        rows = fn(h @ w, target)
        return 0.5 * (rows.sum() if reduction == "none" else rows)

    loss = losses(lambda z, t: TF.cross_entropy(z, t, reduction=reduction, inplace=inplace))
    for _ in range(3):
        loss.backward(retain_graph=True)
    w64 = w.detach().double().requires_grad_()
    ref = losses(lambda z, t: cross_entropy_ref(h.double() @ w64, t, reduction=reduction))
    ref.backward()
    torch.testing.assert_close(w.grad.double(), 3 * w64.grad, rtol=1e-5, atol=1e-7)
    leaf = randn((9, 40), torch.float32, requires_grad=True)
    loss = 0.5 * TF.cross_entropy(leaf * 1, target, inplace=inplace)
    loss.backward(retain_graph=True)
    loss.backward()
    leaf64 = leaf.detach().double().requires_grad_()
    (0.5 * cross_entropy_ref(leaf64, target)).backward()
    torch.testing.assert_close(leaf.grad.double(), 2 * leaf64.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ignore_index", [7, 40, 0])
def test_ignore_index_may_be_any_class_or_outside_the_vocabulary(ignore_index):
    """torch accepts ignore_index >= V (and inside [0, V)): so must tigon."""
    logits = randn((6, 40), torch.float32, requires_grad=True)
    target = torch.tensor([1, ignore_index, 3, ignore_index, 39, 5], device=DEVICE)
    check_op(lambda x: TF.cross_entropy(x, target, ignore_index=ignore_index),
             lambda x: cross_entropy_ref(x, target, ignore_index=ignore_index), [logits], dtype=torch.float32)


def test_shapes_like_torch_and_clear_errors():
    logits = randn((33,), torch.float32, requires_grad=True)  # one unbatched row, as torch allows
    target = torch.tensor(4, device=DEVICE)
    check_op(lambda x: TF.cross_entropy(x, target), lambda x: cross_entropy_ref(x[None], target[None]),
             [logits], dtype=torch.float32)
    with pytest.raises(ValueError, match="logits must be a tensor"):
        TF.cross_entropy(torch.tensor(1.0, device=DEVICE), torch.tensor(0, device=DEVICE))
    with pytest.raises(ValueError, match="target has shape \\(5, 2\\)"):
        TF.cross_entropy(randn((2, 5, 9), torch.float32), torch.zeros(5, 2, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="float64"):
        TF.cross_entropy(randn((2, 9), torch.float32).double(), torch.zeros(2, dtype=torch.long, device=DEVICE))


def test_strided_and_expanded_targets_and_class_weights():
    """Targets and class weights are read by the kernel: any layout must give torch's result."""
    logits = randn((6, 50), torch.float32, requires_grad=True)
    target = torch.randint(0, 50, (12,), device=DEVICE)[::2]
    weight = (torch.rand(100, device=DEVICE) + 0.5)[::2]
    check_op(lambda x: TF.cross_entropy(x, target, weight=weight, label_smoothing=0.1),
             lambda x: cross_entropy_ref(x, target, weight=weight, label_smoothing=0.1), [logits],
             dtype=torch.float32)
    same = torch.tensor(3, device=DEVICE).expand(6)
    check_op(lambda x: TF.cross_entropy(x, same), lambda x: cross_entropy_ref(x, same), [logits], dtype=torch.float32)


@pytest.mark.parametrize("dtype, offset", [(torch.float32, 1e4), (torch.float16, 6e4)])
def test_large_logits_keep_their_precision(dtype, offset):
    """Probabilities formed from the row maximum, not from exp(z - lse) with lse rounded at the
    logits' magnitude: gradient and loss as accurate as eager torch on the same logits."""
    base = torch.randn(8, 300, device=DEVICE) * 2 + offset
    logits = base.clamp(max=torch.finfo(dtype).max).to(dtype)
    target = make_target(8, 300)
    x = logits.clone().requires_grad_()
    loss = TF.cross_entropy(x, target)
    loss.backward()
    x64 = logits.double().requires_grad_()
    ref = cross_entropy_ref(x64, target)
    ref.backward()
    x_eager = logits.clone().requires_grad_()
    eager = cross_entropy_ref(x_eager, target)  # computed in fp32, gradient rounded to dtype
    eager.backward()
    grad_err = (x.grad.double() - x64.grad).abs().max().item()
    eager_err = (x_eager.grad.double() - x64.grad).abs().max().item()
    assert grad_err <= max(4 * eager_err, 1e-7), (grad_err, eager_err)
    assert abs(loss.item() - ref.item()) <= max(4 * abs(eager.item() - ref.item()), 1e-5)


@pytest.mark.parametrize("scale", [0.02, 3.0])
def test_softcap_keeps_the_precision_of_small_logits(scale):
    """cap tanh(x / cap) at small x / cap (Gemma 2's cap 30 on a freshly initialised head's
    logits): as accurate as eager torch's tanh. Through 2 sigmoid(2u) - 1 the capped logits were
    off by ~cap x 1e-7 absolute, and the gradient's error was 5x eager torch's here."""
    n, v = pick(cpu=(9, 300), gpu=(1024, 32000))
    logits = randn((n, v), torch.float32, scale=scale)
    target = make_target(n, v)
    x = logits.clone().requires_grad_()
    loss = TF.cross_entropy(x, target, softcap=30.0)
    loss.backward()
    x64 = logits.double().requires_grad_()
    ref = cross_entropy_ref(x64, target, softcap=30.0)
    ref.backward()
    x_eager = logits.clone().requires_grad_()
    eager = cross_entropy_ref(x_eager, target, softcap=30.0)
    eager.backward()
    grad_err = (x.grad.double() - x64.grad).abs().max().item()
    eager_err = (x_eager.grad.double() - x64.grad).abs().max().item()
    assert grad_err <= 4 * eager_err, (grad_err, eager_err)
    assert abs(loss.item() - ref.item()) <= max(4 * abs(eager.item() - ref.item()), 1e-6 * abs(ref.item()))


def test_predicted_tokens_and_token_scaling():
    n, v = 10, 2000
    logits = randn((2, n // 2, v), torch.float32, scale=3.0, requires_grad=True)
    target = make_target(n, v).view(2, n // 2)
    loss, accuracy, predicted = TF.cross_entropy(logits, target, return_token_accuracy=True,
                                                 return_predicted_tokens=True)
    valid = target != -100
    expected = torch.where(valid, logits.detach().argmax(-1), -1)
    assert predicted.dtype == torch.int64 and torch.equal(predicted, expected)
    torch.testing.assert_close(accuracy, ((expected == target) & valid).sum() / valid.sum())

    def scaled_ref(x):
        rows = cross_entropy_ref(x.reshape(n, v), target.reshape(n), reduction="none")
        p_y = torch.exp(-rows).detach()  # p(target), no gradient through it (0 where ignored)
        return (rows * p_y * valid.reshape(n)).sum() / valid.sum()

    check_op(lambda x: TF.cross_entropy(x, target, use_token_scaling=True), scaled_ref, [logits],
             dtype=torch.float32)


# ---- the custom ops: opcheck, torch.compile, eager gradient buffers ----

def check_compiled(fn, inputs, *args, shapes=None):
    """torch.compile(fn, backend="aot_eager", dynamic=True) gives eager's output and the gradients
    of ``inputs`` (a sum of squares of the output as the loss: a grad_output != 1), for each set
    of inputs in ``shapes`` (the same graph serves them all), and fn traces in one graph."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", dynamic=True)
    for case in shapes or [inputs]:
        runs = []
        for f in (fn, compiled):
            leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in case]
            out = f(*leaves, *args)
            (out.square().sum() if out.ndim else 0.5 * out).backward()
            runs.append((out.detach(), [t.grad for t in leaves if t.requires_grad]))
        (eager_out, eager_grads), (compiled_out, compiled_grads) = runs
        torch.testing.assert_close(compiled_out, eager_out)
        for got, want in zip(compiled_grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*inputs, *args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()


def option_args(**options):
    """CrossEntropyOptions as the ops take them (positional, schema order)."""
    from tigon.ops._cross_entropy_common import CrossEntropyOptions

    return tuple(CrossEntropyOptions(**options))


def opcheck_all_succeed(op, args):
    results = torch.library.opcheck(getattr(op, "library_op", op), args)
    assert set(results.values()) == {"SUCCESS"}, results


CE_OPCHECK_CASES = {
    "plain": dict(),
    "class weights, smoothing, extras, none": dict(weight="random", label_smoothing=0.1, reduction="none",
                                                  return_token_accuracy=True, return_predicted_tokens=True),
    "z-loss, softcap, sum": dict(lse_square_scale=1e-2, return_z_loss=True, softcap=3.0, reduction="sum"),
    "token scaling, weights, mean": dict(weight="random", use_token_scaling=True, return_token_accuracy=True),
}


@pytest.mark.parametrize("case", list(CE_OPCHECK_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_op_passes_opcheck(case, dtype):
    """Schema, autograd registration, fake implementation and AOTAutograd (dynamic shapes)."""
    from tigon.ops import cross_entropy_op

    n, v = 7, 13
    options = dict(CE_OPCHECK_CASES[case])
    if options.get("weight") == "random":
        options["weight"] = (torch.rand(v, device=DEVICE) + 0.5).to(dtype)
    logits = randn((n, v), dtype, scale=2.0, requires_grad=True)
    for compute_grad in (True, False):
        opcheck_all_succeed(cross_entropy_op, (logits, make_target(n, v), *option_args(**options), compute_grad))


def test_cross_entropy_inplace_op_passes_opcheck():
    """tigon::cross_entropy_ (mutates the logits) has no autograd formula of its own (torch takes
    none for mutating ops; CrossEntropyOverLogits is its autograd): checked with grad mode off,
    where its outputs need none."""
    from tigon.ops import cross_entropy_inplace_op

    n, v = 7, 13
    weight = torch.rand(v, device=DEVICE) + 0.5
    with torch.no_grad():
        for options in (dict(), dict(weight=weight, reduction="none", return_predicted_tokens=True)):
            logits = randn((n, v), torch.float32, requires_grad=True)
            opcheck_all_succeed(cross_entropy_inplace_op, (logits, make_target(n, v), *option_args(**options)))


def test_cross_entropy_inplace_op_refuses_rows_it_cannot_write():
    from tigon.ops import cross_entropy_inplace_op

    target = make_target(5, 37)
    with pytest.raises(ValueError, match="unit last stride"):
        cross_entropy_inplace_op(randn((1, 37), torch.float32).expand(5, 37), target, *option_args())
    with pytest.raises(ValueError, match="unit last stride"):
        cross_entropy_inplace_op(randn((37, 5), torch.float32).t(), target, *option_args())


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_compiles_without_graph_breaks(inplace, reduction):
    """Compiled (aot_eager, dynamic shapes): eager's loss and gradients, one graph. inplace=True
    runs the functional op there."""
    v = 41
    weight = torch.rand(v, device=DEVICE) + 0.5

    def fn(z, t):
        return TF.cross_entropy(z * 1, t, reduction=reduction, inplace=inplace, weight=weight, label_smoothing=0.1,
                                lse_square_scale=1e-3)

    shapes = [[randn((b, t, v), torch.float32, requires_grad=True), make_target(b * t, v).view(b, t)]
              for b, t in ((2, 5), (3, 7))]
    check_compiled(fn, shapes[0], shapes=shapes)


def test_cross_entropy_extras_compile_without_graph_breaks():
    v = 29

    def fn(z, t):
        loss, accuracy, predicted = TF.cross_entropy(z, t, return_token_accuracy=True, return_predicted_tokens=True)
        return loss + accuracy + predicted.float().mean()

    check_compiled(fn, [randn((11, v), torch.float32, requires_grad=True)], make_target(11, v))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_formed_in_the_forward_is_scaled_in_place_and_adopted(reduction, monkeypatch):
    """Eager, graph freed after the backward: the [N, V] gradient the forward formed is scaled by
    grad_output in place and becomes logits.grad: no second [N, V] buffer."""
    from tigon.ops import cross_entropy as ce

    buffers = []  # data pointers only: a reference kept here would make autograd copy the buffer
    rows = ce.cross_entropy_rows
    monkeypatch.setattr(ce, "cross_entropy_rows",
                        lambda x, t, n, g, o: buffers.append(g.data_ptr()) or rows(x, t, n, g, o))
    logits = randn((8, 40), torch.float32, requires_grad=True)
    target = make_target(8, 40)
    loss = TF.cross_entropy(logits, target, reduction=reduction)
    (0.5 * (loss.sum() if reduction == "none" else loss)).backward()
    assert buffers == [logits.grad.data_ptr()]
    x64 = logits.detach().double().requires_grad_()
    ref = cross_entropy_ref(x64, target, reduction=reduction)
    (0.5 * (ref.sum() if reduction == "none" else ref)).backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)


def test_option_errors_name_the_argument_before_the_op():
    logits = randn((4, 10), torch.float32)
    target = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        TF.cross_entropy(logits, target, ignore_index=1.5)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        TF.cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be positive"):
        TF.cross_entropy(logits, target, softcap=0.0)
    with pytest.raises(ValueError, match="lse_square_scale"):
        TF.cross_entropy(logits, target, lse_square_scale=-1.0)
    with pytest.raises(TypeError, match="weight \\(class weights\\) must be a torch.Tensor"):
        TF.cross_entropy(logits, target, weight=[1.0] * 10)
