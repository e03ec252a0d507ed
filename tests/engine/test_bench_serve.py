"""bench/serve_pd.py end to end, small: the layer-wise arena connector, two requests, its
table, JSON, plot and timeline (each layer copied after its ``save_kv_layer``)."""
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
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_pd.py"), "--connectors",
                           "arena-layerwise", "--layers", "3", "--requests", "2", "--lengths", "100,300", "--out",
                           out, "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT@D med" in proc.stdout and "arena-layerwise" in proc.stdout, proc.stdout
    with open(os.path.join(out, "serve.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["requests"] == 2 and row["reads"] == 2 and row["descriptors_per_read"] == 1
    assert row["prompt_tokens"]["external_kv_transfer"] == 400 and row["staging_bytes"] == 64 << 20
    assert row["ttft_d_median_s"] > 0
    assert os.path.getsize(os.path.join(out, "serve.png")) > 0
    assert os.path.getsize(os.path.join(out, "serve_timeline.png")) > 0
    assert row["timed"] == 2 and row["layerwise"]["at_layer"] >= 6 and row["layerwise"]["swept"] == 0, row
    for r in row["results"]:
        e = r["events"]
        assert e["bind"] < e["fwd_end"] <= e["saved"] < e["kv_ready"] < e["d_first"], e
        ticks = dict(e["layers"])
        copied = {name: c for c in e["copies"] for name in c["layers"]}
        assert sorted(copied) == sorted(ticks) and len(ticks) == 3, e
        for name, c in copied.items():  # a layer's copy starts after its save_kv_layer, ends before P's record
            assert ticks[name] <= c["start"] <= c["end"] <= e["saved"], (name, c, e)
