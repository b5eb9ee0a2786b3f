"""tigon.compat.liger: Liger-Kernel 0.8.5's API on tigon, checked against Liger's documented
behaviour (its signatures and defaults, what its losses and modules compute) with float64
references or tigon's own API, and the name map against the names Liger exports."""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tigon
from tests.helpers import DEVICE, check_op, rel_err
from tigon import reference as R
from tigon.compat import liger
from tigon.compat.liger import names
from tigon.compat.liger import transformers as compat_transformers
from tigon.compat.liger.chunked_loss import functional as compat_chunked_functional
from tigon.compat.liger.transformers import functional as compat_functional

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = ROOT / "docs" / "guides" / "liger.md"
FP32 = torch.float32

# What Liger-Kernel 0.8.5 exports, taken from its wheel: each module's public names (its
# __all__ where it has one, and the other public names defined by liger_kernel it holds).
LIGER_0_8_5 = {
    "liger_kernel.transformers": """
        AutoLigerKernelForCausalLM LigerBlockSparseTop2MLP LigerCrossEntropyLoss LigerDyT LigerExperts
        LigerFalconH1MLP LigerFalconH1SwiGLUMLP LigerFusedAddRMSNorm LigerFusedCETVDLoss
        LigerFusedLinearCrossEntropyLoss LigerFusedLinearJSD LigerFusedLinearKLDivLoss LigerGEGLUMLP LigerJSD
        LigerKLDIVLoss LigerLayerNorm LigerMHC LigerMLP LigerModulatedRMSNorm LigerMultiTokenAttention
        LigerPhi3SwiGLUMLP LigerPolyNorm LigerQwen3MoeSwiGLUMLP LigerRMSNorm LigerRMSNormForMuseGlimmer
        LigerRMSNormForMuseGlimmerTextCentered LigerReLUSquared LigerSoftmax LigerSparsemax LigerSwiGLUMLP
        LigerSwiGLUMLPForMuseGlimmer LigerTVDLoss LigerTiledGEGLUMLP LigerTiledSwiGLUMLP
        LigerVocabParallelCrossEntropy _apply_liger_kernel _apply_liger_kernel_to_instance
        apply_liger_kernel_to_deepseek_v2 apply_liger_kernel_to_deepseek_v3 apply_liger_kernel_to_deepseek_v4
        apply_liger_kernel_to_exaone4 apply_liger_kernel_to_falcon_h1 apply_liger_kernel_to_gemma
        apply_liger_kernel_to_gemma2 apply_liger_kernel_to_gemma3 apply_liger_kernel_to_gemma3_text
        apply_liger_kernel_to_gemma4 apply_liger_kernel_to_gemma4_text apply_liger_kernel_to_glm4
        apply_liger_kernel_to_glm4v apply_liger_kernel_to_glm4v_moe apply_liger_kernel_to_gpt_oss
        apply_liger_kernel_to_granite apply_liger_kernel_to_hunyuan_v1_dense
        apply_liger_kernel_to_hunyuan_v1_moe apply_liger_kernel_to_internvl apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama4 apply_liger_kernel_to_llava apply_liger_kernel_to_ministral
        apply_liger_kernel_to_mistral apply_liger_kernel_to_mixtral apply_liger_kernel_to_mllama
        apply_liger_kernel_to_muse_glimmer apply_liger_kernel_to_nemotron apply_liger_kernel_to_olmo2
        apply_liger_kernel_to_olmo3 apply_liger_kernel_to_paligemma apply_liger_kernel_to_phi3
        apply_liger_kernel_to_pixtral apply_liger_kernel_to_qwen2 apply_liger_kernel_to_qwen2_5_vl
        apply_liger_kernel_to_qwen2_vl apply_liger_kernel_to_qwen3 apply_liger_kernel_to_qwen3_5
        apply_liger_kernel_to_qwen3_5_moe apply_liger_kernel_to_qwen3_moe apply_liger_kernel_to_qwen3_next
        apply_liger_kernel_to_qwen3_vl apply_liger_kernel_to_qwen3_vl_moe apply_liger_kernel_to_smollm3
        apply_liger_kernel_to_smolvlm is_transformers_available liger_llama4_text_rotary_pos_emb
        liger_llama4_vision_rotary_pos_emb liger_rotary_pos_emb
    """.split(),
    "liger_kernel.transformers.functional": """
        CrossEntropyOutput LigerAttnResFunction LigerCrossEntropyFunction LigerDyTFunction
        LigerFusedAddRMSNormFunction LigerFusedLinearCrossEntropyFunction LigerFusedLinearJSDFunction
        LigerFusedLinearKLDivFunction LigerFusedLinearScaledCrossEntropyTPFunction
        LigerFusedNeighborhoodAttentionFunction LigerGELUMulFunction LigerGroupNormFunction LigerJSDFunction
        LigerKLDivLossFunction LigerLayerNormFunction LigerMHCCoeffsFunction LigerMHCPostResFunction
        LigerMHCPreFunction LigerModulatedRMSNormFunction LigerMultiTokenAttentionFunction LigerPolyNormFunction
        LigerQwen2VLMRopeFunction LigerRMSNormFunction LigerReLUSquaredFunction LigerRopeFunction
        LigerSiLUMulFunction LigerSoftmaxFunction LigerSparsemaxFunction LigerTVDLossFunction liger_attn_res
        liger_cross_entropy liger_dyt liger_fused_add_rms_norm liger_fused_linear_cross_entropy
        liger_fused_linear_jsd liger_fused_linear_kl_div liger_fused_linear_scaled_cross_entropy_tp
        liger_fused_neighborhood_attention liger_geglu liger_group_norm liger_jsd liger_kl_div liger_layer_norm
        liger_mhc_apply liger_mhc_coeffs liger_mhc_forward liger_mhc_post_res liger_mhc_pre
        liger_modulated_rms_norm liger_multi_token_attention liger_poly_norm liger_qwen2vl_mrope
        liger_relu_squared liger_rms_norm liger_rope liger_softmax liger_sparsemax liger_swiglu liger_tvd
    """.split(),
    "liger_kernel.chunked_loss": """
        LigerFusedLinearCPOLoss LigerFusedLinearCosineSimilarityLoss LigerFusedLinearDPOLoss
        LigerFusedLinearGRPOLoss LigerFusedLinearJSDLoss LigerFusedLinearKTOLoss LigerFusedLinearORPOLoss
        LigerFusedLinearSimPOLoss
    """.split(),
    "liger_kernel.chunked_loss.functional": """
        LigerFusedLinearCPOFunction LigerFusedLinearCosineSimilarityFunction LigerFusedLinearDPOFunction
        LigerFusedLinearGRPOFunction LigerFusedLinearJSDFunction LigerFusedLinearKTOFunction
        LigerFusedLinearORPOFunction LigerFusedLinearSimPOFunction liger_fused_linear_cosine
        liger_fused_linear_cpo liger_fused_linear_dpo liger_fused_linear_grpo liger_fused_linear_jsd
        liger_fused_linear_kto liger_fused_linear_orpo liger_fused_linear_simpo
    """.split(),
}
EXTRAS = {"liger_kernel.transformers.LigerGroupNorm"}  # rows of the table beyond the exports (documented)
COMPAT_MODULES = {"liger_kernel.transformers": compat_transformers,
                  "liger_kernel.transformers.functional": compat_functional,
                  "liger_kernel.chunked_loss": liger.chunked_loss,
                  "liger_kernel.chunked_loss.functional": compat_chunked_functional}


@pytest.fixture(autouse=True)
def _on_the_test_device_unpatched():
    """Tensors and models on the tests' device (the CPU under TRITON_INTERPRET=1); no patch left
    behind by a test (class patches are process-wide)."""
    tigon.unpatch()
    with torch.device(DEVICE or "cpu"):
        yield
    tigon.unpatch()


