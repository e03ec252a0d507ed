"""The kernel headers compile to PTX without a GPU: through NVRTC (the run-time path of
kvcopy.copy_backends.nvrtc) when cupy finds libnvrtc, else through ``nvcc --ptx`` on the same source.

Both use exactly the translation unit NVRTC compiles at first use
(``kvcopy.copy_backends.nvrtc.SOURCE`` over ``kernels/*.cuh``), so code nvcc's library build accepts
but NVRTC rejects (a host header, a missing type) fails CI.
"""
import os
import shutil
import subprocess

import pytest

from kvcopy.copy_backends import nvrtc
from kvcopy.kernels import include_dir

ENTRY_NAMES = sorted(list(nvrtc.ENTRY_POINTS.values()) + list(nvrtc.SUM_ENTRY_POINTS.values())
                     + ["kvcopy_store_words"])


def _entries(ptx: str):
    return sorted(line.split()[2].split("(")[0] for line in ptx.splitlines() if line.startswith(".visible .entry"))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles_headers_to_ptx(arch):
    why = nvrtc.available()
    if why is not None:
        pytest.skip(f"NVRTC unavailable ({why}); test_nvcc_compiles_nvrtc_source covers the source")
    ptx = nvrtc.compile_kernels(arch, "ptx").decode()
    assert f".target sm_{arch[-2:]}" in ptx
    assert _entries(ptx) == ENTRY_NAMES


def test_nvrtc_cubin_cached(monkeypatch, tmp_path):
    if nvrtc.available() is not None:
        pytest.skip("NVRTC unavailable")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = nvrtc.cached_cubin("sm_90")
    files = list((tmp_path / "kvcopy" / "nvrtc").iterdir())
    assert len(files) == 1 and first[:4] == b"\x7fELF"
    assert nvrtc.cached_cubin("sm_90") == first


def test_nvcc_compiles_nvrtc_source(tmp_path):
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.isfile(nvcc):
        pytest.skip("no nvcc")
    src = tmp_path / "kvcopy_block_copy.cu"
    src.write_text(nvrtc.SOURCE)
    out = tmp_path / "k.ptx"
    subprocess.run([nvcc, "--ptx", "-std=c++17", "-arch=compute_90", "-I", str(include_dir()), str(src),
                    "-o", str(out)], check=True, capture_output=True)
    assert _entries(out.read_text()) == ENTRY_NAMES
