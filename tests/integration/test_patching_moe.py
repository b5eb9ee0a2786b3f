"""Patched MoE experts against HF's: the stacked experts classes run on tigon's fused op
(tigon.ops.moe_experts) whatever config._experts_implementation names, gpt-oss's clamped SwiGLU
included, and on HF's own forward where the op would not compute what HF does (expert parallel,
a post-expert norm, an activation tigon does not fuse, ...). The whole families train in
tests/integration/test_patching.py; here the experts modules alone, small and odd-sized."""

import copy
import dataclasses

import pytest
import torch

import tigon
from tests.helpers import DEVICE, check_op, randn, recording_backend
from tests.integration.test_patch_scope import _unpatched_after  # noqa: F401 (autouse: unpatch around each test)
from tigon.patching import FAMILIES, apply_family, mlp

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as hf_moe  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 7, 24, 20, 3, 2


@pytest.fixture
def op_calls(monkeypatch):
    """The calls of tigon's fused experts op made by the patched forwards."""
    calls = []
    op = mlp._moe_experts
    monkeypatch.setattr(mlp, "_moe_experts", lambda *a, **k: calls.append(k) or op(*a, **k))
    return calls


@pytest.fixture
def hf_experts_impls(monkeypatch):
    """HF's registered experts implementations (grouped_mm, batched_mm, ...), each recording its call."""
    calls = []
    mapping = hf_moe.ALL_EXPERTS_FUNCTIONS._global_mapping
    for name, fn in list(mapping.items()):
        monkeypatch.setitem(mapping, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    return calls


def experts_module(kind="mixtral", implementation="eager", **config):
    """An HF experts module with random weights (biases too), fp32."""
    size = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K}
    modeling = {"mixtral": modeling_mixtral, "gpt_oss": modeling_gpt_oss}[kind]
    prefix = {"mixtral": "Mixtral", "gpt_oss": "GptOss"}[kind]
    module = getattr(modeling, f"{prefix}Experts")(getattr(modeling, f"{prefix}Config")(**size, **config))
    module.config._experts_implementation = implementation
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return module.to(DEVICE)


def routed_inputs(dtype=torch.float32, scale=1.0):
    """x [T, H], distinct experts per token, routing weights in fp32 (as HF's routers give them)."""
    x = randn((TOKENS, HIDDEN), dtype, scale=scale, requires_grad=True)
    idx = torch.rand(TOKENS, EXPERTS, device=DEVICE).argsort(-1)[:, :TOP_K]
    w = torch.rand(TOKENS, TOP_K, device=DEVICE, requires_grad=True)
    return x, idx, w


def compare(patched, hf, x, idx, w, tol=1e-5, **kwargs):
    """patched(x, idx, w) against hf's: the output, and the gradients of x, w and every parameter."""
    names = [n for n, _ in hf.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in hf.parameters()]

    def call(module):
        return lambda x, w, *p: torch.func.functional_call(module, dict(zip(names, p)), (x, idx, w), kwargs)

    check_op(call(patched), call(hf), [x, w, *params], dtype=x.dtype, tol=tol, what=type(hf).__name__)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_experts_run_the_fused_op_whatever_the_implementation(implementation, op_calls, hf_experts_impls):
    """config._experts_implementation names HF's eager loop or one of its batched forwards: the
    patched experts call tigon's op, never HF's, and match HF's eager loop."""
    hf = experts_module()
    patched = copy.deepcopy(hf)
    patched.config._experts_implementation = implementation
    report = tigon.patch_mixtral(patched)
    assert f"MixtralExperts: {mlp.MOE_EXPERTS}" in str(report), str(report)
    assert patched.forward._tigon == "MoE experts (tigon fused grouped GEMM)"
    compare(patched, hf, *routed_inputs())
    assert len(op_calls) == 1 and op_calls[0]["activation"] == "silu" and op_calls[0]["layout"] == "gate_up"
    assert hf_experts_impls == []
    # unpatched, the same module runs HF's implementation
    tigon.unpatch(patched)
    with torch.no_grad():
        patched(*routed_inputs())
    assert hf_experts_impls == ([] if implementation == "eager" else [implementation])


def test_compiled_experts_trace_the_fused_op():
    """Under torch.compile (one graph, config._experts_implementation "grouped_mm") the
    patched forward's checks trace away and the op is one node of the graph."""
    hf = experts_module()
    patched = copy.deepcopy(hf)
    patched.config._experts_implementation = "grouped_mm"
    tigon.patch_mixtral(patched)
    ops, backend = recording_backend()
    torch._dynamo.reset()
    try:
        x, idx, w = routed_inputs()
        with torch.no_grad():
            ours = torch.compile(patched, backend=backend, fullgraph=True)(x, idx, w)
            assert rel(ours, hf(x, idx, w)) < 1e-5
    finally:
        torch._dynamo.reset()
    assert "tigon.moe_experts.default" in ops, ops


def test_class_patch_runs_the_fused_op_then_unpatches(op_calls):
    report = tigon.patch_mixtral(fused_linear_cross_entropy=False, rope=False, rms_norm=False)
    assert modeling_mixtral.MixtralExperts.forward._tigon == mlp.MOE_EXPERTS, str(report)
    module = experts_module()
    x, idx, w = routed_inputs()
    with torch.no_grad():
        ours = module(x, idx, w)
    assert len(op_calls) == 1
    tigon.unpatch()
    assert not hasattr(modeling_mixtral.MixtralExperts.forward, "_tigon")
    with torch.no_grad():
        assert rel(ours, module(x, idx, w)) < 1e-5
    assert len(op_calls) == 1