# ---- the name map ----

def test_the_name_map_covers_what_liger_0_8_5_exports():
    listed = {f"{m}.{n}" for m, ns in LIGER_0_8_5.items() for n in ns}
    assert sorted(listed - set(names.NAME_MAP)) == [], "Liger names missing from tigon.compat.liger.NAME_MAP"
    assert set(names.NAME_MAP) - listed == EXTRAS
    assert names.LIGER_MODULES == tuple(LIGER_0_8_5)


def _liger_exports(module_name):
    """A live module's public names, as the snapshot above was taken."""
    module = importlib.import_module(module_name)
    out = set(getattr(module, "__all__", ()))
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        owner = value.__self__.__module__ if inspect.ismethod(value) else getattr(value, "__module__", "") or ""
        if owner.startswith("liger_kernel"):
            out.add(name)
    return out


def test_the_name_map_covers_the_installed_liger():
    pytest.importorskip("liger_kernel.transformers")
    from importlib.metadata import version

    for module_name in names.LIGER_MODULES:
        missing = {f"{module_name}.{n}" for n in _liger_exports(module_name)} - set(names.NAME_MAP)
        assert not missing, f"Liger-Kernel {version('liger-kernel')} exports names the map lacks: {sorted(missing)}"


def test_compat_modules_provide_the_table_and_explain_the_rest():
    for liger_module, compat in COMPAT_MODULES.items():
        provided = sorted(n.name for n in names.names_in(liger_module, provided=True))
        assert sorted(compat.__all__) == provided, compat.__name__
        for name in provided:
            assert getattr(compat, name) is not None
        for row in names.names_in(liger_module, provided=False):
            with pytest.raises(ImportError, match=re.escape(row.note[:40])):
                exec(f"from {compat.__name__} import {row.name}", {})
            assert row.compat is None
        with pytest.raises(AttributeError):
            compat.no_such_name  # noqa: B018
    flat = set(liger.__all__) - {"LIGER_VERSION", "NAME_MAP"}
    assert flat == set(compat_transformers.__all__) | set(liger.chunked_loss.__all__)
    assert all(getattr(liger, n) is getattr(compat_transformers, n, None) or getattr(liger, n) is
               getattr(liger.chunked_loss, n, None) for n in flat)
    with pytest.raises(ImportError, match="no kernel"):
        from tigon.compat.liger import LigerMHC  # noqa: F401
    # "as X" reasons are spelled out in the error
    with pytest.raises(ImportError, match="cosine-similarity"):
        from tigon.compat.liger.chunked_loss.functional import liger_fused_linear_cosine  # noqa: F401
    assert all("|" not in row.note for row in names.NAME_MAP.values())  # a Markdown table cell each


def test_the_docs_page_shows_the_name_map():
    page = DOCS_PAGE.read_text()
    assert names.name_map_markdown() in page, (
        "docs/guides/liger.md's name map differs from tigon.compat.liger.NAME_MAP: paste the output of "
        "python -c 'from tigon.compat.liger.names import name_map_markdown; print(name_map_markdown())'")
    for row in names.NAME_MAP.values():
        assert f"| `{row.name}` |" in page


def test_apply_functions_run_on_the_rows_the_table_names():
    from tigon.compat.liger.transformers._patching import SPECS

    for name, spec in SPECS.items():
        row = names.NAME_MAP[f"liger_kernel.transformers.apply_liger_kernel_to_{name}"]
        assert {f"tigon.patch_{r}" for r in spec.rows} <= set(row.tigon.split(", ")), name
        assert all(r in tigon.FAMILIES for r in (*spec.rows, *spec.class_rows))


# Liger 0.8.5's signatures (transcribed from its wheel; checked against the live package below).
SIGNATURES = {
    "apply_liger_kernel_to_llama":
        "(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None)",
    "apply_liger_kernel_to_granite":
        "(rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, model=None)",
    "apply_liger_kernel_to_llava": "(cross_entropy=False, fused_linear_cross_entropy=True, model=None, **kwargs)",
    "apply_liger_kernel_to_llama4": "(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, "
                                    "rms_norm=True, swiglu=True, model=None, layer_norm=True)",
}


def _params(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name not in ("self", "ctx")]


