"""The name map: every public name Liger-Kernel 0.8.5 exports from ``liger_kernel.transformers``,
``liger_kernel.transformers.functional``, ``liger_kernel.chunked_loss`` and
``liger_kernel.chunked_loss.functional``, with what it runs on in tigon, or why
``tigon.compat.liger`` does not provide it. One table, ``NAME_MAP``; the docs' migration page
shows it (``name_map_markdown``), and importing a name it marks not provided raises ImportError
with the reason (``not_provided_getattr``).

A provided name lives at the same place under ``tigon.compat.liger`` as under ``liger_kernel``
(``liger_kernel.transformers.LigerRMSNorm`` -> ``tigon.compat.liger.transformers.LigerRMSNorm``),
and the names of ``liger_kernel.transformers`` and ``liger_kernel.chunked_loss`` also at the top
of ``tigon.compat.liger``. This module imports nothing of tigon: it is data.
"""

from __future__ import annotations

from dataclasses import dataclass

LIGER_VERSION = "0.8.5"
LIGER_MODULES = ("liger_kernel.transformers", "liger_kernel.transformers.functional", "liger_kernel.chunked_loss",
                 "liger_kernel.chunked_loss.functional")


@dataclass(frozen=True)
class Name:
    """One Liger name: ``liger`` its full name, ``tigon`` what it runs on (None: not provided),
    ``note`` how it differs from Liger's, or why it is not provided."""

    liger: str
    tigon: str | None
    note: str = ""

    @property
    def module(self) -> str:
        return self.liger.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.liger.rpartition(".")[2]

    @property
    def provided(self) -> bool:
        return self.tigon is not None

    @property
    def compat(self) -> str | None:
        """Where tigon.compat.liger provides it (None: not provided)."""
        return "tigon.compat.liger" + self.liger[len("liger_kernel"):] if self.provided else None


_T, _TF, _C, _CF = LIGER_MODULES
NO_EFFECT = "no effect"  # Liger's choices among its own kernels: accepted, the values are tigon's


def _rows(module: str, entries) -> list[Name]:
    return [Name(f"{module}.{name}", tigon, note) for name, tigon, note in entries]


