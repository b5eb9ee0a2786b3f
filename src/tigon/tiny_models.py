"""Tiny random Hugging Face models of every family row, built offline from configs: what the
patching tests train and what ``tigon doctor`` patches.

Text rows: ``tiny_model(model_type)`` (a *ForCausalLM of ``SIZES[size]`` plus what the family
needs, ``extra_options``) and ``text_batch``. Vision-language rows: ``tiny_vlm(model_type)`` (one
text layer, a one-layer vision tower, 2x2-pixel patches; ``VLM_CASES``) and ``vlm_batch`` (one
image a row). Where the installed transformers cannot build a model (a family newer or older than
it), the builders raise ``ModelUnavailable`` with the reason. transformers is imported only when
a model is built.
"""

from __future__ import annotations

import inspect

import torch

from tigon.patching import BY_MODEL_TYPE

# Model sizes: "tiny" (fast in Triton's interpreter: the tests' CPU size, and the doctor's), "small"
# (the tests' GPU size).
SIZES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


class ModelUnavailable(LookupError):
    """The installed transformers cannot build this model (it lacks the model type or its class)."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelUnavailable('transformers is not installed: pip install "tigon[hf]"') from None
    return transformers


def _size(size) -> dict:
    if isinstance(size, dict):
        return size
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)} or a dict of config values, got {size!r}")
    return SIZES[size]


def extra_options(size="tiny") -> dict[str, dict]:
    """What a tiny model of each text family needs beyond ``size`` (the options each family's patch
    handles: small expert counts, a pad id inside the vocab, dropout 0), by model type."""
    size = _size(size)
    layers = size["num_hidden_layers"]  # even: the layer kinds below alternate, one a layer
    linear_full = ["linear_attention", "full_attention"] * (layers // 2)
    sliding_full = ["sliding_attention", "full_attention"] * (layers // 2)
    return {
        # The experts' intermediate size small, as the other MoE rows' (each column tile of tigon's
        # fused experts op costs interpreter time).
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, output_router_logits=True,
                        router_aux_loss_coef=0.1),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                          output_router_logits=True, router_aux_loss_coef=0.1),
        "gemma2": dict(final_logit_softcapping=30.0, sliding_window=8),
        "gemma3_text": dict(final_logit_softcapping=30.0, sliding_window=8),
        "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                        attention_multiplier=0.25),
        "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0),
        "glm4": dict(partial_rotary_factor=0.5, pad_token_id=0),
        "smollm3": dict(pad_token_id=0),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64,
                          output_router_logits=True, router_aux_loss_coef=0.1),
        "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_group=1, topk_group=1, pad_token_id=0),
        "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),  # dropout draws differ between runs
        "llama4_text": dict(intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=2,
                            no_rope_layer_interval=2, attention_chunk_size=8, pad_token_id=0),
        "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8,
                    "output_router_logits": True, "router_aux_loss_coef": 0.1},
        "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 64, "layer_types": linear_full,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8, "partial_rotary_factor": 0.5, "output_router_logits": True,
                       "router_aux_loss_coef": 0.1},
        "qwen3_5_text": {"layer_types": linear_full, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
        "qwen3_5_moe_text": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "shared_expert_intermediate_size": 64, "layer_types": linear_full,
                             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                             "linear_value_head_dim": 8, "output_router_logits": True, "router_aux_loss_coef": 0.1},
        "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2, "intermediate_size": 32},
        # MLA: head_dim is the rotary part; every head has its own k and v.
        "deepseek_v2": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
                        "num_key_value_heads": size["num_attention_heads"]},
        "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
                        "num_key_value_heads": size["num_attention_heads"], "n_group": 1, "topk_group": 1},
        "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                      "mamba_chunk_size": 8, "mlp_multipliers": [0.5, 2.0], "lm_head_multiplier": 0.5,
                      "embedding_multiplier": 2.0},
        "nemotron_h": {"num_hidden_layers": 4, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                       "n_groups": 1, "chunk_size": 8, "n_routed_experts": 4, "moe_intermediate_size": 32,
                       "moe_shared_expert_intermediate_size": 32},
        # Layer 0 sparsifies its MLP's gate (activation_sparsity_pattern), as the first layers of Gemma 3n do.
        "gemma3n_text": {"vocab_size_per_layer_input": size["vocab_size"], "hidden_size_per_layer_input": 8,
                         "num_kv_shared_layers": 0, "laurel_rank": 8, "altup_num_inputs": 2, "sliding_window": 8,
                         "layer_types": sliding_full, "activation_sparsity_pattern": [0.95] + [0.0] * (layers - 1)},
        # Per-layer inputs; the full-attention layer's wider heads with proportional RoPE (a quarter rotated).
        # Its MoE block, k = v, shared KV and double-wide MLP: tests/integration/test_patching_forms.py.
        # (Gemma 4 looks every token up in the per-layer table: vocab_size_per_layer_input is the vocab.)
        "gemma4_text": {"vocab_size_per_layer_input": size["vocab_size"], "hidden_size_per_layer_input": 8,
                        "sliding_window": 8, "global_head_dim": 2 * size["head_dim"], "final_logit_softcapping": 30.0,
                        "layer_types": sliding_full},
    }


def tiny_config(model_type: str, size="tiny", **overrides):
    """The config of a tiny ``model_type`` model: ``size`` (a name of SIZES or a dict), then the
    family's extra options, then ``overrides``."""
    transformers = _transformers()
    if model_type not in transformers.CONFIG_MAPPING:  # a family newer than the installed transformers
        raise ModelUnavailable(f"transformers {transformers.__version__} has no model type {model_type!r}")
    values = _size(size)
    return transformers.AutoConfig.for_model(model_type, **{**values, **extra_options(values).get(model_type, {}),
                                                            **overrides})