def test_signatures_are_liger_s():
    for name, expected in SIGNATURES.items():
        assert str(inspect.signature(getattr(liger, name))) == expected
    assert _params(inspect.signature(liger.LigerRMSNorm.__init__))[:6] == [
        (n, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for n, d in
        (("hidden_size", inspect.Parameter.empty), ("eps", 1e-6), ("offset", 0.0), ("casting_mode", "llama"),
         ("init_fn", "ones"), ("in_place", True))]
    assert list(inspect.signature(liger.LigerFusedLinearDPOLoss.forward).parameters) == [
        "self", "lin_weight", "_input", "target", "bias", "ref_input", "ref_weight", "ref_bias"]


def test_signatures_match_the_installed_liger():
    pytest.importorskip("liger_kernel.transformers")
    checked = 0
    for row in names.NAME_MAP.values():
        if not row.provided or row.liger in EXTRAS:
            continue
        theirs = getattr(importlib.import_module(row.module), row.name)
        ours = getattr(COMPAT_MODULES[row.module], row.name)
        if inspect.isclass(theirs) and issubclass(theirs, torch.autograd.Function):
            pairs = [(theirs.forward, ours.apply)]
        elif inspect.isclass(theirs):
            pairs = [(getattr(theirs, m), getattr(ours, m)) for m in ("__init__", "forward", "from_pretrained",
                                                                       "from_config") if m in vars(theirs)]
        elif inspect.ismethod(theirs):  # chunked_loss.functional's Function.apply
            pairs = [(theirs.__self__.forward, ours)]
        elif callable(theirs):
            pairs = [(theirs, ours)]
        else:
            continue
        for a, b in pairs:  # names, kinds and defaults
            sa, sb = inspect.signature(a), inspect.signature(b)
            assert _params(sa) == _params(sb), (row.liger, sa, sb)
            checked += 1
    assert checked > 150


# ---- patching: the one changed import ----

def tiny_llama_config():
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def batch(vocab=128, rows=2, seq=12):
    ids = torch.randint(0, vocab, (rows, seq))
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    return ids, labels


def train(model, ids, labels, steps=2):
    """AdamW steps (eps 1e-6, as tests/integration/test_patching.py's): (losses, the first step's
    gradients, the logits of an inference forward after), and whether the training forward
    returned logits."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, logits_in_training = [], None, None
    model.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
        logits_in_training = out.logits is not None
        if grads is None:
            grads = torch.cat([p.grad.detach().double().flatten() for p in model.parameters()])
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    return losses, grads, logits, logits_in_training


def assert_trains_like_hf(exact, hf, ours):
    """tigon's run as close to the float64 run of HF's code as HF's fp32 run is, up to 4x (never
    tighter than 1e-5 relative): each step's loss, the first step's gradients, the logits after."""
    def check(what, o, h, e):
        ours_err, hf_err = rel_err(o, e), rel_err(h, e)
        assert ours_err <= max(4 * hf_err, 1e-5), f"{what}: {ours_err:.2e} vs HF's own {hf_err:.2e}"

    for step, (e, h, o) in enumerate(zip(*(torch.tensor(run[0], dtype=torch.float64) for run in (exact, hf, ours)))):
        check(f"loss at step {step}", o, h, e)
    check("gradients", ours[1], hf[1], exact[1])
    check("logits after training", ours[2], hf[2], exact[2])


def hf_runs(model, ids, labels):
    """HF's own runs of ``model``'s code, before anything is patched: float64 and fp32."""
    exact = copy.deepcopy(model).double()
    return train(exact, ids, labels), train(copy.deepcopy(model), ids, labels)


def test_the_compat_import_trains_llama_with_tigon_s_kernels():
    """``from liger_kernel.transformers import apply_liger_kernel_to_llama`` replaced by the compat
    import: the class patch, then a Llama built as usual trains with tigon's kernels (the fused
    loss returns no logits, as Liger's) and as HF's code does."""
    config, (ids, labels) = tiny_llama_config(), batch()
    model = LlamaForCausalLM(config)
    exact, hf = hf_runs(model, ids, labels)
    assert hf[3], "HF's own forward returns logits in training"
    hf_norm_forward = modeling_llama.LlamaRMSNorm.forward

    from tigon.compat.liger import apply_liger_kernel_to_llama

    report = apply_liger_kernel_to_llama()
    assert {"rms_norm", "swiglu", "rope", "loss"} <= report.pieces()
    assert modeling_llama.LlamaRMSNorm.forward is not hf_norm_forward
    assert "rms_norm" in getattr(modeling_llama.LlamaRMSNorm.forward, "_tigon", "")
    ours = LlamaForCausalLM(config)
    ours.load_state_dict(model.state_dict())
    run = train(ours, ids, labels)
    assert not run[3], "the fused loss runs: no logits in training with labels"
    assert_trains_like_hf(exact, hf, run)


def test_the_instance_form_patches_that_model_only():
    config, (ids, labels) = tiny_llama_config(), batch()
    model = LlamaForCausalLM(config)
    exact, hf = hf_runs(model, ids, labels)
    ours, other = copy.deepcopy(model), copy.deepcopy(model)
    report = liger.apply_liger_kernel_to_llama(model=ours, rope=False)
    assert {"rms_norm", "swiglu", "loss"} <= report.pieces() and "rope" not in report.pieces()
    assert all("[class]" not in line for line in str(report).splitlines()[1:])
    assert "forward" in vars(ours.model.norm) and "forward" not in vars(other.model.norm)
    assert other(input_ids=ids, labels=labels).logits is not None  # the other model keeps HF's code
    assert_trains_like_hf(exact, hf, train(ours, ids, labels))


def test_hf_trainer_s_entry_and_the_auto_class():
    """What HF Trainer's use_liger_kernel=True calls, _apply_liger_kernel_to_instance(model,
    **liger_kernel_config): the flags the family's function takes (others dropped, as Liger
    drops them); an unknown model type is left alone. AutoLigerKernelForCausalLM loads, then
    patches with the flags found among its keyword arguments."""
    config = tiny_llama_config()
    model = LlamaForCausalLM(config)
    report = liger._apply_liger_kernel_to_instance(model=model, rope=False, swiglu=True, geglu=True, foo=1)
    assert report.family == "llama" and "rope" not in report.pieces() and "swiglu" in report.pieces()

    class Unknown(torch.nn.Module):
        config = types.SimpleNamespace(model_type="not_a_model")

    assert liger._apply_liger_kernel_to_instance(model=Unknown()) is None
    assert liger._apply_liger_kernel("not_a_model", rope=True) is None
    class_report = liger._apply_liger_kernel("llama", rms_norm=False, model_init_kwarg=1)
    assert "rms_norm" not in class_report.pieces() and ("rope", "transformers.models.llama.modeling_llama."
                                                        "apply_rotary_pos_emb", "module-wide") in class_report.replaced
    tigon.unpatch()
    auto = liger.AutoLigerKernelForCausalLM.from_config(config, swiglu=False)
    assert isinstance(auto, LlamaForCausalLM) and "swiglu" not in auto.tigon_report.pieces()
    assert "forward" in vars(auto.model.norm)


def test_patch_functions_refuse_what_liger_refuses_and_what_tigon_lacks():
    with pytest.raises(TypeError, match="rope must be True or False"):
        liger.apply_liger_kernel_to_llama(rope="yes")
    with pytest.raises(ValueError, match="cross_entropy and fused_linear_cross_entropy"):
        liger.apply_liger_kernel_to_llama(cross_entropy=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'geglu'"):
        liger.apply_liger_kernel_to_llama(geglu=True)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['rope_theta'\]"):
        liger.apply_liger_kernel_to_llava(rope_theta=1.0)
    with pytest.raises(TypeError, match="model must be a built model"):
        liger.apply_liger_kernel_to_llama(model="meta-llama/Llama-3.2-1B")
    with pytest.raises(ImportError, match="no DeepSeek-V4 row"):
        from tigon.compat.liger import apply_liger_kernel_to_deepseek_v4  # noqa: F401
    # A positional call, as Liger's functions take: (rope, cross_entropy, fused_linear_cross_entropy, ...)
    report = liger.apply_liger_kernel_to_llama(False, True, False)
    assert "rope" not in report.pieces() and "(cross entropy)" in dict((p, w) for p, w, _ in report.replaced)["loss"]


# ---- the modules and functions of liger_kernel.transformers, against float64 references ----

def randn(*shape, requires_grad=False, scale=1.0):
    return (torch.randn(shape) * scale).requires_grad_(requires_grad)


def with_params(module, *names):
    """fn(x..., *params) running ``module`` with the given parameters (for check_op's gradients)."""
    def fn(*args):
        n = len(args) - len(names)
        return torch.func.functional_call(module, dict(zip(names, args[n:])), tuple(args[:n]))
    return fn


def params(module, *names):
    return [module.get_parameter(n).detach().clone().normal_(0.5, 0.3).requires_grad_() for n in names]


@pytest.mark.parametrize("offset, casting_mode, init_fn", [(0.0, "llama", "ones"), (1.0, "gemma", "zeros"),
                                                           (0.0, -1, "ones")])
def test_rms_norm_modules_and_functions(offset, casting_mode, init_fn):
    norm = liger.LigerRMSNorm(24, eps=1e-5, offset=offset, casting_mode=casting_mode, init_fn=init_fn, in_place=True)
    assert torch.all(norm.weight == (1.0 if init_fn == "ones" else 0.0)) and norm.in_place
    assert norm.variance_epsilon == 1e-5 and norm.offset == offset
    casting = {-1: "none"}.get(casting_mode, casting_mode)
    assert norm.casting_mode == casting
    x, (w,) = randn(3, 5, 24, requires_grad=True), params(norm, "weight")
    ref = lambda x, w: R.rms_norm_ref(x, w, 1e-5, offset, casting)
    check_op(with_params(norm, "weight"), ref, [x, w], dtype=FP32, what="LigerRMSNorm")
    check_op(lambda x, w: compat_functional.liger_rms_norm(x, w, 1e-5, offset, casting_mode), ref, [x, w],
             dtype=FP32, what="liger_rms_norm")
    r = randn(3, 5, 24, requires_grad=True)
    fused = liger.LigerFusedAddRMSNorm(24, eps=1e-5, offset=offset, casting_mode=casting_mode, init_fn=init_fn)
    check_op(with_params(fused, "weight"), lambda x, r, w: (R.rms_norm_ref(x + r, w, 1e-5, offset, casting), x + r),
             [x, r, w], dtype=FP32, what="LigerFusedAddRMSNorm")


def test_muse_glimmer_norms():
    scale_free = liger.LigerRMSNormForMuseGlimmer(24, with_scale=False)
    assert scale_free.weight is None and scale_free.casting_mode == "gemma"
    x = randn(4, 24, requires_grad=True)
    check_op(scale_free, lambda x: R.rms_norm_ref(x, None, 1e-6, 0.0, "gemma"), [x], dtype=FP32)
    centered = liger.LigerRMSNormForMuseGlimmerTextCentered(24)
    assert centered.offset == 1.0 and torch.all(centered.weight == 0)


def mlp_config(act="silu", **kw):
    return LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4, hidden_act=act, **kw)


def _mlp_ref(activation):
    return lambda x, g, u, d: R.glu_mlp_ref(x, g, u, d, activation)