# apply_liger_kernel_to_<name>: tigon's family rows (a built model picks by its model type), and notes
_FAMILIES = {
    "deepseek_v2": ("deepseek_v2", "rope=False by default, as Liger's (tigon can patch DeepSeek-V2's RoPE: pass "
                                   "rope=True)"),
    "deepseek_v3": ("deepseek_v3", "rope=False by default, as Liger's (tigon can patch it: pass rope=True)"),
    "exaone4": ("exaone4", ""),
    "falcon_h1": ("falcon_h1", "the Mamba mixer's gated RMSNorm stays HF's"),
    "gemma": ("gemma", "geglu -> tigon's swiglu option"),
    "gemma2": ("gemma2", "geglu -> swiglu; final logit softcapping in the fused loss"),
    "gemma3": ("gemma3_vl, gemma3", "Gemma3ForConditionalGeneration (gemma3_vl, whose language model is row "
                                    "gemma3) or a text model (gemma3) by model type"),
    "gemma3_text": ("gemma3", "geglu -> swiglu"),
    "gemma4": ("gemma4_vl, gemma4", "rope / layer_norm False by default, as Liger's"),
    "gemma4_text": ("gemma4", "rope=False by default, as Liger's (tigon can patch Gemma 4's RoPE: pass rope=True)"),
    "glm4": ("glm4", "rope=False by default; tigon has no RoPE for GLM-4 either (interleaved pairs): left to HF"),
    "glm4v": ("glm4v", "rope=False by default, as Liger's (tigon can patch it: pass rope=True)"),
    "glm4v_moe": ("glm4v_moe", "rope=False by default, as Liger's (tigon can patch it: pass rope=True)"),
    "gpt_oss": ("gpt_oss", "swiglu=False by default, as Liger's (tigon's fused experts with swiglu=True)"),
    "granite": ("granite", "cross_entropy=True by default, as Liger's; fused_linear_cross_entropy=True works "
                           "(Liger refuses it: tigon's fused loss applies the logits scaling)"),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", ""),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", ""),
    "internvl": ("internvl", "**kwargs: Liger's flags for the language model and vision tower"),
    "llama": ("llama", ""),
    "llama4": ("llama4_vl, llama4", "a text model (llama4) or the image+text one (llama4_vl) by model type; "
                                    "the MoE MLPs stay HF's (see tigon's llama4 row)"),
    "llava": ("llava", "**kwargs: Liger's flags for the language model and vision tower"),
    "ministral": ("ministral", ""),
    "mistral": ("mistral", ""),
    "mixtral": ("mixtral", "swiglu -> tigon's fused MoE experts"),
    "mllama": ("mllama", ""),
    "nemotron": ("nemotron", "relu_squared -> swiglu (the ReLU² MLP); RoPE and LayerNorm1P patched as tigon.patch "
                             "does (Liger has no flag for them; pass rope=False / layer_norm=False in **kwargs)"),
    "olmo2": ("olmo2", ""),
    "olmo3": ("olmo3", ""),
    "paligemma": ("paligemma", "the class patch also patches the Gemma and Gemma 2 classes (without their loss), "
                               "as Liger's"),
    "phi3": ("phi3", ""),
    "pixtral": ("pixtral", ""),
    "qwen2": ("qwen2", ""),
    "qwen2_5_vl": ("qwen2_5_vl", ""),
    "qwen2_vl": ("qwen2_vl", ""),
    "qwen3": ("qwen3", ""),
    "qwen3_5": ("qwen3_5", "rope=False by default; rope=True works (Liger refuses it)"),
    "qwen3_5_moe": ("qwen3_5_moe", "rope=False by default; rope=True works (Liger refuses it)"),
    "qwen3_moe": ("qwen3_moe", "swiglu -> tigon's fused MoE experts"),
    "qwen3_next": ("qwen3_next", "rope=False by default, as Liger's; the gated RMSNorm stays HF's"),
    "qwen3_vl": ("qwen3_vl", "swiglu=False by default, as Liger's"),
    "qwen3_vl_moe": ("qwen3_vl_moe", ""),
    "smollm3": ("smollm3", ""),
    "smolvlm": ("smolvlm", "**kwargs: Liger's flags for the language model and vision tower"),
}

