"""Model shapes by name, random-init stand-ins for real checkpoints: the benchmarks' models, and
names ``tigon plan`` and ``tigon bench --memory-timeline`` take offline in place of a hub id.
Each entry: (model_type, config keyword arguments)."""

from __future__ import annotations

SHAPES = {
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256.
    "llama-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                               max_position_embeddings=4096)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                                   max_position_embeddings=4096)),
    # Gemma-2-2B: head_dim 256, final logit softcap 30, GeGLU (gelu tanh).
    "gemma2-2b": ("gemma2", dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True,
                                 max_position_embeddings=4096)),
    # Llama-3.1-8B.
    "llama-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                               max_position_embeddings=4096)),
    # Qwen2.5-VL-3B-Instruct: 3.75B parameters (text 3.09B with the tied embedding, vision tower 0.67B).
    "qwen2.5-vl-3b": ("qwen2_5_vl", dict(
        text_config=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         intermediate_size=11008, vocab_size=151936, rms_norm_eps=1e-6,
                         max_position_embeddings=128000,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        tie_word_embeddings=True)),
    # Qwen3-30B-A3B's layers (head_dim 128, 128 experts of 768, top-8), 6 of its 48: 4.36B parameters
    # (3.74B in the layers, 0.62B in the untied embedding and head), so that HF's own path fits one
    # 80 GB H100 at batch 4 x 1024 (bf16 weights, gradients and AdamW state: 35 GB). The router's aux
    # loss as HF has it by default (output_router_logits False: not added).
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=6, num_attention_heads=32,
                                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                    moe_intermediate_size=768,
                                    intermediate_size=6144, norm_topk_prob=True, vocab_size=151936,
                                    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096,
                                    rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}


def shape_config(name: str):
    """The transformers config of the shape ``name``."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; the shapes are {sorted(SHAPES)}")
    model_type, kwargs = SHAPES[name]
    return AutoConfig.for_model(model_type, **kwargs)
