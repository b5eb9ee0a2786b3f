"""Vocab-parallel cross entropy: one rank in this process (the sharded kernels, with a shard that
starts past id 0), and two ranks spawned once for the module (gloo on the CPU under the
interpreter, NCCL on two GPUs) comparing every rank's loss and shard gradient with a float64
full-vocabulary reference."""


import pytest
import torch

from tests.helpers import DEVICE, DTYPES, TOL, check_op, pick, randn, rel_err, run_on_ranks
from tests.ops.test_cross_entropy import check_compiled, make_target, opcheck_all_succeed
from tigon import ambient
from tigon import functional as TF
from tigon.nn import TigonVocabParallelCrossEntropyLoss
from tigon.reference import cross_entropy_ref

# (rows, shard width, vocab_start): the interpreter's BLOCK_V is 128, so a 300-wide shard spans
# three blocks and its 3 programs walk several rows each.
ROWS, WIDTH, START = pick(cpu=(9, 300, 17), gpu=(2048, 64128, 64128))
BF16_FLOOR = 2 * 2**-8  # gradient rounded in the forward and again when scaled (as cross_entropy's tests)


def shard_target(n, width, start, ignore="some"):
    """Global ids in [start, start + width) (ignore_index -100 per ``make_target``) and the
    same as ids local to the shard."""
    local = make_target(n, width, ignore)
    return torch.where(local == -100, local, local + start), local


def run_sharded(dtype, reduction="mean", ignore="some", inplace=False, non_contiguous=False, **opts):
    logits = randn((ROWS, WIDTH), dtype, scale=3.0, requires_grad=True, non_contiguous=non_contiguous)
    target, local = shard_target(ROWS, WIDTH, START, ignore)
    check_op(lambda x: TF.vocab_parallel_cross_entropy(x * 1, target, vocab_start=START, reduction=reduction,
                                                       inplace=inplace, **opts),
             lambda x: cross_entropy_ref(x, local, reduction=reduction, **opts), [logits], dtype=dtype,
             what=f"vocab_parallel_cross_entropy[{reduction}, {ignore}, {sorted(opts)}]",
             noise_floor=BF16_FLOOR if dtype == torch.bfloat16 else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction, ignore", [("mean", "some"), ("sum", "none"), ("none", "some"),
                                               ("mean", "all")])
def test_sharded_kernels_match_torch(dtype, reduction, ignore):
    run_sharded(dtype, reduction, ignore)


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict(label_smoothing=0.1)),
    (torch.float32, dict(lse_square_scale=1e-2, softcap=4.0, reduction="sum")),
    (torch.bfloat16, dict(label_smoothing=0.2, lse_square_scale=1e-3, reduction="none")),
])
def test_sharded_options_match_torch(dtype, options):
    run_sharded(dtype, **options)


@pytest.mark.parametrize("inplace", [False, True])
def test_strided_logits_and_in_place(inplace):
    run_sharded(torch.float32, inplace=inplace, non_contiguous=True)


