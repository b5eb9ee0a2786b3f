import pytest
import torch

from tests.helpers import DEVICE, check_op, pick, randn
from tigon import functional as TF
from tigon.ops import moe_experts as moe_experts_module
from tigon.ops.moe_experts import moe_experts_backward_op, moe_experts_op
from tigon.reference import moe_experts_ref

# (tokens, hidden, intermediate, experts). On the CPU the interpreter's tiles are 16 rows by 32
# columns: odd sizes, a hidden / intermediate size above 32 where several column tiles matter.
SMALL = pick(cpu=(13, 24, 20, 5), gpu=(2048, 1024, 768, 16))
WIDE = pick(cpu=(11, 40, 36, 6), gpu=(1536, 2880, 1440, 12))


def routing(tokens, experts, top_k, skip=True, dtype=torch.int64):
    """Distinct experts per token (as a router's top-k), some pairs routed to E (no expert)."""
    idx = torch.rand(tokens, experts, device=DEVICE).argsort(-1)[:, :top_k]
    if skip:
        idx = torch.where(torch.rand(tokens, top_k, device=DEVICE) < 0.2, experts, idx)
    return idx.to(dtype)


def make_inputs(shape, dtype, top_k, *, bias=False, transposed=False, skip=True, weights_dtype=None,
                index_dtype=torch.int64, gate_scale=1.0):
    tokens, hidden, inter, experts = shape
    x = randn((tokens, hidden), dtype, requires_grad=True)
    idx = routing(tokens, experts, top_k, skip, index_dtype)
    w = torch.rand(tokens, top_k, device=DEVICE).to(weights_dtype or dtype).requires_grad_()
    gu_shape, dn_shape = ((experts, hidden, 2 * inter), (experts, inter, hidden)) if transposed else \
        ((experts, 2 * inter, hidden), (experts, hidden, inter))
    gu = randn(gu_shape, dtype, scale=gate_scale * hidden**-0.5, requires_grad=True)
    dn = randn(dn_shape, dtype, scale=inter**-0.5, requires_grad=True)
    biases = [randn((experts, 2 * inter), dtype, scale=0.5, requires_grad=True),
              randn((experts, hidden), dtype, scale=0.5, requires_grad=True)] if bias else [None, None]
    return [x, idx, w, gu, dn, *biases]


def limit_between_values(x, idx, w, gu, dn, gub, db):
    """A clamp limit in the tail of the routed |gate| and |up| values (their top tenth), in the
    widest gap between two of them with at least 8 values above it: a value rounded across the
    limit would flip its gradient between the kernel and the float64 reference, and the tail's
    gaps are many bf16 roundings wide. Transposed weights [E, H, 2I]."""
    x64 = x.detach().double()
    values = torch.cat([((x64[(idx == e).any(-1)] @ gu[e].detach().double()) + gub[e].detach().double()).abs().flatten()
                        for e in range(gu.shape[0])]).sort().values
    tail = values[int(0.9 * values.numel()):]
    gaps = tail[1:] - tail[:-1]
    gaps[-8:] = 0.0
    widest = gaps.argmax()
    return ((tail[widest] + tail[widest + 1]) / 2).item()


def moe(**options):
    def ours(x, idx, w, gu, dn, gub=None, db=None):
        return TF.moe_experts(x, idx, w, gu, dn, gate_up_bias=gub, down_bias=db, **options)

    def ref(*inputs):
        opts = {k: v for k, v in options.items() if v is not None}
        if opts.get("activation") in ("gelu_pytorch_tanh",):
            opts["activation"] = "gelu_tanh"
        return moe_experts_ref(*inputs, **opts)

    return ours, ref


# The matmuls accumulate in another order than torch's: fp32 results differ in the last bits.
def tol(dtype):
    return {torch.bfloat16: 1.2e-2, torch.float16: 3e-3}.get(dtype, 1e-4)