def tiny_model(model_type: str, size="tiny", device="cpu", **overrides):
    """A tiny random *ForCausalLM of ``model_type`` (fp32, on ``device``; the weights drawn after
    ``torch.manual_seed(0)``, so two builds are equal)."""
    config = tiny_config(model_type, size, **overrides)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device)


def text_batch(vocab: int, rows: int, seq: int, device="cpu"):
    """(input_ids, labels) [rows, seq] of random tokens; the first third of row 0's labels -100
    (a masked prompt)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[0, : seq // 3] = -100
    return ids.to(device), labels.to(device)


# ---- vision-language rows ----

VLM_VOCAB, IMAGE = 256, 250  # the image token inside the vocabulary; 251-255 other special tokens
VLM_TEXT = dict(vocab_size=VLM_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
SPECIAL_TOKENS = dict(image_token_id=IMAGE, image_token_index=IMAGE, video_token_id=251, vision_start_token_id=252,
                      vision_end_token_id=253, boi_token_index=254, eoi_token_index=255)
VLM_BATCH, VLM_SEQ, START = 2, 12, 2  # image tokens from position START of each row
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # 8 frequencies of head dim 16
QWEN_VISION = dict(depth=1, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=2)


def _grid_inputs(cfg, grid=(1, 2, 4)):
    """Qwen-VL / GLM-4V: each row's image as patches [t h w, C tp p p] and its grid (t, h, w)."""
    v = cfg.vision_config
    t, h, w = grid
    pixels = torch.randn(VLM_BATCH * t * h * w, 3 * v.temporal_patch_size * v.patch_size**2,
                         generator=torch.Generator().manual_seed(2))
    inputs = dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid] * VLM_BATCH))
    return (t * h * w) // v.spatial_merge_size**2, inputs


def _image_inputs(n_tokens, size=8, tiles=None, **extra):
    """One [3, size, size] image per row ([tiles, 3, size, size] when given), filling n_tokens image tokens."""
    def make(cfg):
        shape = (VLM_BATCH, 3, size, size) if tiles is None else (VLM_BATCH, tiles, 3, size, size)
        pixels = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        return n_tokens, dict(pixel_values=pixels, **extra)
    return make


