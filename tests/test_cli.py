import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.helpers import DEVICE
from tigon.bench.ops import OP_NAMES
from tigon.cli import build_parser, env_report, main
from tigon.planning import model_config as planner


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
    done = subprocess.run([sys.executable, "-m", "tigon", "bench", "rms_norm", "no_such_op", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tigon bench: error: argument op: invalid choice: 'no_such_op'" in done.stderr
    assert all(repr(name) in done.stderr for name in OP_NAMES)
    assert "'rms_norm', 'no_such_op'" not in done.stderr  # only the unknown name is reported as invalid
    assert "no CUDA GPU" not in done.stderr and not out.exists()


def test_bench_host_refuses_the_op_suites_arguments(capsys):
    for argv, flag in ((["bench", "--host", "rms_norm"], "op"), (["bench", "--host", "--quick"], "--quick"),
                       (["bench", "--host", "--memory-timeline"], "--memory-timeline"),
                       (["bench", "--host", "--seq", "64"], "--seq")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        assert f"tigon bench: error: argument {flag}: does not apply to --host" in capsys.readouterr().err


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


@pytest.mark.exhaustive  # two interpreted training runs (75 s); the default run trains every family
def test_demo_trains_both_models_alike(tmp_path):
    """The CPU demo, shortened: the console-script launcher, two runs, the JSON and the plot."""
    import json

    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "tigon", "demo", "--quick", "--steps", "3", "--no-progress",
                           "--device", DEVICE, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HF + tigon" in done.stdout
    record = json.loads((out / "demo.json").read_text())
    hf, tg = (r["losses"] for r in record["results"])
    assert len(hf) == len(tg) == 3
    # fp32 on the CPU: equal to rounding; bf16 on the GPU: the first step agrees to bf16 rounding.
    assert max(abs(a - b) for a, b in zip(hf, tg)) < 1e-4 if DEVICE == "cpu" else abs(hf[0] - tg[0]) < 1e-2


# Bad command-line input: (argv, the argument the error names, words of the message). "{tmp}"
# is a folder holding: empty/ (no config.json), no_model_type/, not_json/, a_list/,
# unknown_type/, bad_value/ (each a config.json as named) and a_file.
ARGS = "--seq 64".split()
BAD_INPUTS = {
    "plan: missing path": (["plan", "{tmp}/no/such/folder", *ARGS], "model", "no such file or folder"),
    "plan: folder without config.json": (["plan", "{tmp}/empty", *ARGS], "model", "has no config.json"),
    "plan: config without model_type": (["plan", "{tmp}/no_model_type", *ARGS], "model", 'no "model_type"'),
    "plan: config.json not JSON": (["plan", "{tmp}/not_json/config.json", *ARGS], "model", "not valid JSON"),
    "plan: config.json a JSON list": (["plan", "{tmp}/a_list", *ARGS], "model", "JSON list"),
    "plan: unknown model_type": (["plan", "{tmp}/unknown_type", *ARGS], "model", "'no_such_family'"),
    "plan: config value of the wrong type": (["plan", "{tmp}/bad_value", *ARGS], "model", "'hidden_size'"),
    "plan: unknown shape": (["plan", "llama-1B", *ARGS], "model", "'llama-1b', 'qwen2.5-0.5b'"),
    "plan: hub id, offline, not cached": (["plan", "tigon-tests/no-such-model", *ARGS], "model", "HF_HUB_OFFLINE"),
    "plan: not a hub id": (["plan", "tigon-tests/no..such", *ARGS], "model", "not a folder here nor a valid hub id"),
    "plan: vision-language model": (["plan", "qwen2.5-vl-3b", *ARGS], "model", "causal language models"),
    "plan: --seq 0": (["plan", "llama-1b", "--seq", "0"], "--seq", "positive integer, got 0"),
    "plan: --seq not a number": (["plan", "llama-1b", "--seq", "1k"], "--seq", "positive integer, got '1k'"),
    "plan: --batch -1": (["plan", "llama-1b", *ARGS, "--batch", "-1"], "--batch", "positive integer, got -1"),
    "plan: --gpu-memory 0": (["plan", "llama-1b", *ARGS, "--gpu-memory", "0"], "--gpu-memory", "80GiB"),
    "plan: --gpu-memory a word": (["plan", "llama-1b", *ARGS, "--gpu-memory", "plenty"], "--gpu-memory", "'plenty'"),
    "plan: --checkpointing -1": (["plan", "llama-1b", *ARGS, "--checkpointing", "-1"], "--checkpointing", "'all'"),
    "plan: unknown optimizer": (["plan", "llama-1b", *ARGS, "--optimizer", "adam"], "--optimizer", "'adamw8bit'"),
    "plan: unknown dtype": (["plan", "llama-1b", *ARGS, "--dtype", "fp16"], "--dtype", "'bfloat16', 'float32'"),
    "plan: --json in a missing folder": (["plan", "llama-1b", *ARGS, "--json", "{tmp}/no/plan.json"], "--json",
                                         "does not exist"),
    "plan: --json a folder": (["plan", "llama-1b", *ARGS, "--json", "{tmp}"], "--json", "give a file"),
    "demo: --steps 0": (["demo", "--steps", "0"], "--steps", "positive integer, got 0"),
    "demo: --steps -3": (["demo", "--steps", "-3"], "--steps", "positive integer, got -3"),
    "demo: unknown device": (["demo", "--device", "tpu"], "--device", "'cuda', 'cpu'"),
    "demo: --out a file": (["demo", "--out", "{tmp}/a_file"], "--out", "give a folder"),
    "bench: unknown op": (["bench", "rms_norm", "no_such_op"], "op", "'fused_linear_cross_entropy'"),
    "bench: --out a file": (["bench", "--out", "{tmp}/a_file"], "--out", "give a folder"),
    "bench: unknown timeline shape": (["bench", "--memory-timeline", "--model", "llama-9b"], "--model", "'llama-8b'"),
    "bench: timeline of a missing config": (["bench", "--memory-timeline", "--model", "{tmp}/empty"], "--model",
                                            "has no config.json"),
    "bench: timeline of a VLM": (["bench", "--memory-timeline", "--model", "qwen2.5-vl-3b"], "--model",
                                 "causal language models"),
    "bench: timeline --batch 0": (["bench", "--memory-timeline", "--batch", "0"], "--batch", "positive integer"),
    "bench: timeline --seq -1": (["bench", "--memory-timeline", "--seq", "-1"], "--seq", "positive integer"),
    "bench: ops with the timeline": (["bench", "--memory-timeline", "rms_norm"], "op", "--memory-timeline"),
    "bench: --model without the timeline": (["bench", "--model", "llama-1b"], "--model", "--memory-timeline"),
    "bench: --batch without the timeline": (["bench", "--batch", "4"], "--batch", "--memory-timeline"),
}


def _bad_configs(folder: Path):
    (folder / "empty").mkdir()
    for name, text in (("no_model_type", '{"hidden_size": 64}'), ("not_json", '{"model_type": "llama",'),
                       ("a_list", "[1, 2]"), ("unknown_type", '{"model_type": "no_such_family"}'),
                       ("bad_value", '{"model_type": "llama", "hidden_size": "big"}')):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(text)
    (folder / "a_file").write_text("not a folder")


@pytest.fixture
def offline(monkeypatch):
    """No network: huggingface_hub offline, and the check that the hub answers fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(planner, "_hub_unreachable", lambda: pytest.fail("the hub was probed"))


def _error_line(argv, capsys) -> str:
    """The CLI's one stderr line for ``argv``, checked: exit status 2, nothing else printed."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr()
    assert done.value.code == 2, out.err
    assert "Traceback" not in out.err and out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


@pytest.mark.parametrize("argv, argument, words", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_naming_the_argument(argv, argument, words, tmp_path, capsys, offline):
    """Every subcommand's bad input ends in one stderr line, 'tigon <command>: error: argument
    <name>: <what is wrong, what to give>', exit status 2, before any work (in-process: the same
    code path as the console script, without a torch import per case)."""
    _bad_configs(tmp_path)
    line = _error_line([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert line.startswith(f"tigon {argv[0]}: error: argument {argument}: "), line
    assert words in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the demo would run")
def test_demo_on_cuda_without_a_gpu_is_one_line(capsys):
    line = _error_line(["demo", "--device", "cuda"], capsys)
    assert line.startswith("tigon demo: error: argument --device: ") and "--device cpu" in line


@pytest.mark.parametrize("argv, words", [(["plna"], "choose from 'env', 'demo', 'bench', 'plan'"),
                                         (["plan", "llama-1b"], "required: --seq"),
                                         (["env", "--verbose"], "unrecognized arguments: --verbose")])
def test_argparse_errors_are_one_line(argv, words, capsys):
    line = _error_line(argv, capsys)
    assert line.startswith("tigon") and words in line, line


def test_options_parse_to_their_values():
    parser, _ = build_parser()
    args = parser.parse_args("plan llama-1b --seq 512 --batch 4 --gpu-memory 80GiB --checkpointing 3".split())
    assert (args.seq, args.batch, args.gpu_memory, args.checkpointing) == (512, 4, 80 * 2**30, 3)
    assert parser.parse_args("plan x --seq 1 --checkpointing all".split()).checkpointing == "all"
    assert parser.parse_args("plan x --seq 1 --checkpointing 0".split()).checkpointing == 0
    assert parser.parse_args("demo --steps 3".split()).steps == 3
    bench = parser.parse_args("bench --memory-timeline --batch 2 --seq 128".split())
    assert (bench.model, bench.batch, bench.seq) == (None, 2, 128)  # the defaults come with --memory-timeline


def _fake_hub_cache(cache: Path, repo_id: str, config: dict) -> Path:
    """The layout huggingface_hub leaves after downloading ``repo_id``'s config.json."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=1000)


def test_hub_id_comes_from_the_cache_offline_or_when_the_hub_does_not_answer(tmp_path, monkeypatch, offline):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _fake_hub_cache(tmp_path, "tigon-tests/tiny-llama", TINY)
    config = planner.load_config("tigon-tests/tiny-llama")
    assert config.model_type == "llama" and config.hidden_size == 64
    assert config._name_or_path == "tigon-tests/tiny-llama"  # what plan's report names

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(planner, "_hub_unreachable", lambda: "huggingface.co:443: Name or service not known")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("downloaded"))
    assert planner.load_config("tigon-tests/tiny-llama").hidden_size == 64
    with pytest.raises(planner.ConfigError, match="the hub does not answer .huggingface.co:443: Name or service"):
        planner.load_config("tigon-tests/not-cached")


def _hub_error(cls, message="404 Client Error"):
    return cls(message, response=types.SimpleNamespace(headers={}, request=None))


@pytest.mark.parametrize("error, words", [
    (lambda: _hub_error(__import__("huggingface_hub").errors.RepositoryNotFoundError), "nor a model on the hub"),
    (lambda: _hub_error(__import__("huggingface_hub").errors.GatedRepoError), "is gated"),
    (lambda: _hub_error(__import__("huggingface_hub").errors.RemoteEntryNotFoundError), "has no config.json"),
    (lambda: _hub_error(__import__("huggingface_hub").errors.HfHubHTTPError, "500 Server Error"), "500 Server"),
])
def test_hub_failures_are_config_errors(error, words, monkeypatch, tmp_path):
    """With the hub answering (the probe and the download stubbed: no network), each of its
    refusals is a one-line ConfigError; a download gives the config, named by its hub id."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(planner, "_hub_unreachable", lambda: None)

    def refuse(*args, **kwargs):
        raise error()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(planner.ConfigError, match=words) as raised:
        planner.load_config("tigon-tests/tiny-llama")
    assert "\n" not in str(raised.value)
    downloaded = _fake_hub_cache(tmp_path / "elsewhere", "tigon-tests/tiny-llama", TINY)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename: str(downloaded))
    assert planner.load_config("tigon-tests/tiny-llama")._name_or_path == "tigon-tests/tiny-llama"


def test_plan_progress_is_lines_when_not_a_terminal(capsys, monkeypatch):
    """Piped (stderr not a terminal), tigon plan says at once that it searches, then every
    PROGRESS_EVERY_S how many steps it traced."""
    from tigon import cli

    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    progress = cli._trace_progress(searching=True)
    progress()
    progress()
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("tigon plan: searching batch sizes") and len(lines) == 4
    assert lines[1].startswith("tigon plan: 1 step traced") and lines[-1].startswith("tigon plan: 2 steps traced in")
