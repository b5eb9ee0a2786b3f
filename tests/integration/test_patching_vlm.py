"""Convergence of patched HF vision-language models against the same models unpatched, per
vision-language row of the family table: image+text batches (image tokens in input_ids, their
labels -100), tiny random configs (tigon.tiny_models.VLM_CASES: 1 text layer, a 1-layer vision
tower, 2x2-pixel patches), fp32, built offline. A family whose classes this transformers lacks is
skipped with the reason.
"""

import copy

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.integration.test_patching import FLOOR, SPREAD_FACTOR, assert_trains_like, float64_copy, rel, train
from tigon import tiny_models
from tigon.patching import BY_MODEL_TYPE, FAMILIES, TigonPatchError
from tigon.tiny_models import VLM_CASES

transformers = pytest.importorskip("transformers")

CASES = VLM_CASES
VLM_ROWS = [f for f in FAMILIES.values() if f.conditional_generation]
# Rows without a training case yet (their model needs inputs this file does not build).
NO_CASE = {}


@pytest.fixture(autouse=True)
def _unpatched_after():
    tigon.unpatch()
    yield
    tigon.unpatch()


def tiny_vlm(model_type):
    """tigon.tiny_models.tiny_vlm on DEVICE; skipped when this transformers lacks the family."""
    try:
        return tiny_models.tiny_vlm(model_type, DEVICE)
    except tiny_models.ModelUnavailable as exc:
        pytest.skip(str(exc))


def vlm_batch(model):
    return tiny_models.vlm_batch(model, DEVICE)


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