MODULE_CASES = {
    # name: (module, parameter names, inputs, float64 reference of (inputs..., parameters...))
    "LigerLayerNorm": (lambda: liger.LigerLayerNorm(24, eps=1e-5, bias=True), ("weight", "bias"),
                       lambda: [randn(3, 24)], lambda x, w, b: R.layer_norm_ref(x, w, b, 1e-5)),
    "LigerGroupNorm": (lambda: liger.LigerGroupNorm(6, 3, eps=1e-5), ("weight", "bias"), lambda: [randn(2, 6, 5)],
                       lambda x, w, b: R.group_norm_ref(x, 3, w, b, 1e-5)),
    "LigerDyT": (lambda: liger.LigerDyT(24, beta=True, init_alpha=0.7), ("alpha", "gamma", "beta"),
                 lambda: [randn(3, 24)], R.dyt_ref),
    "LigerPolyNorm": (lambda: liger.LigerPolyNorm(eps=1e-5), ("weight", "bias"), lambda: [randn(3, 24)],
                      lambda x, w, b: R.poly_norm_ref(x, w, b, 1e-5)),
    "LigerSoftmax": (liger.LigerSoftmax, (), lambda: [randn(3, 24)], R.softmax_ref),
    "LigerSparsemax": (lambda: liger.LigerSparsemax(dim=-1), (), lambda: [randn(3, 24)], R.sparsemax_ref),
    "LigerReLUSquared": (liger.LigerReLUSquared, (), lambda: [randn(3, 24)], R.relu_squared_ref),
    "LigerSwiGLUMLP": (lambda: liger.LigerSwiGLUMLP(mlp_config("swish")), ("gate_proj.weight", "up_proj.weight",
                       "down_proj.weight"), lambda: [randn(2, 3, 24)], _mlp_ref("silu")),
    "LigerGEGLUMLP": (lambda: liger.LigerGEGLUMLP(mlp_config("gelu_pytorch_tanh")), ("gate_proj.weight",
                      "up_proj.weight", "down_proj.weight"), lambda: [randn(2, 3, 24)], _mlp_ref("gelu_tanh")),
    "LigerMLP": (lambda: liger.LigerMLP(mlp_config()), ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                 lambda: [randn(2, 3, 24)], _mlp_ref("silu")),
    "LigerPhi3SwiGLUMLP": (lambda: liger.LigerPhi3SwiGLUMLP(mlp_config()), ("gate_up_proj.weight", "down_proj.weight"),
                           lambda: [randn(2, 3, 24)], lambda x, gu, d: R.glu_mlp_ref(x, gu[:40], gu[40:], d)),
    "LigerBlockSparseTop2MLP": (lambda: liger.LigerBlockSparseTop2MLP(mlp_config()), ("w1.weight", "w3.weight",
                                "w2.weight"), lambda: [randn(5, 24)], _mlp_ref("silu")),
    "LigerExperts": (lambda: liger.LigerExperts(mlp_config(num_local_experts=3)), ("gate_up_proj", "down_proj"),
                     lambda: [randn(5, 24), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), randn(5, 2)],
                     lambda x, i, wt, gu, d: R.moe_experts_ref(x, i, wt, gu, d)),
    "LigerKLDIVLoss": (lambda: liger.LigerKLDIVLoss(reduction="batchmean"), (),
                       lambda: [randn(4, 9).log_softmax(-1), randn(4, 9).softmax(-1)],
                       lambda x, t: R.kl_div_ref(x, t, "batchmean")),
    "LigerTVDLoss": (liger.LigerTVDLoss, (), lambda: [randn(4, 9).softmax(-1), randn(4, 9).softmax(-1),
                                                      torch.tensor([1, -100, 3, 4])],
                     lambda p, q, y: R.tvd_ref(p, q, y, "batchmean")),
    "LigerJSD": (lambda: liger.LigerJSD(beta=0.3), (),
                 lambda: [randn(4, 9).log_softmax(-1), randn(4, 9).log_softmax(-1), torch.tensor([1, -100, 3, 4])],
                 lambda s, t, y: R.jsd_ref(s, t, y, 0.3)),
    "LigerFusedLinearJSD": (lambda: liger.LigerFusedLinearJSD(jsd_beta=0.3, temperature=2.0), (),
                            lambda: [randn(6, 8), randn(9, 8), randn(6, 5), randn(9, 5),
                                     torch.tensor([1, -100, 3, 4, 0, 2])],
                            lambda x, w, tx, tw, y: R.jsd_loss_ref(x @ w.t(), tx @ tw.t(), y, 0.3, 2.0)),
}


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_modules_against_float64(name):
    build, names_, inputs, ref = MODULE_CASES[name]
    module = build()
    inputs = [t.detach().requires_grad_() if t.is_floating_point() and i == 0 else t for i, t in enumerate(inputs())]
    if name == "LigerFusedLinearJSD":  # the student's head gets a gradient, the teacher's does not
        inputs[1].requires_grad_()
    check_op(with_params(module, *names_) if names_ else module, ref, [*inputs, *params(module, *names_)],
             dtype=FP32, what=name, tol=1e-4 if "MLP" in name or "Experts" in name else None)


def test_jsd_loss_in_the_inputs_dtype_as_liger_s():
    s, t = randn(4, 9).log_softmax(-1).bfloat16(), randn(4, 9).log_softmax(-1).bfloat16()
    assert liger.LigerJSD()(s, t).dtype == torch.bfloat16
    assert compat_functional.liger_jsd(s, t).dtype == torch.bfloat16


def test_rotary_embeddings():
    q, k, cos, sin = randn(1, 4, 6, 16), randn(1, 2, 6, 16), randn(1, 6, 16), randn(1, 6, 16)
    for fn in (liger.liger_rotary_pos_emb, compat_functional.liger_rope, compat_functional.LigerRopeFunction.apply):
        check_op(lambda q, k, c, s: fn(q, k, c, s, torch.arange(6)[None]), R.rope_ref,
                 [q.requires_grad_(), k, cos, sin], dtype=FP32, what=fn.__qualname__)
    # rotary_dim = 2R: cos / sin hold one angle per pair (GPT-OSS's)
    half_cos, half_sin = cos[..., :8], sin[..., :8]
    check_op(lambda q, k, c, s: liger.liger_rotary_pos_emb(q, k, c, s, rotary_dim=16),
             lambda q, k, c, s: R.rope_ref(q, k, torch.cat((c, c), -1), torch.cat((s, s), -1)),
             [q, k, half_cos, half_sin], dtype=FP32, what="rotary_dim=2R")
    # Qwen2-VL's multimodal RoPE: sections of [3, B, T, D] cos / sin
    mcos, msin, section = randn(3, 1, 6, 16), randn(3, 1, 6, 16), [2, 3, 3]

    def pick(t):
        return torch.cat([p[i % 3] for i, p in enumerate(t.split(section * 2, dim=-1))], dim=-1)

    check_op(lambda q, k, c, s: compat_functional.liger_qwen2vl_mrope(q, k, c, s, section),
             lambda q, k, c, s: R.rope_ref(q, k, pick(c), pick(s)), [q, k, mcos, msin], dtype=FP32, what="mrope")
    # Llama 4's complex RoPE, [B, T, H, D] with freqs_cis [B, T, D/2]
    freqs = torch.polar(torch.ones(1, 6, 8), randn(1, 6, 8))
    xq, xk = randn(1, 6, 4, 16), randn(1, 6, 2, 16)

    def llama4_ref(x):
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2)) * freqs.to(torch.complex128)[:, :, None]
        return torch.view_as_real(z).flatten(3)

    oq, ok = liger.liger_llama4_text_rotary_pos_emb(xq, xk, freqs)
    assert rel_err(oq, llama4_ref(xq)) < 1e-5 and rel_err(ok, llama4_ref(xk)) < 1e-5


