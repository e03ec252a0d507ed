"""kvcopy-bench: runs with small flags, in process and as ``python -m kvcopy``; checks its JSON.

No timing is asserted: speed is what the benchmark reports, not what a test checks.
"""
import csv
import json
import os
import subprocess
import sys

import pytest

from kvcopy.bench.cli import main

SMALL = ["--num-layers", "2", "--blocks-per-request", "2", "--block-size", "2", "--num-kv-heads", "2",
         "--head-size", "8", "--iters", "3", "--warmup", "0", "--quiet"]


def run_json(tmp_path, *argv):
    path = tmp_path / "out.json"
    rc = main([*argv, "--json", str(path)])
    return rc, json.loads(path.read_text())


def rows_by(result, **match):
    return [r for r in result["results"] if all(r[k] == v for k, v in match.items())]


def test_run_json_fields_verify_and_ratios(tmp_path, capsys):
    rc, res = run_json(tmp_path, "--num-groups", "1,3", "--op-counts", *SMALL)
    assert rc == 0
    for key in ("date", "commit", "torch", "python", "device", "cpu_count"):
        assert key in res["env"], key
    assert res["command"] == "run" and res["argv"][0] == "run"
    assert res["methods"][0] == "memcpy"
    assert {"vllm", "coalesced", "torch", "cpu"} <= set(res["methods"])
    for groups in (1, 3):
        for direction in ("h2d", "d2h"):
            rows = rows_by(res, groups=groups, direction=direction)
            assert rows[0]["method"] == "memcpy"
            ref = rows[0]["median_us"]
            for r in rows:
                for key in ("median_us", "p20_us", "p80_us", "gbps", "pct_of_memcpy", "x_memcpy", "bytes",
                            "ops_per_call", "verify", "iters"):
                    assert key in r, (r["method"], key)
                assert r["p20_us"] <= r["median_us"] <= r["p80_us"]
                assert r["x_memcpy"] == pytest.approx(r["median_us"] / ref)
                assert r["pct_of_memcpy"] == pytest.approx(100 * ref / r["median_us"])
                assert r["bytes"] == rows[0]["bytes"]  # every row moves the same bytes
                assert r["verify"] == ("n/a" if r["method"] == "memcpy" else "ok")
            ops = {r["method"]: r["ops_per_call"] for r in rows}
            # seeds/2's counts: a gather and a scatter per (group, layer) before, per layer after.
            assert ops["vllm"] == 2 * 2 * groups
            assert ops["coalesced"] == 2 * 2
            assert ops["cpu"] == 0  # one native call, not a torch operator
    out = capsys.readouterr().out
    assert "memcpy" in out and "% memcpy" in out and "summary" in out


def test_bytes_per_call_match_the_scenario(tmp_path):
    rc, res = run_json(tmp_path, "--num-groups", "2", "--direction", "d2h", *SMALL)
    assert rc == 0
    sc = res["scenario"]
    # kv_first [2, NB, 2 tokens, 2 heads, 8] bf16: 2 chunks of 64 bytes per block and layer
    assert sc["chunk_bytes"] == 2 * 2 * 8 * 2
    assert sc["call_bytes"] == 2 * 2 * 2 * 2 * sc["chunk_bytes"]  # groups x layers x blocks x chunks
    assert {r["direction"] for r in res["results"]} == {"d2h"}
    assert all(r["bytes"] == sc["call_bytes"] for r in res["results"])


@pytest.mark.parametrize("preset,extra", [
    ("hybrid7", ["--num-layers", "12", "--blocks-per-request", "4", "--window-blocks", "2",
                 "--block-size", "2"]),
    ("mla", ["--num-layers", "3", "--blocks-per-request", "3", "--block-size", "4", "--head-size", "16"]),
    ("dense", ["--num-layers", "3", "--blocks-per-request", "5", "--block-size", "2", "--layout", "nhd",
               "--ids", "contiguous"]),
])
def test_presets_verify(tmp_path, preset, extra):
    rc, res = run_json(tmp_path, "--preset", preset, *extra, "--iters", "2", "--warmup", "0", "--quiet")
    assert rc == 0
    assert res["results"] and all(r["verify"] in ("ok", "n/a") for r in res["results"])
    if preset == "hybrid7":
        sc = res["scenario"]
        # 12 layers: full 5 and 11 form group 0; ten sliding layers in groups of two
        assert sc["num_groups"] == 6
        assert sc["blocks_per_group"][0] == 4 and set(sc["blocks_per_group"][1:]) == {2}


