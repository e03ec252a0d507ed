"""bench/report.py: the tables of docs/bench.md's figures come from the recorded JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_run_table_from_recorded_results(tmp_path):
    res = {"tool": "kvcopy-bench", "command": "run", "description": "toy",
           "env": {"date": "2026-11-29", "commit": "abc", "cpu_count": 2, "torch": "2.13"},
           "results": [
               {"groups": 2, "direction": "h2d", "method": "memcpy", "bytes": 1 << 20, "gbps": 5.0,
                "x_memcpy": 1.0, "ops_per_call": 1, "verify": "n/a"},
               {"groups": 2, "direction": "h2d", "method": "cpu", "bytes": 1 << 20, "gbps": 4.0,
                "x_memcpy": 1.25, "ops_per_call": 0, "verify": "ok"},
               {"groups": 2, "direction": "h2d", "method": "vllm", "bytes": 1 << 20, "gbps": 1.0,
                "x_memcpy": 5.0, "ops_per_call": 64, "verify": "FAIL (3)"},
           ]}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(res))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), str(f)],
                         capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("| 2 | h2d"))
    assert row == "| 2 | h2d | 1 MiB | 5.00 | 1.25x | 5.00x FAIL | 0/64 |"


def _run(load, xs, noise=()):
    rows = [{"groups": 1, "direction": "h2d", "method": "memcpy", "bytes": 1 << 20, "gbps": 5.0,
             "x_memcpy": 1.0, "verify": "n/a", "noise": None}]
    rows += [{"groups": 1, "direction": "h2d", "method": m, "bytes": 1 << 20, "gbps": 5.0 / x, "x_memcpy": x,
              "verify": "ok", "noise": "row" if m in noise else None} for m, x in xs.items()]
    return {"tool": "kvcopy-bench", "command": "run", "argv": ["run", "--threads", "1"], "description": "toy",
            "env": {"date": "2026-12-02", "commit": "abc", "cpu_count": 2, "torch": "2.13", "device": "cpu",
                    "load_average": load}, "threads": {"count": 1, "why": "--threads"}, "results": rows}


def test_repeated_runs_give_the_median_and_the_range(tmp_path):
    runs = [_run(0.1, {"cpu": 1.10, "vllm": 5.0}), _run(0.3, {"cpu": 1.08, "vllm": 5.5}, noise=("vllm",)),
            _run(0.2, {"cpu": 1.14, "vllm": 4.9})]
    files = []
    for i, res in enumerate(runs):  # each run wrote its own file: still runs of one command
        res["argv"] += ["--json", f"out/run-{i}.json"] if i else [f"--json=out/run-{i}.json"]
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(res))
        files.append(str(f))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--runs", *files],
                         capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("| 1 | h2d"))
    assert row == "| 1 | h2d | 1 MiB | 5.00 | 1.10x (1.08-1.14) | 5.00x (4.90-5.50) noise in 1 of 3 runs | - |"
    assert "3 runs" in out and "load average 0.1-0.3" in out
    other = json.loads(Path(files[0]).read_text())
    other["argv"] = ["run"]
    Path(files[0]).write_text(json.dumps(other))
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--runs", *files],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "not runs of one command" in bad.stderr
