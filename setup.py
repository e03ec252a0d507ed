"""kvcopy: builds the native libraries through CMake and says what it built.

``pip install .`` / ``pip install -e .`` build, with CMake and the host C++ compiler:

* ``libkvcopy_cpu.so`` always (backend ``cpu``). If it cannot be built the install
  fails and says why; ``KVCOPY_NO_NATIVE=1`` installs the pure-Python package on
  purpose (backends ``torch`` and, on a GPU, ``triton``).
* ``libkvcopy_cuda.so`` when nvcc is found (``$CUDACXX``, ``nvcc`` on ``PATH``,
  ``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda/bin/nvcc``); ``KVCOPY_WITH_CUDA=0`` skips
  it. A CUDA build that fails is retried CPU-only (``KVCOPY_REQUIRE_CUDA=1``: fail).

What was built, and why not, is printed as a summary (pip shows it with ``-v``) and
recorded in ``kvcopy/_lib/build-info.json``; ``kvcopy.available_copy_backends()`` and
``kvcopy-bench list`` read that record back.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD_INFO = "build-info.json"
VERSION = "0.1.0"


class CMakeLibrary(Extension):
    """A shared library CMake builds; loaded with ctypes, not imported."""

    def __init__(self, name):
        super().__init__(name, sources=[])


def _cmake():
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:  # the `cmake` wheel from pyproject's build requirements
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        return None


def _describe_cmake(exe):
    """What build-info.json records: the version, and where CMake came from. pip's isolated
    build runs a CMake from a temporary folder deleted after the install: that path is not
    recorded, only that it was the build requirement."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
        version = out.split()[2] if out.startswith("cmake version") else "of unknown version"
    except (OSError, subprocess.SubprocessError, IndexError):
        version = "of unknown version"
    where = exe
    temp = os.path.realpath(tempfile.gettempdir())
    if os.path.realpath(exe).startswith(temp + os.sep) or "pip-build-env" in exe:
        where = "the cmake build requirement in pip's temporary build environment"
    return f"cmake {version} ({where})"


NVCC_PLACES = "$CUDACXX, nvcc on PATH, $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc"


def _nvcc():
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    return None


def _off(name):
    return os.environ.get(name, "").strip().lower() in ("0", "off", "no", "false")