CASES = {
    # name: (dtypes, shape, top_k, make_inputs options, functional options)
    "mixtral, fp32 router weights": ([torch.float32, torch.bfloat16], SMALL, 2, {"weights_dtype": torch.float32}, {}),
    "qwen, K 8, int32 index": ([torch.bfloat16], (SMALL[0], SMALL[1], SMALL[2], 9), 8,
                               {"index_dtype": torch.int32}, {}),
    "K 1, gelu_tanh, no skipped pair": ([torch.float32, torch.float16], SMALL, 1, {"skip": False},
                                        {"activation": "gelu_pytorch_tanh"}),
    "gpt-oss: interleaved, transposed, biases, clamped": (
        [torch.float32, torch.bfloat16], WIDE, 2, {"bias": True, "transposed": True, "gate_scale": 2.0},
        {"activation": "clamped_swiglu", "layout": "interleaved", "transposed": True, "alpha": 1.702, "limit": "safe"}),
    "interleaved, not transposed, biases, gelu_erf": ([torch.float32], SMALL, 3, {"bias": True},
                                                      {"activation": "gelu_erf", "layout": "interleaved"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_experts_matches_reference(case):
    dtypes, shape, top_k, input_options, options = CASES[case]
    for dtype in dtypes:
        inputs = make_inputs(shape, dtype, top_k, **input_options)
        case_tol, opts = tol(dtype), options
        if options.get("limit") == "safe":
            opts = {**options, "limit": limit_between_values(*inputs)}
        ours, ref = moe(**opts)
        check_op(ours, ref, inputs, dtype=dtype, tol=case_tol, what=f"moe_experts[{case}, {dtype}]")


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_moe_experts_activation_backward_split_or_fused(split):
    """The activation's backward in its own pass over an fp32 dy, or in down_backward's epilogue
    (GPU_TILES use each, by rows an expert): the same gradients, biases and clamped SwiGLU included."""
    case = "gpt-oss: interleaved, transposed, biases, clamped"
    split_tile = pick(cpu=[16, 32, 1], gpu=[32, 128, 4])
    moe_experts_module.set_tile_overrides({"activation_backward": split_tile if split else []})
    try:
        test_moe_experts_matches_reference(case)
        test_moe_experts_matches_reference("mixtral, fp32 router weights")
    finally:
        moe_experts_module.set_tile_overrides({})


@pytest.mark.parametrize("routing_kind", ["all to one expert", "all skipped"])
def test_moe_experts_uneven_routing(routing_kind):
    """One expert takes every pair (several row blocks and row steps), the others none: their
    weight gradients are exactly zero; all pairs skipped gives zeros everywhere."""
    tokens, experts = SMALL[0], SMALL[3]
    x, _, w, gu, dn, _, _ = make_inputs(SMALL, torch.float32, 2)
    idx = torch.full((tokens, 2), 2 if routing_kind == "all to one expert" else experts, device=DEVICE)
    ours, ref = moe()
    if routing_kind == "all to one expert":  # (with none, the reference has no weight gradient at all)
        check_op(ours, ref, [x, idx, w, gu, dn], dtype=torch.float32, tol=1e-4, what=routing_kind)
    out = ours(x, idx, w, gu, dn)
    out.backward(torch.ones_like(out))
    others = [e for e in range(experts) if routing_kind != "all to one expert" or e != 2]
    assert torch.equal(gu.grad[others], torch.zeros_like(gu.grad[others]))
    assert torch.equal(dn.grad[others], torch.zeros_like(dn.grad[others]))
    if routing_kind == "all skipped":
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


def test_moe_experts_strided_and_expanded_inputs():
    """hidden_states row-padded or expanded from one row (stride 0), routing weights a transposed
    view, expert weights transposed views: read through their strides."""
    tokens, hidden, inter, experts = SMALL
    _, idx, _, _, _, _, _ = make_inputs(SMALL, torch.float32, 2)
    x = randn((tokens, hidden), torch.float32, non_contiguous=True, requires_grad=True)
    w_t = torch.rand(2, tokens, device=DEVICE, requires_grad=True)
    gu_t = randn((experts, hidden, 2 * inter), torch.float32, scale=hidden**-0.5, requires_grad=True)
    dn_t = randn((experts, inter, hidden), torch.float32, scale=inter**-0.5, requires_grad=True)
    ours, ref = moe()

    def views(fn):
        return lambda x, w_t, gu_t, dn_t: fn(x, idx, w_t.t(), gu_t.transpose(1, 2), dn_t.transpose(1, 2))

    check_op(views(ours), views(ref), [x, w_t, gu_t, dn_t], dtype=torch.float32, tol=1e-4, what="strided")
    row = randn((1, hidden), torch.float32, requires_grad=True)
    w = torch.rand(tokens, 2, device=DEVICE, requires_grad=True)
    gu = randn((experts, 2 * inter, hidden), torch.float32, scale=hidden**-0.5, requires_grad=True)
    dn = randn((experts, hidden, inter), torch.float32, scale=inter**-0.5, requires_grad=True)

    def expanded(fn):
        return lambda row, w, gu, dn: fn(row.expand(tokens, hidden), idx, w, gu, dn)

    check_op(expanded(ours), expanded(ref), [row, w, gu, dn], dtype=torch.float32, tol=1e-4, what="expanded")


def test_moe_experts_second_backward_over_retained_graph():
    x, idx, w, gu, dn, gub, db = make_inputs(SMALL, torch.float32, 2, bias=True)
    loss = (TF.moe_experts(x, idx, w, gu, dn, gate_up_bias=gub, down_bias=db)
            * randn((SMALL[0], SMALL[1]), torch.float32)).sum()
    leaves = (x, w, gu, dn, gub, db)
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in leaves]
    loss.backward()
    for t, g in zip(leaves, once):
        assert torch.equal(t.grad, 2 * g)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, on the NaN the test puts in
def test_moe_experts_nan_stays_in_its_token():
    x, idx, w, gu, dn, _, _ = make_inputs(SMALL, torch.float32, 2, skip=False)
    with torch.no_grad():
        clean = TF.moe_experts(x, idx, w, gu, dn)
        x[3, 5] = float("nan")
        x[7, 1] = float("inf")
        dirty = TF.moe_experts(x, idx, w, gu, dn)
    others = [t for t in range(SMALL[0]) if t not in (3, 7)]
    assert torch.isnan(dirty[3]).all() and not torch.isfinite(dirty[7]).any()
    assert torch.equal(dirty[others], clean[others])


def test_moe_experts_no_grad_and_autocast():
    """Without autograd the forward keeps nothing (and gives the same values); under autocast the
    matmuls run in its dtype and the output keeps hidden_states' dtype, as HF's experts."""
    x, idx, w, gu, dn, _, _ = make_inputs(SMALL, torch.float32, 2)
    with torch.no_grad():
        _, kept, _ = moe_experts_op(x, idx, w, gu, dn, None, None, "silu", "gate_up", False, 1.0, 0.0, False)
        assert kept.numel() == 0
        no_grad = TF.moe_experts(x, idx, w, gu, dn)
    torch.testing.assert_close(no_grad, TF.moe_experts(x, idx, w, gu, dn), rtol=0, atol=0)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        mixed = TF.moe_experts(x, idx, w, gu, dn)
    assert mixed.dtype == torch.float32
    bf16 = TF.moe_experts(*(t.to(torch.bfloat16) if t.is_floating_point() and t is not w else t
                            for t in (x, idx, w, gu, dn)))
    # The same bf16 matmuls; the mixed output is not rounded to bf16 at the end (one bf16 ulp).
    torch.testing.assert_close(mixed, bf16.float(), rtol=2**-7, atol=1e-6)


def test_moe_experts_matches_hf_expert_modules():
    """The HF classes themselves (their eager loop, float64) with tigon's options for them."""
    from torch.func import functional_call
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.mixtral import modeling_mixtral

    tokens, hidden, inter, experts = pick(cpu=(7, 24, 20, 3), gpu=(512, 256, 192, 4))
    size = {"hidden_size": hidden, "intermediate_size": inter, "num_local_experts": experts, "num_experts_per_tok": 2}
    for module, options in ((modeling_mixtral.MixtralExperts(modeling_mixtral.MixtralConfig(**size)), {}),
                            (modeling_gpt_oss.GptOssExperts(modeling_gpt_oss.GptOssConfig(**size)),
                             {"layout": "interleaved", "transposed": True, "activation": "clamped_swiglu"})):
        module.config._experts_implementation = "eager"
        names = [n for n, _ in module.named_parameters()]
        params = [randn(p.shape, torch.float32, scale=0.3, requires_grad=True) for _, p in module.named_parameters()]
        x = randn((tokens, hidden), torch.float32, scale=3.0, requires_grad=True)
        idx = routing(tokens, experts, 2, skip=False)
        w = torch.rand(tokens, 2, device=DEVICE, requires_grad=True)
        if "limit" in vars(module):  # gpt-oss: a clamp limit no gate or up lies within fp32 rounding of
            p = dict(zip(names, params))
            module.limit = limit_between_values(x, idx, w, p["gate_up_proj"], p["down_proj"], p["gate_up_proj_bias"],
                                                None)
            options = {**options, "limit": module.limit, "alpha": module.alpha}

        def theirs(x, w, *params, module=module, idx=idx, names=names):
            return functional_call(module, dict(zip(names, params)), (x, idx, w))

        def ours(x, w, *params, options=options, idx=idx, names=names):
            p = dict(zip(names, params))
            return TF.moe_experts(x, idx, w, p["gate_up_proj"], p["down_proj"], gate_up_bias=p.get("gate_up_proj_bias"),
                                  down_bias=p.get("down_proj_bias"), **options)

        check_op(ours, theirs, [x, w, *params], dtype=torch.float32, tol=1e-4, what=type(module).__name__)


def test_moe_experts_custom_ops_pass_opcheck():
    x, idx, w, gu, dn, gub, db = make_inputs(SMALL, torch.float32, 2, bias=True)
    args = (x, idx, w, gu, dn, gub, db, "silu", "gate_up", False, 1.0, 0.0, True)
    assert set(torch.library.opcheck(moe_experts_op.library_op, args, test_utils=("test_schema", "test_faketensor")
                                     ).values()) == {"SUCCESS"}
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    _, kept, table = moe_experts_op(*plain)
    dout = randn((SMALL[0], SMALL[1]), torch.float32)
    back = (dout, plain[0], plain[2], kept, table, *plain[3:7], "silu", "gate_up", False, 1.0, 0.0,
            True, True, True, False, True, False)
    checks = torch.library.opcheck(moe_experts_backward_op.library_op, back,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(checks.values()) == {"SUCCESS"}


def test_moe_experts_bad_arguments():
    x, idx, w, gu, dn, gub, db = (t.detach() if isinstance(t, torch.Tensor) else t
                                  for t in make_inputs(SMALL, torch.float32, 2, bias=True))
    experts = SMALL[3]
    bad = [
        (TypeError, "hidden_states has dtype torch.float64", {"hidden_states": x.double()}),
        (TypeError, "top_k_index must be an integer", {"top_k_index": idx.float()}),
        (TypeError, "top_k_weights has dtype torch.float64", {"top_k_weights": w.double()}),
        (TypeError, "gate_up_proj has dtype torch.bfloat16", {"gate_up_proj": gu.bfloat16()}),
        (ValueError, "top_k_index has shape", {"top_k_index": idx[:-1]}),
        (ValueError, "top_k_weights has shape", {"top_k_weights": w[:, :1]}),
        (ValueError, "gate_up_proj has shape", {"gate_up_proj": gu[:, :, :-1]}),
        (ValueError, "gate_up_proj has shape", {"gate_up_proj": gu[:, :-1]}),
        (ValueError, "down_proj has shape", {"down_proj": dn[:, :, :-1]}),
        (ValueError, "down_proj has shape", {"down_proj": dn[:-1]}),
        (ValueError, "gate_up_bias has shape", {"gate_up_bias": gub[:, :-1]}),
        (ValueError, "down_bias has shape", {"down_bias": db[:-1]}),
        (TypeError, "down_bias must be a torch.Tensor", {"down_bias": [0.0]}),
        (ValueError, "activation 'relu'", {"activation": "relu"}),
        (ValueError, "layout must be one of", {"layout": "up_gate"}),
        (TypeError, "transposed must be a bool", {"transposed": 1}),
        (ValueError, "alpha applies to activation='clamped_swiglu' only", {"alpha": 1.5}),
        (TypeError, "limit must be a finite number", {"activation": "clamped_swiglu", "limit": float("inf")}),
    ]
    base = {"hidden_states": x, "top_k_index": idx, "top_k_weights": w, "gate_up_proj": gu, "down_proj": dn,
            "gate_up_bias": gub, "down_bias": db}
    for error, message, change in bad:
        kwargs = {**base, **change}
        args = [kwargs.pop(n) for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
        with pytest.raises(error, match=message):
            TF.moe_experts(*args, **kwargs)
    for value in (-1, experts + 1):  # E itself means "no expert"
        wrong = idx.clone()
        wrong[4, 1] = value
        with pytest.raises(ValueError, match=rf"top_k_index must lie in \[0, {experts}\]"):
            TF.moe_experts(x, wrong, w, gu, dn)


def test_moe_experts_empty_batch():
    x, idx, w, gu, dn, _, _ = make_inputs(SMALL, torch.float32, 2)
    x0 = x.detach()[:0].requires_grad_()
    w0 = w.detach()[:0].requires_grad_()
    out = TF.moe_experts(x0, idx[:0], w0, gu, dn)
    assert out.shape == (0, SMALL[1])
    out.sum().backward()
    assert torch.equal(gu.grad, torch.zeros_like(gu)) and x0.grad.shape == x0.shape


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 768, 128, 8), (2048, 4096, 14336, 8, 2)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_experts_model_shapes_bf16(shape):
    """The two benchmark layers (fewer tokens), bf16 against float64, with a router's top-k."""
    tokens, hidden, inter, experts, top_k = shape
    inputs = make_inputs((tokens, hidden, inter, experts), torch.bfloat16, top_k, skip=False)
    logits = torch.randn(tokens, experts, device=DEVICE)
    top = torch.softmax(logits, -1).topk(top_k, -1)
    inputs[1] = top.indices
    inputs[2] = (top.values / top.values.sum(-1, keepdim=True)).to(torch.bfloat16).requires_grad_()
    ours, ref = moe()
    check_op(ours, ref, inputs, dtype=torch.bfloat16, tol=1.2e-2, what=f"moe_experts{shape}")
