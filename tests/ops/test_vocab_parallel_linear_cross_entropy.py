"""Vocab-parallel fused linear cross entropy: one rank in this process (the sharded chunk walk on a
shard that starts past id 0; world size 1 as fused_linear_cross_entropy; argument errors; DTensors
on a one-rank mesh), and two ranks spawned once for the module (gloo on the CPU under the
interpreter, NCCL on two GPUs) comparing every rank's loss, dx and its shard's dW (and db) with a
float64 full-vocabulary reference."""

import math

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, ON_GPU, check_op, pick, randn, rel_err, run_on_ranks
from tests.ops.test_cross_entropy import make_target
from tests.ops.test_vocab_parallel_cross_entropy import shard_target
from tigon import functional as TF
from tigon.nn import TigonVocabParallelLinearCrossEntropyLoss
from tigon.reference import fused_linear_cross_entropy_ref

# (rows, hidden, shard width, vocab_start): the interpreter's BLOCK_V is 128, so the 300-wide
# shard spans three blocks; CHUNK rows a chunk with the small budget (four chunks of x's rows).
ROWS, HIDDEN, WIDTH, START = pick(cpu=(13, 16, 300, 17), gpu=(2048, 1024, 64128, 64128))
CHUNK = pick(cpu=4, gpu=512)
# As the fused linear cross entropy's tests: matmuls in the test dtype, and in bf16 the logits and
# the gradient stored in the forward are rounded once more than eager torch's.
FLCE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
FLCE_FLOOR = {torch.float32: 2e-5, torch.bfloat16: 2 * 2**-8}


def budget(rows, width, dtype):
    """A chunk_budget of ``rows`` rows of [rows, width] logits."""
    return rows * width * torch.empty((), dtype=dtype).element_size()


def head(dtype, width=WIDTH, hidden=HIDDEN, bias=False):
    """(weight [width, hidden], bias [width] or None) leaves, logits of a few units."""
    w = randn((width, hidden), dtype, scale=hidden**-0.5 * 3, requires_grad=True)
    return w, randn((width,), dtype, scale=0.5, requires_grad=True) if bias else None


def run_sharded(dtype, reduction="mean", ignore="some", bias=True, chunked=True, x_layout=None, **opts):
    x = randn((ROWS, HIDDEN), dtype, requires_grad=True)
    w, b = head(dtype, bias=bias)
    target, local = shard_target(ROWS, WIDTH, START, ignore)
    chunk_budget = budget(CHUNK, WIDTH, dtype) if chunked else None
    layouts = {None: lambda x: x,
               "padded rows": lambda x: torch.nn.functional.pad(x, (0, 5))[:, :HIDDEN],  # row stride H + 5
               "transposed": lambda x: x.t().contiguous().t()}  # column-major: copied to rows
    arrange = layouts[x_layout]
    check_op(lambda x, w, b: TF.vocab_parallel_linear_cross_entropy(arrange(x), w, target, b, vocab_start=START,
                                                                     reduction=reduction, chunk_budget=chunk_budget,
                                                                     **opts),
             lambda x, w, b: fused_linear_cross_entropy_ref(x, w, local, b, reduction=reduction, **opts), [x, w, b],
             dtype=dtype, tol=FLCE_TOL[dtype], noise_floor=FLCE_FLOOR[dtype], worse_than_eager=3.0,
             what=f"vocab_parallel_linear_cross_entropy[{reduction}, {ignore}, {x_layout}, {sorted(opts)}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction, ignore", [("mean", "some"), ("sum", "none"), ("none", "some"),
                                               ("mean", "all")])
def test_sharded_chunks_match_torch(dtype, reduction, ignore):
    run_sharded(dtype, reduction, ignore)


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict(label_smoothing=0.1, bias=False)),
    (torch.float32, dict(lse_square_scale=1e-2, softcap=4.0, reduction="sum")),
    (torch.bfloat16, dict(label_smoothing=0.2, lse_square_scale=1e-3, reduction="none")),
    (torch.float32, dict(chunked=False)),
])
def test_sharded_options_match_torch(dtype, options):
    run_sharded(dtype, **options)