NAME_MAP: dict[str, Name] = {n.liger: n for n in [
    *_rows(_T, [
        ("AutoLigerKernelForCausalLM", "tigon.AutoModelForCausalLM",
         "transformers' AutoModelForCausalLM, then the loaded model patched with Liger's flags found among the keyword "
         "arguments (Liger patches the classes before loading)"),
        ("LigerBlockSparseTop2MLP", "tigon.functional.swiglu", "w2(silu(w1(x)) * w3(x))"),
        ("LigerCrossEntropyLoss", "tigon.nn.TigonCrossEntropyLoss",
         "inplace=True: as Liger's kernel, the gradient is written over the logits in the forward pass; extras "
         "returned in a CrossEntropyOutput"),
        ("LigerDyT", "tigon.nn.TigonDyT", ""),
        ("LigerExperts", "tigon.functional.moe_experts", "MixtralExperts' stacked gate_up_proj / down_proj"),
        ("LigerFalconH1MLP", "tigon.functional.glu_mlp", "with Falcon-H1's gate / down multipliers; keeps only x"),
        ("LigerFalconH1SwiGLUMLP", "tigon.nn.TigonSwiGLUMLP", "with Falcon-H1's gate / down multipliers"),
        ("LigerFusedAddRMSNorm", "tigon.nn.TigonFusedAddRMSNorm", f"in_place: {NO_EFFECT}"),
        ("LigerFusedCETVDLoss", None,
         "tigon has no fused per-token cross entropy + TVD over logits: compose tigon.functional.cross_entropy("
         "reduction='none') and tigon.functional.tvd of the two softmaxes"),
        ("LigerFusedLinearCrossEntropyLoss", "tigon.nn.TigonFusedLinearCrossEntropyLoss",
         "forward(lin_weight, _input, target, bias) as Liger's (weight first)"),
        ("LigerFusedLinearJSD", "tigon.losses.fused_linear_jsd",
         "accum_dtype other than the weight's dtype refused"),
        ("LigerFusedLinearKLDivLoss", None,
         "tigon has no fused head + KL divergence to given teacher probabilities: tigon.losses.fused_linear_jsd with "
         "beta=0 is the forward KL (teacher to student) from the teacher's hidden states and head"),
        ("LigerGEGLUMLP", "tigon.nn.TigonGeGLUMLP",
         "the GELU follows the config (exact for 'gelu'; Liger always takes the tanh approximation)"),
        ("LigerJSD", "tigon.functional.jsd", "loss in the inputs' dtype, as Liger's; all rows ignored gives 0"),
        ("LigerKLDIVLoss", "tigon.functional.kl_div",
         "eps other than 1e-10 refused (tigon does not clamp the target at eps)"),
        ("LigerLayerNorm", "tigon.functional.layer_norm", f"impl / mode / backend: {NO_EFFECT}"),
        ("LigerMHC", None, "manifold-constrained hyper-connections: tigon has no kernel for them"),
        ("LigerMLP", "tigon.functional.glu_mlp", "the SwiGLU MLP keeping only x (gate and up recomputed)"),
        ("LigerModulatedRMSNorm", None,
         "tigon has no modulated (scale / shift) RMSNorm kernel: tigon.functional.rms_norm, then torch's elementwise "
         "ops"),
        ("LigerMultiTokenAttention", None,
         "tigon has no multi-token attention (a convolution over attention scores) kernel"),
        ("LigerPhi3SwiGLUMLP", "tigon.functional.swiglu", "Phi-3's fused gate_up_proj"),
        ("LigerPolyNorm", "tigon.functional.poly_norm", f"in_place: {NO_EFFECT}"),
        ("LigerQwen3MoeSwiGLUMLP", "tigon.nn.TigonSwiGLUMLP", ""),
        ("LigerRMSNorm", "tigon.nn.TigonRMSNorm",
         f"in_place / row_mode: {NO_EFFECT} (tigon's backward never writes over the incoming gradient)"),
        ("LigerRMSNormForMuseGlimmer", "tigon.nn.TigonRMSNorm", "with_scale=False: no weight"),
        ("LigerRMSNormForMuseGlimmerTextCentered", "tigon.nn.TigonRMSNorm", "Gemma's (1 + weight), fp32"),
        ("LigerReLUSquared", "tigon.functional.relu_squared", ""),
        ("LigerSoftmax", "tigon.nn.TigonSoftmax", ""),
        ("LigerSparsemax", "tigon.nn.TigonSparsemax", ""),
        ("LigerSwiGLUMLP", "tigon.nn.TigonSwiGLUMLP", "no biases, as Liger's"),
        ("LigerSwiGLUMLPForMuseGlimmer", "tigon.nn.TigonSwiGLUMLP", ""),
        ("LigerTVDLoss", "tigon.nn.TigonTVDLoss", ""),
        ("LigerTiledGEGLUMLP", "tigon.nn.TigonTiledGeGLUMLP", "the GELU follows the config, as LigerGEGLUMLP"),
        ("LigerTiledSwiGLUMLP", "tigon.nn.TigonTiledSwiGLUMLP", ""),
        ("LigerVocabParallelCrossEntropy", "tigon.functional.vocab_parallel_cross_entropy",
         "label smoothing with label_smoothing_formula='megatron' (or label_smoothing_mode='partition' on several "
         "ranks) refused"),
        ("_apply_liger_kernel", "tigon.patch_<family>()",
         "the class patch for a model type, with the flags its function takes"),
        ("_apply_liger_kernel_to_instance", "tigon.patch_<family>(model)",
         "what HF Trainer's use_liger_kernel=True calls: the model patched alone"),
        # (every one: model=None patches the classes, a built model is patched alone; returns the PatchReport)
        *((f"apply_liger_kernel_to_{name}", ", ".join(f"tigon.patch_{row}" for row in rows.split(", ")), note)
          for name, (rows, note) in _FAMILIES.items()),
        ("apply_liger_kernel_to_deepseek_v4", None,
         "tigon has no DeepSeek-V4 row (tigon.patch(model) patches what it recognises by structure)"),
        ("apply_liger_kernel_to_muse_glimmer", None,
         "tigon has no MuseGlimmer row (tigon.patch(model) patches what it recognises by structure)"),
        ("is_transformers_available", "importlib.util.find_spec", ""),
        ("liger_llama4_text_rotary_pos_emb", "tigon.patching.rope (form complex_bthd)", ""),
        ("liger_llama4_vision_rotary_pos_emb", None,
         "tigon leaves Llama 4's vision RoPE (2-D complex angles) to HF"),
        ("liger_rotary_pos_emb", "tigon.functional.apply_rotary_pos_emb",
         "position_ids not read, as Liger's; rotary_dim: R or 2R for cos / sin [.., R]"),
        # Not exported by liger_kernel.transformers 0.8.5 (liger_kernel.transformers.group_norm): provided here too
        ("LigerGroupNorm", "tigon.functional.group_norm",
         "not exported by liger_kernel.transformers 0.8.5 (liger_kernel.transformers.group_norm.LigerGroupNorm)"),
    ]),
    *_rows(_TF, [
        ("CrossEntropyOutput", "tigon.functional.cross_entropy", "its extras (z_loss, token accuracy, predictions)"),
        ("LigerAttnResFunction", None, "attention residuals over depth: tigon has no kernel for them"),
        ("LigerCrossEntropyFunction", "tigon.functional.cross_entropy", "inplace=True, as LigerCrossEntropyLoss"),
        ("LigerDyTFunction", "tigon.functional.dyt", ""),
        ("LigerFusedAddRMSNormFunction", "tigon.functional.fused_add_rms_norm", f"in_place: {NO_EFFECT}"),
        ("LigerFusedLinearCrossEntropyFunction", "tigon.functional.fused_linear_cross_entropy",
         f"ce_impl / ce_mode / chunk_mem_const: {NO_EFFECT}"),
        ("LigerFusedLinearJSDFunction", "tigon.losses.fused_linear_jsd", f"jsd_impl / jsd_mode: {NO_EFFECT}"),
        ("LigerFusedLinearKLDivFunction", None, "as LigerFusedLinearKLDivLoss"),
        ("LigerFusedLinearScaledCrossEntropyTPFunction", None,
         "tensor-parallel per-token NLL with temperature and entropy: tigon.functional."
         "vocab_parallel_linear_cross_entropy is the nearest (no temperature, no entropy output)"),
        ("LigerFusedNeighborhoodAttentionFunction", None, "tigon has no neighborhood attention kernel"),
        ("LigerGELUMulFunction", "tigon.functional.geglu", ""),
        ("LigerGroupNormFunction", "tigon.functional.group_norm", ""),
        ("LigerJSDFunction", "tigon.functional.jsd", f"jsd_impl / jsd_mode: {NO_EFFECT}"),
        ("LigerKLDivLossFunction", "tigon.functional.kl_div", "as LigerKLDIVLoss"),
        ("LigerLayerNormFunction", "tigon.functional.layer_norm", ""),
        ("LigerMHCCoeffsFunction", None, "as LigerMHC"),
        ("LigerMHCPostResFunction", None, "as LigerMHC"),
        ("LigerMHCPreFunction", None, "as LigerMHC"),
        ("LigerModulatedRMSNormFunction", None, "as LigerModulatedRMSNorm"),
        ("LigerMultiTokenAttentionFunction", None, "as LigerMultiTokenAttention"),
        ("LigerPolyNormFunction", "tigon.functional.poly_norm", f"in_place: {NO_EFFECT}"),
        ("LigerQwen2VLMRopeFunction", "tigon.functional.apply_rotary_pos_emb",
         "the sections picked in torch, the rotation in tigon's kernel"),
        ("LigerRMSNormFunction", "tigon.functional.rms_norm", f"in_place / row_mode: {NO_EFFECT}"),
        ("LigerReLUSquaredFunction", "tigon.functional.relu_squared", ""),
        ("LigerRopeFunction", "tigon.functional.apply_rotary_pos_emb", "as liger_rotary_pos_emb"),
        ("LigerSiLUMulFunction", "tigon.functional.glu", ""),
        ("LigerSoftmaxFunction", "tigon.functional.softmax", ""),
        ("LigerSparsemaxFunction", "tigon.functional.sparsemax", ""),
        ("LigerTVDLossFunction", "tigon.functional.tvd", ""),
        ("liger_attn_res", None, "as LigerAttnResFunction"),
        ("liger_cross_entropy", "tigon.functional.cross_entropy",
         "inplace=True, as Liger's; torch's deprecated size_average / reduce refused"),
        ("liger_dyt", "tigon.functional.dyt", ""),
        ("liger_fused_add_rms_norm", "tigon.functional.fused_add_rms_norm", f"in_place: {NO_EFFECT}"),
        ("liger_fused_linear_cross_entropy", "tigon.functional.fused_linear_cross_entropy",
         f"chunk_mem_const: {NO_EFFECT}"),
        ("liger_fused_linear_jsd", "tigon.losses.fused_linear_jsd",
         "accum_dtype other than the weight's dtype refused"),
        ("liger_fused_linear_kl_div", None, "as LigerFusedLinearKLDivLoss"),
        ("liger_fused_linear_scaled_cross_entropy_tp", None, "as LigerFusedLinearScaledCrossEntropyTPFunction"),
        ("liger_fused_neighborhood_attention", None, "as LigerFusedNeighborhoodAttentionFunction"),
        ("liger_geglu", "tigon.functional.geglu", ""),
        ("liger_group_norm", "tigon.functional.group_norm", ""),
        ("liger_jsd", "tigon.functional.jsd", "loss in the inputs' dtype, as Liger's"),
        ("liger_kl_div", "tigon.functional.kl_div", "as LigerKLDIVLoss; size_average / reduce refused"),
        ("liger_layer_norm", "tigon.functional.layer_norm", ""),
        ("liger_mhc_apply", None, "as LigerMHC"),
        ("liger_mhc_coeffs", None, "as LigerMHC"),
        ("liger_mhc_forward", None, "as LigerMHC"),
        ("liger_mhc_post_res", None, "as LigerMHC"),
        ("liger_mhc_pre", None, "as LigerMHC"),
        ("liger_modulated_rms_norm", None, "as LigerModulatedRMSNorm"),
        ("liger_multi_token_attention", None, "as LigerMultiTokenAttention"),
        ("liger_poly_norm", "tigon.functional.poly_norm", f"in_place: {NO_EFFECT}"),
        ("liger_qwen2vl_mrope", "tigon.functional.apply_rotary_pos_emb", "as LigerQwen2VLMRopeFunction"),
        ("liger_relu_squared", "tigon.functional.relu_squared", ""),
        ("liger_rms_norm", "tigon.functional.rms_norm", f"in_place: {NO_EFFECT}"),
        ("liger_rope", "tigon.functional.apply_rotary_pos_emb", "as liger_rotary_pos_emb"),
        ("liger_softmax", "tigon.functional.softmax", ""),
        ("liger_sparsemax", "tigon.functional.sparsemax", ""),
        ("liger_swiglu", "tigon.functional.swiglu", ""),
        ("liger_tvd", "tigon.functional.tvd", ""),
    ]),
    *_rows(_C, [
        ("LigerFusedLinearCPOLoss", "tigon.losses.cpo_loss", f"compiled: {NO_EFFECT}"),
        ("LigerFusedLinearCosineSimilarityLoss", None,
         "tigon has no cosine-similarity distillation loss (tigon.losses.fused_linear_jsd distils by JSD)"),
        ("LigerFusedLinearDPOLoss", "tigon.losses.dpo_loss",
         "alpha != 1 with compute_nll_loss=True refused; label_smoothing ignored by loss_type='sigmoid' as in Liger "
         "(warned); tigon's ipo and aot loss types too; compiled: no effect"),
        ("LigerFusedLinearGRPOLoss", "tigon.losses.grpo_loss",
         "loss_type 'luspo' / 'vespo' refused; the metrics (KL, clip ratio) as Liger's; compiled: no effect"),
        ("LigerFusedLinearJSDLoss", "tigon.losses.fused_linear_jsd",
         "the hard loss by tigon.functional.fused_linear_cross_entropy (a second pass of the student head); "
         "compiled: no effect"),
        ("LigerFusedLinearKTOLoss", "tigon.losses.kto_loss", "kl taken as given (clamp_kl=False, as Liger's)"),
        ("LigerFusedLinearORPOLoss", "tigon.losses.orpo_loss", f"compiled: {NO_EFFECT}"),
        ("LigerFusedLinearSimPOLoss", "tigon.losses.simpo_loss", f"compiled: {NO_EFFECT}"),
    ]),
    *_rows(_CF, [
        ("LigerFusedLinearCPOFunction", "tigon.losses.cpo_loss", "as LigerFusedLinearCPOLoss"),
        ("LigerFusedLinearCosineSimilarityFunction", None, "as LigerFusedLinearCosineSimilarityLoss"),
        ("LigerFusedLinearDPOFunction", "tigon.losses.dpo_loss", "as LigerFusedLinearDPOLoss"),
        ("LigerFusedLinearGRPOFunction", "tigon.losses.grpo_loss", "as LigerFusedLinearGRPOLoss"),
        ("LigerFusedLinearJSDFunction", "tigon.losses.fused_linear_jsd", "as LigerFusedLinearJSDLoss"),
        ("LigerFusedLinearKTOFunction", "tigon.losses.kto_loss", "as LigerFusedLinearKTOLoss"),
        ("LigerFusedLinearORPOFunction", "tigon.losses.orpo_loss", "as LigerFusedLinearORPOLoss"),
        ("LigerFusedLinearSimPOFunction", "tigon.losses.simpo_loss", "as LigerFusedLinearSimPOLoss"),
        ("liger_fused_linear_cosine", None, "as LigerFusedLinearCosineSimilarityLoss"),
        ("liger_fused_linear_cpo", "tigon.losses.cpo_loss", "LigerFusedLinearCPOFunction.apply"),
        ("liger_fused_linear_dpo", "tigon.losses.dpo_loss", "LigerFusedLinearDPOFunction.apply"),
        ("liger_fused_linear_grpo", "tigon.losses.grpo_loss", "LigerFusedLinearGRPOFunction.apply"),
        ("liger_fused_linear_jsd", "tigon.losses.fused_linear_jsd", "LigerFusedLinearJSDFunction.apply"),
        ("liger_fused_linear_kto", "tigon.losses.kto_loss", "LigerFusedLinearKTOFunction.apply"),
        ("liger_fused_linear_orpo", "tigon.losses.orpo_loss", "LigerFusedLinearORPOFunction.apply"),
        ("liger_fused_linear_simpo", "tigon.losses.simpo_loss", "LigerFusedLinearSimPOFunction.apply"),
    ]),
]}


