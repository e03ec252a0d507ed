"""The cpu backend's vector loops run on any CPU: csrc/cpu_copy.cpp built with
``KVCOPY_SIMD_EMULATION`` (SIMDe's portable intrinsics in place of the CPU's), then the
checksum tests of the ``cpu`` backend (tests/core/test_checksum.py) run against that library.

Why: the AVX-512 loop is the default where the CPU has AVX-512 F, and no CPU this
project's CI runs on has it. Emulated, its own code runs here: the streaming head that
aligns the destination (the emulated streaming store traps off a 64-byte boundary,
as the CPU's faults), the eight key lanes and their 16-word step, the two
accumulators and their reduction, the scalar tail; any slip there makes a sum differ from
the oracle's (a key lane off by one word fails 184 of the 459 tests; checked by hand).
It says nothing of the loops' speed.

SIMDe comes from the system (Debian/Ubuntu: ``apt install libsimde-dev``); without it
the test skips, and fails where ``KVCOPY_REQUIRE_SIMDE=1`` (.ci/run sets it and
installs the package).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIMDE_DIRS = [Path(p) for p in os.environ.get("SIMDE_INCLUDE_DIR", "").split(os.pathsep) if p] + [
    Path("/usr/include"), Path("/usr/local/include")]


def _cmake():
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:
        import cmake
    except ImportError:
        return None
    return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")


def _missing(why: str):
    if os.environ.get("KVCOPY_REQUIRE_SIMDE", "") not in ("", "0"):
        pytest.fail(f"KVCOPY_REQUIRE_SIMDE=1: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def emulated_lib_dir(tmp_path_factory):
    simde = next((d for d in SIMDE_DIRS if (d / "simde" / "x86" / "avx512.h").is_file()), None)
    if simde is None:
        _missing("SIMDe headers not found (apt install libsimde-dev, or SIMDE_INCLUDE_DIR)")
    cmake = _cmake()
    if cmake is None:
        _missing("CMake not found")
    build = tmp_path_factory.mktemp("simde-build")
    lib_dir = build / "lib"
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DKVCOPY_WITH_CUDA=OFF", "-DKVCOPY_SIMD_EMULATION=ON", f"-DKVCOPY_OUTPUT_DIR={lib_dir}",
                 f"-DKVCOPY_SIMDE_DIR={simde}"]
    # flags of the caller's (-march=native on an AVX-512 host) would give SIMDe native
    # AVX-512 and the CPU's own loop
    env = {k: v for k, v in os.environ.items() if k not in ("CXXFLAGS", "CPPFLAGS")}
    for cmd in (configure, [cmake, "--build", str(build), "--target", "kvcopy_cpu", "-j", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (lib_dir / "libkvcopy_cpu.so").is_file()
    return lib_dir


def _env(lib_dir: Path) -> dict:
    env = dict(os.environ, KVCOPY_LIB_DIR=str(lib_dir))
    for name in ("KVCOPY_CPU_SIMD", "KVCOPY_CPU_STREAM_BYTES"):
        env.pop(name, None)  # the tests set them per case
    return env


def test_emulated_library_offers_both_loops(emulated_lib_dir):
    """The library the run below loads is the emulated one, and it picks AVX-512."""
    probe = ("from kvcopy import native; from kvcopy.copy_backends.cpu import CpuBackend; "
             "lib, why = native.load('kvcopy_cpu'); assert lib is not None, why; "
             "print(native.find('kvcopy_cpu'), lib.kvcopy_cpu_sums_loops(), CpuBackend().checksum_loop())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env=_env(emulated_lib_dir), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    path, loops, loop = done.stdout.split()
    assert Path(path) == emulated_lib_dir / "libkvcopy_cpu.so"
    assert (loops, loop) == ("3", "avx512")


def test_emulated_vector_loops_match_oracle(emulated_lib_dir):
    """Every cpu checksum test of tests/core/test_checksum.py, on the emulated loops: the
    default (AVX-512), AVX2, scalar, and both vector loops' streaming stores."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu",
           str(ROOT / "tests" / "core" / "test_checksum.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=_env(emulated_lib_dir),
                          cwd=ROOT)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 400, tail  # 459 when written
    assert " skipped" not in tail, tail  # the loops' cases need the library: none may skip