def _token_type_inputs(n_tokens, size=8):
    """Gemma 3 / PaliGemma: token_type_ids 1 at the image tokens (attended bidirectionally)."""
    def make(cfg):
        _, extra = _image_inputs(n_tokens, size)(cfg)
        types = torch.zeros(VLM_BATCH, VLM_SEQ, dtype=torch.long)
        types[:, START:START + n_tokens] = 1
        return n_tokens, dict(extra, token_type_ids=types)
    return make


def _mllama_inputs(cfg):
    """Mllama: one image token a row, its image as 2 tiles (aspect ratio 1 x 2) that the text from
    the image token on cross-attends to."""
    pixels = torch.randn(VLM_BATCH, 1, 2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    cross = torch.zeros(VLM_BATCH, VLM_SEQ, 1, 2, dtype=torch.long)
    cross[:, START:] = 1
    return 1, dict(pixel_values=pixels, aspect_ratio_ids=torch.full((VLM_BATCH, 1), 2),
                   aspect_ratio_mask=torch.ones(VLM_BATCH, 1, 2, dtype=torch.long), cross_attention_mask=cross)


def _gemma4_inputs(cfg, grid=4):
    """Gemma 4: each row's image as grid x grid patches [grid², 3 p p] with their (x, y)
    positions, pooled k x k into grid² / k² image tokens, attended bidirectionally in the
    sliding layers (mm_token_type_ids 1 at the image tokens)."""
    v = cfg.vision_config
    n_tokens = grid**2 // v.pooling_kernel_size**2
    pixels = torch.randn(VLM_BATCH, grid**2, 3 * v.patch_size**2, generator=torch.Generator().manual_seed(2))
    xy = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), -1).reshape(-1, 2)
    types = torch.zeros(VLM_BATCH, VLM_SEQ, dtype=torch.long)
    types[:, START:START + n_tokens] = 1
    positions = xy.expand(VLM_BATCH, -1, -1)
    return n_tokens, {"pixel_values": pixels, "image_position_ids": positions, "mm_token_type_ids": types}