def _ce_refs(z, target, ignore_index, lse_square_scale, softcap):
    """Liger's extras in float64: z-loss (summed over kept rows, / kept for "mean"), token
    accuracy and predictions (-1 where ignored)."""
    capped = softcap * torch.tanh(z.double() / softcap)
    keep = target != ignore_index
    z_loss = (lse_square_scale * torch.logsumexp(capped, -1) ** 2 * keep).sum() / keep.sum()
    pred = torch.where(keep, capped.argmax(-1), -1)
    return z_loss, (pred == target)[keep].double().mean(), pred


def test_cross_entropy_loss_module_and_functions():
    N, V = 10, 37
    target = torch.randint(0, V, (N,))
    target[[1, 4]] = -100
    opts = dict(ignore_index=-100, lse_square_scale=1e-3, label_smoothing=0.1, softcap=20.0)
    ref = lambda z: R.cross_entropy_ref(z, target, **opts)
    loss_fn = liger.LigerCrossEntropyLoss(**opts)
    z = randn(N, V, scale=3.0, requires_grad=True)
    # z * 1: Liger's kernel (and tigon's here) writes the gradient over the logits it is given
    check_op(lambda z: loss_fn(z * 1.0, target), ref, [z], dtype=FP32, what="LigerCrossEntropyLoss")
    check_op(lambda z: compat_functional.liger_cross_entropy(z * 1.0, target, **opts), ref, [z], dtype=FP32,
             what="liger_cross_entropy")
    out = liger.LigerCrossEntropyLoss(**opts, return_z_loss=True, return_token_accuracy=True,
                                      return_predicted_tokens=True)(z.detach().clone(), target)
    assert isinstance(out, compat_functional.CrossEntropyOutput)
    z_loss, accuracy, pred = _ce_refs(z.detach(), target, **{k: opts[k] for k in ("ignore_index", "lse_square_scale",
                                                                                    "softcap")})
    assert rel_err(out.loss, ref(z.detach().double())) < 1e-5 and rel_err(out.z_loss, z_loss) < 1e-5
    assert abs(out.token_accuracy.item() - accuracy.item()) < 1e-6 and torch.equal(out.predicted_tokens, pred)
    only_z = compat_functional.liger_cross_entropy(z.detach().clone(), target, return_z_loss=True)
    assert only_z.token_accuracy is None and only_z.predicted_tokens is None and only_z.z_loss.item() == 0.0
    loss, z_l, acc, pred = compat_functional.LigerCrossEntropyFunction.apply(z.detach().clone(), target, None, -100,
                                                                             0.0, 0.0, "none")
    assert loss.shape == (N,) and z_l is None and acc is None and pred is None
    logits = z.detach().clone().requires_grad_() * 1.0
    before = logits.detach().clone()
    liger.LigerCrossEntropyLoss()(logits, target)
    assert not torch.equal(logits.detach(), before), "as Liger's, the gradient is written over the logits"


def test_fused_linear_cross_entropy_takes_the_weight_first():
    x, w, b = randn(2, 5, 16, requires_grad=True), randn(37, 16, requires_grad=True), randn(37, requires_grad=True)
    target = torch.randint(0, 37, (2, 5))
    target[0, :2] = -100
    opts = dict(label_smoothing=0.05, lse_square_scale=1e-3)
    loss_fn = liger.LigerFusedLinearCrossEntropyLoss(**opts)
    ref = lambda x, w, b: R.fused_linear_cross_entropy_ref(x.reshape(-1, 16), w, target.reshape(-1), b, **opts)
    check_op(lambda x, w, b: loss_fn(w, x, target, b), ref, [x, w, b], dtype=FP32, tol=1e-4, what="FLCE module")
    out = compat_functional.liger_fused_linear_cross_entropy(x.detach(), w.detach(), target, b.detach(), **opts,
                                                             return_token_accuracy=True)
    assert out.z_loss is None and 0.0 <= out.token_accuracy.item() <= 1.0
    loss, *extras = compat_functional.LigerFusedLinearCrossEntropyFunction.apply(x.detach(), w.detach(), target)
    assert extras == [None, None, None] and loss.ndim == 0


# ---- liger_kernel.chunked_loss ----

def preference_batch(pairs=2, T=6, H=16, V=37):
    x, ref_x = randn(2 * pairs, T, H, requires_grad=True), randn(2 * pairs, T, H)
    w = randn(V, H, scale=0.5, requires_grad=True)
    target = torch.randint(0, V, (2 * pairs, T))
    target[:, :2] = -100  # prompts
    return x, w, target, ref_x, randn(V, H, scale=0.5)


def test_dpo_loss_against_float64():
    x, w, target, ref_x, ref_w = preference_batch()
    pairs = x.shape[0] // 2

    def reference(x, w, alpha=0.0):
        ref_lp = R.sequence_logps_ref(ref_x.to(x.dtype), ref_w.to(x.dtype), target)[0]
        loss = R.dpo_ref(x, w, target, ref_lp[:pairs], ref_lp[pairs:], beta=0.2)
        return loss + alpha * R.chosen_nll_ref(x, w, target) if alpha else loss

    dpo = liger.LigerFusedLinearDPOLoss(beta=0.2)
    check_op(lambda x, w: dpo(w, x, target, None, ref_x, ref_w)[0], reference, [x, w], dtype=FP32, tol=1e-4)
    loss, metrics = dpo(w, x, target, None, ref_x, ref_w)
    assert len(metrics) == 7 and metrics[4].item() == 0.0  # no NLL term asked for
    logps = R.sequence_logps_ref(x.detach().double(), w.detach().double(), target)[0]
    assert rel_err(metrics[0], logps[:pairs]) < 1e-5 and rel_err(metrics[1], logps[pairs:]) < 1e-5
    # alpha weighs the chosen NLL (tigon's dpo_loss adds it with weight 1: another alpha is one more pass)
    with_nll = liger.LigerFusedLinearDPOLoss(beta=0.2, compute_nll_loss=True, alpha=0.5)
    check_op(lambda x, w: with_nll(w, x, target, None, ref_x, ref_w)[0], lambda x, w: reference(x, w, 0.5), [x, w],
             dtype=FP32, tol=1e-4)
    nll = with_nll(w, x, target, None, ref_x, ref_w)[1][4]
    assert rel_err(nll, R.chosen_nll_ref(x.detach().double(), w.detach().double(), target)) < 1e-5
    # reference-free, and the functional form (Liger's positional arguments)
    free = compat_chunked_functional.liger_fused_linear_dpo(x.detach(), w.detach(), target, None, None, None, None,
                                                            -100, 0.2, False, True, False)
    assert rel_err(free[0], R.dpo_ref(x.detach().double(), w.detach().double(), target, 0.0, 0.0, beta=0.2)) < 1e-5
    with pytest.warns(UserWarning, match="not read by loss_type='sigmoid'"):
        smoothed = liger.LigerFusedLinearDPOLoss(beta=0.2, label_smoothing=0.2)(w, x, target, None, ref_x, ref_w)
    assert torch.equal(smoothed[0], loss)


