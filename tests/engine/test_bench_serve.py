"""bench/serve_pd.py end to end, small: one connector, two requests, its table, JSON and plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_serving_benchmark_reports_every_figure(engine_dir):
    out = os.path.join(engine_dir, "bench-serve")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_pd.py"), "--connectors", "arena",
                           "--requests", "2", "--lengths", "100,300", "--out", out, "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT@D med" in proc.stdout and "arena" in proc.stdout, proc.stdout
    with open(os.path.join(out, "serve.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["requests"] == 2 and row["reads"] == 2 and row["descriptors_per_read"] == 1
    assert row["prompt_tokens"]["external_kv_transfer"] == 400 and row["staging_bytes"] == 64 << 20
    assert row["ttft_d_median_s"] > 0 and os.path.getsize(os.path.join(out, "serve.png")) > 0
