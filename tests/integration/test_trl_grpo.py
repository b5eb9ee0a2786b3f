"""examples/grpo_with_trl.py: tigon's chunked GRPO inside TRL's GRPOTrainer trains like TRL's own
loss: the same logged losses, gradient norms and KL over a few steps (fp32, so that the runs'
samples stay the same), with tigon's loss really in use."""

import copy
import pathlib
import runpy

import pytest

pytest.importorskip("trl")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "grpo_with_trl.py"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo"])
def test_tigon_grpo_trainer_matches_trl(tmp_path, loss_type):
    from trl import GRPOTrainer

    example = runpy.run_path(str(EXAMPLE))
    trainer_class = example["TigonGRPOTrainer"]
    namespace = trainer_class._compute_loss.__globals__
    calls = []
    tigon_loss = namespace["grpo_loss"]
    namespace["grpo_loss"] = lambda *a, **k: calls.append(k["loss_type"]) or tigon_loss(*a, **k)
    model, tokenizer, data = example["tiny_setup"]()
    config = dict(loss_type=loss_type, bf16=False, epsilon_high=5.0 if loss_type == "cispo" else None)
    trl_log = example["train"](GRPOTrainer, copy.deepcopy(model), tokenizer, data, str(tmp_path / "trl"), **config)
    ours = example["train"](trainer_class, model, tokenizer, data, str(tmp_path / "tigon"), **config)
    assert calls and set(calls) == {loss_type}, calls
    assert len(ours) == len(trl_log) == 3
    for step, (a, b) in enumerate(zip(trl_log, ours)):
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key, a, b)
