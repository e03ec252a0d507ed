"""bench/hardening_probe.py: each class runs in its own child and its counts come back
(a short run: the full one is ``python bench/hardening_probe.py``); a child that dies
by a signal counts as a crash."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "bench" / "hardening_probe.py"


def test_a_short_run_counts_every_class_it_runs_and_finds_nothing():
    out = subprocess.run([sys.executable, str(PROBE), "--only", "records", "discard-after-pull", "threads",
                          "--reps", "1", "--calls", "300", "--json"], capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["class"] for r in rows] == ["records", "discard-after-pull", "threads"], out.stdout + out.stderr
    by = {r["class"]: r for r in rows}
    assert by["records"]["cases"] > 1000  # every bit flip of a record, and more
    assert by["threads"]["cases"] == 8 * 300 and by["discard-after-pull"]["cases"] == 1
    for r in rows:
        assert (r["wrong_bytes"], r["crashes"], r["hangs"], r["unexpected"], r["problems"]) == (0, 0, 0, 0, 0), r
    assert out.returncode == 0


def test_a_child_killed_by_a_signal_is_a_crash(monkeypatch):
    sys.path.insert(0, str(PROBE.parent))
    try:
        import hardening_probe
    finally:
        sys.path.remove(str(PROBE.parent))

    class Died:
        returncode, stdout, stderr = -11, "", "Segmentation fault"

    monkeypatch.setattr(hardening_probe.subprocess, "run", lambda *a, **k: Died())
    row = hardening_probe._run_class("records", hardening_probe.argparse.Namespace(
        reps=1, threads=1, calls=1, timeout=10))
    assert row["crashes"] == 1 and row["unexpected"] == 0

    def hang(*a, **k):
        raise subprocess.TimeoutExpired("probe", 10)

    monkeypatch.setattr(hardening_probe.subprocess, "run", hang)
    assert hardening_probe._run_class("records", hardening_probe.argparse.Namespace(
        reps=1, threads=1, calls=1, timeout=10))["hangs"] == 1
