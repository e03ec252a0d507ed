"""``kvcopy-bench nixl --two-hosts``: P and D in two network namespaces, the rows timed
over the rate-capped link, D's KV checked against P's in host and arena mode."""
import json

import pytest

from kvcopy.bench.cli import main
from kvcopy.bench.two_hosts import unavailable


def _why_not():
    from kvcopy.nixl import nixl_available

    return unavailable() or nixl_available()


def test_faults_need_two_hosts_and_a_bad_rate_is_refused(capsys):
    assert main(["nixl", "--faults"]) == 2
    assert "--two-hosts" in capsys.readouterr().err
    assert main(["nixl", "--two-hosts", "--rate", "fast"]) == 2  # checked before the harness is probed
    assert "rate" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--nixl-thread-nice", "20"], "nixl_thread_nice"),
    (["--nixl-thread-nice", "-1"], "nixl_thread_nice"),
    (["--p-load", "-1"], "--p-load"),
    (["--p-cpus", "x"], "cpus"),
    (["--p-cpus", "1-"], "cpus"),
    (["--d-cpus", "4096"], "not all of them usable"),
    (["--faults", "--p-load", "1"], "not of --faults"),
    (["--faults", "--write-rows"], "not of --faults"),
    (["--write-poll-ms", "-1"], "--write-poll-ms"),
])
def test_bad_busy_p_options_are_refused_before_anything_runs(capsys, flags, message):
    assert main(["nixl", "--two-hosts", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(bool(_why_not()), reason=f"two hosts: {_why_not()}")
def test_two_hosts_rows_over_the_link(tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = main(["nixl", "--two-hosts", "--rate", "1gbit", "--num-groups", "2", "--num-layers", "2",
               "--blocks-per-request", "3", "--iters", "2", "--json", str(path)])
    assert rc == 0
    printed = capsys.readouterr().out
    out = json.loads(path.read_text())
    for r in out["results"]:  # the printed spread columns are the row's own p10 and p90
        assert f"{r['p10_us'] / 1e3:>8.2f} {r['p90_us'] / 1e3:>8.2f}" in printed, printed
    assert out["facts"]["verify_by_mode"] == {"host": "ok", "arena": "ok"}
    rows = {r["method"]: r for r in out["results"]}
    assert list(rows) == ["bulk READ", "arena pull", "arena pull+complete", "host pull"]
    assert rows["bulk READ"]["descriptors"] == rows["arena pull"]["descriptors"] == 1
    assert rows["host pull"]["descriptors"] == 2 * 2 * 3 * 2  # groups x layers x blocks x (K, V)
    assert all(r["iters"] >= 2 and r["pct_rate"] > 0 and r["x_bulk"] > 0 for r in rows.values())
    assert rows["bulk READ"]["x_bulk"] == 1.0


@pytest.mark.skipif(bool(_why_not()), reason=f"two hosts: {_why_not()}")
def test_a_busy_p_with_niced_nixl_threads(tmp_path):
    """P pinned to one CPU with a busy thread, its managers' agents at nice 19: the
    threads NIXL and UCX started for them run at 19 on that CPU, the reference bulk
    READ's P agent at 0, the load kept multiplying, D's KV is still exact, and the WRITE
    rows are timed against the bulk WRITE."""
    import os

    cpu = max(os.sched_getaffinity(0))
    path = tmp_path / "out.json"
    rc = main(["nixl", "--two-hosts", "--rate", "1gbit", "--num-groups", "2", "--num-layers", "2",
               "--blocks-per-request", "3", "--iters", "2", "--nixl-thread-nice", "19", "--p-cpus", str(cpu),
               "--p-load", "1", "--write-rows", "--json", str(path)])
    assert rc == 0
    out = json.loads(path.read_text())
    facts = out["facts"]
    assert facts["verify_by_mode"] == {"host": "ok", "arena": "ok"}
    rows = {r["method"]: r for r in out["results"]}
    assert list(rows) == ["bulk READ", "bulk READ at P's nice", "arena pull", "arena pull+complete", "host pull",
                          "bulk WRITE", "bulk WRITE at P's nice"]
    assert all(r["iters"] >= 2 and r["x_bulk"] > 0 for r in rows.values())
    assert rows["bulk WRITE"]["x_bulk"] == rows["bulk READ"]["x_bulk"] == 1.0
    assert {r["x_bulk_of"] for m, r in rows.items() if "WRITE" in m} == {"bulk WRITE"}
    assert rows["bulk WRITE at P's nice"]["descriptors"] == 1
    assert facts["p_cpus"] == [cpu] and facts["d_cpus"] is None and facts["p_load_mm_per_s"] > 0
    threads = facts["p_threads"]
    assert all(cpus == [cpu] for _, _, cpus in threads), threads
    # UCX's async thread (once per process) and the progress threads of the host and arena
    # managers and of the niced raw agent; the reference raw agent's progress thread stays at 0
    assert [name for name, nice, _ in threads if nice == 19].count("async") == 1
    assert sum(nice == 19 for _, nice, _ in threads) == 4, threads
    assert sum(nice == 0 for _, nice, _ in threads) == len(threads) - 4, threads
