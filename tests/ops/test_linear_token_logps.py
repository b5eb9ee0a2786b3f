import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_op, launches_take_turns, pick, randn, run_in_threads
from tests.ops.test_cross_entropy import make_target
from tigon import functional as TF
from tigon.reference import token_logps_ref

# (rows, hidden, vocab): odd sizes; the GPU shape is one DPO chunk of a Llama-3-sized head.
SHAPES = pick(cpu=[(37, 24, 301), (5, 16, 4099)], gpu=[(2048, 4096, 128256), (999, 1024, 32001)])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignore", ["some", "none", "all"])
def test_linear_token_logps_matches_reference(shape, dtype, bias, ignore):
    n, h, v = shape
    x = randn((n, h), dtype, requires_grad=True)
    w = randn((v, h), dtype, scale=h**-0.5 * 3, requires_grad=True)
    b = randn((v,), dtype, scale=0.5, requires_grad=True) if bias else None
    target = make_target(n, v, ignore)
    check_op(lambda x, w, b: TF.linear_token_logps(x, w, target, b), lambda x, w, b: token_logps_ref(x, w, target, b),
             [x, w, b], dtype=dtype, tol=1e-4 if dtype == torch.float32 else 2e-2,
             noise_floor=2 * 2**-8 if dtype == torch.bfloat16 else 2e-5, worse_than_eager=3.0,
             what=f"linear_token_logps[{ignore}, bias={bias}]")


def test_linear_token_logps_strided_x_and_fp32_head():
    """A non-contiguous bf16 x (every other row of a bigger tensor) with an fp32 weight."""
    n, h, v = pick((9, 24, 301), (1000, 2048, 32000))
    x = randn((n, h), torch.bfloat16, non_contiguous=True, requires_grad=True)
    w = randn((v, h), torch.float32, scale=h**-0.5 * 3, requires_grad=True)
    target = make_target(n, v, "some")
    check_op(lambda x, w: TF.linear_token_logps(x, w, target), lambda x, w: token_logps_ref(x, w, target),
             [x, w], dtype=torch.bfloat16, tol=2e-2, noise_floor=2 * 2**-8, worse_than_eager=3.0)


