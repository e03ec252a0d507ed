"""CI builds the CUDA library with nvcc: it must be there, export the C ABI and hold
sm_80 and sm_90 machine code plus compute_90 PTX.

Skipped only when no nvcc exists on the machine (then setup.py builds the CPU library
alone, by design). With nvcc present a missing library is a failure: setup.py falls
back to a CPU-only build when the CUDA build breaks, and this test is what notices.
The architectures are read from the library's ``.nv_fatbin`` section (cuobjdump is
used too when the toolkit has it).
"""
import ctypes
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kvcopy import native

NVCC = next((p for p in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                         os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
             if p and os.path.isfile(p)), None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc here: the CUDA library is not built")

ABI = ["kvcopy_cuda_copy", "kvcopy_cuda_entry_fields", "kvcopy_cuda_error_name", "kvcopy_cuda_device_info",
       "kvcopy_cuda_host_device_pointer",
       "kvcopy_cuda_stream_capturing", "kvcopy_cuda_stream_create", "kvcopy_cuda_stream_destroy",
       "kvcopy_ce_copy", "kvcopy_ce_batch_abi", "kvcopy_ce_error_name"]


def _library() -> Path:
    path = next((p for p in native._candidates("kvcopy_cuda") if p.is_file()), None)
    assert path is not None, (
        "nvcc is installed but libkvcopy_cuda.so was not built: the CUDA build failed and "
        "setup.py fell back to CPU only (rerun `pip install -e .` and read the CMake output)")
    return path


def fatbin_entries(data: bytes):
    """(kind, arch) of every image in the ELF's .nv_fatbin: kind "elf" or "ptx"."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]

    def name(off):
        end = data.index(b"\0", strtab + off)
        return data[strtab + off:end].decode()

    out = []
    for sec in sections:
        if name(sec[0]) != ".nv_fatbin":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos + 16 <= end:
            magic, _ver, header, size = struct.unpack_from("<IHHQ", data, pos)
            if magic != 0xBA55ED50:
                break
            p, stop = pos + header, pos + header + size
            while p < stop:
                kind, _, ehdr, payload = struct.unpack_from("<HHIQ", data, p)
                arch = struct.unpack_from("<I", data, p + 28)[0]
                out.append(({1: "ptx", 2: "elf"}.get(kind, str(kind)), arch))
                p += ehdr + payload
            pos = stop
    return out


def test_library_built_with_c_abi():
    lib, missing = native.probe("kvcopy_cuda", _library())
    assert missing == []
    for sym in ABI:
        assert hasattr(lib, sym), sym
    from kvcopy.copy_backends import kernel_inputs, nvrtc

    # the ctypes mirror used by the NVRTC launcher has the C++ layout
    assert lib.kvcopy_cuda_params_bytes() == ctypes.sizeof(native.KernelParams)
    assert lib.kvcopy_cuda_params_bytes() <= 4096  # kernel parameter limit of every CUDA version
    assert lib.kvcopy_cuda_inline_words() == kernel_inputs.INLINE_WORDS == nvrtc.NvrtcLauncher.inline_words


def test_library_holds_sm80_sm90_and_ptx():
    entries = fatbin_entries(_library().read_bytes())
    assert ("elf", 90) in entries, entries
    assert ("elf", 80) in entries, entries
    assert ("ptx", 90) in entries, entries
    assert {arch for _, arch in entries} <= {80, 90}, "only the two architectures CI pays for"
    tool = shutil.which("cuobjdump") or os.path.join(os.path.dirname(NVCC), "cuobjdump")
    if os.path.isfile(tool):  # toolkits that ship it: the same answer from NVIDIA's tool
        out = subprocess.run([tool, "--list-elf", str(_library())], capture_output=True, text=True).stdout
        assert "sm_90" in out and "sm_80" in out, out


def test_library_needs_only_the_driver():
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd")
    out = subprocess.run([ldd, str(_library())], capture_output=True, text=True).stdout
    assert "libcudart" not in out, "cudart must be linked statically (GPU machines may have no toolkit)"
