import subprocess
import sys

import pytest

from tests.helpers import DEVICE
from tigon.cli import env_report, main


def test_env_reports_versions_and_how_kernels_run():
    report = env_report()
    for word in ("torch", "triton", "transformers", "GPU", "kernels"):
        assert word in report
    assert "interpreted" in report or "compiled" in report


def test_bench_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bench would run")
    assert main(["bench", "--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_demo_trains_both_models_alike(tmp_path):
    """The CPU demo, shortened: the console-script launcher, two runs, the JSON and the plot."""
    import json

    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "tigon_cli", "demo", "--quick", "--steps", "3", "--no-progress",
                           "--device", DEVICE, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HF + tigon" in done.stdout
    record = json.loads((out / "demo.json").read_text())
    hf, tg = (r["losses"] for r in record["results"])
    assert len(hf) == len(tg) == 3
    # fp32 on the CPU: equal to rounding; bf16 on the GPU: the first step agrees to bf16 rounding.
    assert max(abs(a - b) for a, b in zip(hf, tg)) < 1e-4 if DEVICE == "cpu" else abs(hf[0] - tg[0]) < 1e-2
