"""kvcopy.copy_backends.ce: the copy engines, one cuMemcpyBatchAsync per call.

Without a device: what it says and what it refuses. With one (``gpu`` tests): the
shared cases bit-exact in both directions, in the batch and the loop modes, on a
side stream and on the legacy default stream.
"""
import pytest
import torch

import kvcopy
from kvcopy.copy_backends import ce
from kvcopy.testing import CopyCase, check_copy, standard_cases

CASES = standard_cases()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what is said without a device")
def test_without_a_device_ce_is_unavailable_and_says_why():
    backend = ce.CopyEngineBackend()
    assert "no CUDA device here" in backend.unavailable_reason()
    assert backend.batch_abi() == 0  # nothing resolved: the loop is all there would be
    assert "no CUDA device here" in kvcopy.available_copy_backends()["ce"]
    case = CopyCase(num_groups=1)
    dev, host = case.build()
    with pytest.raises(ValueError, match="backend 'ce' is not available"):
        kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="ce")


def test_host_only_tables_are_not_a_copy_engine_copy():
    case = CopyCase(num_groups=1)
    dev, host = case.build()
    tables = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="torch").tables("d2h")
    assert "needs a CUDA tensor on one side" in ce.CopyEngineBackend().unsupported_reason(tables)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ce_bit_exact(case, direction):
    check_copy("ce", case, direction, device="cuda").close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["loop", "batch"])
def test_ce_modes(mode, monkeypatch):
    from kvcopy.copy_backends import get_backend

    backend = get_backend("ce")
    if mode == "batch" and backend.batch_abi() == 0:
        pytest.fail("the driver of the GPU machine (CUDA 13) must offer cuMemcpyBatchAsync")
    monkeypatch.setenv("KVCOPY_CE_MODE", mode)
    case = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48)
    for direction in ("h2d", "d2h"):
        with torch.cuda.stream(torch.cuda.Stream()):  # a non-legacy stream: batch runs directly
            check_copy("ce", case, direction, device="cuda").close()
        check_copy("ce", case, direction, device="cuda").close()  # legacy stream: side stream


@pytest.mark.gpu
def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("KVCOPY_CE_MODE", "fast")
    case = CopyCase(num_groups=1)
    dev, host = case.build("cuda")
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="ce")
    with pytest.raises(ValueError, match="KVCOPY_CE_MODE must be one of"):
        copier.to_host([[0]])
    copier.close()
