"""benchmarks/bench_losses.py runs on the CPU (tiny shapes) and its implementations of one case
compute the same loss: the timed rows are of the same computation."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.exhaustive  # the benchmark's implementations: the losses are checked in tests/losses
@pytest.mark.parametrize("loss", ["grpo", "dpo"])
def test_loss_benchmark_implementations_agree(tmp_path, loss):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TRITON_INTERPRET="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_losses.py"), "--device", "cpu",
                    "--losses", loss, "--batch", "2", "--seq", "12", "--hidden", "24", "--vocab", "97",
                    "--grpo-vocab", "101", "--reps", "1", "--out", str(tmp_path)], check=True, env=env,
                   capture_output=True, timeout=600)
    rows = json.load(open(tmp_path / "losses.json"))["rows"]
    losses = {r["impl"]: r["loss"] for r in rows if not r["impl"].startswith("3 matmuls")}
    assert "error" not in str(rows) and {"tigon", "torch"} <= set(losses), rows
    assert max(losses.values()) - min(losses.values()) < 2e-2 * max(1.0, abs(losses["torch"])), losses