def test_orpo_cpo_simpo_against_float64():
    x, w, target, _, _ = preference_batch()
    pairs = x.shape[0] // 2

    def avg_logps(x, w):
        return R.sequence_logps_ref(x, w, target, average=True)[0]

    def orpo_ref(x, w, beta=0.1):
        lp = avg_logps(x, w)
        c, r = lp[:pairs], lp[pairs:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return R.chosen_nll_ref(x, w, target) - beta * F.logsigmoid(log_odds).mean(), log_odds

    orpo = liger.LigerFusedLinearORPOLoss(beta=0.1)
    check_op(lambda x, w: orpo(w, x, target)[0], lambda x, w: orpo_ref(x, w)[0], [x, w], dtype=FP32, tol=1e-4)
    metrics = orpo(w, x, target)[1]
    _, log_odds = orpo_ref(x.detach().double(), w.detach().double())
    assert len(metrics) == 9 and rel_err(metrics[7], F.logsigmoid(log_odds).mean()) < 1e-5
    assert rel_err(metrics[8], log_odds.mean()) < 1e-5

    def sigmoid_pref(x, w, beta, gamma, average, alpha):
        lp = R.sequence_logps_ref(x, w, target, average=average)[0]
        loss = -F.logsigmoid(beta * (lp[:pairs] - lp[pairs:]) - gamma).mean()
        return loss + alpha * R.chosen_nll_ref(x, w, target)

    cpo = liger.LigerFusedLinearCPOLoss(beta=0.3, alpha=0.5)
    check_op(lambda x, w: cpo(w, x, target)[0], lambda x, w: sigmoid_pref(x, w, 0.3, 0.0, False, 0.5), [x, w],
             dtype=FP32, tol=1e-4)
    simpo = liger.LigerFusedLinearSimPOLoss(beta=0.3, gamma=0.4, alpha=0.0)  # compute_nll_loss=True, weight 0
    check_op(lambda x, w: simpo(w, x, target)[0], lambda x, w: sigmoid_pref(x, w, 0.3, 0.4, True, 0.0), [x, w],
             dtype=FP32, tol=1e-4)
    nll = simpo(w, x, target)[1][4]  # reported although not added, as Liger's
    assert rel_err(nll, R.chosen_nll_ref(x.detach().double(), w.detach().double(), target)) < 1e-5


def test_kto_loss_takes_kl_as_given():
    x, w, target, ref_x, ref_w = preference_batch()
    labels = torch.tensor([True, False, True, False])
    ref_lp = R.sequence_logps_ref(ref_x.double(), ref_w.double(), target)[0]
    kto = liger.LigerFusedLinearKTOLoss(beta=0.2, use_ref_model=True, chunk_size=3)
    for kl in (0.05, -0.1):  # a negative KL estimate is not clamped, as in Liger
        check_op(lambda x, w: kto(x, w, target, None, labels, ref_x, ref_w, None, kl)[0],
                 lambda x, w: R.kto_ref(x, w, target, labels, ref_logps=ref_lp, beta=0.2, kl=kl), [x, w],
                 dtype=FP32, tol=1e-4)
    _, metrics = kto(x, w, target, None, labels, ref_x, ref_w, None, 0.05)
    logps = R.sequence_logps_ref(x.detach().double(), w.detach().double(), target)[0]
    logit_sums = (x.detach().double() @ w.detach().double().t()).sum((1, 2))
    expected = (logps[labels].sum(), logps[~labels].sum(), logit_sums[labels].sum(), logit_sums[~labels].sum(),
                0.2 * (logps - ref_lp)[labels].sum(), 0.2 * (logps - ref_lp)[~labels].sum())
    for ours, theirs in zip(metrics, expected):
        assert rel_err(ours, theirs) < 1e-4


def test_jsd_distillation_loss():
    sx, sw = randn(8, 16, requires_grad=True), randn(37, 16, requires_grad=True)
    tx, tw = randn(8, 12), randn(37, 12)
    labels = torch.randint(0, 37, (8,))
    labels[:3] = -100

    def reference(sx, sw, hard=0.3, soft=0.7):
        s, t = sx @ sw.t(), (tx @ tw.t()).to(sx.dtype)
        return hard * R.cross_entropy_ref(s, labels) + soft * R.jsd_loss_ref(s, t, labels, 0.4, 2.0)

    jsd = liger.LigerFusedLinearJSDLoss(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.4, temperature=2.0,
                                        chunk_size=3)
    check_op(lambda sx, sw: jsd(sx, sw, tx, tw, labels), reference, [sx, sw], dtype=FP32, tol=1e-4)
    loss, soft, hard = liger.LigerFusedLinearJSDLoss(beta=0.4, temperature=2.0, return_soft_hard_loss=True)(
        sx, sw, tx, tw, labels)
    assert rel_err(hard, R.cross_entropy_ref(sx.detach().double() @ sw.detach().double().t(), labels)) < 1e-5
    assert rel_err(loss, 0.5 * soft + 0.5 * hard) < 1e-6 and not soft.requires_grad


def grpo_batch(B=3, T=5, H=16, V=37):
    x, w = randn(B, T, H, requires_grad=True), randn(V, H, scale=0.5, requires_grad=True)
    ids, mask = torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    advantages = torch.tensor([1.0, -0.5, 0.25])
    old = R.token_logps_ref(x.detach(), w.detach(), ids).float() + 0.3 * randn(B, T)
    ref = R.token_logps_ref(x.detach(), w.detach(), ids).float() + 0.1 * randn(B, T)
    return x, w, ids, mask, advantages, old, ref


def test_grpo_loss_and_its_metrics():
    x, w, ids, mask, adv, old, ref = grpo_batch()
    grpo = liger.LigerFusedLinearGRPOLoss(beta=0.05, loss_type="bnpo", temperature=0.7, chunk_size=2)
    loss, (kl, clip) = grpo(x, w, ids, mask, adv, None, ref, old)
    ours, metrics = tigon.losses.grpo_loss(x, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old,
                                           beta=0.05, loss_type="bnpo", temperature=0.7)
    assert torch.allclose(loss, ours) and torch.allclose(kl, metrics["kl"])
    assert torch.allclose(clip, metrics["clip_ratio/region_mean"])
    # without a reference the KL term is 0 (Liger's: ref = the policy's own log-probs)
    free, (kl0, _) = liger.LigerFusedLinearGRPOLoss(beta=0.05, use_ref_model=False, loss_type="bnpo")(
        x, w, ids, mask, adv, None, ref, old)
    assert kl0.item() == 0.0 and torch.allclose(free, tigon.losses.grpo_loss(
        x, w, ids, mask, adv, old_per_token_logps=old, beta=0.0, loss_type="bnpo")[0])
    # sequence-level importance sampling: the clip ratio is the share of tokens in clipped sequences
    seq = liger.LigerFusedLinearGRPOLoss(beta=0.0, loss_type="grpo", importance_sampling_level="sequence",
                                         epsilon_low=0.05, epsilon_high=0.05)
    loss, (clip,) = seq(x, w, ids, mask, adv, None, None, old, vllm_is_ratio=torch.tensor([1.0, 0.9, 1.1]))
    lp = R.token_logps_ref(x.detach().double(), w.detach().double(), ids)
    m = mask.double()
    coef = torch.exp(((lp - old.double()) * m).sum(-1) / m.sum(-1))
    clipped = ((coef < 0.95) & (adv < 0)) | ((coef > 1.05) & (adv > 0))
    assert rel_err(clip, (clipped[:, None] * m).sum() / m.sum()) < 1e-6
    expected = tigon.losses.grpo_loss(x, w, ids, mask, adv, old_per_token_logps=old, beta=0.0, loss_type="grpo",
                                      importance_sampling_level="sequence", epsilon_low=0.05, epsilon_high=0.05,
                                      importance_sampling_ratio=torch.tensor([[1.0], [0.9], [1.1]]))[0]
    assert torch.allclose(loss, expected)
    loss.backward()
    assert x.grad is not None and w.grad is not None


# ---- what tigon lacks: errors naming the argument ----

UNSUPPORTED = [
    (lambda: liger.LigerRMSNorm(8, init_fn="normal"), ValueError, "init_fn"),
    (lambda: liger.LigerRMSNorm(8, casting_mode="fp16"), ValueError, "casting_mode"),
    (lambda: liger.LigerCrossEntropyLoss(reduction="batchmean"), ValueError, "reduction"),
    (lambda: liger.LigerKLDIVLoss(eps=1e-3)(randn(2, 3).log_softmax(-1), randn(2, 3).softmax(-1)),
     NotImplementedError, "eps"),
    (lambda: compat_functional.liger_kl_div(randn(2, 3), randn(2, 3), reduce=False), NotImplementedError, "reduce"),
    (lambda: compat_functional.liger_cross_entropy(randn(2, 3), torch.tensor([0, 1]), size_average=False),
     NotImplementedError, "size_average"),
    (lambda: liger.LigerFusedLinearJSD(accum_dtype=torch.float64)(randn(2, 4), randn(5, 4), randn(2, 4), randn(5, 4),
                                                                  None), NotImplementedError, "accum_dtype"),
    (lambda: liger.LigerFusedLinearGRPOLoss(loss_type="vespo"), NotImplementedError, "loss_type='vespo'"),
    (lambda: liger.LigerFusedLinearGRPOLoss(loss_type="sapo", importance_sampling_level="sequence"), ValueError,
     "importance_sampling_level"),
    (lambda: liger.LigerFusedLinearDPOLoss(loss_type="exo_pair"), ValueError, "label_smoothing"),
    (lambda: liger.LigerFusedLinearDPOLoss(loss_type="kto"), ValueError, "loss_type"),
    (lambda: liger.LigerFusedLinearDPOLoss()(randn(5, 4), randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)),
     ValueError, "ref_input"),
    (lambda: liger.LigerVocabParallelCrossEntropy(label_smoothing=0.1, label_smoothing_formula="megatron"),
     NotImplementedError, "label_smoothing_formula"),
    (lambda: liger.LigerVocabParallelCrossEntropy(reduction="mean"), ValueError, "reduction"),
    (lambda: compat_functional.liger_rope(randn(1, 2, 3, 8), randn(1, 2, 3, 8), randn(1, 3, 6), randn(1, 3, 6),
                                          rotary_dim=8), ValueError, "rotary_dim"),
    (lambda: liger.LigerSwiGLUMLP(mlp_config("gelu")), ValueError, "hidden_act"),
]


