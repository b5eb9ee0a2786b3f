"""The patcher's RoPE forms, LayerNorm and report columns against the HF code they replace:
each RoPE drop-in against the HF function of its form (outputs and gradients, float64
reference), the LayerNorm1P forward, a family with two RoPE functions (DeepSeek-V3) in both its
paths and as a class patch, and what a row leaves to HF in the report."""

import copy
import types

import pytest
import torch

import tigon
from tests.helpers import DEVICE, DTYPES, check_op, randn
from tests.integration.test_patch_scope import tigon_entries
from tests.integration.test_patching import assert_same_training, batch, rel, tiny_model
from tigon.patching import FAMILIES, Family, TigonPatchError, apply_family, norms, rope

transformers = pytest.importorskip("transformers")

B, H, T = 2, 3, 5  # odd sizes; k has one head (MLA's shared rotary key) or H


@pytest.fixture(autouse=True)
def _unpatched_after():
    tigon.unpatch()
    yield
    tigon.unpatch()


def angles(rot, batch=B):
    """(cos, sin) of one angle per rotated pair: [batch, T, rot / 2], fp32 as HF computes them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    pos = torch.arange(T, dtype=torch.float32).add(3.0).expand(batch, T)
    freqs = pos[..., None] * inv_freq
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def heads(dtype, n_heads, dim, extra=0):
    """[B, n, T, dim] as HF's attention makes it: a transposed view of the projection, and with
    ``extra`` the last ``dim`` columns of wider heads (MLA's split of nope / rope parts)."""
    x = randn((B, T, n_heads, extra + dim), dtype).transpose(1, 2)[..., extra:]
    return x.requires_grad_(True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_angles_form_matches_gpt_oss(dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    cos, sin = angles(8)
    q, k = heads(dtype, H, 8), heads(dtype, 1, 8)
    check_op(rope.tigon_apply_rotary_pos_emb_half_angles, apply_rotary_pos_emb,
             [q, k, cos.to(dtype), sin.to(dtype)], dtype=dtype, what="rope half_angles")


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_to_halves_form_matches_deepseek_v3_interleave(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    cos, sin = angles(8)
    cos, sin = torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)
    q, k = heads(dtype, H, 8, extra=6), heads(dtype, 1, 8, extra=6)
    check_op(rope.tigon_apply_rotary_pos_emb_pairs_to_halves, apply_rotary_pos_emb_interleave,
             [q, k, cos, sin], dtype=dtype, what="rope pairs_to_halves")


@pytest.mark.parametrize("dtype", DTYPES)
def test_complex_form_matches_deepseek_v2(dtype):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    cos, sin = angles(8)
    freqs_cis = torch.polar(torch.full_like(cos, 1.25), torch.atan2(sin, cos))  # with attention scaling
    q, k = heads(dtype, H, 8, extra=6), heads(dtype, 1, 8, extra=6)
    # HF rotates in fp32 from the float64 copies too: a float32-exact reference.
    check_op(rope.tigon_apply_rotary_emb_complex, apply_rotary_emb, [q, k, freqs_cis], dtype=dtype,
             what="rope complex", noise_floor=1e-5 if dtype == torch.float32 else None)


def test_unknown_rope_form_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown RoPE form 'spiral'; the forms are \['half'"):
        rope.rope_drop_in("spiral")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_1p_forward_matches_nemotron(dtype):
    n = 37
    forward = norms.make_layer_norm_forward(1.0)

    def ours(x, weight, bias):
        return forward(types.SimpleNamespace(weight=weight, bias=bias, eps=1e-5), x)

    def hf(x, weight, bias):
        return torch.nn.functional.layer_norm(x, (n,), weight + 1.0, bias, 1e-5)

    x = randn((3, 4, n), dtype, non_contiguous=True, requires_grad=True)
    weight = randn((n,), dtype, scale=0.1, requires_grad=True)
    bias = randn((n,), dtype, scale=0.1, requires_grad=True)
    check_op(ours, hf, [x, weight, bias], dtype=dtype, what="LayerNorm1P")


@pytest.mark.gpu
def test_layer_norm_1p_under_autocast_casts_as_hf():
    """Under CUDA autocast LayerNorm1P runs in the autocast dtype (fp32 weights, bf16 output)."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    hf = NemotronLayerNorm1P(64).to(DEVICE)
    torch.nn.init.normal_(hf.weight, std=0.1)
    x = torch.randn(8, 64, device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = hf(x)
        ours = norms.make_layer_norm_forward(1.0)(hf, x)
    assert ours.dtype == expected.dtype == torch.bfloat16
    assert rel(ours, expected) < 1e-2


def rope_spy(monkeypatch):
    calls = []
    ours = rope._rope
    monkeypatch.setattr(rope, "_rope", lambda *a, **k: calls.append(1) or ours(*a, **k))
    return calls


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_patches_both_rope_paths(interleave, monkeypatch):
    """DeepSeek-V3 calls apply_rotary_pos_emb_interleave (rope_interleave=True) or
    apply_rotary_pos_emb: both run on tigon's RoPE, with HF's results."""
    model = tiny_model("deepseek_v3", rope_interleave=interleave)
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    calls = rope_spy(monkeypatch)
    report = tigon.patch(model, rms_norm=False, swiglu=False)
    assert "apply_rotary_pos_emb_interleave, transformers" in str(report)
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, expected) < 1e-5
    assert len(calls) == model.config.num_hidden_layers


def test_class_patch_replaces_every_rope_function_of_the_row():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    originals = m.apply_rotary_pos_emb, m.apply_rotary_pos_emb_interleave
    report = tigon.patch_deepseek_v3(rms_norm=False, swiglu=False, fused_linear_cross_entropy=False)
    assert report.pieces() == {"rope"}
    assert m.apply_rotary_pos_emb is rope.tigon_apply_rotary_pos_emb
    assert m.apply_rotary_pos_emb_interleave is rope.tigon_apply_rotary_pos_emb_pairs_to_halves
    tigon.unpatch()
    assert (m.apply_rotary_pos_emb, m.apply_rotary_pos_emb_interleave) == originals


def test_rope_form_with_another_signature_is_refused():
    wrong = Family("llama_complex", ("nope",), "transformers.models.llama.modeling_llama", "LlamaForCausalLM",
                   rope_form="complex")
    with pytest.raises(TigonPatchError, match=r"takes \['q', 'k', 'cos', 'sin'.*not \(xq, xk, freqs_cis, \.\.\.\)"):
        apply_family(wrong)
    assert tigon.unpatch() == 0


def test_layer_norm_and_relu_squared_mlp_patch_with_hf_outputs():
    model = tiny_model("nemotron")
    ids, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    report = tigon.patch(model)
    assert {"layer_norm", "swiglu", "rope", "loss"} <= report.pieces()
    assert "forward" in vars(model.model.layers[0].mlp) and "forward" in vars(model.model.norm)
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, expected) < 1e-5
    tigon.unpatch(model)
    assert "layer_norm" not in tigon.patch(model, layer_norm=False).pieces()
    assert "forward" not in vars(model.model.norm)


def test_layer_norm_over_several_dims_is_refused():
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    model = tiny_model("nemotron")
    model.model.norm = NemotronLayerNorm1P((4, 16)).to(DEVICE)
    with pytest.raises(TigonPatchError, match=r"NemotronLayerNorm1P normalises over \(4, 16\)"):
        tigon.patch(model)
    assert tigon_entries(model) == []


def test_relu_squared_mlp_refuses_another_activation():
    model = tiny_model("nemotron", hidden_act="relu")
    with pytest.raises(TigonPatchError, match="NemotronMLP: activation .* is not ReLU²"):
        tigon.patch(model)
    assert tigon_entries(model) == []  # nothing was changed
    assert "swiglu" not in tigon.patch(model, swiglu=False).pieces()


def test_report_lists_what_the_row_leaves_to_hf():
    left = set(FAMILIES["nemotron_h"].left_to_hf)
    assert {piece for piece, _ in left} == {"rms_norm", "swiglu"}
    model = tiny_model("nemotron_h")
    assert left <= set(tigon.patch(model).skipped)
    tigon.unpatch(model)
    skipped = tigon.patch(model, swiglu=False).skipped
    assert not any(piece == "swiglu" for piece, _ in skipped)  # not asked for: not listed
    assert {entry for entry in left if entry[0] == "rms_norm"} <= set(skipped)


def gemma4_modeling():
    return pytest.importorskip("transformers.models.gemma4.modeling_gemma4",
                               reason=f"transformers {transformers.__version__} has no Gemma 4")


def proportional_angles(dim, rotated):
    """Gemma 4's proportional RoPE tables [B, T, dim]: ``rotated`` of the dim / 2 angles turn,
    the others are 0 (cos 1, sin 0), each angle twice (cat(f, f)) as rotate_half reads them."""
    cos, sin = angles(2 * rotated)
    still = dim // 2 - rotated
    cos = torch.cat((cos, torch.ones(B, T, still, device=DEVICE)), -1)
    sin = torch.cat((sin, torch.zeros(B, T, still, device=DEVICE)), -1)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_single_form_matches_gemma4(dtype, unsqueeze_dim):
    """Gemma 4 rotates q and k in separate calls, apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim),
    a quarter of the angles turning (proportional RoPE)."""
    apply_rotary_pos_emb = gemma4_modeling().apply_rotary_pos_emb
    cos, sin = (t.to(dtype) for t in proportional_angles(16, 2))
    if unsqueeze_dim == 1:
        x = heads(dtype, H, 16)
    else:  # [B, T, H, D]: a view of the projection, as the attention makes it
        x = randn((B, T, H * 16), dtype).view(B, T, H, 16).requires_grad_(True)

    def hf(x, cos, sin):
        return apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def ours(x, cos, sin):
        return rope.tigon_apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=unsqueeze_dim)

    check_op(ours, hf, [x, cos, sin], dtype=dtype, what="rope single")


def test_single_form_under_gemma4_vision_multidimensional_rope(monkeypatch):
    """A class patch makes the module's apply_rotary_pos_emb tigon's, which the vision tower's
    apply_multidimensional_rope calls on each axis's slice of the head (strided views)."""
    modeling = gemma4_modeling()
    cos, sin = proportional_angles(8, 4)
    cos, sin = torch.cat((cos, cos.flip(1)), -1), torch.cat((sin, sin.flip(1)), -1)  # (x, y): [B, T, 16]
    positions = torch.zeros(B, T, 2, dtype=torch.long, device=DEVICE)
    x = randn((B, T, H * 16), torch.float32).view(B, T, H, 16).requires_grad_(True)

    def hf(x, cos, sin):
        return modeling.apply_multidimensional_rope(x, cos, sin, positions)

    def ours(x, cos, sin):
        with monkeypatch.context() as m:
            m.setattr(modeling, "apply_rotary_pos_emb", rope.tigon_apply_rotary_pos_emb_single)
            return modeling.apply_multidimensional_rope(x, cos, sin, positions)

    check_op(ours, hf, [x, cos, sin], dtype=torch.float32, what="rope single (2-D)")


# Gemma 4's other layer forms (the training test's model has none of them): its MoE block (the
# dense MLP and the experts side by side), shared KV with the sharing layer's double-wide MLP,
# and k = v on the full-attention layers.
GEMMA4_VARIANTS = {
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "shared_kv": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                  "num_kv_shared_layers": 1, "use_double_wide_mlp": True},
    "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
}


def one_step(model, ids, labels):
    """(loss, gradients) of one training call and the logits before any update (train()'s
    results without optimizer steps: AdamW's first update is about lr * sign(gradient), which a
    gradient entry within rounding of 0 may flip, and these models have such entries)."""
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return [loss.item()], grads, logits


@pytest.mark.parametrize("variant", list(GEMMA4_VARIANTS))
def test_gemma4_layer_variants_match_hf(variant):
    model = tiny_model("gemma4_text", **GEMMA4_VARIANTS[variant])
    patched = copy.deepcopy(model)
    ids, labels = batch(model.config.vocab_size)
    ref = one_step(model, ids, labels)
    report = tigon.patch(patched)
    assert {"rms_norm", "swiglu", "rope", "loss"} <= report.pieces(), str(report)
    layers = patched.model.layers
    if variant == "moe":
        assert any(w.startswith("Gemma4TextExperts") for p, w, _ in report.replaced if p == "swiglu"), str(report)
    if variant == "shared_kv":
        assert layers[2].mlp.down_proj.in_features == 2 * model.config.intermediate_size
        assert "forward" in vars(layers[2].mlp) and "forward" in vars(layers[2].self_attn)
    assert_same_training(ref, one_step(patched, ids, labels))


def test_gemma4_audio_tower_norms_train_like_hf():
    """Gemma 4's audio tower, whose Gemma4RMSNorm instances the language model's row patches in a
    multimodal model: outputs and gradients as HF's."""
    modeling = gemma4_modeling()
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma4_audio", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  subsampling_conv_channels=[8, 4], output_proj_dims=64, conv_kernel_size=3,
                                  attention_chunk_size=4, attention_context_left=5)
    torch.manual_seed(0)
    model = modeling.Gemma4AudioModel(config).to(DEVICE)
    patched = copy.deepcopy(model)
    assert "rms_norm" in apply_family(FAMILIES["gemma4"], model=patched).pieces()
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(2, 24, 8, generator=gen).to(DEVICE)  # [B, frames, mel bins]
    mask = torch.ones(2, 24, dtype=torch.bool, device=DEVICE)
    mask[1, 20:] = False
    cotangent = None

    def run(m):
        nonlocal cotangent
        out = m(input_features=features, attention_mask=mask).last_hidden_state
        if cotangent is None:
            cotangent = torch.randn(out.shape, generator=gen).to(DEVICE)
        out.backward(cotangent)
        return out, {n: p.grad for n, p in m.named_parameters()}

    (ref, ref_grads), (ours, our_grads) = run(model), run(patched)
    assert rel(ours, ref) < 1e-5
    for name, g in ref_grads.items():
        assert rel(our_grads[name], g) < 1e-4, name


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v2", "deepseek_v3", "nemotron", "gemma4_text"])
def test_new_forms_trace_without_graph_breaks(model_type):
    """The RoPE forms, LayerNorm1P and the ReLU² MLP under torch.compile's tracer: one graph, as HF's."""
    model = tiny_model(model_type, output_router_logits=False) if model_type == "gpt_oss" else tiny_model(model_type)
    ids, labels = batch(model.config.vocab_size)

    def loss(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    torch._dynamo.reset()
    assert torch._dynamo.explain(loss)(ids, labels).graph_break_count == 0  # HF's own model traces whole
    torch._dynamo.reset()
    report = tigon.patch(model)
    assert {"rope", "loss"} <= report.pieces()
    explained = torch._dynamo.explain(loss)(ids, labels)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    torch._dynamo.reset()