@pytest.mark.parametrize("x_layout", ["padded rows", "transposed"])
def test_strided_x(x_layout):
    run_sharded(torch.float32, x_layout=x_layout)


def test_mean_divides_by_the_whole_calls_rows():
    """The first chunk's rows all ignored, the others not: "mean" is over every chunk's rows (a
    per-chunk mean would weigh the chunks unequally)."""
    x = randn((ROWS, HIDDEN), torch.float32, requires_grad=True)
    w, _ = head(torch.float32)
    target, local = shard_target(ROWS, WIDTH, START, ignore="none")
    target[:CHUNK] = local[:CHUNK] = -100
    check_op(lambda x, w: TF.vocab_parallel_linear_cross_entropy(x, w, target, vocab_start=START,
                                                                  chunk_budget=budget(CHUNK, WIDTH, torch.float32)),
             lambda x, w: fused_linear_cross_entropy_ref(x, w, local), [x, w], dtype=torch.float32, tol=1e-4,
             noise_floor=2e-5, worse_than_eager=3.0)


def test_z_loss_is_returned():
    x = randn((ROWS, HIDDEN), torch.float32)
    w, _ = head(torch.float32)
    target, local = shard_target(ROWS, WIDTH, START)
    loss, z_loss = TF.vocab_parallel_linear_cross_entropy(x, w, target, vocab_start=START, lse_square_scale=1e-2,
                                                          return_z_loss=True, chunk_budget=budget(CHUNK, WIDTH,
                                                                                                  torch.float32))
    logits = x.double() @ w.detach().double().t()
    valid = local != -100
    z_ref = 1e-2 * (torch.logsumexp(logits, -1).pow(2) * valid).sum() / valid.sum()
    torch.testing.assert_close(z_loss.double(), z_ref, rtol=1e-5, atol=1e-7)
    want = fused_linear_cross_entropy_ref(x.double(), w.detach().double(), local, lse_square_scale=1e-2)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_over_a_retained_graph_is_exact(reduction):
    """Gradients formed in the forward pass ("mean") or again in the backward ("none") are scaled
    by grad_output there: over a retained graph each backward sees them unscaled."""
    x = randn((ROWS, HIDDEN), torch.float32, requires_grad=True)
    w, b = head(torch.float32, bias=True)
    target, local = shard_target(ROWS, WIDTH, START)

    def half_loss(fn, *args, **kwargs):
        out = fn(*args, reduction=reduction, **kwargs)
        return 0.37 * (out.sum() if reduction == "none" else out)

    loss = half_loss(TF.vocab_parallel_linear_cross_entropy, x, w, target, b, vocab_start=START,
                     chunk_budget=budget(CHUNK, WIDTH, torch.float32))
    for _ in range(3):
        loss.backward(retain_graph=True)
    refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    half_loss(fused_linear_cross_entropy_ref, refs[0], refs[1], local, refs[2]).backward()
    for name, ours, ref in zip(("dx", "dW", "db"), (x, w, b), refs):
        err = rel_err(ours.grad, 3 * ref.grad)
        assert err <= 1e-4, f"{name} relative error {err:.3g} after three backward passes"


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered", "ignore:invalid value encountered")  # the interpreter
def test_nan_in_x_makes_the_loss_nan():
    x = randn((ROWS, HIDDEN), torch.float32)
    w, _ = head(torch.float32)
    target, _ = shard_target(ROWS, WIDTH, START, ignore="none")
    x[1, 3] = float("nan")
    kwargs = dict(vocab_start=START, chunk_budget=budget(CHUNK, WIDTH, torch.float32))
    assert torch.isnan(TF.vocab_parallel_linear_cross_entropy(x, w, target, **kwargs))
    rows = TF.vocab_parallel_linear_cross_entropy(x, w, target, reduction="none", **kwargs)
    assert torch.isnan(rows[1]) and torch.isfinite(rows[0]) and torch.isfinite(rows[2:]).all()


