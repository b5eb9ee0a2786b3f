"""Convergence of patched HF vision-language models against the same models unpatched, per
vision-language row of the family table: image+text batches (image tokens in input_ids, their
labels -100), tiny random configs (1 text layer, a 1-layer vision tower, 2x2-pixel patches),
fp32, built offline. A family whose classes this transformers lacks is skipped with the reason.
"""

import copy
import inspect

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.integration.test_patching import FLOOR, SPREAD_FACTOR, assert_trains_like, float64_copy, rel, train
from tigon.patching import BY_MODEL_TYPE, FAMILIES, TigonPatchError

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

VOCAB, IMAGE = 256, 250  # the image token inside the vocabulary; 251-255 other special tokens
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SPECIAL_TOKENS = dict(image_token_id=IMAGE, image_token_index=IMAGE, video_token_id=251, vision_start_token_id=252,
                      vision_end_token_id=253, boi_token_index=254, eoi_token_index=255)
BATCH, SEQ, START = 2, 12, 2  # image tokens from position START of each row
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # 8 frequencies of head dim 16
QWEN_VISION = dict(depth=1, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=2)


def _grid_inputs(cfg, grid=(1, 2, 4)):
    """Qwen-VL / GLM-4V: each row's image as patches [t h w, C tp p p] and its grid (t, h, w)."""
    v = cfg.vision_config
    t, h, w = grid
    pixels = torch.randn(BATCH * t * h * w, 3 * v.temporal_patch_size * v.patch_size**2,
                         generator=torch.Generator().manual_seed(2))
    inputs = dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid] * BATCH))
    return (t * h * w) // v.spatial_merge_size**2, inputs


def _image_inputs(n_tokens, size=8, tiles=None, **extra):
    """One [3, size, size] image per row ([tiles, 3, size, size] when given), filling n_tokens image tokens."""
    def make(cfg):
        shape = (BATCH, 3, size, size) if tiles is None else (BATCH, tiles, 3, size, size)
        pixels = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        return n_tokens, dict(pixel_values=pixels, **extra)
    return make


# model_type -> (config keywords, inputs(config) -> (image tokens per row, model inputs besides ids))
CASES = {
    "qwen2_vl": (dict(text_config=dict(TEXT, rope_parameters=MROPE),
                      vision_config=dict(QWEN_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2)), _grid_inputs),
    "qwen2_5_vl": (dict(text_config=dict(TEXT, rope_parameters=MROPE),
                        vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                           window_size=8, fullatt_block_indexes=[0])), _grid_inputs),
    "qwen3_vl": (dict(text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_section=[4, 2, 2])),
                      vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                         num_position_embeddings=16, deepstack_visual_indexes=[0])), _grid_inputs),
    "qwen3_vl_moe": (dict(text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_section=[4, 2, 2]), num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
                          vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                             num_position_embeddings=16, deepstack_visual_indexes=[0])), _grid_inputs),
    "glm4v": (dict(text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_section=[1, 1, 2],
                                                               partial_rotary_factor=0.5)),
                   vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                      image_size=8)), _grid_inputs),
    "glm4v_moe": (dict(text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_section=[1, 1, 2],
                                                                   partial_rotary_factor=0.5),
                                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=0, n_group=1, topk_group=1),
                       vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                          image_size=8)), _grid_inputs),
    "gemma3": (dict(text_config=dict(TEXT, sliding_window=8), vision_config=SIGLIP, mm_tokens_per_image=4),
               None),  # inputs: below (token_type_ids)
    "paligemma": (dict(text_config=dict(TEXT, model_type="gemma2", final_logit_softcapping=30.0),
                       vision_config=dict(SIGLIP, image_size=4), projection_dim=64), None),
    "llava": (dict(text_config=dict(TEXT, model_type="qwen2"),
                   vision_config=dict(SIGLIP, model_type="clip_vision_model", image_size=4, projection_dim=64),
                   vision_feature_layer=-1), _image_inputs(4, size=4)),
    "internvl": (dict(text_config=dict(TEXT, model_type="qwen2"),
                      vision_config=dict(SIGLIP, image_size=[8, 8], patch_size=[2, 2], use_qk_norm=True),
                      vision_feature_layer=-1), _image_inputs(4)),
    "mistral3": (dict(text_config=dict(TEXT, model_type="mistral"),
                      vision_config=dict(SIGLIP, head_dim=16), vision_feature_layer=-1, spatial_merge_size=2),
                 _image_inputs(4, image_sizes=torch.tensor([[8, 8]] * BATCH))),
    "smolvlm": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=dict(SIGLIP), scale_factor=2),
                _image_inputs(4, tiles=1)),
    "idefics3": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=dict(SIGLIP), scale_factor=2),
                 _image_inputs(4, tiles=1)),
    "llama4": (dict(text_config=dict(TEXT, intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=2,
                                     no_rope_layer_interval=4, attention_chunk_size=64),
                    vision_config=dict(SIGLIP, intermediate_size=128, vision_output_dim=32, projector_input_dim=32,
                                       projector_output_dim=32,
                                       pixel_shuffle_ratio=0.5)), _image_inputs(4)),
}


