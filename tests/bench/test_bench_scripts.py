"""bench/nixl_plan_cost.py and bench/arena_plan_cost.py: each runs on a small case
(real NIXL over UCX, one process) and prints every row it promises, with a time."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcopy.nixl import nixl_available

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(bool(nixl_available()), reason=f"NIXL: {nixl_available()}")


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def timed_rows(out: str, names) -> dict:
    rows = {}
    for name in names:
        m = re.search(rf"^{re.escape(name)}\s+(\d+\.\d+)", out, re.M)
        assert m is not None, (name, out)
        rows[name] = float(m.group(1))
    return rows


def test_nixl_plan_cost_times_each_row_against_a_raw_read():
    out = run_script("nixl_plan_cost.py", "--layers", "2", "--pages", "4", "--num-pages", "16", "--iters", "2")
    rows = timed_rows(out, ["plan_pull", "raw READ", "pull", "pull+complete"])
    assert all(v > 0 for v in rows.values()), rows
    # derived (pull+complete minus pull, two calls each): present, of either sign
    assert re.search(r"^complete only\s+-?\d+\.\d+", out, re.M), out
    assert "8 descriptors" in out  # 2 layers x 4 pages


def test_arena_plan_cost_times_plan_pull_beside_a_memcpy():
    out = run_script("arena_plan_cost.py", "--groups", "1", "--iters", "3")
    rows = timed_rows(out, ["plan_pull", "plan_pull cold", "memcpy"])
    assert all(v > 0 for v in rows.values()), rows
    assert "1 descriptor(s)" in out


def test_arena_plan_cost_per_step_times_layerwise_plans_beside_their_copies():
    out = run_script("arena_plan_cost.py", "--per-step", "--layers", "3", "--blocks", "2", "--iters", "2")
    assert "3 layers (3 units)" in out, out
    rows = [line.split() for line in out.splitlines() if re.fullmatch(r"\s*\d+(\s+\d+\.\d+){8}", line)]
    # requests; settle, per unit, alone, per unit, copies, stage, memcpy, settle/stage
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16], out
    assert all(float(x) > 0 for r in rows for x in r[1:9]), out


def test_serve_pd_refuses_bad_arguments_before_starting_anything():
    # the benchmark itself runs real engines: tests/engine/test_bench_serve.py
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_pd.py"), "--connectors", "nixl"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unknown connector(s) ['nixl']" in proc.stderr, proc.stderr[-2000:]