def test_unavailable_backend_is_skipped_with_reason(tmp_path):
    rc, res = run_json(tmp_path, "--backends", "cpu,cuda,ce", "--num-groups", "1", *SMALL)
    assert rc == 0
    import torch

    if not torch.cuda.is_available():
        assert "cuda" in res["skipped"] and res["skipped"]["cuda"]
        assert {r["method"] for r in res["results"]} == {"memcpy", "cpu"}


def test_unknown_backend_is_an_error(capsys):
    assert main(["--backends", "nope", "--quiet"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_sweep_csv(tmp_path):
    path = tmp_path / "sweep.csv"
    rc = main(["sweep", "--chunk-sizes", "2K,8K", "--num-groups", "2", "--num-layers", "2",
               "--blocks-per-request", "2", "--iters", "2", "--warmup", "0", "--backends", "cpu",
               "--csv", str(path), "--quiet", "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    rows = list(csv.DictReader(path.open()))
    assert {int(r["chunk_bytes"]) for r in rows} == {2048, 8192}
    assert {r["method"] for r in rows} == {"memcpy", "cpu"}
    assert all(r["verify"] in ("ok", "n/a") for r in rows)


def test_sweep_caps_bytes_per_call(tmp_path):
    rc, res = run_json(tmp_path, "sweep", "--chunk-sizes", "64K", "--num-groups", "2", "--num-layers", "2",
                       "--max-call-bytes", "1M", "--backends", "cpu", "--iters", "1", "--warmup", "0",
                       "--quiet", "--direction", "h2d")
    assert rc == 0
    assert all(r["bytes"] <= 1 << 20 for r in res["results"])


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "seeds2" in out and "cpu" in out


def test_python_dash_m_json_to_stdout():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "kvcopy", "--num-groups", "2", "--direction", "h2d",
                           "--backends", "cpu,vllm", *SMALL, "--json", "-"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)  # the table went to stderr
    assert "memcpy" in proc.stderr
    assert [r["method"] for r in res["results"]] == ["memcpy", "cpu", "vllm"]  # the order asked for
    assert all(r["x_memcpy"] > 0 for r in res["results"])


def test_nixl_subcommand(tmp_path):
    from kvcopy.nixl import nixl_available

    if nixl_available():
        pytest.skip("NIXL not installed")
    rc, res = run_json(tmp_path, "nixl", "--num-groups", "2", "--num-layers", "2", "--blocks-per-request", "3",
                       "--block-size", "2", "--num-kv-heads", "2", "--head-size", "8", "--ids", "contiguous",
                       "--iters", "2", "--warmup", "0", "--quiet", "--device", "cpu")
    assert rc == 0
    (plan,) = res["plans"]
    assert plan["verify"] == "ok"
    # 2 groups x 2 layers x 3 blocks x 2 chunks per page; contiguous ids merge per (layer, group, chunk)
    assert plan["descriptors_per_page"] == 24
    assert plan["descriptors_merged"] == 8
    methods = [r["method"] for r in res["results"]]
    assert methods[0] == "bulk READ" and "pull+complete" in methods
    assert all(r["bytes"] == plan["plan_bytes"] for r in res["results"])


@pytest.mark.parametrize("layout", ["kv_first", "hnd_view_of_nhd"])
def test_verify_catches_missing_and_stray_writes(layout):
    from kvcopy.bench.scenarios import Scenario, _raw_bytes

    sc = Scenario(num_layers=2, num_groups=2, blocks_per_request=2, block_size=2, num_kv_heads=2,
                  head_size=8, layout=layout)
    point = sc.build("cpu")
    try:
        exp = point.expected("h2d")
        assert point.check(point.method("cpu", "h2d"), "h2d", exp) is None
        assert point.check(lambda: None, "h2d", exp) is not None  # nothing written
        good = point.method("vllm", "h2d")

        def stray():
            good()
            _raw_bytes(point.dev_storages[1])[-1:].fill_(7)  # one byte outside the contract

        assert "storage 1" in point.check(stray, "h2d", exp)
    finally:
        point.close()


def test_every_row_on_the_same_threads_stated_in_the_header(tmp_path, capsys, monkeypatch):
    """The memcpy floor and the cpu backend run on one thread count, which the header
    states; the cpu backend's team size is read when its copier is prepared."""
    import torch

    from kvcopy.backends import get_backend

    get_backend("cpu")  # an instance that existed before the run must still follow --threads
    monkeypatch.delenv("KVCOPY_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    real_prepare = type(get_backend("cpu")).prepare

    def spy(self, tables):
        real_prepare(self, tables)
        seen.append((torch.get_num_threads(), tables.backend_state["cpu"][-1]))

    monkeypatch.setattr(type(get_backend("cpu")), "prepare", spy)
    rc, res = run_json(tmp_path, "--num-groups", "2", "--threads", "1", "--direction", "h2d", *SMALL)
    assert rc == 0
    assert res["threads"] == {"count": 1, "why": "--threads"} and res["env"]["torch_threads"] == 1
    assert seen and all(s == (1, 1) for s in seen), seen
    assert torch.get_num_threads() == before and "KVCOPY_CPU_THREADS" not in os.environ
    out = capsys.readouterr().out
    assert "threads: 1 thread for every row, memcpy included" in out
    assert "lower is better" in out and "ops/call: '-' = not counted (pass --op-counts" in out
    assert "1 threads" not in out and "(s)" not in out and "2 groups" in out


def test_progress_bar_uses_the_table_size_unit(tmp_path, capsys):
    rc = main(["--num-groups", "1,2", "--direction", "h2d", "--json", str(tmp_path / "o.json"),
               *[a for a in SMALL if a != "--quiet"]])
    assert rc == 0
    err = capsys.readouterr().err
    assert "1 group, chunk 64 B, h2d" in err and "2 groups, chunk 64 B, h2d" in err, err


def test_row_faster_than_its_floor_is_flagged():
    from kvcopy.bench.output import below_floor, format_table

    def row(method, p20, med, p80):
        return {"method": method, "chunk_bytes": 1024, "groups": 1, "direction": "h2d", "bytes": 4096,
                "p20_us": p20, "median_us": med, "p80_us": p80, "x_memcpy": med / 10.0, "verify": "ok"}

    rows = [row("memcpy", 9.0, 10.0, 11.0), row("cpu", 5.0, 6.0, 7.0), row("torch", 8.0, 10.5, 12.0)]
    result = {"command": "run", "env": {"device": "cpu", "cpu_count": 2, "torch": "x"}, "description": "d",
              "results": rows, "skipped": {}, "notes": [], "threads": {"count": 1, "why": "--threads"}}
    assert below_floor(result) == {id(rows[1])}  # torch's p80 overlaps the floor: noise, not flagged
    text = format_table(result, sweep=False)
    assert "0.60!" in text and "1 row faster than the memcpy floor" in text


@pytest.mark.parametrize("layout", ["lbnhc", "blnhc"])
def test_converting_preset_verifies_every_method(tmp_path, layout):
    """The convert512 preset (LBNHC cache vs contiguous host) and a cross-layer layout
    run and check bit-exact (every byte of each allocation) with small sizes."""
    rc, res = run_json(tmp_path, "--preset", "convert512", "--layout", layout, *SMALL)
    assert rc == 0
    rows = [r for r in res["results"] if r["method"] != "memcpy"]
    assert rows and all(r["verify"] == "ok" for r in rows), [(r["method"], r["verify"]) for r in rows]
    assert {int(r["chunk_bytes"]) for r in res["results"]} == {2 * 8 * 2}  # C = 2 x 8 bf16 per run


def test_checksum_rows_beside_their_backends(tmp_path):
    """--checksum adds a '<backend>+sum' row (the same copier with checksums on),
    verified like the others; ce+sum is never added (ce computes no checksums)."""
    rc, res = run_json(tmp_path, "--num-groups", "2", "--backends", "cpu,torch", "--checksum", *SMALL)
    assert rc == 0
    methods = {r["method"] for r in res["results"]}
    assert {"cpu", "cpu+sum", "torch", "torch+sum"} <= methods
    assert all(r["verify"] in ("ok", "n/a") for r in res["results"])
    assert main(["--backends", "vllm+sum", "--quiet"]) == 2
