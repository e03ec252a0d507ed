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


@pytest.mark.parametrize("argv,says", [(["--link", "fast"], "--link: rate must be"),
                                       (["--kv-heads", "0"], "--kv-heads, --head-dim >= 1"),
                                       (["--head-dim", "0"], "--kv-heads, --head-dim >= 1")])
def test_serve_pd_refuses_a_bad_link_or_model_shape(argv, says, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve_pd

    with pytest.raises(SystemExit) as exc:
        serve_pd.parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_serve_pd_prints_the_kv_per_token_and_request(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve_pd

    args = argparse.Namespace(kv_bytes_per_token=8 * 2 * 8 * 64 * 4, layers=8, kv_heads=8, head_dim=64,
                              lengths=[256, 1024], link="1gbit")
    line = serve_pd.describe_model(args)
    assert "32 KiB of KV per prompt token" in line and "256 tokens 8.00 MiB, 1024 tokens 32.00 MiB" in line, line
    assert "capped at 1gbit" in line and "client and proxy in D's namespace" in line, line
    assert "link" not in serve_pd.describe_model(argparse.Namespace(**dict(vars(args), link=None)))


def test_serve_pd_records_a_failed_request_and_summarizes_the_others(monkeypatch):
    """A request P or D does not answer is recorded as failed, not fatal to the run; the
    figures are over the requests that completed, token comparison skips the failed one."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve_pd

    failed = serve_pd.try_request("http://127.0.0.1:9", "http://127.0.0.1:9", [1, 2, 3], 2)  # port 9: refused
    assert failed["error"].startswith("URLError") and failed["token_ids"] is None and failed["tokens"] == 3
    ok = {"p_s": 0.5, "ttft_d_s": 0.1, "ttft_s": 0.6, "d_s": 0.2, "token_ids": [7, 8], "tokens": 3,
          "p_request": "p", "d_sent": 1.0, "d_first": 1.1}
    row = serve_pd.summarize("arena", [ok, failed], {"ttft_d_s": 0.1}, 1.0, {}, {}, {"bytes": 0, "buffers": 0})
    assert row["requests"] == 2 and row["failed_requests"] == 1 and row["ttft_median_s"] == 0.6
    assert row["token_ids"] == [[7, 8], None] and row["results"][1]["error"] == failed["error"]
    with pytest.raises(RuntimeError, match="no request completed"):
        serve_pd.summarize("arena", [failed], {"ttft_d_s": 0.1}, 1.0, {}, {}, {"bytes": 0, "buffers": 0})


def test_serve_pd_split_gives_p_and_d_a_core_each(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve_pd

    (p_env, p_cpus), (d_env, d_cpus) = serve_pd.engine_envs(argparse.Namespace(bind="split"), {"X": "1"})
    assert (p_cpus, d_cpus) == ([0], [1]) and p_env["X"] == d_env["X"] == "1"
    assert (p_env["VLLM_CPU_OMP_THREADS_BIND"], p_env["KVCOPY_TRANSFER_CPUS"]) == ("0", "0")
    assert (d_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["KVCOPY_TRANSFER_CPUS"]) == ("1", "1")
    (p_env, p_cpus), (d_env, d_cpus) = serve_pd.engine_envs(argparse.Namespace(bind="nobind"), {})
    assert p_cpus is d_cpus is None and p_env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" == d_env[
        "VLLM_CPU_OMP_THREADS_BIND"]


def test_serve_timeline_joins_a_layerwise_push_chunks_and_copies(monkeypatch):
    """A layer-wise push's chunk WRITEs (P's post, D's ``c``) join its request by the
    reservation's token; a copy's end for a request is when its units were handed to the
    chunked push (whose posts run inside the same copy call), not the call's end."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import serve_timeline

    tok = "ab" * 16
    p_tl = {"unit_layers": [["l.0"], ["l.1"]],
            "steps": [{"bind": 0.0, "fwd_end": 1.0, "saved": 1.001, "final": ["r-1", "r-2"],
                       "layers": [["l.0", 0.4], ["l.1", 0.9]],
                       "copies": [{"units": [0], "requests": ["r-1", "r-2"], "start": 0.40, "end": 0.47,
                                   "handed": {"r-1": 0.42, "r-2": 0.455}, "handed_end": {"r-1": 0.44, "r-2": 0.46}},
                                  {"units": [1], "requests": ["r-1"], "start": 0.90, "end": 0.95}]}],
            "pushes": {tok: {"took": 0.1, "post": 0.94, "post_done": 0.95, "closed": 1.02,
                             "chunks": [[0, 1, 0.42, 0.43]]}}}
    d_tl = {"pulls": [{"p_request": "r-1", "taken": 0.05, "posted": 0.06, "post_done": 0.06, "kv_ready": 1.03,
                       "token": tok, "landing": 1.025, "chunks": [[0, 1, 0.465, "p1"], [0, 1, 0.47, "p0"]]},
                      {"p_request": "r-2", "taken": 0.05, "posted": 0.06, "post_done": 0.06, "kv_ready": 1.05,
                       "token": None, "landing": None, "chunks": None}]}
    r = {"p_request": "r-1", "tokens": 8, "d_sent": 0.0, "d_first": 1.05, "ttft_d_s": 1.05}
    r2 = {"p_request": "r-2", "tokens": 8, "d_sent": 0.0, "d_first": 1.07, "ttft_d_s": 1.07}
    serve_timeline.attach_events([r, r2], p_tl, d_tl)
    # r-2's copy in the same call starts after r-1's hand-on returned, ends at its own hand-on
    assert (r2["events"]["copies"][0]["start"], r2["events"]["copies"][0]["end"]) == (0.44, 0.455)
    (chunk,) = r["events"]["chunks"]  # seen: once D had it from both P ranks
    assert chunk == {"units": [0, 1], "layers": ["l.0"], "post": 0.42, "post_done": 0.43, "seen": 0.47}
    assert r["chunks"] == 1 and abs(r["chunk_write_s_median"] - 0.05) < 1e-9 and r["last_chunk_write_s"] == \
        r["chunk_write_s_median"]
    assert [(c["start"], c["end"]) for c in r["events"]["copies"]] == [(0.40, 0.42), (0.90, 0.95)]  # handed, else
    # the call's end
    ph = serve_timeline.phase_summary([r])["phases"]["8"]
    assert ph["chunks"] == 1 and abs(ph["end_to_ready_s"] - 0.03) < 1e-9
    # a pull (no token, no chunks) has none of these
    pull = {"p_request": "r-1", "tokens": 8, "d_sent": 1.0, "d_first": 1.2, "ttft_d_s": 0.2}
    serve_timeline.attach_events([pull], p_tl, {"pulls": [d_tl["pulls"][1], dict(d_tl["pulls"][0], token=None,
                                                                                   chunks=None)]})
    assert "chunks" not in pull["events"] and "chunks" not in pull