@pytest.mark.parametrize("case", range(len(UNSUPPORTED)))
def test_what_tigon_lacks_raises_naming_it(case):
    call, error, name = UNSUPPORTED[case]
    with pytest.raises(error, match=re.escape(name)):
        call()


def test_vocab_parallel_cross_entropy_on_one_rank():
    logits, target = randn(4, 2, 11, requires_grad=True), torch.randint(0, 11, (4, 2))
    target[0, 0] = -100
    ce = liger.LigerVocabParallelCrossEntropy(label_smoothing=0.1)
    check_op(lambda z: ce(z * 1.0, target), lambda z: R.cross_entropy_ref(z.reshape(-1, 11), target.reshape(-1),
                                                                          reduction="none", label_smoothing=0.1
                                                                          ).reshape(4, 2), [logits], dtype=FP32)


# ---- the docs page's code ----

def test_the_docs_page_s_code_runs():
    """Every Python block of docs/guides/liger.md, in order, in one namespace (the page reads top
    to bottom; tests/docs/test_snippets.py runs every page so too): its liger_kernel alias is
    tigon's compat layer and is gone after its block."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS_PAGE.read_text(), re.S)
    assert len(blocks) >= 5
    namespace = {"__name__": "__snippet__"}
    for block in blocks:
        exec(compile(block, str(DOCS_PAGE), "exec"), namespace)
    assert namespace["apply_liger_kernel_to_llama"] is liger.apply_liger_kernel_to_llama  # the aliased import
    assert "liger_kernel" not in sys.modules or sys.modules["liger_kernel"] is not liger
    assert namespace["out"].logits is None and namespace["x"].grad is not None


# ---- against the installed Liger-Kernel (skipped without it: CI does not install it) ----

def _tensors(out):
    """The tensors of an output (a tensor, nested tuples, a CrossEntropyOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if hasattr(out, "__dataclass_fields__"):
        return [t for f in out.__dataclass_fields__ for t in _tensors(getattr(out, f))]
    return []


def _run(fn, inputs):
    """fn's outputs and the gradients of the floating inputs that require grad (backward of the
    first output against a fixed cotangent)."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    outs = _tensors(fn(*inputs))
    if outs[0].requires_grad:
        cot = torch.linspace(0.5, 1.5, outs[0].numel(), dtype=outs[0].dtype).reshape(outs[0].shape)
        (outs[0] * cot).sum().backward()
    return [o.detach() for o in outs], [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def _liger_cases():
    """(name, ours, theirs, inputs): the same call on tigon.compat.liger and on liger_kernel."""
    import liger_kernel.chunked_loss as lc
    import liger_kernel.transformers as lt
    import liger_kernel.transformers.functional as lf

    x3, w, target = randn(2, 5, 16, requires_grad=True), randn(37, 16, scale=0.5, requires_grad=True), \
        torch.randint(0, 37, (2, 5))
    target[0, :2] = -100
    logits, flat_t = randn(10, 37, scale=2.0, requires_grad=True), target.reshape(-1)
    px, pw, pt, ref_x, ref_w = preference_batch()
    gx, gw, ids, mask, adv, old, ref = grpo_batch()
    labels = torch.tensor([True, False, True, False])
    # (no softcap, and no LigerKLDIVLoss: Liger's kernels call .to() on a Python float there, which Triton's
    # interpreter refuses)
    ce_opts = dict(lse_square_scale=1e-3, label_smoothing=0.1, return_z_loss=True, return_token_accuracy=True,
                   return_predicted_tokens=True)
    cfg = mlp_config()
    # HF's cos / sin: each angle twice (cat(freqs, freqs)), the layout Liger's kernel reads
    angles = randn(1, 6, 8)
    q, k = randn(1, 4, 6, 16, requires_grad=True), randn(1, 2, 6, 16)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    m_angles = randn(3, 1, 6, 8)
    mcos, msin = torch.cat((m_angles, m_angles), -1).cos(), torch.cat((m_angles, m_angles), -1).sin()
    cases = [
        ("LigerCrossEntropyLoss", lambda z: liger.LigerCrossEntropyLoss(**ce_opts)(z * 1.0, flat_t),
         lambda z: lt.LigerCrossEntropyLoss(**ce_opts)(z * 1.0, flat_t), [logits]),
        ("liger_cross_entropy none", lambda z: compat_functional.liger_cross_entropy(z * 1.0, flat_t, reduction="none"),
         lambda z: lf.liger_cross_entropy(z * 1.0, flat_t, reduction="none"), [logits]),
        ("LigerFusedLinearCrossEntropyLoss",
         lambda x, w: liger.LigerFusedLinearCrossEntropyLoss(**ce_opts)(w, x.reshape(-1, 16), flat_t),
         lambda x, w: lt.LigerFusedLinearCrossEntropyLoss(**ce_opts)(w, x.reshape(-1, 16), flat_t), [x3, w]),
        ("LigerJSD", lambda s: liger.LigerJSD(0.3)(s.log_softmax(-1), logits.detach().log_softmax(-1), flat_t),
         lambda s: lt.LigerJSD(0.3)(s.log_softmax(-1), logits.detach().log_softmax(-1), flat_t), [logits]),
        ("liger_tvd", lambda s: compat_functional.liger_tvd(s.softmax(-1), logits.detach().flip(0).softmax(-1), flat_t),
         lambda s: lf.liger_tvd(s.softmax(-1), logits.detach().flip(0).softmax(-1), flat_t), [logits]),
        ("liger_rotary_pos_emb", lambda q: liger.liger_rotary_pos_emb(q, k, cos, sin),
         lambda q: lt.liger_rotary_pos_emb(q, k, cos, sin), [q]),
        ("liger_rotary_pos_emb rotary_dim", lambda q: liger.liger_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8],
                                                                                 rotary_dim=16),
         lambda q: lt.liger_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8], rotary_dim=16), [q]),
        ("LigerSwiGLUMLP", lambda x: _seeded(liger.LigerSwiGLUMLP, cfg)(x),
         lambda x: _seeded(lt.LigerSwiGLUMLP, cfg)(x), [randn(2, 3, 24, requires_grad=True)]),
        ("LigerPolyNorm", lambda x: liger.LigerPolyNorm()(x), lambda x: lt.LigerPolyNorm()(x),
         [randn(3, 24, requires_grad=True)]),
        ("LigerRMSNorm gemma", lambda x: liger.LigerRMSNorm(24, offset=1.0, casting_mode="gemma", init_fn="zeros")(x),
         lambda x: lt.LigerRMSNorm(24, offset=1.0, casting_mode="gemma", init_fn="zeros")(x),
         [randn(3, 24, requires_grad=True)]),
        ("LigerFusedAddRMSNorm", lambda x: liger.LigerFusedAddRMSNorm(24)(x, x.detach() * 0.5),
         lambda x: lt.LigerFusedAddRMSNorm(24)(x, x.detach() * 0.5), [randn(3, 24, requires_grad=True)]),
        ("LigerLayerNorm", lambda x: liger.LigerLayerNorm(24)(x), lambda x: lt.LigerLayerNorm(24)(x),
         [randn(3, 24, requires_grad=True)]),
        ("LigerDyT", lambda x: liger.LigerDyT(24, init_alpha=0.8)(x), lambda x: lt.LigerDyT(24, init_alpha=0.8)(x),
         [randn(3, 24, requires_grad=True)]),
        ("LigerGEGLUMLP", lambda x: _seeded(liger.LigerGEGLUMLP, mlp_config("gelu_pytorch_tanh"))(x),
         lambda x: _seeded(lt.LigerGEGLUMLP, mlp_config("gelu_pytorch_tanh"))(x),
         [randn(2, 3, 24, requires_grad=True)]),
        ("LigerFusedLinearJSD", lambda x, w: liger.LigerFusedLinearJSD(0.3, temperature=2.0)(
            x.reshape(-1, 16), w, ref_x.reshape(-1, 16), ref_w, pt.reshape(-1)),
         lambda x, w: lt.LigerFusedLinearJSD(0.3, temperature=2.0)(x.reshape(-1, 16), w, ref_x.reshape(-1, 16), ref_w,
                                                                   pt.reshape(-1)), [px, pw]),
        ("liger_qwen2vl_mrope", lambda q: compat_functional.liger_qwen2vl_mrope(q, k, mcos, msin, [2, 3, 3]),
         lambda q: lf.liger_qwen2vl_mrope(q, k, mcos, msin, [2, 3, 3]), [q]),
        ("LigerFusedLinearDPOLoss",
         lambda x, w: liger.LigerFusedLinearDPOLoss(beta=0.2, compute_nll_loss=True, alpha=0.5)(w, x, pt, None, ref_x,
                                                                                                 ref_w),
         lambda x, w: lc.LigerFusedLinearDPOLoss(beta=0.2, compute_nll_loss=True, alpha=0.5, compiled=False)(
             w, x, pt, None, ref_x, ref_w), [px, pw]),
        ("LigerFusedLinearDPOLoss hinge, reference free",
         lambda x, w: liger.LigerFusedLinearDPOLoss(loss_type="hinge", use_ref_model=False)(w, x, pt),
         lambda x, w: lc.LigerFusedLinearDPOLoss(loss_type="hinge", use_ref_model=False, compiled=False)(w, x, pt),
         [px, pw]),
        ("LigerFusedLinearORPOLoss", lambda x, w: liger.LigerFusedLinearORPOLoss(beta=0.2)(w, x, pt, None, pt.flip(1)),
         lambda x, w: lc.LigerFusedLinearORPOLoss(beta=0.2, compiled=False)(w, x, pt, None, pt.flip(1)), [px, pw]),
        ("LigerFusedLinearCPOLoss", lambda x, w: liger.LigerFusedLinearCPOLoss(alpha=0.0)(w, x, pt),
         lambda x, w: lc.LigerFusedLinearCPOLoss(alpha=0.0, compiled=False)(w, x, pt), [px, pw]),
        ("LigerFusedLinearSimPOLoss", lambda x, w: liger.LigerFusedLinearSimPOLoss(beta=0.5)(w, x, pt),
         lambda x, w: lc.LigerFusedLinearSimPOLoss(beta=0.5, compiled=False)(w, x, pt), [px, pw]),
        ("LigerFusedLinearKTOLoss",
         lambda x, w: liger.LigerFusedLinearKTOLoss(use_ref_model=True)(x, w, pt, None, labels, ref_x, ref_w, None,
                                                                       torch.tensor(-0.05)),
         lambda x, w: lc.LigerFusedLinearKTOLoss(use_ref_model=True, compiled=False)(x, w, pt, None, labels, ref_x,
                                                                                     ref_w, None, torch.tensor(-0.05)),
         [px, pw]),
        ("LigerFusedLinearJSDLoss",
         lambda x, w: liger.LigerFusedLinearJSDLoss(beta=0.3, temperature=2.0, return_soft_hard_loss=True)(
             x.reshape(-1, 16), w, ref_x.reshape(-1, 16), ref_w, pt.reshape(-1)),
         lambda x, w: lc.LigerFusedLinearJSDLoss(beta=0.3, temperature=2.0, return_soft_hard_loss=True,
                                                 compiled=False)(x.reshape(-1, 16), w, ref_x.reshape(-1, 16), ref_w,
                                                                 pt.reshape(-1)), [px, pw]),
    ]
    for loss_type, level in (("bnpo", "token"), ("grpo", "sequence"), ("cispo", "token"), ("sapo", "token"),
                             ("dapo", "token"), ("dr_grpo", "token")):
        opts = dict(beta=0.05, loss_type=loss_type, importance_sampling_level=level, temperature=0.8,
                    max_completion_length=6, epsilon_high=0.1 if loss_type != "cispo" else 1.05)
        cases.append((f"LigerFusedLinearGRPOLoss {loss_type} {level}",
                      lambda x, w, o=opts: liger.LigerFusedLinearGRPOLoss(**o)(x, w, ids, mask, adv, None, ref, old),
                      lambda x, w, o=opts: lc.LigerFusedLinearGRPOLoss(**o, compiled=False)(x, w, ids, mask, adv,
                                                                                            None, ref, old),
                      [gx, gw]))
    return cases


def _seeded(cls, *args):
    torch.manual_seed(7)
    return cls(*args)


def test_agrees_with_the_installed_liger():
    """The compat layer and Liger-Kernel itself on the same calls: every output (metrics
    included) and the inputs' gradients. A call Liger's own kernels cannot run in Triton's
    interpreter (a Python float where its kernel wants a tensor, a GPU driver it asks for) is left
    out there; on a GPU every call runs."""
    pytest.importorskip("liger_kernel.chunked_loss")

    problems, compared = [], 0
    for name, ours, theirs, inputs in _liger_cases():
        try:
            t_out, t_grads = _run(theirs, inputs)
        except Exception:  # Liger's kernels on the CPU, in Triton's interpreter: not all of them run there
            if DEVICE != "cpu":
                raise
            continue
        o_out, o_grads = _run(ours, inputs)
        compared += 1
        if len(o_out) != len(t_out):
            problems.append(f"{name}: {len(o_out)} outputs, Liger's {len(t_out)}")
            continue
        for i, (a, b) in enumerate(zip(o_out, t_out)):
            if a.shape != b.shape:
                problems.append(f"{name}: output {i} has shape {tuple(a.shape)}, Liger's {tuple(b.shape)}")
            elif rel_err(a.float(), b.float()) > 2e-5:
                problems.append(f"{name}: output {i} {rel_err(a.float(), b.float()):.2e} off Liger's")
        for i, (a, b) in enumerate(zip(o_grads, t_grads)):
            if rel_err(a, b) > 1e-4:
                problems.append(f"{name}: gradient {i} {rel_err(a, b):.2e} off Liger's")
    assert not problems, "\n".join(problems)
    assert compared >= 10
