"""Packaging: kernels/ ships as kvcopy.kernels, editable or not, with its headers."""
import os
import subprocess
import sys
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
    assert "kvcopy/copier.py" in names and "kvcopy/nixl/__init__.py" in names
    # The pure-Python install reports the missing native library instead of failing.
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    probe = subprocess.run(
        [sys.executable, "-c",
         "import kvcopy, kvcopy.kernels; r = kvcopy.available_backends(); "
         "assert r['torch'] is None and r['cpu'], r; print('ok')"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True,
    )
    assert probe.stdout.strip() == "ok", probe.stderr