def test_one_rank_is_fused_linear_cross_entropy():
    """No process group and vocab_start None or 0: fused_linear_cross_entropy, bit for bit."""
    x = randn((ROWS, HIDDEN), torch.float32)
    w, b = head(torch.float32, bias=True)
    target = make_target(ROWS, WIDTH)
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, return_z_loss=True,
                chunk_budget=budget(CHUNK, WIDTH, torch.float32))
    runs = []
    for fn in (lambda *a: TF.fused_linear_cross_entropy(*a, **opts),
               lambda *a: TF.vocab_parallel_linear_cross_entropy(*a, **opts),
               lambda *a: TF.vocab_parallel_linear_cross_entropy(*a, vocab_start=0, **opts)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        loss, z_loss = fn(leaves[0], leaves[1], target, leaves[2])
        loss.backward()
        runs.append((loss.detach(), z_loss, *(t.grad for t in leaves)))
    for run in runs[1:]:
        for got, want in zip(run, runs[0], strict=True):
            assert torch.equal(got, want)


def test_module_and_nd_input():
    x = randn((3, 4, HIDDEN), torch.float32, requires_grad=True)
    w, b = head(torch.float32, bias=True)
    target, local = shard_target(12, WIDTH, START)
    module = TigonVocabParallelLinearCrossEntropyLoss(vocab_start=START, reduction="none", label_smoothing=0.1,
                                                      chunk_budget=budget(5, WIDTH, torch.float32))
    check_op(lambda x, w, b: module(x, w, target.view(3, 4), bias=b),
             lambda x, w, b: fused_linear_cross_entropy_ref(x.reshape(12, HIDDEN), w, local, b, reduction="none",
                                      label_smoothing=0.1).view(3, 4),
             [x, w, b], dtype=torch.float32, tol=1e-4, noise_floor=2e-5, worse_than_eager=3.0)
    assert f"vocab_start={START}" in repr(module) and "chunk_budget" in repr(module)


def test_bad_arguments_name_the_argument():
    x = randn((4, 8), torch.float32)
    w = randn((30, 8), torch.float32)
    target = torch.tensor([17, 18, 19, -100], device=DEVICE)

    def call(*args, **kwargs):
        return TF.vocab_parallel_linear_cross_entropy(*args, **{"vocab_start": 17, **kwargs})

    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        call(x.double(), w, target)
    with pytest.raises(ValueError, match="weight has shape"):
        call(x, w[:, :7], target)
    with pytest.raises(ValueError, match="target has 3 elements but x has 4 rows"):
        call(x, w, target[:3])
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        call(x, w, target.float())
    with pytest.raises(ValueError, match="bias has 29 entries"):
        call(x, w, target, randn((29,), torch.float32))
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        call(x, w, target, [0.0] * 30)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="vocab_start must be a non-negative int"):
            call(x, w, target, vocab_start=bad)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        call(x, w, target, group=[0, 1])
    with pytest.raises(ValueError, match="reduction"):
        call(x, w, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        call(x, w, target, label_smoothing=2.0)
    with pytest.raises(ValueError, match="softcap"):
        call(x, w, target, softcap=-1.0)
    with pytest.raises(ValueError, match="chunk_budget must be a positive number of bytes"):
        call(x, w, target, chunk_budget=0)
    with pytest.raises(ValueError, match="target holds 47, which is not ignore_index=-100 and lies in no rank's"):
        call(x, w, torch.tensor([17, 47, 19, -100], device=DEVICE))


def test_compiled_call_runs_eagerly_at_a_graph_break():
    """Under torch.compile (Dynamo only) the sharded call is a graph break and gives eager's values;
    with one rank and no vocab_start (fused_linear_cross_entropy) it is traced."""
    from torch._dynamo.utils import counters

    x = randn((ROWS, HIDDEN), torch.float32, requires_grad=True)
    w, _ = head(torch.float32)
    target, local = shard_target(ROWS, WIDTH, START)
    for vocab_start, t in ((START, target), (None, local)):
        def fn(x, w):
            return TF.vocab_parallel_linear_cross_entropy(torch.tanh(x), w, t, vocab_start=vocab_start,
                                                          reduction="sum")

        torch._dynamo.reset()
        counters.clear()
        got = torch.autograd.grad(torch.compile(fn, backend="eager")(x, w), (x, w))
        want = torch.autograd.grad(fn(x, w), (x, w))
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
        assert bool(counters["graph_break"]) == (vocab_start is not None), dict(counters["graph_break"])
    torch._dynamo.reset()


# ---- two ranks ----

D_ROWS, D_HIDDEN, D_VOCAB, D_SPLIT = pick(cpu=(13, 16, 511, 300), gpu=(1024, 512, 32011, 17003))  # uneven
D_CHUNK = pick(cpu=4, gpu=256)
DIST_CASES = {
    "fp32, mean, bias, chunks": dict(bias=True),
    "bf16, mean, vocab_start gathered": dict(dtype="bfloat16", gather_start=True),
    "sum, all ignored": dict(reduction="sum", ignore="all"),
    "mean, all ignored, one chunk": dict(ignore="all", chunked=False),
    "none, bias, smoothing": dict(reduction="none", bias=True, label_smoothing=0.1),
    "sum, smoothing, z-loss, softcap": dict(reduction="sum", label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0),
    "bf16, smoothing, bias, one chunk": dict(dtype="bfloat16", label_smoothing=0.2, bias=True, chunked=False),
    "strided x, loss * 0.37": dict(strided=True, cotangent=0.37),
    "retained graph, backward twice": dict(backwards=2, bias=True),
    "none, retained graph, backward twice": dict(reduction="none", backwards=2),
    "DTensor head (ColwiseParallel), bias": dict(dtensor=True, bias=True),
    "DTensor head, Replicate DTensor x": dict(dtensor=True, replicate_x=True, chunked=False),
}


def dtensor_head(w_full, b_full, device):
    """nn.Linear(H, V) holding w_full / b_full, parallelised by ColwiseParallel over a 1-D mesh of
    both ranks: its weight (and bias) DTensors sharded over the vocabulary, as DTensor splits V."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (2,))
    linear = torch.nn.Linear(w_full.shape[1], w_full.shape[0], bias=b_full is not None, device=device,
                             dtype=w_full.dtype)
    with torch.no_grad():
        linear.weight.copy_(w_full)
        if b_full is not None:
            linear.bias.copy_(b_full)
    return parallelize_module(linear, mesh, ColwiseParallel(use_local_output=False)), mesh


def dist_case(rank, spec, device):
    """One case on this rank: the message of the first mismatch, or "ok"."""
    import torch.distributed as dist

    dtype = getattr(torch, spec.get("dtype", "float32"))
    reduction = spec.get("reduction", "mean")
    opts = {k: spec[k] for k in ("label_smoothing", "lse_square_scale", "softcap") if k in spec}
    g = torch.Generator().manual_seed(1234)  # the same inputs and cotangent on both ranks
    x_full = torch.randn(D_ROWS, D_HIDDEN, generator=g).to(dtype)
    w_full = (torch.randn(D_VOCAB, D_HIDDEN, generator=g) * D_HIDDEN**-0.5 * 3).to(dtype)
    b_full = (torch.randn(D_VOCAB, generator=g) * 0.5).to(dtype) if spec.get("bias") else None
    target = torch.randint(0, D_VOCAB, (D_ROWS,), generator=g)
    if spec.get("ignore", "some") == "some":
        target[::3] = -100
    elif spec.get("ignore") == "all":
        target[:] = -100
    cotangent = (torch.tensor(spec["cotangent"], dtype=torch.float64) if "cotangent" in spec else
                 torch.randn(D_ROWS if reduction == "none" else (), generator=g, dtype=torch.float64))
    if spec.get("dtensor"):
        width = math.ceil(D_VOCAB / 2)  # DTensor's split: ceil(V / ranks) rows a rank
        start, width = rank * width, min(width, D_VOCAB - rank * width)
    else:
        start, width = (0, D_SPLIT) if rank == 0 else (D_SPLIT, D_VOCAB - D_SPLIT)
    chunk_budget = (budget(D_CHUNK, max(D_SPLIT, D_VOCAB - D_SPLIT, math.ceil(D_VOCAB / 2)), dtype)
                    if spec.get("chunked", True) else None)

    x = x_full.to(device, copy=True)
    if spec.get("strided"):  # rows D_HIDDEN + 3 apart
        x = torch.nn.functional.pad(x, (0, 3))[:, :D_HIDDEN].detach()
    x.requires_grad_()
    kwargs = dict(reduction=reduction, chunk_budget=chunk_budget, **opts)
    if spec.get("dtensor"):
        linear, mesh = dtensor_head(w_full.to(device), None if b_full is None else b_full.to(device), device)
        weight, bias = linear.weight, linear.bias
        x_in = x
        if spec.get("replicate_x"):
            from torch.distributed.tensor import DTensor, Replicate

            x_in = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        loss = TF.vocab_parallel_linear_cross_entropy(x_in, weight, target.to(device), bias, **kwargs)
    else:
        weight = w_full[start:start + width].to(device).requires_grad_()
        bias = None if b_full is None else b_full[start:start + width].to(device).requires_grad_()
        loss = TF.vocab_parallel_linear_cross_entropy(x, weight, target.to(device), bias,
                                                      vocab_start=None if spec.get("gather_start") else start,
                                                      **kwargs)
    backwards = spec.get("backwards", 1)
    for _ in range(backwards):
        loss.backward(cotangent.to(device, loss.dtype), retain_graph=backwards > 1)

    losses = [None, None]
    dist.all_gather_object(losses, loss.detach().cpu().double().numpy().tobytes())
    if losses[0] != losses[1]:
        return "the ranks' losses differ"
    refs = [t.detach().double().requires_grad_() if t is not None else None for t in (x_full, w_full, b_full)]
    ref = fused_linear_cross_entropy_ref(refs[0], refs[1], target, refs[2], reduction=reduction, **opts)
    ref.backward(cotangent * backwards)
    compared = [("loss", loss, ref), ("dx", x.grad, refs[0].grad)]
    if spec.get("dtensor"):
        from torch.distributed.tensor import DTensor

        for name, param in (("weight", weight), ("bias", bias)):
            if param is not None and not (isinstance(param.grad, DTensor)
                                          and param.grad.placements == param.placements):
                return f"{name}.grad is a {type(param.grad).__name__}, not a DTensor placed as {name}"
        grads = [weight.grad.to_local(), None if bias is None else bias.grad.to_local()]
    else:
        grads = [weight.grad, None if bias is None else bias.grad]
    compared.append(("dW", grads[0], refs[1].grad[start:start + width]))
    if bias is not None:
        compared.append(("db", grads[1], refs[2].grad[start:start + width]))
    tol = FLCE_TOL[dtype]
    for name, got, want in compared:
        err = rel_err(got.cpu(), want)
        if not err <= tol:
            return f"{name} relative error {err:.3g} > {tol:.3g}"
    return "ok"


def dist_nan(rank, device):
    """NaN in x (the same on both ranks): the loss NaN on both, never silently finite."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(D_ROWS, D_HIDDEN, generator=g)
    x[2, 5] = float("nan")
    w = torch.randn(D_VOCAB, D_HIDDEN, generator=g)
    target = torch.randint(0, D_VOCAB, (D_ROWS,), generator=g)
    start, width = (0, D_SPLIT) if rank == 0 else (D_SPLIT, D_VOCAB - D_SPLIT)
    loss = TF.vocab_parallel_linear_cross_entropy(x.to(device), w[start:start + width].to(device), target.to(device),
                                                  vocab_start=start, chunk_budget=budget(D_CHUNK, D_SPLIT,
                                                                                         torch.float32))
    return "ok" if torch.isnan(loss).item() else f"loss {loss.item()}"


def dist_errors(rank, device):
    """A target in no shard, overlapping shards (both ranks at id 0) and a replicated DTensor
    weight: a ValueError on both ranks (none left waiting in a collective), and a good call after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    x = torch.randn(4, 8, device=device)
    w = torch.randn(50 + 10 * rank, 8, device=device)
    replicated = DTensor.from_local(torch.ones(20, 8, device=device), init_device_mesh(device.type, (2,)),
                                    [Replicate()], run_check=False)
    messages = []
    for weight, target, start, expected in (
            (w, [0, 1, 200, 2], 50 * rank, "lies in no rank's vocabulary shard"),
            (w, [0, 1, 5, 2], 0, "in 2 ranks' vocabulary shards"),
            (replicated, [0, 1, 5, 2], None, "takes one sharded over the vocabulary")):
        try:
            TF.vocab_parallel_linear_cross_entropy(x, weight, torch.tensor(target, device=device), vocab_start=start)
            messages.append("no error")
        except ValueError as e:
            messages.append("ok" if expected in str(e) else str(e))
    loss = TF.vocab_parallel_linear_cross_entropy(x, w, torch.tensor([0, 1, 60, 2], device=device),
                                                  vocab_start=50 * rank)
    messages.append("ok" if torch.isfinite(loss).item() else "the call after the errors failed")
    return "ok" if messages == ["ok"] * 4 else "; ".join(messages)


def dist_cases(rank, device):
    return {**{name: lambda spec=spec: dist_case(rank, spec, device) for name, spec in DIST_CASES.items()},
            "NaN in x": lambda: dist_nan(rank, device), "errors": lambda: dist_errors(rank, device)}


@pytest.fixture(scope="module")
def two_ranks():
    """Both ranks' results, {case: "ok" or what failed}, from one job of two processes for the module."""
    return run_on_ranks(dist_cases)


@pytest.mark.parametrize("case", [*DIST_CASES, "NaN in x", "errors"])
def test_two_ranks_match_the_full_vocabulary(two_ranks, case):
    assert [r[case] for r in two_ranks] == ["ok", "ok"]


# ---- DTensors on a one-rank mesh (last: the two ranks above fork this process, which must not
# hold a process group then) ----

def test_dtensors_on_one_rank(tmp_path):
    """fused_linear_cross_entropy refuses a DTensor weight or x, saying what to use; a one-rank
    vocabulary-sharded DTensor head is fused_linear_cross_entropy, its weight's gradient a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh(torch.device(DEVICE).type, (1,))
        x = randn((ROWS, HIDDEN), torch.float32, requires_grad=True)
        w, _ = head(torch.float32)
        target = make_target(ROWS, WIDTH)
        sharded = DTensor.from_local(w.detach().clone(), mesh, [Shard(0)], run_check=False).requires_grad_()
        for args, name in (((x, sharded), "weight"),
                           ((DTensor.from_local(x, mesh, [Replicate()], run_check=False), w), "x")):
            with pytest.raises(ValueError, match=f"but {name} is a DTensor") as error:
                TF.fused_linear_cross_entropy(*args, target)
            for words in ("FSDP2 / ZeRO-3", "tigon.patch", "tigon.functional.vocab_parallel_linear_cross_entropy"):
                assert words in str(error.value)
        loss = TF.vocab_parallel_linear_cross_entropy(x, sharded, target)
        loss.backward()
        want = TF.fused_linear_cross_entropy(x.detach().requires_grad_(), w, target)
        want.backward()
        assert torch.equal(loss, want)
        assert isinstance(sharded.grad, DTensor) and sharded.grad.placements == (Shard(0),)
        assert torch.equal(sharded.grad.to_local(), w.grad)
        with pytest.raises(ValueError, match="group and vocab_start come from a DTensor weight"):
            TF.vocab_parallel_linear_cross_entropy(x, sharded, target, vocab_start=0)
        with pytest.raises(ValueError, match="bias is a DTensor but weight is not"):
            TF.vocab_parallel_linear_cross_entropy(x, w, target, DTensor.from_local(
                torch.zeros(WIDTH, device=DEVICE), mesh, [Shard(0)], run_check=False))
    finally:
        dist.destroy_process_group()
