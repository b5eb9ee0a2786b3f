"""The extras (pyproject.toml's optional dependencies, read back from the installed metadata) and the
one-line error naming the extra a command or function needs. scripts/check_package.sh checks the
same in fresh venvs with each extra alone (CI)."""

from pathlib import Path

import pytest

from tigon import extras as extras_module
from tigon.cli import main
from tigon.extras import MissingExtra, extras, missing_from, require_extra

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def test_extras_are_pyprojects_with_tigons_own_expanded():
    declared = PYPROJECT["project"]["optional-dependencies"]
    found = extras()
    assert set(found) == set(declared)
    assert found["hf"] == ("transformers", "accelerate")
    assert set(found["hf"]) < set(found["demo"]) and set(found["hf"]) < set(found["trl"])
    assert {"tokenizers", "matplotlib", "tqdm"} <= set(found["demo"])
    assert {"trl", "datasets", "peft", "pytest"} <= set(found["test"])  # test = demo + trl + pytest ...
    assert set(found["test"]) | set(found["docs"]) == set(found["dev"])
    assert "tigon" not in {d for dists in found.values() for d in dists}


def test_an_uninstalled_source_tree_reads_pyproject(monkeypatch):
    """PYTHONPATH=src (the GPU scripts): no metadata, the same extras from pyproject.toml."""
    installed = {extra: set(dists) for extra, dists in extras().items()}

    def no_metadata(name):
        raise extras_module.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(extras_module.metadata, "requires", no_metadata)
    extras.cache_clear()
    try:
        assert {extra: set(dists) for extra, dists in extras().items()} == installed
    finally:
        extras.cache_clear()


def test_missing_extra_names_the_extra_in_one_line(monkeypatch):
    monkeypatch.setattr(extras_module, "_installed", lambda dist: dist != "tokenizers")
    assert missing_from("demo") == ["tokenizers"] and missing_from("hf") == []
    require_extra("hf", "x")  # nothing missing: no error
    with pytest.raises(MissingExtra) as caught:
        require_extra("demo", "tigon demo")
    assert str(caught.value) == 'tigon demo needs tokenizers, which is not installed: pip install "tigon[demo]"'
    assert isinstance(caught.value, ImportError) and caught.value.extra == "demo"
    with pytest.raises(ValueError, match="extra must be one of"):
        missing_from("no_such_extra")


@pytest.mark.parametrize("argv, extra", [(["demo", "--quick"], "demo"), (["plan", "llama-1b", "--seq", "64"], "hf")])
def test_commands_say_which_extra_to_install(monkeypatch, capsys, argv, extra):
    monkeypatch.setattr(extras_module, "_installed", lambda dist: dist not in ("transformers", "tokenizers"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tigon {argv[0]}: error: ")
    assert f'pip install "tigon[{extra}]"' in err
