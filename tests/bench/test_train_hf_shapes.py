"""benchmarks/train_hf.py's end-to-end shapes (issue 21): the Qwen2.5-VL batches are what the
model's image processor makes of an image, and tiny versions of qwen2.5-vl-3b and qwen3-moe
train patched by tigon with HF's losses (fp32, from the same weights on the same batches)."""

import argparse
import importlib.util
import json
import os

import pytest
import torch

from tests.helpers import DEVICE

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("train_hf", os.path.join(ROOT, "benchmarks", "train_hf.py"))
train_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_hf)


class _Model:
    """What image_text_batch reads of a model (its config, its forward's parameters), without weights."""

    def __init__(self, config):
        self.config = config

    def forward(self, input_ids=None, labels=None, pixel_values=None, image_grid_thw=None, mm_token_type_ids=None):
        raise NotImplementedError


@pytest.mark.parametrize("shapes, size", [(train_hf.SHAPES, 448), (train_hf.TINY_SHAPES, train_hf.TINY_IMAGE_SIZE)])
def test_image_batch_is_what_the_processor_makes(shapes, size, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setattr(train_hf, "DEVICE", "cpu")

    try:
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor
    model_type, kwargs = shapes["qwen2.5-vl-3b"]
    config = AutoConfig.for_model(model_type, **kwargs)
    vision = config.vision_config
    processor = Processor(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                          temporal_patch_size=vision.temporal_patch_size)
    images = torch.randint(0, 256, (3, size, size, 3), dtype=torch.uint8).numpy()
    expected = processor(images=list(images), return_tensors="pt")
    batch, seq = 3, 300 if size == 448 else 16
    inputs = train_hf.image_text_batch(_Model(config), batch, seq, torch.Generator().manual_seed(0), size)
    assert inputs["pixel_values"].shape == expected["pixel_values"].shape
    assert torch.equal(inputs["image_grid_thw"].cpu(), expected["image_grid_thw"])
    n_image = int(expected["image_grid_thw"][0].prod()) // vision.spatial_merge_size**2
    ids, labels = inputs["input_ids"].cpu(), inputs["labels"].cpu()
    assert ((ids == config.image_token_id).sum(1) == n_image).all()
    assert (ids[:, 0] == config.vision_start_token_id).all()
    assert (ids[:, n_image + 1] == config.vision_end_token_id).all()
    text = ids[:, n_image + 2:]
    assert text.min() >= 0 and text.max() < min(config.image_token_id, config.vision_start_token_id)
    assert (labels[:, :n_image + 2] == -100).all() and torch.equal(labels[:, n_image + 2:], text)
    assert torch.equal(inputs["mm_token_type_ids"].cpu(), (ids == config.image_token_id).long())
    with pytest.raises(ValueError, match="--image-size"):
        train_hf.image_text_batch(_Model(config), batch, seq, torch.Generator(), size + 14)
    with pytest.raises(ValueError, match="--seq"):
        train_hf.image_text_batch(_Model(config), batch, n_image + 2, torch.Generator(), size)


def test_liger_skip_reason():
    assert "no Liger-Kernel patch function" in train_hf.liger_skip_reason("not_a_model_type")
    for model_type in ("qwen2_5_vl", "qwen3_moe"):
        reason = train_hf.liger_skip_reason(model_type)
        if importlib.util.find_spec("liger_kernel") is None:
            assert "not installed" in reason
        else:
            assert reason is None or train_hf.LIGER_PATCHES[model_type] in reason


@pytest.mark.exhaustive  # the benchmark script's own shapes: the families train in tests/integration
@pytest.mark.parametrize("shape", ["qwen2.5-vl-3b", "qwen3-moe"])
def test_tiny_training_patched_matches_hf(shape, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_hf, "DEVICE", DEVICE)
    model_type, kwargs = train_hf.TINY_SHAPES[shape]
    # one text layer: the interpreter's time goes mostly to per-layer launches (RoPE)
    if "text_config" in kwargs:
        kwargs = dict(kwargs, text_config=dict(kwargs["text_config"], num_hidden_layers=1))
    else:
        kwargs = dict(kwargs, num_hidden_layers=1)
    args = argparse.Namespace(shape=shape, seq=16, steps=1, warmup=1, timed_tokens=None, lr=1e-3, adamw="for-loop",
                              chunk_mib=None, compile_mode="default", dtype="float32",
                              image_size=train_hf.TINY_IMAGE_SIZE, batches=None, out=str(tmp_path), checkpointing="all",
                              memory_budget=None)
    state, n_params = train_hf.initial_state(model_type, kwargs, torch.float32)
    results = [train_hf.run_or_oom(impl, model_type, kwargs, state, args, 1) for impl in ("hf", "tigon", "tigon-class")]
    hf, tigon, tigon_class = results
    assert all("error" not in r for r in results), results
    assert "tigon patched" in tigon["report"] and tigon_class["report"].startswith("class patch")
    assert len(hf["losses"]) == len(tigon["losses"]) == 2  # the second after an AdamW step
    assert train_hf.first_loss_difference(hf, tigon) < 1e-4, (hf["losses"], tigon["losses"])
    assert tigon_class["losses"] == tigon["losses"]
    results = results[:2]
    train_hf.save(args, n_params, results, final=True)
    saved = json.loads((tmp_path / f"train_{shape}.json").read_text())
    assert saved["first_losses"] == {"hf": {"1": hf["losses"]}, "tigon": {"1": tigon["losses"]}}
    train_hf.print_table(results)
    assert f"| 1 | {train_hf._losses(hf)} | {train_hf._losses(tigon)} |" in capsys.readouterr().out


def test_sequence_sweep_table_json_and_plot(tmp_path, capsys):
    """--seqs: rows keyed by the sequence length at one batch size, an out-of-memory point kept."""
    rows = [dict(impl=impl, batch=4, seq=seq, tokens_per_s=1000.0 * seq, peak_gib=seq / 512, losses=[1.0, 0.9, 0.8])
            for impl in ("hf", "tigon") for seq in (512, 1024)]
    rows.append(dict(impl="hf", batch=4, seq=2048, error="out of memory"))
    args = argparse.Namespace(shape="llama-1b", seq=2048, seqs=[512, 1024, 2048], batch=4, batches=None,
                              out=str(tmp_path), dtype="bfloat16", checkpointing="all")
    assert train_hf.sweep_points(args) == [(4, 512), (4, 1024), (4, 2048)]
    train_hf.save(args, 10**9, rows, final=True)
    saved = json.loads((tmp_path / "train_llama-1b_seq_sweep.json").read_text())
    assert saved["first_losses"]["tigon"] == {"512": [1.0, 0.9, 0.8], "1024": [1.0, 0.9, 0.8]}
    assert (tmp_path / "train_llama-1b_seq_sweep.png").stat().st_size > 0
    train_hf.print_table(rows, "seq")
    out = capsys.readouterr().out
    assert "| seq | hf | tigon |" in out and "| 2048 | out of memory |  |" in out