def _token_type_inputs(n_tokens, size=8):
    """Gemma 3 / PaliGemma: token_type_ids 1 at the image tokens (attended bidirectionally)."""
    def make(cfg):
        _, extra = _image_inputs(n_tokens, size)(cfg)
        types = torch.zeros(BATCH, SEQ, dtype=torch.long)
        types[:, START:START + n_tokens] = 1
        return n_tokens, dict(extra, token_type_ids=types)
    return make


CASES["gemma3"] = (CASES["gemma3"][0], _token_type_inputs(4))


def _mllama_inputs(cfg):
    """Mllama: one image token a row, its image as 2 tiles (aspect ratio 1 x 2) that the text from
    the image token on cross-attends to."""
    pixels = torch.randn(BATCH, 1, 2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    cross = torch.zeros(BATCH, SEQ, 1, 2, dtype=torch.long)
    cross[:, START:] = 1
    return 1, dict(pixel_values=pixels, aspect_ratio_ids=torch.full((BATCH, 1), 2),
                   aspect_ratio_mask=torch.ones(BATCH, 1, 2, dtype=torch.long), cross_attention_mask=cross)


# A self-attention layer, then a cross-attention one; a 1-layer tower (and 1 global layer) of 2 tiles.
CASES["mllama"] = (dict(text_config=dict(TEXT, num_hidden_layers=2, cross_attention_layers=[1]),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_global_layers=1, attention_heads=2, image_size=8, patch_size=2,
                                           max_num_tiles=2, supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
                                           intermediate_layers_indices=[0], vision_output_dim=64)),
                   _mllama_inputs)
CASES["paligemma"] = (CASES["paligemma"][0], _token_type_inputs(4, size=4))


def _gemma4_inputs(cfg, grid=4):
    """Gemma 4: each row's image as grid x grid patches [grid², 3 p p] with their (x, y)
    positions, pooled k x k into grid² / k² image tokens, attended bidirectionally in the
    sliding layers (mm_token_type_ids 1 at the image tokens)."""
    v = cfg.vision_config
    n_tokens = grid**2 // v.pooling_kernel_size**2
    pixels = torch.randn(BATCH, grid**2, 3 * v.patch_size**2, generator=torch.Generator().manual_seed(2))
    xy = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), -1).reshape(-1, 2)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, START:START + n_tokens] = 1
    positions = xy.expand(BATCH, -1, -1)
    return n_tokens, {"pixel_values": pixels, "image_position_ids": positions, "mm_token_type_ids": types}


CASES["gemma4"] = (
    {"text_config": {**TEXT, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": 8, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
                     "global_head_dim": 32, "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision"},
     "vision_config": {**SIGLIP, "num_key_value_heads": 2, "head_dim": 16, "pooling_kernel_size": 2,
                       "position_embedding_size": 16},
     "audio_config": None},
    _gemma4_inputs)
VLM_ROWS = [f for f in FAMILIES.values() if f.conditional_generation]
# Rows without a training case yet (their model needs inputs this file does not build).
NO_CASE = {}


@pytest.fixture(autouse=True)
def _unpatched_after():
    tigon.unpatch()
    yield
    tigon.unpatch()


def tiny_vlm(model_type):
    """A tiny random model of ``model_type`` (skips when this transformers lacks its family)."""
    family = BY_MODEL_TYPE[model_type]
    try:
        modeling = __import__(family.module, fromlist=["_"])
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {family.module}")
    cls = getattr(modeling, family.conditional_generation, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.conditional_generation}")
    overrides, _ = CASES[model_type]
    config = AutoConfig.for_model(model_type, **overrides)
    for name, value in SPECIAL_TOKENS.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(0)
    return cls(config).to(DEVICE)


def vlm_batch(model):
    """(input_ids, labels, image inputs): one image per row at START, labels -100 there (as a
    processor's collator sets them) and on the first prompt token of row 0."""
    n_tokens, extra = CASES[model.config.model_type][1](model.config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 240, (BATCH, SEQ), generator=gen)
    ids[:, START:START + n_tokens] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    labels[0, 0] = -100
    params = inspect.signature(type(model).forward).parameters
    if "mm_token_type_ids" in params and "image_grid_thw" in extra:  # Qwen-VL: which tokens are the image's
        extra["mm_token_type_ids"] = (ids == IMAGE).int()
    return ids.to(DEVICE), labels.to(DEVICE), {k: v.to(DEVICE) for k, v in extra.items()}


def split_zero_gradients(*runs):
    """train()'s results (the exact run first) less the gradients that are 0 in exact arithmetic
    (a vision tower's key bias without RoPE: softmax ignores a shift of all of a query's scores),
    whose values are rounding noise; those are compared absolutely."""
    zero = {n for n, g in runs[0][1].items() if g.norm() <= 1e-7}
    for n in zero:
        for run in runs[1:]:
            assert run[1][n].norm() <= 1e-7, f"gradient of {n}: {run[1][n].norm():.2e}, expected 0"
    return [(losses, {n: g for n, g in grads.items() if n not in zero}, logits) for losses, grads, logits in runs]


