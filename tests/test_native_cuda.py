"""kvcopy.native for libkvcopy_cuda: its signatures declared at load, and CUDA error names."""
import os
import shutil

import pytest

from kvcopy import native

NVCC = next((p for p in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                         os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
             if p and os.path.isfile(p)), None)


@pytest.fixture
def fresh_library(monkeypatch):
    """native.load resolves again (it loads once per process)."""
    monkeypatch.setattr(native, "_loaded", {})


@pytest.mark.skipif(NVCC is None, reason="no nvcc here: the CUDA library is not built")
def test_error_names_without_a_gpu():
    """The library's error table works without a device (CI builds it with nvcc)."""
    lib, why = native.load("kvcopy_cuda")
    assert lib is not None, why
    assert native.error_name(1) == "cudaErrorInvalidValue"
    assert native.error_name(100000 + 1) in ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(native.CudaError, match="cudaErrorInvalidValue") as info:
        native.check(1, "a test call")
    assert (info.value.code, info.value.name) == (1, "cudaErrorInvalidValue")
    assert str(info.value) == "a test call failed: cudaErrorInvalidValue (1)"
    native.check(0, "a call that worked")


class _Partial:
    """A library of the right ABI version that has some of the C ABI's functions, not all."""

    def __init__(self):
        self.kvcopy_cuda_abi_version = lambda: native.ABI_VERSIONS["kvcopy_cuda"]
        self.kvcopy_cuda_entry_fields = lambda: native.ENTRY_FIELDS
        self.kvcopy_cuda_threads = lambda: 256


def test_a_library_missing_a_function_is_out_of_date():
    lib, why = native._checked(_Partial(), "kvcopy_cuda", native.LIB_DIR / "libkvcopy_cuda.so")
    assert lib is None and "out of date" in why and "rebuild" in why and "kvcopy_cuda_inline_words" in why


def test_no_library_gives_its_reason_and_numbered_errors(fresh_library, monkeypatch):
    monkeypatch.setattr(native, "find", lambda stem: None)
    monkeypatch.setattr(native, "missing_reason", lambda stem, tried: "libkvcopy_cuda.so is not built (no nvcc)")
    assert native.load("kvcopy_cuda") == (None, "libkvcopy_cuda.so is not built (no nvcc)")
    assert native.error_name(700) == "CUDA error 700"
    with pytest.raises(native.CudaError, match=r"launch failed: CUDA error 700 \(700\)"):
        native.check(700, "launch")
