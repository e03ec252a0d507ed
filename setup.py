"""kvcopy: builds the native libraries through CMake when a compiler is there.

``pip install -e .`` / ``pip install .``: the CPU library always (host C++ compiler),
the CUDA library too when nvcc is found. Without CMake or a compiler the build step
prints why and the pure-Python package still installs (backends ``torch`` and, with a
GPU, ``triton`` work). ``KVCOPY_NO_NATIVE=1`` skips the native build on purpose.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


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


def _nvcc():
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand):
            return cand
    return None


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        *pkg, stem = fullname.split(".")
        return os.path.join(*pkg, stem + ".so")

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get("KVCOPY_NO_NATIVE"):
            print("kvcopy: KVCOPY_NO_NATIVE set; skipping the native build", file=sys.stderr)
            return
        cmake = _cmake()
        if cmake is None:
            print("kvcopy: CMake not found; installing without the native library", file=sys.stderr)
            return
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [cmake, "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                f"-DKVCOPY_OUTPUT_DIR={out_dir}"]
        nvcc = _nvcc()
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        else:
            args.append("-DKVCOPY_WITH_CUDA=OFF")
        try:
            subprocess.run(args, check=True)
            subprocess.run([cmake, "--build", str(build_dir), "-j", str(os.cpu_count() or 2)], check=True)
        except (subprocess.CalledProcessError, OSError) as exc:
            if nvcc and os.environ.get("KVCOPY_REQUIRE_NATIVE") is None:
                # A broken CUDA toolchain must not cost the CPU library: retry without it.
                print(f"kvcopy: native build with CUDA failed ({exc}); retrying CPU only", file=sys.stderr)
                try:
                    subprocess.run(args[:-1] + ["-DKVCOPY_WITH_CUDA=OFF"], check=True)
                    subprocess.run([cmake, "--build", str(build_dir), "-j", str(os.cpu_count() or 2)], check=True)
                    return
                except (subprocess.CalledProcessError, OSError) as exc2:
                    exc = exc2
            if os.environ.get("KVCOPY_REQUIRE_NATIVE"):
                raise
            print(f"kvcopy: native build failed ({exc}); installing without it", file=sys.stderr)

    def copy_extensions_to_source(self):
        # Editable installs: put whatever CMake produced beside the package sources.
        for ext in self.extensions:
            rel = Path(self.get_ext_filename(ext.name)).parent
            built, target = Path(self.build_lib) / rel, ROOT / rel
            target.mkdir(parents=True, exist_ok=True)
            for lib in built.glob("lib*.so"):
                shutil.copy2(lib, target / lib.name)

    def get_outputs(self):
        # Only what CMake actually produced (the CUDA library is optional).
        out = []
        for ext in self.extensions:
            d = Path(self.get_ext_fullpath(ext.name)).parent
            out += [str(p) for p in sorted(d.glob("lib*.so"))]
        return out


setup(
    name="kvcopy",
    version="0.1.0",
    description="Fused CUDA/Triton copies of paged KV-cache blocks between GPU KV tensors "
                "and host staging buffers, with a NIXL transfer manager",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=["kvcopy", "kvcopy.backends", "kvcopy.bench", "kvcopy.kernels", "kvcopy.nixl"],
    package_dir={"kvcopy.kernels": "kernels"},
    package_data={"kvcopy.kernels": ["*.cuh"]},
    ext_modules=[CMakeLibrary("kvcopy._lib.libkvcopy_cpu")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch", "numpy"],
    extras_require={
        "triton": ["triton"],
        "nixl": ["nixl-cu12"],
        "nvrtc": ["cupy-cuda12x", "nvidia-cuda-nvrtc-cu12"],
        "test": ["pytest", "pytest-benchmark"],
        "all": ["triton", "nixl-cu12", "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "pytest", "pytest-benchmark"],
    },
    entry_points={"console_scripts": ["kvcopy-bench=kvcopy.bench.cli:main"]},
    zip_safe=False,
)
