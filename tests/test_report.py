"""bench/report.py: the README's results tables come from the recorded JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
