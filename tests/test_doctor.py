"""``tigon doctor``: it passes where tigon is right, fails (exit status 1) where an op or a patched
family is wrong, NaN included, reports through --json everything it checked with the versions,
refuses unknown names as argparse does, and checks every op of the suite."""

import json
import math

import pytest
import torch

from tests.helpers import DEVICE
from tigon import doctor, tiny_models
from tigon import functional as TF
from tigon.bench.cases import OP_NAMES
from tigon.cli import main
from tigon.patching import FAMILIES

DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"


@pytest.fixture(autouse=True)
def _checks_in_this_process(monkeypatch):
    """The checks run in this process (default_workers spreads them over spawned processes on a
    GPU), so the tests' monkeypatched faults reach them; test_worker_processes_... asks for 2."""
    monkeypatch.setattr(doctor, "default_workers", lambda device: 1)


def test_every_op_of_the_suite_is_checked_at_two_shapes_one_odd():
    checks = doctor.op_checks()
    assert list(checks) == list(OP_NAMES)
    for op, check in checks.items():
        for kind in ("cpu", "gpu"):
            regular, odd = check.shapes[kind]
            assert any(size % 2 for size in odd), f"{op}: no odd size in {odd} ({kind})"


def test_every_family_row_has_a_tiny_model():
    """A text row's *ForCausalLM, a vision-language row's case in VLM_CASES, or (a vision tower) the
    model of the row that hosts it."""
    for name in FAMILIES:
        host = FAMILIES[doctor.HOSTED_BY.get(name, name)]
        if host.conditional_generation:
            assert host.model_types[0] in tiny_models.VLM_CASES, name
        else:
            assert host.causal_lm, name


def test_a_few_ops_and_a_family_pass_and_the_json_has_everything(capsys):
    """Through the command: exit status 0, the report on stderr (JSON on stdout), a progress line
    a check (stderr is no terminal here), every check and the versions in the JSON."""
    ops = ["rms_norm", "cross_entropy"]
    status = main(["doctor", "--ops", *ops, "--families", "llama", "--json", "-", "--no-compile", "--workers", "1"])
    out, err = capsys.readouterr()
    assert status == 0, err
    result = json.loads(out)
    n = 7 if DEVICE == "cuda" else 5  # 4 op checks, 1 family, then 2 timings on a GPU
    assert f"tigon doctor: [1/{n}] rms_norm" in err and "[5/" in err and "] family llama" in err
    assert DEVICE != "cuda" or f"[{n}/{n}] timing cross_entropy" in err
    assert err.rstrip().splitlines()[-1].startswith("tigon is healthy here: 5 checks passed")
    env = result["environment"]
    for key in ("python", "tigon", "torch", "triton", "transformers", "cuda", "gpu", "capability", "kernels"):
        assert key in env
    assert env["torch"] == torch.__version__ and env["kernels"] == ("compiled" if DEVICE == "cuda" else "interpreted")
    assert [(r["op"], r["dtype"], r["passed"]) for r in result["ops"]] == [(op, DTYPE, True) for op in ops
                                                                           for _ in range(2)]
    assert all(0 <= r["max_error"] <= r["tolerance"] for r in result["ops"])
    [family] = result["families"]
    assert family["family"] == "llama" and family["status"] == "passed", family
    assert {"loss", "rms_norm", "rope", "swiglu"} <= set(family["pieces"])
    assert family["loss_diff"] <= family["loss_tolerance"] and family["grads_diff"] <= family["grads_tolerance"]
    assert result["status"] == 0 and result["failed"] == [] and result["settings"]["families"] == ["llama"]
    if DEVICE == "cuda":
        assert [t["op"] for t in result["timings"]] == ops and all(t["vs_eager"] for t in result["timings"])
    else:
        assert result["timings"] == [] and "vs eager / vs compile: —" in err


def test_worker_processes_give_the_rows_of_one_process():
    """--workers 2: the checks in two spawned processes, their rows in the same order and equal
    (each check seeds from its own name, shape and dtype)."""
    alone = doctor.run(ops=["rms_norm", "swiglu"], families=["llama"], progress=False, workers=1)
    spread = doctor.run(ops=["rms_norm", "swiglu"], families=["llama"], progress=False, workers=2)
    assert spread["settings"]["workers"] == 2 and spread["status"] == 0
    for part, keys in (("ops", ("op", "shape", "max_error", "passed")), ("families", ("family", "loss_diff"))):
        assert [[r[k] for k in keys] for r in spread[part]] == [[r[k] for k in keys] for r in alone[part]]


def _run_rms_norm():
    result = doctor.run(ops=["rms_norm"], families=["none"], progress=False)
    assert len(result["ops"]) == 2
    return result