def names_in(liger_module: str, provided: bool | None = None) -> list[Name]:
    """The rows of one of LIGER_MODULES (only the provided ones, or only the others)."""
    return [n for n in NAME_MAP.values() if n.module == liger_module and (provided is None or n.provided == provided)]


def exported(liger_module: str) -> list[str]:
    """The names a compat module provides for ``liger_module``: its ``__all__``."""
    return sorted(n.name for n in names_in(liger_module, provided=True))


def reason(row: Name) -> str:
    """Why ``row`` is not provided, a note "as X" replaced by X's."""
    if row.note.startswith("as "):
        for other in NAME_MAP.values():
            if other.name == row.note[3:] and not other.provided:
                return f"{row.note}: {reason(other)}"
    return row.note


def not_provided_getattr(module: str, *liger_modules: str):
    """A module ``__getattr__`` for ``module`` (the compat counterpart of ``liger_modules``):
    importing a name NAME_MAP marks not provided raises ImportError with the reason."""
    def __getattr__(name: str):
        for liger_module in liger_modules:
            row = NAME_MAP.get(f"{liger_module}.{name}")
            if row is not None and not row.provided:
                raise ImportError(f"{module} does not provide {name} ({row.liger} in Liger-Kernel {LIGER_VERSION}): "
                                  f"{reason(row)}. See tigon.compat.liger.NAME_MAP.")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def name_map_markdown() -> str:
    """NAME_MAP as the Markdown table of the docs' migration page (docs/guides/liger.md), one
    section a Liger module."""
    out = []
    for module in LIGER_MODULES:
        out += [f"### `{module}`", "", "| Liger name | tigon.compat.liger | runs on | notes |", "|---|---|---|---|"]
        for n in sorted(names_in(module), key=lambda n: (n.name.lstrip("_").lower(), n.name)):
            compat = f"`{n.compat}`" if n.provided else "not provided"
            runs_on = f"`{n.tigon}`" if n.provided else ""
            out.append(f"| `{n.name}` | {compat} | {runs_on} | {n.note} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