# model_type -> (config keywords, inputs(config) -> (image tokens per row, model inputs besides ids))
VLM_CASES = {
    "qwen2_vl": (dict(text_config=dict(VLM_TEXT, rope_parameters=MROPE),
                      vision_config=dict(QWEN_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2)), _grid_inputs),
    "qwen2_5_vl": (dict(text_config=dict(VLM_TEXT, rope_parameters=MROPE),
                        vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                           window_size=8, fullatt_block_indexes=[0])), _grid_inputs),
    "qwen3_vl": (dict(text_config=dict(VLM_TEXT, rope_parameters=dict(MROPE, mrope_section=[4, 2, 2])),
                      vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                         num_position_embeddings=16, deepstack_visual_indexes=[0])), _grid_inputs),
    "qwen3_vl_moe": (dict(text_config=dict(VLM_TEXT, rope_parameters=dict(MROPE, mrope_section=[4, 2, 2]),
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           decoder_sparse_step=1),
                          vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                             num_position_embeddings=16, deepstack_visual_indexes=[0])),
                     _grid_inputs),
    "glm4v": (dict(text_config=dict(VLM_TEXT, rope_parameters=dict(MROPE, mrope_section=[1, 1, 2],
                                                                   partial_rotary_factor=0.5)),
                   vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                      image_size=8)), _grid_inputs),
    "glm4v_moe": (dict(text_config=dict(VLM_TEXT, rope_parameters=dict(MROPE, mrope_section=[1, 1, 2],
                                                                       partial_rotary_factor=0.5),
                                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=0, n_group=1, topk_group=1),
                       vision_config=dict(QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                                          image_size=8)), _grid_inputs),
    "gemma3": (dict(text_config=dict(VLM_TEXT, sliding_window=8), vision_config=SIGLIP, mm_tokens_per_image=4),
               _token_type_inputs(4)),
    "paligemma": (dict(text_config=dict(VLM_TEXT, model_type="gemma2", final_logit_softcapping=30.0),
                       vision_config=dict(SIGLIP, image_size=4), projection_dim=64), _token_type_inputs(4, size=4)),
    "llava": (dict(text_config=dict(VLM_TEXT, model_type="qwen2"),
                   vision_config=dict(SIGLIP, model_type="clip_vision_model", image_size=4, projection_dim=64),
                   vision_feature_layer=-1), _image_inputs(4, size=4)),
    "internvl": (dict(text_config=dict(VLM_TEXT, model_type="qwen2"),
                      vision_config=dict(SIGLIP, image_size=[8, 8], patch_size=[2, 2], use_qk_norm=True),
                      vision_feature_layer=-1), _image_inputs(4)),
    "mistral3": (dict(text_config=dict(VLM_TEXT, model_type="mistral"),
                      vision_config=dict(SIGLIP, head_dim=16), vision_feature_layer=-1, spatial_merge_size=2),
                 _image_inputs(4, image_sizes=torch.tensor([[8, 8]] * VLM_BATCH))),
    "smolvlm": (dict(text_config=dict(VLM_TEXT, model_type="llama"), vision_config=dict(SIGLIP), scale_factor=2),
                _image_inputs(4, tiles=1)),
    "idefics3": (dict(text_config=dict(VLM_TEXT, model_type="llama"), vision_config=dict(SIGLIP), scale_factor=2),
                 _image_inputs(4, tiles=1)),
    "llama4": (dict(text_config=dict(VLM_TEXT, intermediate_size_mlp=128, num_local_experts=2,
                                     interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=64),
                    vision_config=dict(SIGLIP, intermediate_size=128, vision_output_dim=32, projector_input_dim=32,
                                       projector_output_dim=32, pixel_shuffle_ratio=0.5)), _image_inputs(4)),
    # A self-attention layer, then a cross-attention one; a 1-layer tower (and 1 global layer) of 2 tiles.
    "mllama": (dict(text_config=dict(VLM_TEXT, num_hidden_layers=2, cross_attention_layers=[1]),
                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_global_layers=1, attention_heads=2, image_size=8, patch_size=2,
                                       max_num_tiles=2, supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
                                       intermediate_layers_indices=[0], vision_output_dim=64)),
               _mllama_inputs),
    "gemma4": ({"text_config": {**VLM_TEXT, "num_hidden_layers": 2,
                                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                                "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VLM_VOCAB,
                                "global_head_dim": 32, "final_logit_softcapping": 30.0,
                                "use_bidirectional_attention": "vision"},
                "vision_config": {**SIGLIP, "num_key_value_heads": 2, "head_dim": 16, "pooling_kernel_size": 2,
                                  "position_embedding_size": 16},
                "audio_config": None},
               _gemma4_inputs),
}


def tiny_vlm(model_type: str, device="cpu"):
    """A tiny random image+text model of the vision-language row of ``model_type`` (a key of
    VLM_CASES): its *ForConditionalGeneration class, fp32, on ``device``, weights drawn after
    ``torch.manual_seed(0)``."""
    transformers = _transformers()
    family = BY_MODEL_TYPE[model_type]
    try:
        modeling = __import__(family.module, fromlist=["_"])
    except ImportError:
        raise ModelUnavailable(f"transformers {transformers.__version__} has no {family.module}") from None
    cls = getattr(modeling, family.conditional_generation, None)
    if cls is None:
        raise ModelUnavailable(f"transformers {transformers.__version__} has no {family.conditional_generation}")
    overrides, _ = VLM_CASES[model_type]
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    for name, value in SPECIAL_TOKENS.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(0)
    return cls(config).to(device)


def vlm_batch(model, device="cpu"):
    """(input_ids, labels, image inputs) for a ``tiny_vlm`` model: one image per row at START,
    labels -100 there (as a processor's collator sets them) and on the first prompt token of row 0."""
    n_tokens, extra = VLM_CASES[model.config.model_type][1](model.config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 240, (VLM_BATCH, VLM_SEQ), generator=gen)
    ids[:, START:START + n_tokens] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    labels[0, 0] = -100
    params = inspect.signature(type(model).forward).parameters
    if "mm_token_type_ids" in params and "image_grid_thw" in extra:  # Qwen-VL: which tokens are the image's
        extra["mm_token_type_ids"] = (ids == IMAGE).int()
    return ids.to(device), labels.to(device), {k: v.to(device) for k, v in extra.items()}
