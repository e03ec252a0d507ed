"""kvcopy.copy_backends.cudalib: libkvcopy_cuda through ctypes, and CUDA error names."""
import os
import shutil

import pytest

from kvcopy.copy_backends import cudalib
from kvcopy import native

NVCC = next((p for p in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                         os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
             if p and os.path.isfile(p)), None)


@pytest.fixture
def fresh_library(monkeypatch):
    """cudalib.library() resolves again (it loads once per process)."""
    monkeypatch.setattr(cudalib, "_loaded", False)
    monkeypatch.setattr(cudalib, "_lib", None)
    monkeypatch.setattr(cudalib, "_lib_reason", None)


@pytest.mark.skipif(NVCC is None, reason="no nvcc here: the CUDA library is not built")
def test_error_names_without_a_gpu():
    """The library's error table works without a device (CI builds it with nvcc)."""
    lib, why = cudalib.library()
    assert lib is not None, why
    assert cudalib.error_name(1) == "cudaErrorInvalidValue"
    assert cudalib.error_name(100000 + 1) in ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(cudalib.CudaError, match="cudaErrorInvalidValue") as info:
        cudalib.check(1, "a test call")
    assert (info.value.code, info.value.name) == (1, "cudaErrorInvalidValue")
    assert str(info.value) == "a test call failed: cudaErrorInvalidValue (1)"
    cudalib.check(0, "a call that worked")


class _Partial:
    """A library that has some of the C ABI's functions, not all."""

    def __init__(self):
        self.kvcopy_cuda_abi_version = lambda: 1


def test_a_library_missing_a_function_is_out_of_date(fresh_library, monkeypatch):
    monkeypatch.setattr(native, "load", lambda stem: (_Partial(), None))
    lib, why = cudalib.library()
    assert lib is None and "out of date" in why and "rebuild" in why


def test_no_library_gives_its_reason_and_numbered_errors(fresh_library, monkeypatch):
    monkeypatch.setattr(native, "load", lambda stem: (None, "libkvcopy_cuda.so is not built (no nvcc)"))
    assert cudalib.library() == (None, "libkvcopy_cuda.so is not built (no nvcc)")
    assert cudalib.error_name(700) == "CUDA error 700"
    with pytest.raises(cudalib.CudaError, match=r"launch failed: CUDA error 700 \(700\)"):
        cudalib.check(700, "launch")
