"""Where the kernels run in this test session, chosen once:

- ``TRITON_INTERPRET=1``: CPU tensors through Triton's interpreter, small odd shapes (CI).
- otherwise, with CUDA: compiled kernels on the GPU, realistic shapes, plus the ``gpu``-marked
  cases. ``pytest --gpu`` insists on this mode and fails at once without a GPU.

Which tests run: by default a representative subset of each parametrised test (``tests/tiers.py``)
and none marked ``exhaustive`` (slow checks of what the default run covers otherwise: the demo
run again, the benchmark harness); ``--exhaustive`` runs them all (CI does).

Each test process compiles into caches of its own (Inductor's and Triton's, in a temporary folder
removed at the end), so two runs on one machine never read each other's half-written files.
"""

import gc
import os
import shutil
import tempfile
import zlib

_CACHE_ROOT = tempfile.mkdtemp(prefix="tigon-test-caches-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "triton")

import pytest  # noqa: E402

from tests import helpers  # noqa: E402  (imports torch and triton: after the cache folders are set)
from tests.tiers import representative  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run on the CUDA GPU (compiled kernels); fail if none")
    parser.addoption("--exhaustive", action="store_true",
                     help="every parameter combination, not a representative subset of each test (CI)")
    parser.addoption("--part", default=None, metavar="K/N",
                     help="only part K of N of the selected tests (by a hash of each test's id): a run split "
                          "across time-limited calls, e.g. GPU leases")


def pytest_configure(config):
    if config.getoption("--gpu") and helpers.DEVICE != "cuda":
        raise pytest.UsageError("--gpu needs a CUDA GPU and TRITON_INTERPRET unset")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # pytest-xdist's processes share the cores: torch's threads each, not every core each
        # (2 workers of 2 threads on 2 cores spend their time switching).
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


def pytest_report_header(config):
    tier = "every combination (--exhaustive)" if config.getoption("--exhaustive") else "representative subset"
    return [f"tigon kernels on: {helpers.DEVICE or 'nowhere (no CUDA and TRITON_INTERPRET unset)'}",
            f"tigon tests: {tier}; caches in {_CACHE_ROOT}"]


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--exhaustive"):
        keep = representative(item for item in items if "exhaustive" not in item.keywords)
        dropped = [item for item in items if item not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item in keep]
    part = config.getoption("--part")
    if part:
        k, n = _part(part)
        mine = {item.nodeid for item in items if zlib.crc32(item.nodeid.encode()) % n == k - 1}
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in mine])
        items[:] = [item for item in items if item.nodeid in mine]
    for item in items:
        if "gpu" in item.keywords and helpers.DEVICE != "cuda":
            item.add_marker(pytest.mark.skip(reason="GPU-only case (run with --gpu on a CUDA machine)"))
        elif helpers.DEVICE is None and "kernels" in item.fixturenames:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU, and TRITON_INTERPRET=1 is not set"))


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--part takes K/N with 1 <= K <= N, got {text!r}")
    return k, n


def pytest_runtest_logreport(report):
    """With TIGON_TEST_LOG=path, each test's id, outcome, seconds and (for a failure) first error
    line are appended there as it finishes: a run cut short by a time limit (a GPU lease) still
    says what ran, what failed and what took the time."""
    path = os.environ.get("TIGON_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and not (report.failed or report.skipped or report.duration >= 1.0):
        return  # a setup or teardown: only when it failed, skipped or took a second
    error = ""
    if report.failed:
        lines = str(report.longrepr).strip().splitlines()
        errors = [line for line in lines if line.startswith("E ")] or lines[-1:]
        error = errors[0][:300] if errors else ""
    with open(path, "a") as log:
        log.write(f"{report.nodeid}\t{report.outcome} ({report.when})\t{report.duration:.1f}\t{error}\n")


@pytest.fixture(autouse=True)
def kernels(request):
    """Every test runs with output poisoning on (unwritten elements show up as NaN) and its own
    seed: reproducible, independent of test order; TIGON_TEST_SEED=k draws other inputs."""
    import torch

    from tigon.ops._common import set_poison_outputs

    set_poison_outputs(True)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("TIGON_TEST_SEED", "0")))
    precision = helpers.fp32_matmul_settings()
    yield helpers.DEVICE
    # HF's TrainingArguments(torch_compile=True) turns TF32 on for the whole process: fp32 tests
    # that ran after it in the same worker compared TF32 matmuls with HF's (6e-4 apart, H200).
    assert helpers.fp32_matmul_settings() == precision, "the test changed the process's fp32 matmul precision"
    if helpers.DEVICE == "cuda":
        # Test processes share one GPU (pytest-xdist): what a test's tensors held goes back to the
        # GPU, not to this process's cache (12 workers' caches once left no room on an H200).
        gc.collect()
        torch.cuda.empty_cache()