def test_linear_token_logps_under_autograd_grad_not_torch_func():
    """torch.autograd.grad (what the chunked losses use) gives autograd's gradients; torch.func
    transforms refuse the op (its autograd is a custom op's registered formula)."""
    n, h, v = 11, 16, 257
    x = randn((n, h), torch.float32, requires_grad=True)
    w = randn((v, h), torch.float32, scale=0.5, requires_grad=True)
    target = make_target(n, v, "some")
    scale = torch.randn(n, device=DEVICE)
    value = (TF.linear_token_logps(x, w, target) * scale).sum()
    gx, gw = torch.autograd.grad(value, (x, w))
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = (token_logps_ref(xr, wr, target) * scale).sum()
    ref.backward()
    torch.testing.assert_close(value, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, wr.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(lambda x: TF.linear_token_logps(x, w.detach(), target).sum())(x.detach())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compute_grad", [True, False])
def test_linear_token_logps_opcheck(bias, compute_grad):
    """torch.library.opcheck: schema, autograd registration, fake tensor (shapes, dtypes,
    strides of both outputs) and AOT dispatch with dynamic shapes, gradients included."""
    n, h, v = 7, 12, 37
    x = randn((n, h), torch.float32, requires_grad=compute_grad)
    w = randn((v, h), torch.float32, scale=h**-0.5 * 3, requires_grad=compute_grad)
    b = randn((v,), torch.float32, scale=0.5, requires_grad=compute_grad) if bias else None
    target = make_target(n, v, "some")
    result = torch.library.opcheck(torch.ops.tigon.linear_token_logps.default, (x, w, b, target, -100, compute_grad))
    assert set(result.values()) == {"SUCCESS"}, result


def test_linear_token_logps_compiles_without_graph_breaks():
    """torch.compile (aot_eager, dynamic shapes) traces the op in one graph and gives eager's
    values and gradients, for two batch sizes."""
    h, v = 12, 37

    def fn(x, w, b, target, scale):
        return (TF.linear_token_logps(x, w, target, b) * scale).sum()

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (2, 3):
        x = randn((rows, 5, h), torch.float32, requires_grad=True)
        w = randn((v, h), torch.float32, scale=h**-0.5 * 3, requires_grad=True)
        b = randn((v,), torch.float32, scale=0.5, requires_grad=True)
        target = torch.randint(0, v, (rows, 5), device=DEVICE)
        target[:, 0] = -100
        scale = torch.randn(rows, 5, device=DEVICE)
        explained = torch._dynamo.explain(fn)(x, w, b, target, scale)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        out = compiled(x, w, b, target, scale)
        grads = torch.autograd.grad(out, (x, w, b))
        ref = fn(x, w, b, target, scale)
        ref_grads = torch.autograd.grad(ref, (x, w, b))
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_linear_token_logps_bad_inputs():
    x = randn((4, 8), torch.float32)
    w = randn((10, 8), torch.float32)
    with pytest.raises(ValueError, match="target"):
        TF.linear_token_logps(x, w, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        TF.linear_token_logps(x, randn((10, 7), torch.float32), torch.zeros(4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="target"):
        TF.linear_token_logps(x, w, torch.full((4,), 10, dtype=torch.long, device=DEVICE))
    target = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="ignore_index"):  # checked before the op (its schema's error is vaguer)
        TF.linear_token_logps(x, w, target, ignore_index=-100.0)
    with pytest.raises(TypeError, match="bias"):
        TF.linear_token_logps(x, w, target, bias=[0.0] * 10)
    with pytest.raises(TypeError, match="target"):
        TF.linear_token_logps(x, w, target.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gradients_accumulate_in_the_matmul(dtype):
    """Inside accumulate_head_grads, two chunks' backwards add the head's weight and bias
    gradients into one accumulator each (autograd gets None for them: no [V, H] gradient per
    chunk) and still return x's; the sums equal autograd's over both chunks. Another tensor
    (not given to the block) keeps its plain gradient."""
    from tigon.ops.linear_token_logps import accumulate_head_grads

    n, h, v = 13, 16, 257
    x = randn((2 * n, h), dtype, requires_grad=True)
    w = randn((v, h), dtype, scale=0.5, requires_grad=True)
    b = randn((v,), dtype, scale=0.5, requires_grad=True)
    target = make_target(2 * n, v, "some")
    scale = torch.randn(2 * n, device=DEVICE)
    value = (TF.linear_token_logps(x, w, target, b) * scale).sum()
    ref_x, ref_w, ref_b = torch.autograd.grad(value, (x, w, b))
    with accumulate_head_grads(w, b) as acc:
        dxs = []
        for rows in (slice(0, n), slice(n, 2 * n)):
            xc = x[rows].detach().requires_grad_()
            chunk = (TF.linear_token_logps(xc, w, target[rows], b) * scale[rows]).sum()
            dx, dw, db = torch.autograd.grad(chunk, (xc, w, b), allow_unused=True)
            assert dw is None and db is None
            dxs.append(dx)
        assert acc.get(w).dtype == dtype and acc.get(b) is not None and acc.get(x) is None
        w2 = w.detach().clone().requires_grad_()  # not in the block: its gradient comes back
        (TF.linear_token_logps(x, w2, target, b.detach()) * scale).sum().backward()
        assert w2.grad is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat(dxs), ref_x, rtol=tol, atol=tol)
    torch.testing.assert_close(acc.get(w), ref_w, rtol=tol, atol=tol)
    torch.testing.assert_close(acc.get(b), ref_b, rtol=tol, atol=tol)
    torch.testing.assert_close(w2.grad, ref_w, rtol=tol, atol=tol)


def head_case(n=7, h=16, v=131):
    """A head (weight, bias) and three batches of rows for it."""
    w = randn((v, h), torch.float32, scale=0.5, requires_grad=True)
    b = randn((v,), torch.float32, scale=0.5, requires_grad=True)
    batches = [(randn((n, h), torch.float32), make_target(n, v, "some")) for _ in range(3)]
    return w, b, batches


def head_grads_alone(w, b, x, target):
    """(dW, db) of sum(linear_token_logps) with no block open."""
    return torch.autograd.grad(TF.linear_token_logps(x, w, target, b).sum(), (w, b))


def test_head_gradient_blocks_bind_each_op_call_at_its_forward():
    """An op call adds its head gradients into the block that was open (in its thread) when its
    forward ran: two blocks over one weight, both forwards run before either backward and the
    first block left while the second is open, each get their own call's gradients. A call made
    before any block returns its gradients though its backward runs inside one, and so does a
    call whose backward runs after its block was left."""
    from tigon.ops.linear_token_logps import accumulate_head_grads

    w, b, batches = head_case()
    want = [head_grads_alone(w, b, x, t) for x, t in batches]
    (xa, ta), (xb, tb), (xc, tc) = batches
    outside = TF.linear_token_logps(xc, w, tc, b).sum()
    block_a = accumulate_head_grads(w, b)
    acc_a = block_a.__enter__()
    loss_a = TF.linear_token_logps(xa, w, ta, b).sum()
    block_b = accumulate_head_grads(w, b)
    acc_b = block_b.__enter__()
    loss_b = TF.linear_token_logps(xb, w, tb, b).sum()
    block_a.__exit__(None, None, None)  # left first: block b stays open
    assert torch.autograd.grad(loss_b, (w, b), allow_unused=True) == (None, None)
    got_c = torch.autograd.grad(outside, (w, b))
    block_b.__exit__(None, None, None)
    got_a = torch.autograd.grad(loss_a, (w, b))
    assert acc_a.get(w) is None and acc_a.get(b) is None
    for got, ref in ((got_a, want[0]), ((acc_b.get(w), acc_b.get(b)), want[1]), (got_c, want[2])):
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_head_gradient_blocks_of_two_threads_over_one_weight(monkeypatch):
    """Two threads each open a block over the same weight and bias, run a forward, and only then
    (both blocks open) the backward: each block gets its own thread's gradients. The Triton
    interpreter is not thread-safe, so kernel launches take turns (the blocks still overlap)."""
    import threading

    from tigon.ops.linear_token_logps import accumulate_head_grads

    launches_take_turns(monkeypatch)
    w, b, batches = head_case()
    want = [head_grads_alone(w, b, x, t) for x, t in batches[:2]]
    both_open, both_done = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)
    got = [None, None]

    def run(i):
        x, t = batches[i]
        with accumulate_head_grads(w, b) as acc:
            loss = TF.linear_token_logps(x, w, t, b).sum()
            both_open.wait()
            assert torch.autograd.grad(loss, (w, b), allow_unused=True) == (None, None)
            both_done.wait()
        got[i] = (acc.get(w), acc.get(b))

    run_in_threads(run, barriers=(both_open, both_done))
    for i in range(2):
        for g, r in zip(got[i], want[i]):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
