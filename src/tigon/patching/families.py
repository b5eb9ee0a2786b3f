"""The table of Hugging Face model families the patcher knows: one row per family.

A row names the HF pieces tigon replaces; the mechanisms that replace them live in the
package's other modules (norms, mlp, rope, causal_lm, ...) and are shared by every row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # patch_<name>()
    model_types: tuple[str, ...]  # config.model_type values
    module: str  # the modeling module, e.g. transformers.models.llama.modeling_llama
    causal_lm: str | None  # the *ForCausalLM class (None: a vision-language row without one)
    rms_norms: tuple[str, ...] = ()  # RMSNorm classes (every norm of the model, incl. q/k norms)
    rms_casting: str = "llama"  # "llama": normalise in fp32, cast, times weight; "gemma": fp32 throughout
    rms_offset: float = 0.0  # 1.0: the weight is applied as (1 + weight)
    # LayerNorm classes computing F.layer_norm(x, weight + layer_norm_offset, bias, eps), under
    # autocast in the autocast dtype (Nemotron's LayerNorm1P: offset 1)
    layer_norms: tuple[str, ...] = ()
    layer_norm_offset: float = 0.0
    rope: str | None = "apply_rotary_pos_emb"  # module-level function the attention calls (None: no RoPE patch)
    # Its form, a key of tigon.patching.rope.ROPE_FORMS: "half" (HF's rotate_half, cos [.., R]),
    # "half_angles" (rotate_half, cos [.., R/2]: GPT-OSS), "pairs_to_halves" (adjacent pairs in,
    # halves out: DeepSeek-V3's rope_interleave), "complex" ((xq, xk, freqs_cis): DeepSeek-V2), ...
    rope_form: str = "half"
    more_ropes: tuple[tuple[str, str], ...] = ()  # further (function, form) pairs the attention calls
    mlps: tuple[str, ...] = ()  # dense gated MLP classes
    mlp_layout: str = "gate_up_down"  # or "fused_gate_up": gate_up_proj(x).chunk(2) -> (gate, up)
    experts: str | None = None  # MoE experts class with stacked 3-D gate_up_proj / down_proj
    # The experts class's own _apply_gate as a tigon.ops.moe_experts activation ("clamped_swiglu":
    # gpt-oss's, alpha / limit read from the module); None: HF's default gate, act_fn(gate) * up.
    experts_activation: str | None = None
    relu2_mlps: tuple[str, ...] = ()  # non-gated MLP classes: down_proj(relu(up_proj(x))^2) (Nemotron)
    logit_softcap: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    logit_divisor: str | None = None  # config attribute: logits = logits / divisor (Granite)
    logit_multiplier: str | None = None  # config attribute: logits = logits * multiplier (Falcon-H1)
    # Something after the MLP in the layer saves its output (a post-MLP norm, a gated shared
    # expert): under gradient checkpointing the recomputation cannot stop at the MLP, so the MLP
    # keeps gate / up instead of recomputing them (tigon.ops.glu_mlp).
    mlp_output_saved: bool = False
    note: str = ""  # what the row leaves alone, for the report
    left_to_hf: tuple[tuple[str, str], ...] = ()  # (piece, why): other pieces HF keeps, listed in the report
    # Vision-language rows. The image+text *ForConditionalGeneration class: its loss is patched as
    # causal_lm's (logit transforms read from the text config); its language model and vision
    # tower keep their own rows, found from the model's sub-configs (config.text_config.model_type,
    # ...) when a built model is patched, or named in ``parts`` for class patches.
    conditional_generation: str | None = None
    parts: tuple[str, ...] = ()  # rows of sub-models every model of the row has (class patches apply them too)
    vision_mlps: tuple[str, ...] = ()  # gated MLPs of a vision tower (gate_up_down, biases allowed)


def _m(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), _m("llama"), "LlamaForCausalLM", ("LlamaRMSNorm",), mlps=("LlamaMLP",)),
    Family("mistral", ("mistral",), _m("mistral"), "MistralForCausalLM", ("MistralRMSNorm",), mlps=("MistralMLP",)),
    Family("mixtral", ("mixtral",), _m("mixtral"), "MixtralForCausalLM", ("MixtralRMSNorm",),
           experts="MixtralExperts"),
    Family("qwen2", ("qwen2",), _m("qwen2"), "Qwen2ForCausalLM", ("Qwen2RMSNorm",), mlps=("Qwen2MLP",)),
    Family("qwen3", ("qwen3",), _m("qwen3"), "Qwen3ForCausalLM", ("Qwen3RMSNorm",), mlps=("Qwen3MLP",)),
    Family("qwen3_moe", ("qwen3_moe",), _m("qwen3_moe"), "Qwen3MoeForCausalLM", ("Qwen3MoeRMSNorm",),
           mlps=("Qwen3MoeMLP",), experts="Qwen3MoeExperts"),
    Family("gemma", ("gemma",), _m("gemma"), "GemmaForCausalLM", ("GemmaRMSNorm",), "gemma", 1.0,
           mlps=("GemmaMLP",)),
    Family("gemma2", ("gemma2",), _m("gemma2"), "Gemma2ForCausalLM", ("Gemma2RMSNorm",), "gemma", 1.0,
           mlps=("Gemma2MLP",), logit_softcap="final_logit_softcapping", mlp_output_saved=True),
    Family("gemma3", ("gemma3_text",), _m("gemma3"), "Gemma3ForCausalLM", ("Gemma3RMSNorm",), "gemma", 1.0,
           mlps=("Gemma3MLP",), logit_softcap="final_logit_softcapping", mlp_output_saved=True),
    Family("phi3", ("phi3",), _m("phi3"), "Phi3ForCausalLM", ("Phi3RMSNorm",), mlps=("Phi3MLP",),
           mlp_layout="fused_gate_up"),
    Family("granite", ("granite",), _m("granite"), "GraniteForCausalLM", ("GraniteRMSNorm",),
           mlps=("GraniteMLP",), logit_divisor="logits_scaling"),
    Family("olmo2", ("olmo2",), _m("olmo2"), "Olmo2ForCausalLM", ("Olmo2RMSNorm",), "gemma", mlps=("Olmo2MLP",),
           mlp_output_saved=True),
    Family("glm4", ("glm4",), _m("glm4"), "Glm4ForCausalLM", ("Glm4RMSNorm",), rope=None, mlps=("Glm4MLP",),
           mlp_layout="fused_gate_up", mlp_output_saved=True,
           note="rope: GLM-4 rotates interleaved pairs; tigon's RoPE is half-split"),
    # Further families with the same pieces (each one is a row here and a convergence test).
    Family("ministral", ("ministral",), _m("ministral"), "MinistralForCausalLM", ("MinistralRMSNorm",),
           mlps=("MinistralMLP",)),
    Family("smollm3", ("smollm3",), _m("smollm3"), "SmolLM3ForCausalLM", ("SmolLM3RMSNorm",), mlps=("SmolLM3MLP",)),
    Family("qwen2_moe", ("qwen2_moe",), _m("qwen2_moe"), "Qwen2MoeForCausalLM", ("Qwen2MoeRMSNorm",),
           mlps=("Qwen2MoeMLP",), experts="Qwen2MoeExperts", mlp_output_saved=True),
    Family("olmo3", ("olmo3",), _m("olmo3"), "Olmo3ForCausalLM", ("Olmo3RMSNorm",), "gemma", mlps=("Olmo3MLP",),
           mlp_output_saved=True),
    Family("exaone4", ("exaone4",), _m("exaone4"), "Exaone4ForCausalLM", ("Exaone4RMSNorm",), mlps=("Exaone4MLP",),
           mlp_output_saved=True),
    Family("seed_oss", ("seed_oss",), _m("seed_oss"), "SeedOssForCausalLM", ("SeedOssRMSNorm",),
           mlps=("SeedOssMLP",)),
    Family("hunyuan_v1_dense", ("hunyuan_v1_dense",), _m("hunyuan_v1_dense"), "HunYuanDenseV1ForCausalLM",
           ("HunYuanDenseV1RMSNorm",), mlps=("HunYuanDenseV1MLP",)),
    Family("helium", ("helium",), _m("helium"), "HeliumForCausalLM", ("HeliumRMSNorm",), "gemma", rope=None,
           mlps=("HeliumMLP",), note="rope: Helium rotates interleaved pairs; tigon's RoPE is half-split"),
    Family("glm4_moe", ("glm4_moe",), _m("glm4_moe"), "Glm4MoeForCausalLM", ("Glm4MoeRMSNorm",),
           mlps=("Glm4MoeMLP",), experts="Glm4MoeExperts"),
    Family("gpt_oss", ("gpt_oss",), _m("gpt_oss"), "GptOssForCausalLM", ("GptOssRMSNorm",), "gemma",
           rope_form="half_angles", experts="GptOssExperts", experts_activation="clamped_swiglu"),
    Family("qwen3_next", ("qwen3_next",), _m("qwen3_next"), "Qwen3NextForCausalLM", ("Qwen3NextRMSNorm",), "gemma",
           1.0, mlps=("Qwen3NextMLP",), experts="Qwen3NextExperts", mlp_output_saved=True,
           left_to_hf=(("rms_norm", "Qwen3NextRMSNormGated: norm(x) * silu(gate) in the linear attention"),)),
    Family("qwen3_5", ("qwen3_5_text",), _m("qwen3_5"), "Qwen3_5ForCausalLM", ("Qwen3_5RMSNorm",), "gemma", 1.0,
           mlps=("Qwen3_5MLP",),
           left_to_hf=(("rms_norm", "Qwen3_5RMSNormGated: norm(x) * silu(gate) in the linear attention"),)),
    Family("qwen3_5_moe", ("qwen3_5_moe_text",), _m("qwen3_5_moe"), "Qwen3_5MoeForCausalLM", ("Qwen3_5MoeRMSNorm",),
           "gemma", 1.0, mlps=("Qwen3_5MoeMLP",), experts="Qwen3_5MoeExperts", mlp_output_saved=True,
           left_to_hf=(("rms_norm", "Qwen3_5MoeRMSNormGated: norm(x) * silu(gate) in the linear attention"),)),
    # The shared MLP runs before the routed experts, which save their inputs.
    Family("hunyuan_v1_moe", ("hunyuan_v1_moe",), _m("hunyuan_v1_moe"), "HunYuanMoEV1ForCausalLM",
           ("HunYuanMoEV1RMSNorm",), mlps=("HunYuanMoEV1MLP",), experts="HunYuanMoEV1Experts", mlp_output_saved=True),
    Family("deepseek_v2", ("deepseek_v2",), _m("deepseek_v2"), "DeepseekV2ForCausalLM", ("DeepseekV2RMSNorm",),
           rope="apply_rotary_emb", rope_form="complex", mlps=("DeepseekV2MLP",), experts="DeepseekV2Experts"),
    Family("deepseek_v3", ("deepseek_v3",), _m("deepseek_v3"), "DeepseekV3ForCausalLM", ("DeepseekV3RMSNorm",),
           rope="apply_rotary_pos_emb_interleave", rope_form="pairs_to_halves",
           more_ropes=(("apply_rotary_pos_emb", "half"),), mlps=("DeepseekV3MLP",), experts="DeepseekV3Experts"),
    Family("falcon_h1", ("falcon_h1",), _m("falcon_h1"), "FalconH1ForCausalLM", ("FalconH1RMSNorm",),
           mlps=("FalconH1MLP",), logit_multiplier="lm_head_multiplier",
           left_to_hf=(("rms_norm", "FalconH1RMSNormGated: the Mamba mixer's grouped norm(x) * silu(gate)"),)),
    Family("nemotron", ("nemotron",), _m("nemotron"), "NemotronForCausalLM", layer_norms=("NemotronLayerNorm1P",),
           layer_norm_offset=1.0, relu2_mlps=("NemotronMLP",)),
    Family("nemotron_h", ("nemotron_h",), _m("nemotron_h"), "NemotronHForCausalLM", ("NemotronHRMSNorm",), "gemma",
           rope=None, relu2_mlps=("NemotronHMLP",), note="rope: Nemotron-H's attention has no position embedding",
           left_to_hf=(("rms_norm", "NemotronHRMSNormGated: the Mamba mixer's grouped norm(x) * silu(gate)"),
                       ("swiglu", "NemotronHExperts: non-gated ReLU² experts, [E, I, H] up / [E, H, I] down"))),
    # Gemma 3n rotates q and k in separate calls, apply_rotary_pos_emb(x, cos, sin): the "single" form.
    Family("gemma3n", ("gemma3n_text",), _m("gemma3n"), "Gemma3nForCausalLM", ("Gemma3nRMSNorm",), "gemma",
           rope_form="single", logit_softcap="final_logit_softcapping",
           left_to_hf=(("swiglu", "Gemma3nTextMLP: its activation-sparsity layers cut the gate at a Gaussian "
                                  "quantile"),)),
    # Gemma 4: weight applied as is (no 1 +), v / router norms without weight; one tensor per RoPE call
    # (proportional RoPE on full-attention layers: cos 1, sin 0 past the rotated part).
    Family("gemma4", ("gemma4_text",), _m("gemma4"), "Gemma4ForCausalLM", ("Gemma4RMSNorm",), "gemma",
           rope_form="single", mlps=("Gemma4TextMLP",), experts="Gemma4TextExperts",
           logit_softcap="final_logit_softcapping", mlp_output_saved=True,
           left_to_hf=(("swiglu", ("the per-layer-input gate, gelu(per_layer_input_gate(h)) * per_layer_input: "
                                   "its second factor is an embedding, not a projection of h")),)),
    # Vision-language families
    # Qwen-VL / GLM-4V: the multimodal RoPE's sections (temporal, height, width) are picked in the
    # rotary embedding, which hands the attention cos / sin [B, T, R]: the attention's RoPE is the
    # plain one (interleaved pairs in GLM-4V), and the vision tower's apply_rotary_pos_emb_vision.
    Family("qwen2_vl", ("qwen2_vl",), _m("qwen2_vl"), None, ("Qwen2VLRMSNorm",), mlps=("Qwen2MLP",),
           layer_norms=("nn.LayerNorm",), more_ropes=(("apply_rotary_pos_emb_vision", "vision"),),
           conditional_generation="Qwen2VLForConditionalGeneration",
           left_to_hf=(("swiglu", "VisionMlp and the patch merger's MLP: not gated"),)),
    Family("qwen2_5_vl", ("qwen2_5_vl",), _m("qwen2_5_vl"), None, ("Qwen2_5_VLRMSNorm",), mlps=("Qwen2MLP",),
           vision_mlps=("Qwen2_5_VLMLP",), more_ropes=(("apply_rotary_pos_emb_vision", "vision"),),
           conditional_generation="Qwen2_5_VLForConditionalGeneration",
           left_to_hf=(("swiglu", "the patch merger's MLP: not gated"),)),
    Family("qwen3_vl", ("qwen3_vl",), _m("qwen3_vl"), None, ("Qwen3VLTextRMSNorm",), mlps=("Qwen3VLTextMLP",),
           layer_norms=("nn.LayerNorm",), more_ropes=(("apply_rotary_pos_emb_vision", "vision"),),
           conditional_generation="Qwen3VLForConditionalGeneration",
           left_to_hf=(("swiglu", "Qwen3VLVisionMLP and the patch mergers' MLPs: not gated"),)),
    Family("qwen3_vl_moe", ("qwen3_vl_moe",), _m("qwen3_vl_moe"), None, ("Qwen3VLMoeTextRMSNorm",),
           mlps=("Qwen3VLMoeTextMLP",), experts="Qwen3VLMoeTextExperts", layer_norms=("nn.LayerNorm",),
           more_ropes=(("apply_rotary_pos_emb_vision", "vision"),),
           conditional_generation="Qwen3VLMoeForConditionalGeneration",
           left_to_hf=(("swiglu", "Qwen3VLMoeVisionMLP and the patch mergers' MLPs: not gated"),)),
    Family("glm4v", ("glm4v",), _m("glm4v"), None, ("Glm4vRMSNorm",), rope_form="interleaved",
           more_ropes=(("apply_rotary_pos_emb_vision", "vision"),), mlps=("Glm4vTextMLP",),
           mlp_layout="fused_gate_up", mlp_output_saved=True, vision_mlps=("Glm4VisionMlp",),
           layer_norms=("nn.LayerNorm",), conditional_generation="Glm4vForConditionalGeneration"),
    Family("glm4v_moe", ("glm4v_moe",), _m("glm4v_moe"), None, ("Glm4vMoeTextRMSNorm", "Glm4vMoeRMSNorm"),
           more_ropes=(("apply_rotary_pos_emb_vision", "vision"),), mlps=("Glm4vMoeTextMLP",),
           experts="Glm4vMoeTextExperts", vision_mlps=("Glm4vMoeisionMlp",), layer_norms=("nn.LayerNorm",),
           conditional_generation="Glm4vMoeForConditionalGeneration"),
    # Language model and vision tower from rows of their own (Gemma 3's gemma3, PaliGemma's gemma /
    # gemma2, Llava's llama, mistral, qwen2, ...; Mistral3's pixtral); the LayerNorms of SigLIP /
    # CLIP / Idefics3-style towers are torch's own nn.LayerNorm, patched in built models.
    Family("gemma3_vl", ("gemma3",), _m("gemma3"), None, rope=None, layer_norms=("nn.LayerNorm",),
           conditional_generation="Gemma3ForConditionalGeneration", parts=("gemma3",),
           note="rope: the language model's, by its own row", left_to_hf=(("swiglu", "SiglipMLP: not gated"),)),
    Family("paligemma", ("paligemma",), _m("paligemma"), None, rope=None, layer_norms=("nn.LayerNorm",),
           logit_softcap="final_logit_softcapping", conditional_generation="PaliGemmaForConditionalGeneration",
           note="rope: the language model's, by its own row", left_to_hf=(("swiglu", "SiglipMLP: not gated"),)),
    Family("llava", ("llava",), _m("llava"), None, rope=None, layer_norms=("nn.LayerNorm",),
           conditional_generation="LlavaForConditionalGeneration", note="rope: the language model's, by its own row",
           left_to_hf=(("swiglu", "the vision tower's MLP (CLIP's, SigLIP's): not gated"),)),
    Family("smolvlm", ("smolvlm",), _m("smolvlm"), None, rope=None, layer_norms=("nn.LayerNorm",),
           conditional_generation="SmolVLMForConditionalGeneration", note="rope: the language model's, by its own row",
           left_to_hf=(("swiglu", "SmolVLMVisionMLP: not gated"),)),
    Family("idefics3", ("idefics3",), _m("idefics3"), None, rope=None, layer_norms=("nn.LayerNorm",),
           conditional_generation="Idefics3ForConditionalGeneration", note="rope: the language model's, by its own row",
           left_to_hf=(("swiglu", "Idefics3VisionMLP: not gated"),)),
    Family("internvl", ("internvl",), _m("internvl"), None, ("InternVLVisionRMSNorm",), rope=None,
           layer_norms=("nn.LayerNorm",), conditional_generation="InternVLForConditionalGeneration",
           note="rope: the language model's, by its own row", left_to_hf=(("swiglu", "InternVLVisionMLP: not gated"),)),
    Family("mistral3", ("mistral3",), _m("mistral3"), None, ("Mistral3RMSNorm",), rope=None,
           conditional_generation="Mistral3ForConditionalGeneration",
           note="rope: the language model's, by its own row"),
    Family("pixtral", ("pixtral",), _m("pixtral"), None, ("PixtralRMSNorm",), vision_mlps=("PixtralMLP",)),
    Family("mllama", ("mllama", "mllama_text_model"), _m("mllama"), "MllamaForCausalLM", ("MllamaTextRMSNorm",),
           mlps=("MllamaTextMLP",), layer_norms=("nn.LayerNorm",),
           conditional_generation="MllamaForConditionalGeneration",
           left_to_hf=(("swiglu", "MllamaVisionMLP: not gated"),)),
    Family("llama4", ("llama4_text",), _m("llama4"), "Llama4ForCausalLM", ("Llama4TextRMSNorm", "Llama4TextL2Norm"),
           rope="apply_rotary_emb", rope_form="complex_bthd",
           left_to_hf=(("swiglu", "Llama4TextExperts: [E, H, 2I] weights on tokens sorted by expert (bmm)"),
                       ("swiglu", "Llama4TextMLP: Llama4TextMoe adds the experts' output into the shared MLP's "
                                  "in place, which a custom op's output refuses"))),
    Family("llama4_vl", ("llama4",), _m("llama4"), None, rope=None, layer_norms=("nn.LayerNorm",),
           conditional_generation="Llama4ForConditionalGeneration", parts=("llama4",),
           note="rope: the vision tower's vision_apply_rotary_emb (2-D complex) stays HF's; the language "
                "model's is row llama4's",
           left_to_hf=(("swiglu", "Llama4VisionMLP: not gated"),)),
    Family("gemma4_vl", ("gemma4",), _m("gemma4"), None, rope=None, vision_mlps=("Gemma4VisionMLP",),
           logit_softcap="final_logit_softcapping", conditional_generation="Gemma4ForConditionalGeneration",
           parts=("gemma4",),
           note="rope: the language model's, by its own row (in built models the vision tower's 2-D "
                "apply_multidimensional_rope stays HF's)",
           left_to_hf=(("swiglu", "Gemma4AudioFeedForward: not gated"),)),
)}
"""The families tigon patches, by name (``patch_<name>``): a Family row each, naming the Hugging Face
modeling module, its classes and functions that the patch replaces, and what it leaves to HF."""

BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
