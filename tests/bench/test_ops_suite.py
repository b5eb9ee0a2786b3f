"""The op suite's list of op names (tigon.bench.cases.OP_NAMES, as tigon.bench.ops gives it): the
one list that `tigon bench`, ``python -m tigon.bench.ops --ops`` and ``run`` check names against.
CPU: nothing is measured."""

import pytest

from tigon.bench import ops as suite
from tigon.bench.cases import Case


def test_unknown_op_error_lists_the_unknown_names_and_every_valid_one():
    assert suite.unknown_op_error(suite.OP_NAMES) is None and suite.unknown_op_error([]) is None
    message = suite.unknown_op_error(["rms_norm", "rmsnorm", "rope2"])
    assert message.startswith("invalid choice: 'rmsnorm', 'rope2' (choose from ")
    assert all(repr(name) in message for name in suite.OP_NAMES)


def test_module_cli_rejects_an_unknown_op(capsys):
    with pytest.raises(SystemExit) as done:
        suite.main(["--ops", "layer_norm", "no_such_op"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --ops: invalid choice: 'no_such_op'" in err and "'fused_linear_cross_entropy'" in err


def test_run_rejects_an_unknown_op_before_measuring(tmp_path):
    with pytest.raises(ValueError, match=r"^ops: invalid choice: 'no_such_op'"):
        suite.run(["no_such_op"], out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_case_must_name_a_listed_op():
    with pytest.raises(ValueError, match="not in OP_NAMES"):
        Case("rmsnorm", "8x8", lambda: [], {})
    assert Case("rms_norm", "8x8", lambda: [], {}).op == "rms_norm"
