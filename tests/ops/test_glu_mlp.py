import pytest
import torch
import torch.utils.checkpoint as checkpoint_module

from tests.helpers import DEVICE, DTYPES, check_op, pick, randn, rel_err
from tests.ops.test_layer_norm import assert_compiles_like_eager
from tigon import functional as TF
from tigon.ops import glu_down, glu_mlp
from tigon.reference import glu_mlp_ref, glu_ref

# (tokens, hidden, intermediate); on the CPU the intermediate is cut into 3 ragged slices of 16.
TOKENS, HIDDEN, INTER = pick((2, 5), (2, 1023)), pick(24, 2048), pick(40, 5632 + 64)
SLICE = pick(16, 2048)


def make_weights(dtype, requires_grad=True):
    wg = randn((INTER, HIDDEN), dtype, scale=HIDDEN**-0.5 * 2, requires_grad=requires_grad)
    wu = randn((INTER, HIDDEN), dtype, scale=HIDDEN**-0.5, requires_grad=requires_grad)
    wd = randn((HIDDEN, INTER), dtype, scale=INTER**-0.5, requires_grad=requires_grad)
    return wg, wu, wd


# The projections are matmuls: in fp32 they may run in tf32 on the GPU.
def tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("slices", ["ragged", "one"])
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_glu_mlp_matches_reference(dtype, activation, slices, non_contiguous):
    x = randn((*TOKENS, HIDDEN), dtype, non_contiguous=non_contiguous, requires_grad=True)
    slice_columns = SLICE if slices == "ragged" else None

    def ours(x, wg, wu, wd):
        return glu_mlp.glu_mlp_input_only(x, wg, wu, wd, activation, slice_columns=slice_columns)

    check_op(ours, lambda *t: glu_mlp_ref(*t, activation), [x, *make_weights(dtype)], dtype=dtype, tol=tol(dtype),
             what=f"glu_mlp[{activation}, {slices}, non_contiguous={non_contiguous}]")


def test_glu_mlp_frozen_weights():
    x = randn((*TOKENS, HIDDEN), torch.float32, requires_grad=True)
    check_op(lambda x, wg, wu, wd: TF.glu_mlp(x, wg, wu, wd), glu_mlp_ref, [x, *make_weights(torch.float32, False)],
             dtype=torch.float32, tol=1e-3, what="glu_mlp, frozen weights")


def layer(x, weights, tail):
    """A Llama-style half layer: residual + MLP(scaled x), then ``tail`` (what follows the MLP)."""
    return tail(x + TF.glu_mlp(x * 1.5, *weights))


def ref_layer(x, weights, tail):
    return tail(x + glu_mlp_ref(x * 1.5, *weights))


TAILS = {
    "nothing": lambda h: h,  # nothing after the MLP saves a tensor: the recompute stops at it
    "saves": lambda h: h * h,  # the tail saves h: the MLP's output is needed, no skip
}


def count_skips(monkeypatch):
    """Records each forward's answer to "does checkpoint's recomputation stop right after me"."""
    answers = []
    stops_after = glu_mlp.checkpoint_recompute_stops_after
    monkeypatch.setattr(glu_mlp, "checkpoint_recompute_stops_after",
                        lambda n: answers.append(stops_after(n)) or answers[-1])
    return answers


@pytest.mark.parametrize("tail", list(TAILS))
@pytest.mark.parametrize("early_stop", [True, False])
def test_glu_mlp_under_checkpoint(tail, early_stop, monkeypatch):
    """Under torch.utils.checkpoint (non-reentrant): gradients match, and the forward's matmuls
    are skipped in the recomputation exactly when checkpoint stops right after the MLP."""
    x = randn((*TOKENS, HIDDEN), torch.float32, requires_grad=True)
    weights = make_weights(torch.float32)
    x64, weights64 = (x.detach().double().requires_grad_(True),
                      [w.detach().double().requires_grad_(True) for w in weights])
    cotangent = torch.randn(x.shape, device=DEVICE, dtype=torch.float64)
    skips = count_skips(monkeypatch)
    with checkpoint_module.set_checkpoint_early_stop(early_stop):
        out = checkpoint_module.checkpoint(layer, x, weights, TAILS[tail], use_reentrant=False)
        out.backward(cotangent.float())
    ref_layer(x64, weights64, TAILS[tail]).backward(cotangent)
    expect_skip = early_stop and tail == "nothing"
    assert sum(skips) == int(expect_skip)
    for name, got, want in zip(["x", "gate", "up", "down"], [x, *weights], [x64, *weights64]):
        err = rel_err(got.grad, want.grad)
        assert err <= tol(torch.float32), f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_mlp_multipliers(dtype):
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)

    def ref(x, wg, wu, wd):
        return torch.nn.functional.linear(glu_ref(x @ wg.t() * 0.7, x @ wu.t(), "silu"), wd) * 1.3

    check_op(lambda x, wg, wu, wd: TF.glu_mlp(x, wg, wu, wd, gate_multiplier=0.7, down_multiplier=1.3), ref,
             [x, *make_weights(dtype)], dtype=dtype, tol=tol(dtype), what="glu_mlp multipliers")


def test_glu_mlp_bad_inputs():
    x = randn((3, HIDDEN), torch.float32)
    wg, wu, wd = make_weights(torch.float32, False)
    with pytest.raises(ValueError, match="up_weight"):
        TF.glu_mlp(x, wg, wu[:, :-1], wd)
    with pytest.raises(ValueError, match="down_weight"):
        TF.glu_mlp(x, wg, wu, wd.t())
    with pytest.raises(ValueError, match="activation"):
        TF.glu_mlp(x, wg, wu, wd, activation="relu")
    with pytest.raises(TypeError, match="gate_weight"):
        TF.glu_mlp(x, wg.double(), wu, wd)


