"""tests/conftest.py: GPU tests skip without a device, --require-gpu / KVCOPY_REQUIRE_GPU=1
turns each such skip into a failure, and the run ends with a line saying why tests skipped.

A throwaway suite beside a copy of the conftest runs in a child pytest, on whatever
host runs the tests (with or without a GPU)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

SUITE = '''
import pytest
import torch


@pytest.mark.gpu
def test_marked():
    assert torch.cuda.is_available()


@pytest.mark.gpu
def test_skips_itself():
    pytest.skip("NVRTC unavailable here")


def test_needs_vllm():
    pytest.skip("vLLM 0.33 not installed (run in the vLLM env)")


def test_plain():
    assert True
'''


def run_suite(tmp_path: Path, *args: str, require: str = "") -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    env = {k: v for k, v in os.environ.items() if k != "KVCOPY_REQUIRE_GPU"}
    if require:
        env["KVCOPY_REQUIRE_GPU"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_gpu_skips_pass_and_say_why(tmp_path):
    proc = run_suite(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    if torch.cuda.is_available():
        assert "1 passed" not in proc.stdout and "2 passed" in proc.stdout
        assert "skipped: 1 need vLLM 0.33 (README: 'Set up and test' runs them); 1 NVRTC unavailable here" \
            in proc.stdout
    else:
        assert "1 passed, 3 skipped" in proc.stdout
        assert "skipped: 2 need a CUDA device; 1 need vLLM 0.33 (README: 'Set up and test' runs them)" \
            in proc.stdout, proc.stdout


def test_require_gpu_fails_every_gpu_skip(tmp_path):
    for how in (dict(require="1"), dict(args=("--require-gpu",))):
        proc = run_suite(tmp_path, *how.get("args", ()), require=how.get("require", ""))
        assert proc.returncode == 1, proc.stdout[-3000:]
        # with a device the body's skip fails the call; without, the marker's skip fails the
        # setup of both (pytest reports a failed setup as an error)
        failed = "1 failed" if torch.cuda.is_available() else "2 errors"
        assert f"{failed}" in proc.stdout and "1 skipped" in proc.stdout, proc.stdout[-3000:]
        if torch.cuda.is_available():
            assert "this GPU test was skipped (NVRTC unavailable here)" in proc.stdout
        else:
            # each failed setup says why; the short summary may repeat it, wrapped to the
            # terminal's width, so only the per-test error sections are counted
            sections = [s.split("\n=")[0] for s in proc.stdout.split("ERROR at setup of ")[1:]]
            assert sorted(s.split()[0] for s in sections) == ["test_marked", "test_skips_itself"], proc.stdout
            assert all("this GPU test was skipped (needs a CUDA device)" in s for s in sections), proc.stdout
    assert run_suite(tmp_path, require="0").returncode == 0  # 0 means off
