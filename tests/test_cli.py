import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEVICE
from tigon.bench.ops import OP_NAMES
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
    assert main(["bench", "rms_norm", "fused_linear_cross_entropy"]) == 2  # known names reach the GPU check
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bench_rejects_unknown_op_names_before_the_gpu_check(tmp_path):
    """Through the console-script launcher, as a user runs it (no interpreter flag), on any
    machine: an argparse error naming the bad op and listing the valid ones, exit status 2,
    nothing measured or written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "tigon_cli", "bench", "rms_norm", "no_such_op", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tigon bench: error: argument op: invalid choice: 'no_such_op'" in done.stderr
    assert all(repr(name) in done.stderr for name in OP_NAMES)
    assert "'rms_norm', 'no_such_op'" not in done.stderr  # only the unknown name is reported as invalid
    assert "no CUDA GPU" not in done.stderr and not out.exists()


def test_version_prints_tigon_and_its_version(capsys):
    import tigon

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"tigon {tigon.__version__}\n"


def test_package_metadata_takes_its_version_from_tigon():
    """One owner for the version: pyproject.toml declares it dynamic, read from tigon.__version__."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tigon.__version__"}


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
