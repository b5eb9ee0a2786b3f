"""examples/dpo_with_trl.py: tigon's chunked DPO inside TRL's DPOTrainer trains like TRL's own loss."""

import pathlib
import runpy

import pytest

pytest.importorskip("trl")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dpo_with_trl.py"


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "nca_pair", "apo_zero", "discopop", "aot"])
def test_tigon_dpo_trainer_matches_trl(tmp_path, loss_type):
    import copy

    from trl import DPOTrainer

    example = runpy.run_path(str(EXAMPLE))
    namespace = example["TigonDPOTrainer"]._compute_loss.__globals__
    calls = []
    tigon_loss = namespace["dpo_loss"]
    namespace["dpo_loss"] = lambda *a, **k: calls.append(k["loss_type"]) or tigon_loss(*a, **k)
    model, tokenizer, data = example["tiny_setup"]()
    trl_losses = example["train"](DPOTrainer, copy.deepcopy(model), tokenizer, data, str(tmp_path / "trl"),
                                  loss_type=loss_type)
    ours = example["train"](example["TigonDPOTrainer"], model, tokenizer, data, str(tmp_path / "tigon"),
                            loss_type=loss_type)
    assert calls and set(calls) == {loss_type}, calls  # tigon's loss ran, not TRL's fallback
    assert len(ours) == len(trl_losses) == 3
    assert ours == pytest.approx(trl_losses, rel=5e-4)