@pytest.mark.parametrize("fault", ["output off by 5%", "gradient off by 5%", "a NaN"])
def test_a_broken_op_fails_its_checks(fault, monkeypatch, capsys):
    right = TF.rms_norm

    def broken(x, weight, *args, **kwargs):
        y = right(x, weight, *args, **kwargs)
        if fault == "output off by 5%":  # more than bf16's tolerance (1.2e-2) on a GPU
            return y * 1.05
        if fault == "gradient off by 5%":
            return y + (y - y.detach()) * 0.05  # the same values, gradients 1.05 times
        return torch.where(torch.arange(y.shape[-1], device=y.device) == 3, float("nan"), y)

    monkeypatch.setattr(TF, "rms_norm", broken)
    result = _run_rms_norm()
    assert [r["passed"] for r in result["ops"]] == [False, False]
    for r in result["ops"]:
        errors, tol = r["errors"], r["tolerance"]
        assert set(errors) == {"output", "grad of x", "grad of weight"} and r["max_error"] == max(errors.values())
        if fault == "gradient off by 5%":
            assert errors["output"] <= tol < min(errors["grad of x"], errors["grad of weight"])
        elif fault == "a NaN":
            assert errors["output"] == r["max_error"] == math.inf
        else:
            assert errors["output"] > tol
    assert result["status"] == 1
    assert result["verdict"] == (f"2 checks failed: rms_norm {result['ops'][0]['shape']}, "
                                 f"rms_norm {result['ops'][1]['shape']}")
    assert main(["doctor", "--ops", "rms_norm", "--families", "none", "--no-progress"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_an_op_that_raises_fails_with_the_error(monkeypatch):
    def raising(*args, **kwargs):
        raise RuntimeError("kernel launch failed\nmore lines")

    monkeypatch.setattr(TF, "rms_norm", raising)
    result = _run_rms_norm()
    assert [r["error"] for r in result["ops"]] == ["RuntimeError: kernel launch failed"] * 2
    assert result["status"] == 1


@pytest.mark.parametrize("fault", ["loss", "a piece left out"])
def test_a_wrong_patch_fails_its_family(fault, monkeypatch):
    """The family check fails when the patched model trains otherwise than HF's (here: noise added
    to its head's weights after patching), or when the row's pieces are not all patched."""
    right = doctor.patch

    def wrong(model, **kwargs):
        if fault == "a piece left out":
            return right(model, rope=False, **kwargs)
        report = right(model, **kwargs)
        with torch.no_grad():
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        return report

    monkeypatch.setattr(doctor, "patch", wrong)
    result = doctor.run(ops=["none"], families=["llama"], progress=False)
    [row] = result["families"]
    assert row["status"] == "failed" and result["status"] == 1 and result["failed"] == ["family llama"]
    if fault == "loss":
        assert row["loss_diff"] > row["loss_tolerance"] and row["reason"].startswith("loss ")
    else:
        assert row["reason"] == "not patched: rope"


def test_a_family_this_transformers_cannot_build_is_skipped(monkeypatch):
    def unavailable(model_type, *args, **kwargs):
        raise tiny_models.ModelUnavailable(f"transformers 0.0 has no model type {model_type!r}")

    monkeypatch.setattr(tiny_models, "tiny_model", unavailable)
    result = doctor.run(ops=["relu_squared"], families=["gemma2"], progress=False)
    assert result["families"] == [{**result["families"][0], "status": "skipped",
                                   "reason": "transformers 0.0 has no model type 'gemma2'"}]
    assert result["status"] == 0 and result["skipped"] == ["family gemma2"]
    assert result["verdict"].startswith("tigon is healthy here: 2 checks passed, 1 skipped in ")
    assert "skipped  transformers 0.0 has no model type 'gemma2'" in doctor.report(result)


def test_unknown_names_are_argparse_errors(capsys):
    for argv, flag, what in ((["--ops", "rms_norm", "rms_nrom"], "--ops", "op"),
                             (["--families", "lama"], "--families", "family")):
        with pytest.raises(SystemExit) as done:
            main(["doctor", *argv])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert f"tigon doctor: error: argument {flag}: invalid {what}: '{argv[-1]}' (choose from" in err
        known = OP_NAMES if flag == "--ops" else FAMILIES
        assert all(repr(name) in err for name in known) and "or all, or none" in err
    with pytest.raises(ValueError, match="invalid op: 'nope'"):
        doctor.run(ops=["nope"])


def test_json_to_a_file_is_strict_json(tmp_path, monkeypatch):
    """Non-finite errors become strings: the file parses as strict JSON (jq, other languages)."""
    right = TF.rms_norm
    monkeypatch.setattr(TF, "rms_norm", lambda x, w, *a, **k: right(x, w) * float("nan"))
    path = tmp_path / "doctor.json"
    assert main(["doctor", "--ops", "rms_norm", "--families", "none", "--no-progress", "--json", str(path)]) == 1

    def no_constants(name):
        raise ValueError(f"not strict JSON: {name}")

    result = json.loads(path.read_text(), parse_constant=no_constants)
    assert [r["max_error"] for r in result["ops"]] == ["inf", "inf"]
