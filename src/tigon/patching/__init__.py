"""Patch Hugging Face transformers models with tigon's kernels (see ``families.FAMILIES``). Activation
checkpointing is not this package's: ``tigon.patch`` (tigon.api) adds it from tigon.planning."""

from tigon.patching.errors import TigonPatchError
from tigon.patching.families import BY_MODEL_TYPE, FAMILIES, Family
from tigon.patching.install import set_instance_attribute, unpatch
from tigon.patching.options import PATCH_OPTION_NAMES, PatchOptions, PatchReport, kernels_only
from tigon.patching.patcher import apply_family, family_patcher, patch, patched

# One patch_<family> per row of FAMILIES (tests/integration/test_patching.py checks they match).
patch_llama = family_patcher("llama")
patch_mistral = family_patcher("mistral")
patch_mixtral = family_patcher("mixtral")
patch_qwen2 = family_patcher("qwen2")
patch_qwen3 = family_patcher("qwen3")
patch_qwen3_moe = family_patcher("qwen3_moe")
patch_gemma = family_patcher("gemma")
patch_gemma2 = family_patcher("gemma2")
patch_gemma3 = family_patcher("gemma3")
patch_phi3 = family_patcher("phi3")
patch_granite = family_patcher("granite")
patch_olmo2 = family_patcher("olmo2")
patch_glm4 = family_patcher("glm4")
patch_ministral = family_patcher("ministral")
patch_smollm3 = family_patcher("smollm3")
patch_qwen2_moe = family_patcher("qwen2_moe")
patch_olmo3 = family_patcher("olmo3")
patch_exaone4 = family_patcher("exaone4")
patch_seed_oss = family_patcher("seed_oss")
patch_hunyuan_v1_dense = family_patcher("hunyuan_v1_dense")
patch_helium = family_patcher("helium")
patch_glm4_moe = family_patcher("glm4_moe")
patch_gpt_oss = family_patcher("gpt_oss")
patch_qwen3_next = family_patcher("qwen3_next")
patch_qwen3_5 = family_patcher("qwen3_5")
patch_qwen3_5_moe = family_patcher("qwen3_5_moe")
patch_hunyuan_v1_moe = family_patcher("hunyuan_v1_moe")
patch_deepseek_v2 = family_patcher("deepseek_v2")
patch_deepseek_v3 = family_patcher("deepseek_v3")
patch_falcon_h1 = family_patcher("falcon_h1")
patch_nemotron = family_patcher("nemotron")
patch_nemotron_h = family_patcher("nemotron_h")
patch_gemma3n = family_patcher("gemma3n")
patch_gemma4 = family_patcher("gemma4")
# Vision-language families
patch_qwen2_vl = family_patcher("qwen2_vl")
patch_qwen2_5_vl = family_patcher("qwen2_5_vl")
patch_qwen3_vl = family_patcher("qwen3_vl")
patch_qwen3_vl_moe = family_patcher("qwen3_vl_moe")
patch_glm4v = family_patcher("glm4v")
patch_glm4v_moe = family_patcher("glm4v_moe")
patch_gemma3_vl = family_patcher("gemma3_vl")
patch_paligemma = family_patcher("paligemma")
patch_llava = family_patcher("llava")
patch_smolvlm = family_patcher("smolvlm")
patch_idefics3 = family_patcher("idefics3")
patch_internvl = family_patcher("internvl")
patch_mistral3 = family_patcher("mistral3")
patch_pixtral = family_patcher("pixtral")
patch_mllama = family_patcher("mllama")
patch_llama4 = family_patcher("llama4")
patch_llama4_vl = family_patcher("llama4_vl")
patch_gemma4_vl = family_patcher("gemma4_vl")

PATCHERS = {name: value for name, value in globals().items() if name.startswith("patch_")}

__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "PATCH_OPTION_NAMES", "PatchOptions", "PatchReport",
           "TigonPatchError", "apply_family", "kernels_only", "patch", "patched",
           "set_instance_attribute", "unpatch", *PATCHERS]