def as_float64(inputs):
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.parametrize("model_type", list(CASES))
def test_patched_vlm_trains_like_hf(model_type):
    model = tiny_vlm(model_type)
    patched = copy.deepcopy(model)
    exact_model = float64_copy(model)
    ids, labels, images = vlm_batch(model)
    try:
        hf = train(model, ids, labels, **images)
    except AttributeError as exc:  # HF's own forward: Llama 4's in transformers 5.24 reads a missing output field
        pytest.skip(f"HF's {type(model).__name__}.forward fails in transformers {transformers.__version__}: {exc}")
    exact = train(exact_model, ids, labels, **as_float64(images))
    report = tigon.patch(patched)
    family = BY_MODEL_TYPE[model_type]
    assert report.family == family.name
    assert {"loss", "rms_norm"} <= report.pieces(), str(report)
    assert "rope" in report.pieces() or any(p == "rope" for p, _ in report.skipped), str(report)
    ours = train(patched, ids, labels, **images)
    assert_trains_like(*split_zero_gradients(exact, hf, ours), routed=bool(family.experts))
    with torch.no_grad():  # inference on the image+text batch too
        exact_logits = exact_model(input_ids=ids, **as_float64(images)).logits
        hf_err = rel(model(input_ids=ids, **images).logits, exact_logits)
        ours_err = rel(patched(input_ids=ids, **images).logits, exact_logits)
    bound = max(SPREAD_FACTOR * hf_err, FLOOR[torch.float32])
    assert ours_err <= bound, f"image+text logits: {ours_err:.2e} > {bound:.2e} (HF's own: {hf_err:.2e})"


def test_every_vlm_row_has_a_case():
    assert {f.model_types[0] for f in VLM_ROWS} == set(CASES) | set(NO_CASE)


def test_report_names_the_sub_models_rows_and_what_hf_keeps():
    """Llava on a Qwen2 language model and a CLIP tower: the text row (qwen2) patches the language
    model, the llava row the loss and every nn.LayerNorm; the report says what stays HF's."""
    model = tiny_vlm("llava")
    report = tigon.patch(model)
    assert report.family == "llava"
    replaced = {(piece, what) for piece, what, _ in report.replaced}
    assert ("layer_norm", "nn.LayerNorm") in replaced
    assert any(piece == "rms_norm" and what.startswith("Qwen2RMSNorm") for piece, what in replaced), str(report)
    assert any(piece == "rope" and "modeling_qwen2" in what for piece, what in replaced), str(report)
    assert any(p == "loss" and w.startswith("LlavaForConditionalGeneration") for p, w in replaced), str(report)
    assert ("swiglu", "the vision tower's MLP (CLIP's, SigLIP's): not gated") in report.skipped
    assert any(p == "sub-model" and "clip_vision_model" in why for p, why in report.skipped), str(report)
    assert all("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.LayerNorm)
    tigon.unpatch(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_class_patch_of_a_vlm_row_applies_its_parts_and_leaves_torch_classes():
    """patch_gemma3_vl(): Gemma3ForConditionalGeneration's loss and, through its part gemma3, the
    language model's norms, MLP and RoPE, process-wide; torch's nn.LayerNorm is not changed
    (patched in built models only), and unpatch restores everything."""
    from transformers.models.gemma3 import modeling_gemma3

    before = torch.nn.LayerNorm.forward
    report = tigon.patch_gemma3_vl()
    assert {"loss", "rms_norm", "swiglu", "rope"} <= report.pieces(), str(report)
    assert hasattr(modeling_gemma3.Gemma3ForConditionalGeneration.forward, "_tigon")
    assert hasattr(modeling_gemma3.Gemma3RMSNorm.forward, "_tigon")
    assert torch.nn.LayerNorm.forward is before
    assert any(p == "layer_norm" and "patched in built models only" in why for p, why in report.skipped)
    tigon.unpatch()
    assert not hasattr(modeling_gemma3.Gemma3ForConditionalGeneration.forward, "_tigon")
    assert not hasattr(modeling_gemma3.Gemma3RMSNorm.forward, "_tigon")


def test_missing_vlm_piece_changes_nothing(monkeypatch):
    """A sub-model row that cannot be applied (here: a class missing from its module) raises
    TigonPatchError and leaves the model as it was, the composite row's patches included."""
    import dataclasses

    from tigon.patching import families, patcher

    model = tiny_vlm("llava")
    broken = dataclasses.replace(BY_MODEL_TYPE["qwen2"], rms_norms=("Qwen2RMSNormRenamed",))
    monkeypatch.setattr(patcher, "BY_MODEL_TYPE", dict(families.BY_MODEL_TYPE, qwen2=broken))
    with pytest.raises(TigonPatchError, match="Qwen2RMSNormRenamed"):
        tigon.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())
