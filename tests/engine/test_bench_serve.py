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


@pytest.mark.slow
def test_the_serving_benchmark_times_each_push_phase_with_split_cores(engine_dir):
    """arena-push behind the concurrent proxy, P on CPU 0 and D on CPU 1 (``--bind split``):
    every request pushed in one descriptor, and its timeline in order: D's RESERVE before
    P's worker took it, the WRITE posted after the prefill ended and after the take, then
    ended (D saw it), KV ready, first token."""
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("--bind split needs CPUs 0 and 1")
    out = os.path.join(engine_dir, "bench-serve-push")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_pd.py"), "--connectors", "arena-push",
                           "--proxy", "concurrent", "--bind", "split", "--layers", "2", "--requests", "2",
                           "--lengths", "100,300", "--out", out, "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESERVE->P took" in proc.stdout, proc.stdout
    with open(os.path.join(out, "serve.json")) as f:
        (row,) = json.load(f)["rows"]
    assert row["failed_requests"] == 0 and row["reads"] == 2 and row["descriptors_per_read"] == 1, row
    assert row["prompt_tokens"]["external_kv_transfer"] == 400 and row["timed"] == 2
    for r in row["results"]:
        e = r["events"]
        assert e["reserve_sent"] <= e["p_took"] <= e["write_post"] and e["fwd_end"] <= e["write_post"], e
        # P's "closed" is taken after its poll saw the WRITE end, and NIXL sends D's notification
        # in that poll: D may see it first
        assert e["write_post"] <= e["write_closed"] and e["write_post"] <= e["d_landing"] <= e["kv_ready"] \
            < e["d_first"], e


@pytest.mark.slow
def test_the_serving_benchmark_over_a_capped_link(engine_dir):
    """``--link``: P and D in two namespaces over a 1 Gbit/s veth, the client and proxy in
    D's: a pull and a layer-wise push behind the concurrent proxy, every request answered
    and loaded, D's tokens equal across the two, P's veth carrying at least the prompts'
    KV (``--kv-heads 8``: 8 KiB per token), and no namespace left after the run. The
    300-token push sends its first layer (1.2 MiB, above ``push_chunk_bytes``) as a chunk
    WRITE after that layer's copy, which D reads the ``c`` of before its KV is ready."""
    from kvcopy.bench import two_hosts

    why = two_hosts.unavailable()
    if why:
        pytest.skip(f"two hosts: {why}")
    out = os.path.join(engine_dir, "bench-serve-link")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "serve_pd.py"), "--link", "1gbit",
                             "--connectors", "arena,arena-push-layerwise", "--proxy", "concurrent", "--layers", "2",
                             "--kv-heads", "8", "--requests", "2", "--lengths", "100,300", "--out", out, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()  # its namespaces go with the next TwoHosts' sweep (named after its pid)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "8 KiB of KV per prompt token" in stdout and "link MiB P->D / D->P" in stdout, stdout
    with open(os.path.join(out, "serve.json")) as f:
        data = json.load(f)
    assert data["args"]["kv_bytes_per_token"] == 2 * 2 * 8 * 64 * 4
    pull, push = data["rows"]
    assert (pull["proxy"], push["proxy"]) == ("sequential", "concurrent")
    for row in (pull, push):
        assert row["failed_requests"] == 0 and row["prompt_tokens"]["external_kv_transfer"] == 400, row
        assert row["prompt_tokens"]["local_compute"] == 0, row
        assert row["prompt_kv_bytes"] == 400 * 8192 and row["link"]["p_sent_bytes"] >= row["prompt_kv_bytes"], row
    assert push["token_ids"] == pull["token_ids"] and all(pull["token_ids"])
    (long,) = [r for r in push["results"] if r["tokens"] == 300]
    e = long["events"]
    assert e["chunks"] and long["chunks"] == len(e["chunks"]), long
    copies = {name: c for c in e["copies"] for name in c["layers"]}
    for c in e["chunks"]:  # after its layers' copies; D read its c before the KV was ready
        assert all(copies[n]["end"] <= c["post"] for n in c["layers"]), (c, e["copies"])
        assert c["post"] <= c["post_done"] and c["seen"] is not None and c["post"] <= c["seen"] <= e["kv_ready"], c
    assert "chunk WRITE->D saw c" in stdout, stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{two_hosts.PREFIX}-{proc.pid}-" not in names, names