def _run(cmd, log):
    """Run ``cmd`` with its output passed through (pip shows it with -v); the last
    lines are kept for the error message."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = deque(maxlen=25)
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line.rstrip())
    if proc.wait() != 0:
        log.extend(tail)
        raise subprocess.CalledProcessError(proc.returncode, cmd)


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        *pkg, stem = fullname.split(".")
        return os.path.join(*pkg, stem + ".so")

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in list(out_dir.glob("lib*.so")) + [out_dir / BUILD_INFO]:
            old.unlink(missing_ok=True)  # a record of this build only
        info = {"kvcopy": VERSION, "python": sys.version.split()[0], "cmake": None, "nvcc": None,
                "libraries": {"kvcopy_cpu": {"built": False, "reason": None},
                              "kvcopy_cuda": {"built": False, "reason": None}}}
        try:
            self._build(out_dir, info)
        finally:
            libs = info["libraries"]
            for stem, entry in libs.items():
                entry["built"] = (out_dir / f"lib{stem}.so").is_file()
                if entry["built"]:
                    entry["reason"] = None
                elif not entry["reason"]:
                    entry["reason"] = "CMake finished without building it"
            (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
            _print_summary(info, out_dir)

    def _build(self, out_dir, info):
        libs = info["libraries"]
        if os.environ.get("KVCOPY_NO_NATIVE"):
            why = "KVCOPY_NO_NATIVE set at install"
            libs["kvcopy_cpu"]["reason"] = libs["kvcopy_cuda"]["reason"] = why
            return
        cmake = _cmake()
        info["cmake"] = cmake and _describe_cmake(cmake)
        if cmake is None:
            why = "CMake not found at install (pip install cmake, or your system's package)"
            libs["kvcopy_cpu"]["reason"] = libs["kvcopy_cuda"]["reason"] = why
            self._cpu_failed(why)
            return
        if not (ROOT / "CMakeLists.txt").is_file():
            why = f"CMakeLists.txt is missing from the source tree ({ROOT}): a broken sdist"
            libs["kvcopy_cpu"]["reason"] = libs["kvcopy_cuda"]["reason"] = why
            self._cpu_failed(why)
            return
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        base = [cmake, "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                f"-DKVCOPY_OUTPUT_DIR={out_dir}"]
        nvcc = None
        if _off("KVCOPY_WITH_CUDA"):
            libs["kvcopy_cuda"]["reason"] = "KVCOPY_WITH_CUDA=0 at install"
        else:
            nvcc = info["nvcc"] = _nvcc()
            if nvcc is None:
                libs["kvcopy_cuda"]["reason"] = f"no nvcc at install (looked at {NVCC_PLACES})"
        jobs = ["-j", str(os.cpu_count() or 2)]
        log = []
        try:
            # ON said each time: a build folder's cache keeps an earlier OFF (a fallback
            # below) and would skip the CUDA library on every later build
            args = base + ([f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DKVCOPY_WITH_CUDA=ON"] if nvcc
                           else ["-DKVCOPY_WITH_CUDA=OFF"])
            _run(args, log)
            _run([cmake, "--build", str(build_dir)] + jobs, log)
            return
        except (subprocess.CalledProcessError, OSError) as exc:
            if not nvcc or os.environ.get("KVCOPY_REQUIRE_CUDA"):
                why = f"CMake build failed ({exc})"
                libs["kvcopy_cpu"]["reason"] = libs["kvcopy_cuda"]["reason"] = why
                self._cpu_failed(why, log)
                return
            # A broken CUDA toolchain must not cost the CPU library: retry without it.
            libs["kvcopy_cuda"]["reason"] = f"the CUDA build with {nvcc} failed: " + " | ".join(log[-3:])
            log.clear()
        try:
            _run(base + ["-DKVCOPY_WITH_CUDA=OFF"], log)
            _run([cmake, "--build", str(build_dir)] + jobs, log)
        except (subprocess.CalledProcessError, OSError) as exc:
            libs["kvcopy_cpu"]["reason"] = f"CMake build failed ({exc})"
            self._cpu_failed(libs["kvcopy_cpu"]["reason"], log)

    @staticmethod
    def _cpu_failed(why, log=()):
        tail = "".join(f"    {line}\n" for line in log)
        raise SystemExit(
            f"kvcopy: cannot build libkvcopy_cpu.so: {why}\n{tail}"
            "kvcopy: set KVCOPY_NO_NATIVE=1 to install without the native libraries "
            "(backends torch and, on a GPU, triton only)")

    def copy_extensions_to_source(self):
        # Editable installs: put whatever CMake produced beside the package sources.
        for ext in self.extensions:
            rel = Path(self.get_ext_filename(ext.name)).parent
            built, target = Path(self.build_lib) / rel, ROOT / rel
            target.mkdir(parents=True, exist_ok=True)
            for old in list(target.glob("lib*.so")) + [target / BUILD_INFO]:
                old.unlink(missing_ok=True)
            for f in list(built.glob("lib*.so")) + [built / BUILD_INFO]:
                if f.is_file():
                    shutil.copy2(f, target / f.name)

    def get_outputs(self):
        # Only what CMake actually produced (the CUDA library is optional), and the record.
        out = []
        for ext in self.extensions:
            d = Path(self.get_ext_fullpath(ext.name)).parent
            out += [str(p) for p in sorted(d.glob("lib*.so"))]
            if (d / BUILD_INFO).is_file():
                out.append(str(d / BUILD_INFO))
        return out


def _print_summary(info, out_dir):
    lines = ["", "kvcopy native build:"]
    for stem, entry in info["libraries"].items():
        state = "built" if entry["built"] else f"NOT built: {entry['reason']}"
        lines.append(f"  lib{stem}.so  {state}")
    lines.append(f"  record: {out_dir / BUILD_INFO}  (kvcopy-bench list shows it after install)")
    # pip keeps the backend's output and shows it with -v (or when the install fails).
    sys.stdout.flush()
    sys.stderr.write("\n".join(lines) + "\n")


# What to install beside torch and numpy (docs/development.md, "Extras", gives sizes):
#   cpu  every CPU test and the examples: NIXL over UCX, Triton's interpreter, pytest
#   gpu  the GPU extras: the NVRTC fallback for the cuda backend (cupy + libnvrtc)
_TEST = ["pytest", "pytest-benchmark", "pyyaml"]  # pyyaml: the GPU workflow test reads gpu.yml
_NIXL = ["nixl-cu12"]
_TRITON = ["triton"]
_NVRTC = ["cupy-cuda12x", "nvidia-cuda-nvrtc-cu12"]
_PLOT = ["matplotlib"]

setup(
    name="kvcopy",
    version=VERSION,
    description="Fused CUDA/Triton copies of paged KV-cache blocks between GPU KV tensors "
                "and host staging buffers, with a NIXL transfer manager",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # torch 2.13.0 (the README's install) publishes wheels for CPython 3.10-3.14, none for 3.9.
    python_requires=">=3.10",
    # every package under kvcopy/ (kvcopy/kernels is a link to kernels/, mapped below)
    packages=find_packages(include=["kvcopy", "kvcopy.*"], exclude=["kvcopy.kernels"]) + ["kvcopy.kernels"],
    package_dir={"kvcopy.kernels": "kernels"},
    package_data={"kvcopy.kernels": ["*.cuh"]},
    ext_modules=[CMakeLibrary("kvcopy._lib.libkvcopy_cpu")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch", "numpy"],
    extras_require={
        "test": _TEST,
        "nixl": _NIXL,
        "triton": _TRITON,
        "nvrtc": _NVRTC,
        "plot": _PLOT,
        "cpu": _TEST + _NIXL + _TRITON,
        "gpu": _TRITON + _NIXL + _NVRTC,
        "all": _TEST + _NIXL + _TRITON + _NVRTC + _PLOT,
    },
    entry_points={"console_scripts": ["kvcopy-bench=kvcopy.bench.cli:main"]},
    zip_safe=False,
)
