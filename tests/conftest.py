"""Test configuration: GPU tests skip here, in one place, when there is no CUDA device."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def prefill():
    """A prefill engine in a child process, driven over a pipe (kvcopy.testing.nixl.engines)."""
    from kvcopy.testing.nixl.engines import PrefillProcess, one_torch_thread

    proc = PrefillProcess()
    with one_torch_thread():
        yield proc
    proc.stop()
