"""The table of Hugging Face model families the patcher knows: one row per family.

A row names the HF pieces tigon replaces; the mechanisms that replace them live in
``tigon.patching.forwards`` and are shared by every row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # patch_<name>()
    model_types: tuple[str, ...]  # config.model_type values
    module: str  # the modeling module, e.g. transformers.models.llama.modeling_llama
    causal_lm: str  # the *ForCausalLM class
    rms_norms: tuple[str, ...] = ()  # RMSNorm classes (every norm of the model, incl. q/k norms)
    rms_casting: str = "llama"  # "llama": normalise in fp32, cast, times weight; "gemma": fp32 throughout
    rms_offset: float = 0.0  # 1.0: the weight is applied as (1 + weight)
    rope: str | None = "apply_rotary_pos_emb"  # module-level function (half-split rotate_half form)
    mlps: tuple[str, ...] = ()  # dense gated MLP classes
    mlp_layout: str = "gate_up_down"  # or "fused_gate_up": gate_up_proj(x).chunk(2) -> (gate, up)
    experts: str | None = None  # MoE experts class with stacked 3-D gate_up_proj / down_proj
    logit_softcap: str | None = None  # config attribute: logits = cap * tanh(logits / cap)
    logit_divisor: str | None = None  # config attribute: logits = logits / divisor (Granite)
    # Something after the MLP in the layer saves its output (a post-MLP norm, a gated shared
    # expert): under gradient checkpointing the recomputation cannot stop at the MLP, so the MLP
    # keeps gate / up instead of recomputing them (tigon.ops.glu_mlp).
    mlp_output_saved: bool = False
    note: str = ""  # what the row leaves alone, for the report


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
)}

BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
