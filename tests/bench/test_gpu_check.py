"""bench/gpu_check.sh and bench/gpu_check.py: the CPU rehearsal of the one-shot GPU run.

The whole script runs as CI would see it (``KVCOPY_DEVICE=cpu``, only ``python3`` on
PATH, ``$OUT`` set), and must write its log and one JSON per step under ``$OUT``, at
most 8 files (what the device runner returns), and nothing under ``bench/results/``.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def _results_listing():
    d = ROOT / "bench" / "results"
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) if d.is_dir() else []


def _python3_only_path(tmp_path: Path) -> str:
    """A PATH whose python3 is this interpreter and that has no `python` at all."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shim / "python3").chmod(0o755)
    system = [d for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
              if os.path.isdir(d)]
    path = os.pathsep.join([str(shim)] + system)
    if shutil.which("python", path=path) is not None:
        pytest.skip("this host has a `python` in its system folders")
    return path


def test_cpu_rehearsal_writes_everything_under_out(tmp_path):
    """The GPU workflow's steps (bench/gpu_ci.sh: the GPU tests, then gpu_check.sh) on the
    CPU: the tests' JUnit XML and log in $OUT, gpu_check's files in $OUT/gpu_check."""
    top = tmp_path / "out"
    out = top / "gpu_check"
    before = _results_listing()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "OUT", "KVCOPY_LIB_DIR", "TRITON_INTERPRET", "KVCOPY_REQUIRE_GPU")}
    env.update(PATH=_python3_only_path(tmp_path), KVCOPY_DEVICE="cpu", OUT=str(top), TMPDIR=str(tmp_path))
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_ci.sh")], env=env, capture_output=True, text=True,
                       timeout=420, cwd=str(tmp_path))
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert "gpu_ci: CPU rehearsal" in p.stdout
    xml = (top / "pytest-gpu.xml").read_text()
    assert "<testsuite" in xml and 'failures="0"' in xml and 'errors="0"' in xml
    assert "need a CUDA device" in (top / "pytest-gpu.log").read_text()  # the GPU tests skipped, and said why
    assert f"gpu_check: python3 ({tmp_path / 'bin' / 'python3'})" in p.stdout
    names = sorted(f.name for f in out.iterdir())
    assert names == sorted([gpu_check.LOG_NAME] + list(gpu_check.FILES.values())), names
    assert len(names) <= 8
    for step, name in gpu_check.FILES.items():
        data = json.loads((out / name).read_text())
        assert data["step"] == step and data["status"] in ("ok", "skipped"), (name, data.get("status"))
        assert data["device"] == "cpu"
    smoke = json.loads((out / gpu_check.FILES["smoke"]).read_text())
    ran = {(c["backend"], c["direction"]): c["status"] for c in smoke["cases"]}
    assert ran[("cpu", "h2d")] == ran[("cpu", "d2h")] == "ok"
    assert ran[("triton", "h2d")] == "ok"  # Triton's interpreter on the CPU
    sweep = json.loads((out / gpu_check.FILES["sweep"]).read_text())
    assert sweep["tool"] == "kvcopy-bench" and sweep["results"]
    assert {r["chunk_bytes"] for r in sweep["results"]} == {2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20}
    verified = {r["chunk_bytes"] for r in sweep["results"] if r["verify"] == "ok"}
    assert verified == {2 << 10, 8 << 10, 32 << 10}  # verify at the small points only
    scen = json.loads((out / gpu_check.FILES["scenario"]).read_text())
    assert any(r.get("mode") == "stubbed" for r in scen["host_path"]["rows"])
    assert {"cpu", "cpu+sum"} <= {r["method"] for r in scen["checksum"]["results"]}  # the checksum's cost
    assert "checksum d2h cpu+sum" in gpu_check.scenario_text(scen)
    log = (out / gpu_check.LOG_NAME).read_text()
    assert "kvcopy-bench sweep" in log and "pytest" in log
    # The summary is the end of the output (what a device run's 12,000-character tail returns).
    tail = p.stdout[-3000:]
    assert "== gpu_check summary" in tail and "result: every step ok" in tail
    assert _results_listing() == before


def test_the_gpu_workflow_runs_the_rehearsed_script_and_keeps_its_files():
    """What .github/workflows/gpu.yml must do (its syntax is checked in .ci/run)."""
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    (job,) = flow["jobs"].values()
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    assert job["env"]["KVCOPY_REQUIRE_GPU"] == "1"
    runs = [s.get("run", "") for s in job["steps"]]
    assert any("pip install torch==2.13.0 -e" in r for r in runs)
    assert "bash bench/gpu_ci.sh" in runs
    keep = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert keep["if"] == "always()" and keep["with"]["path"].rstrip("/") == "gpu-ci-out"
    assert job["env"]["OUT"].endswith("/gpu-ci-out")


def _write(d: Path, step: str, data: dict) -> None:
    (d / gpu_check.FILES[step]).write_text(json.dumps(data))


def test_mark_summary_and_save(tmp_path, monkeypatch, capsys):
    out, work, results = tmp_path / "out", tmp_path / "work", tmp_path / "results"
    out.mkdir()
    work.mkdir()
    monkeypatch.setenv("GPU_CHECK_OUT", str(out))
    monkeypatch.setenv("GPU_CHECK_WORK", str(work))
    monkeypatch.setenv("KVCOPY_DEVICE", "cuda")
    _write(out, "facts", {"step": "facts", "status": "ok", "started": "2026-12-01T10:00:00+00:00",
                          "gpu": {"gpus": [{"name": "NVIDIA H200"}]}})
    _write(out, "sweep", {"step": "sweep", "status": "running", "tool": "kvcopy-bench", "partial": True,
                          "results": [{"direction": "h2d", "chunk_bytes": 2048, "method": "memcpy", "gbps": 40.0},
                                      {"direction": "h2d", "chunk_bytes": 2048, "method": "cuda",
                                       "pct_of_memcpy": 93.0, "verify": "ok"}]})
    (work / "scenario-seeds2.json").write_text(json.dumps({"tool": "kvcopy-bench", "results": []}))
    gpu_check.cmd_mark("sweep", 124)  # the shell's timeout killed it mid-sweep
    gpu_check.cmd_mark("scenario", 137)  # killed before it wrote anything: the sub-run's partial is kept
    sweep = json.loads((out / gpu_check.FILES["sweep"]).read_text())
    assert sweep["status"] == "timeout" and sweep["results"]
    scen = json.loads((out / gpu_check.FILES["scenario"]).read_text())
    assert scen["status"] == "timeout" and scen["seeds2"]["tool"] == "kvcopy-bench"
    assert gpu_check.summary() == 1  # timeouts and steps that never ran are failures
    text = capsys.readouterr().out
    assert "sweep     TIMEOUT" in text and "build     not run" in text and "FAILED steps:" in text
    assert "93" in text  # the partial sweep's row is still summarized
    written = gpu_check.save(out, results)
    assert sorted(p.name for p in written) == ["nvidia-h200-20261201T100000Z-seeds2.json",
                                               "nvidia-h200-20261201T100000Z-sweep.json"]
    saved = json.loads(written[1].read_text())
    assert saved["tool"] == "kvcopy-bench" and "step" not in saved