def test_gpt_oss_experts_match_hf(op_calls):
    """gpt-oss's clamped SwiGLU on interleaved gate / up columns of transposed [E, H, 2I] weights,
    with biases; a limit the inputs reach (read from the module), keyword routing arguments."""
    hf = experts_module("gpt_oss")
    hf.limit = 1.5
    patched = copy.deepcopy(hf)
    report = tigon.patch_gpt_oss(patched)
    assert "GptOssExperts: MoE experts (tigon fused grouped GEMM) with its clamped_swiglu gate" in str(report)
    assert "_apply_gate" not in vars(patched)  # its own gate stays (HF's other forwards call it)
    x, idx, w = routed_inputs(scale=3.0)
    with torch.no_grad():
        gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
        assert (gate_up.abs() > hf.limit).float().mean() > 0.2  # the clamps matter
    compare(patched, hf, x, idx, w)
    assert len(op_calls) == 1
    expected = {"activation": "clamped_swiglu", "layout": "interleaved", "transposed": True, "alpha": float(hf.alpha),
                "limit": 1.5}
    assert {k: op_calls[0][k] for k in expected} == expected
    with torch.no_grad():
        by_name = patched(x, router_indices=idx, routing_weights=w)
        assert rel(by_name, hf(x, router_indices=idx, routing_weights=w)) < 1e-5
    assert len(op_calls) == 2


def test_bf16_experts_with_fp32_routing_weights(op_calls):
    """bf16 hidden states and weights, fp32 routing weights (Gemma 4's router, DeepSeek's): the
    output in bf16, as HF's, within bf16 rounding of an fp32 run."""
    hf = experts_module()
    patched = copy.deepcopy(hf).to(torch.bfloat16)
    tigon.patch_mixtral(patched)
    x, idx, w = routed_inputs()
    with torch.no_grad():
        exact = hf(x, idx, w)
        ours = patched(x.to(torch.bfloat16), idx, w)
    assert ours.dtype == torch.bfloat16 and len(op_calls) == 1
    assert rel(ours, exact) < 2e-2


def _expert_parallel(m):
    m._is_expert_parallel = True


def _post_expert_norm(m):
    m.has_post_expert_norm = True


def _float64(m):
    m.double()


def _fewer_experts(m):
    m.num_experts = EXPERTS - 1


def _interleaved_default_gate(m):
    m.is_concatenated = False


def _no_layout_flags(m):  # an older transformers' gpt-oss
    del m.is_concatenated, m.is_transposed


FALLBACKS = {
    "expert_parallel": ("mixtral", _expert_parallel, "expert parallel"),
    "post_expert_norm": ("mixtral", _post_expert_norm, "has_post_expert_norm"),
    "float64": ("mixtral", _float64, "not a plain 3-D fp32 / bf16 / fp16 tensor"),
    "num_experts": ("mixtral", _fewer_experts, "num_experts"),
    "interleaved_default_gate": ("mixtral", _interleaved_default_gate, "interleaved"),
    "own_gate_without_layout_flags": ("gpt_oss", _no_layout_flags, "is_concatenated / is_transposed"),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_experts_fall_back_to_hf(case, op_calls):
    """What the fused op would not compute as HF does runs HF's forward (said in the report);
    HF's forward here is its eager loop, which ignores those flags: the same outputs."""
    kind, change, why = FALLBACKS[case]
    hf = experts_module(kind)
    change(hf)
    patched = copy.deepcopy(hf)
    report = getattr(tigon, f"patch_{kind}")(patched)
    assert any(piece == "swiglu" and why in note and "HF's forward runs" in note for piece, note in report.skipped), \
        str(report)
    dtype = torch.float64 if case == "float64" else torch.float32
    x, idx, w = routed_inputs(dtype)
    idx = idx.remainder(hf.num_experts)  # within the experts the module believes it has
    with torch.no_grad():
        assert rel(patched(x, idx, w.to(dtype)), hf(x, idx, w.to(dtype))) < 1e-6
    assert op_calls == []


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_unfused_activation_falls_back_to_hf(implementation, op_calls):
    """An activation tigon does not fuse: no error, HF's forward (and, in HF's other
    implementations, HF's gate formula inside tigon's _apply_gate), gradients included."""
    hf = experts_module(implementation=implementation, hidden_act="relu")
    patched = copy.deepcopy(hf)
    report = tigon.patch_mixtral(patched)
    assert any("activation" in note and "HF's forward runs" in note for _, note in report.skipped), str(report)
    compare(patched, hf, *routed_inputs())
    assert op_calls == []


def test_a_gate_of_its_own_needs_the_row_to_name_it():
    """gpt-oss's row without its experts_activation: its experts are left to HF, said so."""
    row = dataclasses.replace(FAMILIES["gpt_oss"], experts_activation=None)
    module = experts_module("gpt_oss")
    report = apply_family(row, model=module)
    assert any("a gate of its own" in note for piece, note in report.skipped if piece == "swiglu"), str(report)
    assert "forward" not in vars(module) and "_apply_gate" not in vars(module)
    assert mlp.hf_default_gate(modeling_mixtral.MixtralExperts)
    assert not mlp.hf_default_gate(modeling_gpt_oss.GptOssExperts)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