@pytest.mark.parametrize("frozen", [False, True])
def test_glu_mlp_custom_ops_pass_opcheck(frozen):
    from tigon.ops.glu_mlp import glu_mlp_backward_op, glu_mlp_op

    x = randn((*TOKENS, HIDDEN), torch.float32, non_contiguous=True, requires_grad=True)
    weights = make_weights(torch.float32, requires_grad=not frozen)
    options = ("gelu_tanh", 0.7, 1.3, torch.float32, SLICE)
    # On the GPU the op is a triton_op: AOTDispatcher traces its whole-buffer formula, whose fp32
    # matmuls sum in another order than the eager slices' (elementwise 1e-4 apart where values are
    # near 0): compared with them by norm in test_traced_formulas_match_the_sliced_ones and
    # compiled in tests/ops/test_kernel_ops.py instead.
    tols = pick(cpu={}, gpu=dict(test_utils=("test_schema", "test_autograd_registration", "test_faketensor")))
    assert set(torch.library.opcheck(glu_mlp_op.library_op, (x, *weights, *options, True, False),
                                     **tols).values()) == {"SUCCESS"}
    dout = randn((*TOKENS, HIDDEN), torch.float32)
    needs = (True, *(not frozen,) * 3)
    checks = torch.library.opcheck(glu_mlp_backward_op.library_op,
                                   (dout, x.detach(), *[w.detach() for w in weights], *options, *needs), **tols)
    assert set(checks.values()) == {"SUCCESS"}


def test_glu_mlp_compiles_without_graph_breaks():
    x = randn((*TOKENS, HIDDEN), torch.float32, requires_grad=True)

    def loss(x, wg, wu, wd):
        return (TF.glu_mlp(x * 1.5, wg, wu, wd, gate_multiplier=0.7, down_multiplier=1.3) ** 2).sum()

    assert_compiles_like_eager(loss, [x, *make_weights(torch.float32)])


def test_gated_mlp_under_checkpoint_compiles_without_graph_breaks(monkeypatch):
    """In eager the checkpointed MLP keeps only x (tigon::glu_mlp, reading checkpoint's hooks);
    under torch.compile it takes tigon::glu_down (torch handles the checkpoint): same loss and
    gradients, one graph."""
    x = randn((*TOKENS, HIDDEN), torch.float32, requires_grad=True)
    input_only_calls = []
    op = glu_mlp.glu_mlp_op
    monkeypatch.setattr(glu_mlp, "glu_mlp_op", lambda *args: input_only_calls.append(1) or op(*args))
    wg, wu, wd = make_weights(torch.float32)
    layers = [torch.nn.Linear(1, 1, bias=False).to(DEVICE) for _ in range(3)]
    for layer, w in zip(layers, (wg, wu, wd)):
        layer.weight = torch.nn.Parameter(w.detach().clone())

    def loss(x):
        def block(h):
            return h + glu_mlp.gated_mlp(h, *layers, "silu")
        return (checkpoint_module.checkpoint(block, x, use_reentrant=False) ** 2).sum()

    # On the GPU the two paths' fp32 matmuls sum in different orders (eager: the input-only MLP's
    # dx accumulation; compiled: autograd's): gradients up to 6.5e-5 apart elementwise (H100).
    assert_compiles_like_eager(loss, [x], rel=pick(cpu=None, gpu=1e-5))
    assert len(input_only_calls) == 2  # eager: the forward and checkpoint's recomputation


@pytest.mark.parametrize("need", ["all", "x only", "weights only"])
def test_traced_formulas_match_the_sliced_ones(need):
    """The whole-buffer formulas the triton_ops trace for Inductor (traced_glu_mlp_*,
    traced_glu_down_backward; on the CPU the ops are plain custom ops, so they are called here
    directly) give the sliced eager path's outputs and gradients."""
    need_x, need_w = need != "weights only", need != "x only"
    x = randn((*TOKENS, HIDDEN), torch.float32)
    wg, wu, wd = make_weights(torch.float32, requires_grad=False)
    dout = randn((*TOKENS, HIDDEN), torch.float32)
    multipliers, mm, x2, dout2 = (0.7, 1.3), torch.float32, x.reshape(-1, HIDDEN), dout.reshape(-1, HIDDEN)
    sliced = glu_mlp.glu_mlp_forward(x, wg, wu, wd, "gelu_tanh", multipliers, mm, SLICE)
    whole = glu_mlp.traced_glu_mlp_forward(x2, wg, wu, wd, "gelu_tanh", multipliers)
    # fp32 matmuls summing in other orders (cuBLAS on the GPU): compared by norm.
    assert rel_err(whole, sliced.reshape(whole.shape)) < 1e-5
    want = glu_mlp.glu_mlp_backward(dout, x, wg, wu, wd, "gelu_tanh", multipliers, mm, SLICE, need_x, need_w, need_w,
                                    need_w)
    got = glu_mlp.traced_glu_mlp_backward(dout2, x2, wg, wu, wd, "gelu_tanh", multipliers, need_x, need_w, need_w,
                                          need_w)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert rel_err(g, w.reshape(g.shape)) < 1e-5
    a, b = x2 @ wg.t(), x2 @ wu.t()
    want = glu_down.glu_down_backward(dout, a, b, wd, None, "gelu_tanh", multipliers, mm, SLICE, need_x, need_w, False)
    got = glu_down.traced_glu_down_backward(dout2, a, b, wd, "gelu_tanh", multipliers, mm, need_x, need_w)
    for g, w in zip(got, want[:3], strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert rel_err(g, w) < 1e-5