def test_one_rank_is_cross_entropy():
    """No process group and vocab_start None or 0: tigon's cross_entropy, bit for bit; the sharded
    kernels at vocab_start 0 agree with it."""
    from tigon.ops.vocab_parallel_cross_entropy import shard_options, sharded_cross_entropy

    x = randn((ROWS, WIDTH), torch.float32, scale=3.0)
    target = make_target(ROWS, WIDTH)
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, return_z_loss=True)
    runs = []
    for fn in (lambda z: TF.vocab_parallel_cross_entropy(z, target, **opts),
               lambda z: TF.vocab_parallel_cross_entropy(z, target, vocab_start=0, **opts),
               lambda z: TF.cross_entropy(z, target, **opts),
               lambda z: sharded_cross_entropy(z, target, None, 1, 0, shard_options(-100, "mean", 0.1, 1e-3, None,
                                                                                   True), True)):
        leaf = x.clone().requires_grad_()
        loss, z_loss = fn(leaf)
        loss.backward()
        runs.append((loss.detach(), z_loss, leaf.grad))
    for run in runs[1:3]:
        for got, want in zip(run, runs[0], strict=True):
            assert torch.equal(got, want)
    for got, want in zip(runs[3], runs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_expanded_and_transposed_logits_and_expanded_targets():
    """Rows sharing memory (an expanded [1, V] leaf, with inplace=True) get their own gradient;
    transposed logits (stride 6 along V) and an expanded target are read as they are."""
    base = randn((1, 40), torch.float32, scale=2.0, requires_grad=True)
    target = torch.tensor(START + 3, device=DEVICE).expand(6)
    check_op(lambda b: TF.vocab_parallel_cross_entropy(b.expand(6, 40), target, vocab_start=START, inplace=True),
             lambda b: cross_entropy_ref(b.expand(6, 40), target - START), [base], dtype=torch.float32)
    columns = randn((40, 6), torch.float32, scale=2.0, requires_grad=True)
    target, local = shard_target(6, 40, START)
    check_op(lambda c: TF.vocab_parallel_cross_entropy(c.t(), target, vocab_start=START, inplace=True),
             lambda c: cross_entropy_ref(c.t(), local), [columns], dtype=torch.float32)


@pytest.mark.parametrize("inplace", [False, True])
def test_backward_over_a_retained_graph_is_exact(inplace):
    """Two backward passes with different grad_outputs over one graph: each as float64's."""
    x = randn((ROWS, WIDTH), torch.float32, scale=2.0, requires_grad=True)
    target, local = shard_target(ROWS, WIDTH, START)
    rows = TF.vocab_parallel_cross_entropy(x * 1, target, vocab_start=START, reduction="none", inplace=inplace)
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_ref(x64, local, reduction="none")
    for i in range(2):
        cotangent = torch.randn(ROWS, device=DEVICE, dtype=torch.float64)
        (got,) = torch.autograd.grad(rows, x, cotangent.float(), retain_graph=True)
        (want,) = torch.autograd.grad(ref, x64, cotangent, retain_graph=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7, msg=f"backward {i}")


def test_leaves_the_callers_logits_alone_unless_in_place():
    x = randn((ROWS, WIDTH), torch.float32, requires_grad=True)
    target, _ = shard_target(ROWS, WIDTH, START)
    before = x.detach().clone()
    TF.vocab_parallel_cross_entropy(x, target, vocab_start=START).backward()
    assert torch.equal(x.detach(), before)
    y = x * 1
    x.grad = None
    TF.vocab_parallel_cross_entropy(y, target, vocab_start=START, inplace=True).backward()
    torch.testing.assert_close(y.detach(), x.grad)  # y holds the gradient now


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf - inf
def test_masked_logits_and_non_finite_values():
    """-inf logits (a masked vocabulary) are fine; a +inf or NaN logit makes its row NaN."""
    x = randn((ROWS, WIDTH), torch.float32, scale=2.0)
    target, local = shard_target(ROWS, WIDTH, START, ignore="none")
    x[:, WIDTH // 2:] = -float("inf")
    target = torch.where(local < WIDTH // 2, target, START)
    local = target - START
    check_op(lambda z: TF.vocab_parallel_cross_entropy(z, target, vocab_start=START, reduction="none"),
             lambda z: cross_entropy_ref(z, local, reduction="none"), [x.requires_grad_()], dtype=torch.float32)
    y = x.detach().clone()
    y[1, 0], y[2, 1] = float("inf"), float("nan")
    rows = TF.vocab_parallel_cross_entropy(y, target, vocab_start=START, reduction="none")
    assert torch.isnan(rows[1:3]).all() and torch.isfinite(rows[3:]).all()


def test_module_and_nd_input():
    logits = randn((3, 3, WIDTH), torch.float32, requires_grad=True)
    target, local = shard_target(9, WIDTH, START)
    module = TigonVocabParallelCrossEntropyLoss(vocab_start=START, reduction="none", label_smoothing=0.1)
    check_op(lambda x: module(x, target.view(3, 3)),
             lambda x: cross_entropy_ref(x.view(9, WIDTH), local, reduction="none", label_smoothing=0.1).view(3, 3),
             [logits], dtype=torch.float32)
    assert f"vocab_start={START}" in repr(module)


def test_bad_arguments_name_the_argument():
    x = randn((4, 30), torch.float32)
    target = torch.tensor([17, 18, 19, -100], device=DEVICE)
    with pytest.raises(TypeError, match="logits has dtype torch.float64"):
        TF.vocab_parallel_cross_entropy(x.double(), target, vocab_start=17)
    with pytest.raises(ValueError, match="target has shape"):
        TF.vocab_parallel_cross_entropy(x, target[:3], vocab_start=17)
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        TF.vocab_parallel_cross_entropy(x, target.float(), vocab_start=17)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="vocab_start must be a non-negative int"):
            TF.vocab_parallel_cross_entropy(x, target, vocab_start=bad)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        TF.vocab_parallel_cross_entropy(x, target, group=[0, 1], vocab_start=17)
    with pytest.raises(ValueError, match="reduction"):
        TF.vocab_parallel_cross_entropy(x, target, vocab_start=17, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        TF.vocab_parallel_cross_entropy(x, target, vocab_start=17, label_smoothing=2.0)
    with pytest.raises(ValueError, match="target holds 47, which is not ignore_index=-100 and lies in no rank's"):
        TF.vocab_parallel_cross_entropy(x, torch.tensor([17, 47, 19, -100], device=DEVICE), vocab_start=17)


def test_unchecked_target_outside_the_shards_gives_nan(monkeypatch):

    monkeypatch.setattr(ambient, "CHECK_LABELS", False)
    x = randn((3, 30), torch.float32, requires_grad=True)
    rows = TF.vocab_parallel_cross_entropy(x, torch.tensor([17, 3, 18], device=DEVICE), vocab_start=17,
                                           reduction="none")
    rows.sum().backward()
    assert torch.isnan(rows[1]) and torch.isfinite(rows[0::2]).all()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[0::2]).all()


def test_ops_pass_opcheck():
    """Schemas, fake implementations, autograd registration and AOTAutograd (dynamic shapes)."""
    from tigon.ops import (
        vocab_parallel_cross_entropy_inplace_op,
        vocab_parallel_cross_entropy_op,
        vocab_parallel_cross_entropy_stats_op,
    )

    n, v, start = 7, 13, 5
    logits = randn((n, v), torch.float32, scale=2.0, requires_grad=True)
    target, _ = shard_target(n, v, start)
    opcheck_all_succeed(vocab_parallel_cross_entropy_stats_op, (logits.detach(), target, start, -100, 3.0, True))
    stats = vocab_parallel_cross_entropy_stats_op(logits.detach(), target, start, -100, 3.0, True)
    opcheck_all_succeed(vocab_parallel_cross_entropy_op,
                        (logits, target, stats, 1, start, -100, "none", 0.1, 1e-3, 3.0, True, True))
    with torch.no_grad():
        opcheck_all_succeed(vocab_parallel_cross_entropy_inplace_op,
                            (logits.detach().clone(), target, stats, 1, start, -100, "sum", 0.0, 0.0, None, False))


def test_compiles_without_graph_breaks():
    def fn(z, t):
        return TF.vocab_parallel_cross_entropy(z * 1, t, vocab_start=START, reduction="none", label_smoothing=0.1)

    check_compiled(fn, [randn((ROWS, WIDTH), torch.float32, requires_grad=True)], shard_target(ROWS, WIDTH, START)[0])


# ---- two ranks ----

D_ROWS, D_VOCAB, D_SPLIT = pick(cpu=(9, 300, 170), gpu=(1024, 32011, 17003))  # uneven shards
DIST_CASES = {
    "fp32, mean, some ignored": dict(),
    "bf16, none, vocab_start gathered": dict(dtype="bfloat16", reduction="none", gather_start=True),
    "sum, all ignored": dict(reduction="sum", ignore="all"),
    "mean, all ignored": dict(ignore="all"),
    "smoothing, z-loss, softcap": dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0, reduction="sum"),
    "bf16, smoothing": dict(dtype="bfloat16", label_smoothing=0.2),
    "in place": dict(inplace=True, reduction="none"),
    "a shard of -inf rows": dict(masked=True),
    "torch.compile, one graph": dict(compiled=True, label_smoothing=0.1),
}


def dist_case(rank, spec, device):
    """One case on this rank: the message of the first mismatch, or "ok"."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    reduction = spec.get("reduction", "mean")
    opts = {k: spec[k] for k in ("label_smoothing", "lse_square_scale", "softcap") if k in spec}
    g = torch.Generator().manual_seed(1234)  # the same logits, targets and cotangent on both ranks
    full = (torch.randn(D_ROWS, D_VOCAB, generator=g) * 3).to(dtype)
    target = torch.randint(0, D_VOCAB, (D_ROWS,), generator=g)
    if spec.get("ignore", "some") == "some":
        target[::3] = -100
    elif spec.get("ignore") == "all":
        target[:] = -100
    if spec.get("masked"):  # odd rows: rank 1's whole shard -inf (a padded vocabulary), target on rank 0
        full[1::2, D_SPLIT:] = -float("inf")
        target[1::2] = torch.randint(0, D_SPLIT, (D_ROWS // 2,), generator=g)
    cotangent = torch.randn(D_ROWS if reduction == "none" else (), generator=g, dtype=torch.float64)
    start, width = (0, D_SPLIT) if rank == 0 else (D_SPLIT, D_VOCAB - D_SPLIT)
    shard = full[:, start:start + width].to(device).requires_grad_()
    target_dev = target.to(device)

    import torch.distributed as dist

    group = dist.group.WORLD if spec.get("compiled") else None  # else the default group

    def fn(x, t):
        return TF.vocab_parallel_cross_entropy(x * 1, t, group=group, reduction=reduction,
                                               vocab_start=None if spec.get("gather_start") else start,
                                               inplace=spec.get("inplace", False), **opts)

    if spec.get("compiled"):  # Dynamo only ("eager"): AOTAutograd of the ops is tested in one process
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        loss = torch.compile(fn, backend="eager", dynamic=True)(shard, target_dev)
        if counters["graph_break"]:
            return f"graph breaks: {dict(counters['graph_break'])}"
    else:
        loss = fn(shard, target_dev)
    loss.backward(cotangent.to(device, loss.dtype))
    full64 = full.double().requires_grad_()
    ref = cross_entropy_ref(full64, target, reduction=reduction, **opts)
    ref.backward(cotangent)
    tol = TOL[dtype]
    for name, got, want in (("loss", loss, ref), ("grad", shard.grad, full64.grad[:, start:start + width])):
        err = rel_err(got.cpu(), want)
        if not err <= tol:
            return f"{name} relative error {err:.3g} > {tol:.3g}"
    return "ok"


def dist_errors(rank, device):
    """Targets in no shard, and overlapping shards (both ranks claiming id 0 on): a ValueError on
    both ranks (no rank left waiting in a collective)."""
    x = torch.randn(4, 50 + 10 * rank, device=device)
    messages = []
    for target, start, expected in (([0, 1, 200, 2], 50 * rank, "lies in no rank's vocabulary shard"),
                                    ([0, 1, 5, 2], 0, "in 2 ranks' vocabulary shards")):
        try:
            TF.vocab_parallel_cross_entropy(x, torch.tensor(target, device=device), vocab_start=start)
            messages.append("no error")
        except ValueError as e:
            messages.append("ok" if expected in str(e) else str(e))
    return "ok" if messages == ["ok", "ok"] else "; ".join(messages)


def dist_cases(rank, device):
    return {**{name: lambda spec=spec: dist_case(rank, spec, device) for name, spec in DIST_CASES.items()},
            "errors": lambda: dist_errors(rank, device)}


@pytest.fixture(scope="module")
def two_ranks():
    """Both ranks' results, {case: "ok" or what failed}, from one job of two processes for the module."""
    return run_on_ranks(dist_cases)


@pytest.mark.parametrize("case", [*DIST_CASES, "errors"])
def test_two_ranks_match_the_full_vocabulary(two_ranks, case):
    assert [r[case] for r in two_ranks] == ["ok", "ok"]
