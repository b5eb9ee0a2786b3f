import pytest
import torch

from tests.helpers import DEVICE, DTYPES, check_module, check_op, pick, randn, rel_err
from tigon import functional as TF
from tigon.nn import (
    TigonFusedAddRMSNorm,
    TigonGeGLUMLP,
    TigonLayerNorm,
    TigonRMSNorm,
    TigonSwiGLUMLP,
)
from tigon.reference import fused_add_rms_norm_ref

transformers = pytest.importorskip("transformers")
from transformers.models.gemma import modeling_gemma  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

HIDDEN = pick(48, 2048)
TOKENS = pick((2, 5), (4, 1024))
# Matmuls inside the MLPs: the fp32 case may run at tf32 precision on the GPU.
MLP_TOL = {torch.float32: 1e-3, torch.bfloat16: 1.5e-2}


def llama_config(**kw):
    base = dict(hidden_size=HIDDEN, intermediate_size=pick(40, 5632), num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    base.update(kw)
    return modeling_llama.LlamaConfig(**base)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_matches_hf_llama(dtype):
    theirs = modeling_llama.LlamaRMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.1)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    check_module(TigonRMSNorm(HIDDEN, eps=1e-5), theirs, [x], dtype=dtype, what="TigonRMSNorm vs LlamaRMSNorm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_matches_hf_gemma(dtype):
    theirs = modeling_gemma.GemmaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.1)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    ours = TigonRMSNorm(HIDDEN, eps=1e-6, offset=1.0, casting="gemma")
    check_module(ours, theirs, [x], dtype=dtype, what="TigonRMSNorm vs GemmaRMSNorm")


