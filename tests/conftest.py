"""Where the kernels run in this test session, chosen once:

- ``TRITON_INTERPRET=1``: CPU tensors through Triton's interpreter, small odd shapes (CI).
- otherwise, with CUDA: compiled kernels on the GPU, realistic shapes, plus the ``gpu``-marked
  cases. ``pytest --gpu`` insists on this mode and fails at once without a GPU.
"""

import pytest

from tests import helpers


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run on the CUDA GPU (compiled kernels); fail if none")


def pytest_configure(config):
    if config.getoption("--gpu") and helpers.DEVICE != "cuda":
        raise pytest.UsageError("--gpu needs a CUDA GPU and TRITON_INTERPRET unset")


def pytest_report_header(config):
    return f"tigon kernels on: {helpers.DEVICE or 'nowhere (no CUDA and TRITON_INTERPRET unset)'}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and helpers.DEVICE != "cuda":
            item.add_marker(pytest.mark.skip(reason="GPU-only case (run with --gpu on a CUDA machine)"))
        elif helpers.DEVICE is None and "kernels" in item.fixturenames:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU, and TRITON_INTERPRET=1 is not set"))


@pytest.fixture(autouse=True)
def kernels(request):
    """Every test runs with output poisoning on (unwritten elements show up as NaN) and its own
    seed: reproducible, independent of test order; TIGON_TEST_SEED=k draws other inputs."""
    import os
    import zlib

    import torch

    from tigon.ops._common import set_poison_outputs

    set_poison_outputs(True)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("TIGON_TEST_SEED", "0")))
    yield helpers.DEVICE