class PlainRMSNorm(torch.nn.Module):
    """RMSNorm computed in the input's dtype (Liger's reference for casting "none")."""

    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_none_casting(dtype):
    theirs = PlainRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.1)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    ours = TigonRMSNorm(HIDDEN, eps=1e-6, casting="none")
    check_module(ours, theirs, [x], dtype=dtype, what="TigonRMSNorm(casting='none') vs plain RMSNorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
def test_rms_norm_module_without_weight_matches_torch(dtype, casting):
    """elementwise_affine=False: no parameter, as torch's nn.RMSNorm."""
    theirs = torch.nn.RMSNorm(HIDDEN, eps=1e-6, elementwise_affine=False)
    ours = TigonRMSNorm(HIDDEN, eps=1e-6, casting=casting, elementwise_affine=False)
    assert ours.weight is None and not list(ours.parameters())
    assert "elementwise_affine=False" in repr(ours)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    check_module(ours, theirs, [x], dtype=dtype, what="TigonRMSNorm vs nn.RMSNorm (no weight)")
    y, s = TigonFusedAddRMSNorm(HIDDEN, casting=casting, elementwise_affine=False)(x, x)
    assert y.shape == s.shape == x.shape


def test_rms_norm_module_bad_options():
    with pytest.raises(ValueError, match="casting must be one of 'llama', 'gemma', 'none'"):
        TigonRMSNorm(HIDDEN, casting="bert")
    with pytest.raises(ValueError, match="elementwise_affine=False"):
        TigonRMSNorm(HIDDEN, offset=1.0, elementwise_affine=False)
    with pytest.raises(TypeError):
        TigonRMSNorm(HIDDEN, in_place=True)  # the option is called inplace


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", [dict(elementwise_affine=False), dict(bias=False)])
def test_layer_norm_module_without_parameters_matches_torch(dtype, options):
    theirs = torch.nn.LayerNorm(HIDDEN, **options)
    x = randn((*TOKENS, HIDDEN), dtype, shift=3.0, requires_grad=True)
    check_module(TigonLayerNorm(HIDDEN, **options), theirs, [x], dtype=dtype, what=f"TigonLayerNorm({options})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_module_matches_torch(dtype):
    theirs = torch.nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.1)
        theirs.bias.normal_(0.0, 0.1)
    x = randn((*TOKENS, HIDDEN), dtype, shift=3.0, requires_grad=True)
    check_module(TigonLayerNorm(HIDDEN), theirs, [x], dtype=dtype, what="TigonLayerNorm vs nn.LayerNorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_swiglu_mlp_matches_hf_llama(dtype, mlp_bias):
    config = llama_config(mlp_bias=mlp_bias)
    theirs = modeling_llama.LlamaMLP(config)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    check_module(TigonSwiGLUMLP(config), theirs, [x], dtype=dtype, tol=MLP_TOL[dtype],
                 what="TigonSwiGLUMLP vs LlamaMLP")


def spy(fn, calls):
    """fn, recording each call."""
    return lambda *args, **kwargs: calls.append(1) or fn(*args, **kwargs)


def test_swiglu_mlp_under_checkpoint_keeps_only_its_input(monkeypatch):
    """Inside torch.utils.checkpoint the module takes tigon::glu_mlp (keeps only x) and still
    matches HF's MLP."""
    import torch.utils.checkpoint as ckpt

    from tigon.ops import glu_mlp

    config = llama_config()
    theirs = modeling_llama.LlamaMLP(config).to(DEVICE)
    ours = TigonSwiGLUMLP(config).to(DEVICE)
    ours.load_state_dict(theirs.state_dict())
    x = randn((*TOKENS, HIDDEN), torch.float32, requires_grad=True)
    forms = []
    monkeypatch.setattr(glu_mlp, "glu_mlp_op", spy(glu_mlp.glu_mlp_op, forms))
    out = ckpt.checkpoint(lambda t: t + ours(t), x, use_reentrant=False)
    out.sum().backward()
    assert len(forms) == 2  # the forward and checkpoint's recomputation, both keeping only x
    x_ref = x.detach().clone().requires_grad_(True)
    (x_ref + theirs(x_ref)).sum().backward()
    # Relative Frobenius errors: fp32 matmuls may run in tf32 on the GPU.
    assert rel_err(x.grad, x_ref.grad) <= 1e-3
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-3, name


@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_mlp_matches_hf_gemma(dtype):
    config = modeling_gemma.GemmaConfig(hidden_size=HIDDEN, intermediate_size=pick(40, 5632), num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=16, num_hidden_layers=1, vocab_size=64,
                                        hidden_activation="gelu_pytorch_tanh")
    theirs = modeling_gemma.GemmaMLP(config)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    ours = TigonGeGLUMLP(config)
    assert ours.activation == "gelu_tanh"
    check_module(ours, theirs, [x], dtype=dtype, tol=MLP_TOL[dtype], what="TigonGeGLUMLP vs GemmaMLP")


def test_mlp_refuses_a_config_with_another_activation():
    with pytest.raises(ValueError, match="TigonSwiGLUMLP computes silu, but the activation is 'gelu_erf'"):
        TigonSwiGLUMLP(llama_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="TigonGeGLUMLP computes gelu_tanh / gelu_erf"):
        TigonGeGLUMLP(llama_config(hidden_act="silu"))
    with pytest.raises(ValueError, match="activation 'relu' is not one tigon fuses"):
        TigonSwiGLUMLP(llama_config(hidden_act="relu"))
    exact = TigonGeGLUMLP(llama_config(hidden_act="gelu"))
    assert exact.activation == "gelu_erf"
    assert "TigonSwiGLUMLP" in repr(TigonSwiGLUMLP(hidden_size=8, intermediate_size=16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_module(dtype):
    module = TigonFusedAddRMSNorm(HIDDEN, eps=1e-5).to(DEVICE)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    r = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    w = randn((HIDDEN,), dtype, shift=1.0, requires_grad=True)
    with torch.no_grad():
        module.weight.data = w.detach().clone()
    y, s = module(x, r)
    ref_y, ref_s = fused_add_rms_norm_ref(x.detach(), r.detach(), w.detach(), eps=1e-5)
    assert torch.equal(s, ref_s)
    check_op(lambda x, r, w: TF.fused_add_rms_norm(x, r, w, eps=1e-5),
             lambda x, r, w: fused_add_rms_norm_ref(x, r, w, eps=1e-5), [x, r, w], dtype=dtype)
    assert torch.allclose(y.float(), ref_y.float(), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_hf_with_hf_rotary_embedding(dtype):
    config = llama_config(max_position_embeddings=256)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, HIDDEN // 4
    batch, tokens = TOKENS
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(DEVICE)
    x = torch.zeros(batch, tokens, HIDDEN, device=DEVICE, dtype=dtype)
    position_ids = torch.arange(tokens, device=DEVICE)[None].expand(batch, -1)
    cos, sin = rotary(x, position_ids)
    q = randn((batch, tokens, heads, head_dim), dtype).transpose(1, 2).requires_grad_()
    k = randn((batch, tokens, kv_heads, head_dim), dtype).transpose(1, 2).requires_grad_()
    check_op(lambda q, k: TF.apply_rotary_pos_emb(q, k, cos, sin),
             lambda q, k: modeling_llama.apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype)),
             [q, k], dtype=dtype, what="rope vs HF apply_rotary_pos_emb")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_with_falcon_h1_multipliers(dtype):
    """Falcon-H1's MLP scales the gate's input and the MLP's output (config.mlp_multipliers)."""
    from transformers.models.falcon_h1 import modeling_falcon_h1

    config = llama_config(mlp_bias=True)
    config.mlp_multipliers = [0.6, 1.7]
    theirs = modeling_falcon_h1.FalconH1MLP(config)
    ours = TigonSwiGLUMLP(config)
    assert (ours.gate_multiplier, ours.down_multiplier) == (0.6, 1.7) and "gate_multiplier=0.6" in repr(ours)
    x = randn((*TOKENS, HIDDEN), dtype, requires_grad=True)
    check_module(ours, theirs, [x], dtype=dtype, tol=MLP_TOL[dtype], what="TigonSwiGLUMLP vs FalconH1MLP")
