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
                for key in ("min_us", "p10_us", "median_us", "p90_us", "spread", "gbps", "pct_of_memcpy",
                            "x_memcpy", "bytes", "ops_per_call", "verify", "iters", "noise"):
                    assert key in r, (r["method"], key)
                assert r["min_us"] <= r["p10_us"] <= r["median_us"] <= r["p90_us"]
                assert r["spread"] == pytest.approx(r["p90_us"] / r["p10_us"] - 1)
                assert r["x_memcpy"] == pytest.approx(r["median_us"] / ref)
                assert r["pct_of_memcpy"] == pytest.approx(100 * ref / r["median_us"])
                assert r["bytes"] == rows[0]["bytes"]  # every row moves the same bytes
                assert r["verify"] == ("n/a" if r["method"] == "memcpy" else "ok")
            ops = {r["method"]: r["ops_per_call"] for r in rows}
            # vLLM's coalescing change: a gather and a scatter per (group, layer) before, per layer after.
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
    """Some of the methods asked for run: the others are listed with the reason, exit 0."""
    rc, res = run_json(tmp_path, "--backends", "cpu,cuda,ce", "--num-groups", "1", *SMALL)
    assert rc == 0
    import torch

    if not torch.cuda.is_available():
        assert "cuda" in res["skipped"] and res["skipped"]["cuda"]
        assert {r["method"] for r in res["results"]} == {"memcpy", "cpu"}


def test_unknown_backend_is_an_error(capsys):
    assert main(["--backends", "nope", "--quiet"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_nothing_asked_for_can_run_is_an_error(capsys, monkeypatch):
    """--backends cuda without CUDA measured only the floor and exited 0; now it exits 2
    before measuring, naming why each method cannot run."""
    import kvcopy

    real = kvcopy.available_copy_backends()
    monkeypatch.setattr(kvcopy, "available_copy_backends",
                        lambda: {**real, "cuda": "no CUDA device here", "ce": "no CUDA device here"})
    assert main(["--backends", "cuda,ce", "--quiet", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "none of the methods asked for can run here" in err and "cuda: no CUDA device here" in err


def test_sweep_csv(tmp_path):
    path = tmp_path / "sweep.csv"
    rc = main(["sweep", "--chunk-sizes", "2K,8K", "--num-groups", "2", "--num-layers", "2",
               "--blocks-per-request", "2", "--iters", "2", "--warmup", "0", "--backends", "cpu",
               "--csv", str(path), "--quiet"])
    assert rc == 0
    rows = list(csv.DictReader(path.open()))
    assert {int(r["chunk_bytes"]) for r in rows} == {2048, 8192}
    assert {r["method"] for r in rows} == {"memcpy", "cpu"}
    assert all(r["verify"] in ("ok", "n/a") for r in rows)


@pytest.mark.parametrize("command", ["sweep", "run"])
def test_plot_panels(tmp_path, command):
    """The sweep plot has one panel per (direction, group count) with one line per method;
    the run plot one panel per direction; the title names the scenario."""
    pytest.importorskip("matplotlib", reason="the kvcopy[plot] extra")
    import matplotlib.pyplot as plt

    from kvcopy.bench import plot as plot_module

    made = []
    real_subplots = plt.subplots
    plt.subplots = lambda *a, **k: made.append(real_subplots(*a, **k)) or made[-1]
    try:
        png = tmp_path / "p.png"
        extra = ["--chunk-sizes", "2K,8K"] if command == "sweep" else []
        rc = main([command, *extra, "--num-groups", "1,3", "--num-layers", "2", "--blocks-per-request", "2",
                   "--iters", "2", "--warmup", "0", "--backends", "cpu,vllm", "--quiet", "--plot", str(png)])
    finally:
        plt.subplots = real_subplots
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig, axes = made[0]
    assert axes.shape == ((2, 2) if command == "sweep" else (2, 1))
    if command == "sweep":
        assert [ax.get_title() for ax in axes.flat] == ["h2d, 1 KV cache group", "h2d, 3 KV cache groups",
                                                       "d2h, 1 KV cache group", "d2h, 3 KV cache groups"]
        labels = [line.get_label() for line in axes[0][0].get_lines() if not line.get_label().startswith("_")]
        assert labels == ["memcpy", "cpu", "vllm"]
    assert "seeds2: 2 layers" in fig._suptitle.get_text()
    assert plot_module.matplotlib_missing() is None


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
    assert plan["verify"] == "ok" and plan["arena_verify"] == "ok"
    # 2 groups x 2 layers x 3 blocks x 2 chunks per page; contiguous ids merge per (layer, group, chunk)
    assert plan["descriptors_per_page"] == 24
    assert plan["descriptors_merged"] == 8
    methods = [r["method"] for r in res["results"]]
    assert methods[0] == "bulk READ" and "pull+complete" in methods
    assert all(r["bytes"] == plan["plan_bytes"] for r in res["results"])
    # the '+sum' rows: every compared pull matched (host mode: one more descriptor per page read)
    assert {"save+sum", "pull+complete+sum", "arena save+sum", "arena pull+complete+sum"} <= set(methods)
    descs = {r["method"]: r["descriptors"] for r in res["results"]}
    assert descs["pull+complete+sum"] == descs["pull+complete"] + 2 * 3
    for facts in (plan["host_checksums"], plan["arena_checksums"]):
        assert facts["checksum_checked"] > 0 and facts["checksum_failed"] == facts["checksum_unchecked"] == 0


@pytest.mark.parametrize("layout", ["kv_first", "hnd_view_of_nhd"])
def test_verify_catches_missing_and_stray_writes(layout):
    from kvcopy.bench.scenarios import Scenario

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
            point.raw["device"][1][-1:].fill_(7)  # one byte outside the contract

        assert "storage 1" in point.check(stray, "h2d", exp)
    finally:
        point.close()


@pytest.mark.parametrize("layout", ["kv_first", "lbnhc"])
def test_the_floor_copies_within_the_same_buffers(layout):
    """The memcpy floor moves the call's bytes from the source slab to the destination
    slab, the allocations every method's storages are slices of."""
    import torch

    from kvcopy.bench.scenarios import Scenario

    sc = Scenario(num_layers=3, num_groups=2, blocks_per_request=2, block_size=2, num_kv_heads=2, head_size=8,
                  layout=layout)
    point = sc.build("cpu")
    try:
        for side, stores in (("device", point.dev_storages), ("host", point.host_storages)):
            slab = point.slabs[side]
            lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
            for t in stores:
                assert lo <= t.data_ptr() < hi, side
        n = point.total_bytes
        for direction, src, dst in (("h2d", "host", "device"), ("d2h", "device", "host")):
            point.slabs[dst].fill_(0xA5)
            point.method("memcpy", direction)()
            assert torch.equal(point.slabs[dst][:n], point.slabs[src][:n])
            assert bool((point.slabs[dst][n:] == 0xA5).all())  # exactly the call's bytes
    finally:
        point.close()


def test_every_row_on_the_same_threads_stated_in_the_header(tmp_path, capsys, monkeypatch):
    """The memcpy floor and the cpu backend run on one thread count, which the header
    states; the cpu backend's team size is read when its copier is prepared."""
    import torch

    from kvcopy.copy_backends import get_backend

    get_backend("cpu")  # an instance that existed before the run must still follow --threads
    monkeypatch.delenv("KVCOPY_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    real_prepare = type(get_backend("cpu")).prepare

    def spy(self, tables):
        real_prepare(self, tables)
        seen.append((torch.get_num_threads(), tables.backend_state["cpu"].tuning.num_threads))

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


def _result(rows, threads=1, load=0.1):
    return {"command": "run", "description": "d", "results": rows, "skipped": {}, "notes": [],
            "env": {"device": "cpu", "cpu_count": 2, "torch": "x", "load_average": load},
            "threads": {"count": threads, "why": "--threads"}}


def _row(method, low, med, p90, groups=1, iters=20):
    return {"method": method, "chunk_bytes": 1024, "groups": groups, "direction": "h2d", "bytes": 4096,
            "iters": iters, "min_us": low, "median_us": med, "p90_us": p90, "spread": p90 / low - 1,
            "x_memcpy": med / 10.0, "verify": "ok"}


def test_noise_flags_name_the_floor_or_the_row():
    """A row is flagged only by its own spread or its point's floor's, and says which;
    a row below a steady floor is not flagged (it is a result, not noise)."""
    from kvcopy.bench.output import format_table, noise_flags

    steady = [_row("memcpy", 9.5, 10.0, 10.5), _row("cpu", 5.0, 6.0, 6.2), _row("torch", 8.0, 10.5, 14.0),
              _row("vllm", 30.0, 31.0, 33.0, iters=2)]
    noisy = [_row("memcpy", 9.0, 12.0, 25.0, groups=2), _row("cpu", 10.0, 11.0, 11.5, groups=2)]
    result = _result(steady + noisy)
    flags = noise_flags(result)
    assert {r["method"]: flags.get(id(r)) for r in steady} == {"memcpy": None, "cpu": None, "torch": "row",
                                                              "vllm": "row"}
    assert [flags.get(id(r)) for r in noisy] == ["floor", "floor"]
    text = format_table(result, sweep=False)
    assert "noise: 3 rows flagged (floor and row)" in text
    assert "fewer than 3 calls give no spread" in text  # vllm's 2 calls
    assert "--threads 1" not in text  # it ran with 1 thread already
    assert "cpu          median 0.60x  worst 0.60x  best 0.60x over 1 point (1 more flagged as noise" in text
    assert "!" not in text


def test_noise_advice_follows_the_thread_count_and_the_load():
    from kvcopy.bench.output import format_table

    rows = [_row("memcpy", 9.0, 12.0, 25.0), _row("cpu", 10.0, 11.0, 11.5)]
    busy = format_table(_result(rows, threads=2, load=3.0), sweep=False)
    assert "load average 3.0 on 2 cores" in busy and "or with --threads 1" in busy
    quiet = format_table(_result(rows, threads=1, load=0.1), sweep=False)
    assert "something else ran during the run" in quiet and "--threads 1" not in quiet
    steady = format_table(_result([_row("memcpy", 9.5, 10.0, 10.5), _row("cpu", 10.0, 11.0, 11.5)]), sweep=False)
    assert "noise:" not in steady


def test_measure_settles_each_timed_call_and_rotates_the_rounds():
    """Every timed call follows an untimed call of the same method (settle=1), and each
    round starts one method further, so no method always follows the same one."""
    from kvcopy.bench.timing import measure

    calls = []
    methods = {m: (lambda m=m: calls.append(m)) for m in ("a", "b", "c")}
    timings = measure(methods, "cpu", iters=3, warmup=1, budget_s=60.0, settle=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert calls[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert all(t.stats()["iters"] == 3 for t in timings.values())


def test_measure_flushes_right_before_each_timed_call():
    """``flush`` runs after the settling calls and the ``before`` hook, right before each
    timed call, and never before an untimed one."""
    from kvcopy.bench.timing import measure

    calls = []
    methods = {m: (lambda m=m: calls.append(m)) for m in ("a", "b")}
    before = {"a": lambda: calls.append("before-a")}
    measure(methods, "cpu", iters=2, warmup=1, budget_s=60.0, settle=1, before=before,
            flush=lambda: calls.append("flush"))
    assert calls == ["before-a", "a", "b",  # warm-up
                     "before-a", "a", "before-a", "flush", "a", "b", "flush", "b",
                     "b", "flush", "b", "before-a", "a", "before-a", "flush", "a"]


@pytest.mark.parametrize("cache", ["cold-dst", "cold"])
def test_cold_cache_runs_flush_the_slabs_before_each_timed_call(cache, tmp_path, capsys, monkeypatch):
    """--cache cold-dst/cold: before every timed call of every row (memcpy included) the
    destination slab (and with cold the source's) is flushed, whole, after the settling
    calls (cold-dst) or with none (cold); the rows still verify bit-exact, and the JSON
    and the header say which."""
    import kvcopy.copy_backends.cpu as cpu_mod
    from kvcopy.bench import run as run_mod

    flushed = []
    real = cpu_mod.flush_caches

    def spy(t):
        flushed.append((t.data_ptr(), t.untyped_storage().nbytes()))
        return real(t)

    monkeypatch.setattr(cpu_mod, "flush_caches", spy)
    slabs = {}
    real_flush = run_mod._cache_flush

    def spy_flush(point, direction, c):
        slabs[direction] = {side: (t.data_ptr(), t.untyped_storage().nbytes()) for side, t in point.slabs.items()}
        return real_flush(point, direction, c)

    monkeypatch.setattr(run_mod, "_cache_flush", spy_flush)
    import kvcopy.bench.timing as timing_mod

    settles = []
    real_measure = timing_mod.measure

    def spy_measure(*args, **kw):
        settles.append(kw["settle"])
        return real_measure(*args, **kw)

    monkeypatch.setattr(timing_mod, "measure", spy_measure)
    rc, res = run_json(tmp_path, "--num-groups", "1", "--backends", "cpu", "--checksum", "--cache", cache,
                       "--budget", "60", *SMALL)
    assert rc == 0 and res["cache"] == cache
    # cold-dst settles as warm (the source as warm for every row), cold not at all
    assert settles == [run_mod.SETTLE_CPU if cache == "cold-dst" else 0] * 2
    rows = res["results"]
    assert {r["method"] for r in rows} == {"memcpy", "cpu", "cpu+sum"}
    assert all(r["verify"] == ("n/a" if r["method"] == "memcpy" else "ok") for r in rows)
    timed = sum(r["iters"] for r in rows)
    assert timed == 2 * 3 * 3  # two directions, three rows, --iters 3
    per_call = 1 if cache == "cold-dst" else 2
    flushed_after_check = flushed[-timed * per_call:]  # _check_cache flushed a probe first
    assert len(flushed) == timed * per_call + 1
    for direction, (src, dst) in (("h2d", ("host", "device")), ("d2h", ("device", "host"))):
        want = [slabs[direction][dst]] + ([slabs[direction][src]] if cache == "cold" else [])
        mine = flushed_after_check[:timed * per_call // 2] if direction == "h2d" else \
            flushed_after_check[timed * per_call // 2:]
        assert mine == want * (len(mine) // len(want)), direction
    out = capsys.readouterr().out
    assert f"cache: {cache}: the " in out and "flushed from every cache level before each timed call" in out


def test_cold_cache_is_refused_where_it_cannot_mean_anything(tmp_path, monkeypatch):
    """A GPU run, and a library with no flush for the CPU, are refused before anything runs."""
    import kvcopy.copy_backends.cpu as cpu_mod
    from kvcopy.bench.args import BenchError
    from kvcopy.bench.run import _check_cache

    class Args:
        cache = "cold"

    with pytest.raises(BenchError, match="CPU runs only"):
        _check_cache(Args(), "cuda")
    monkeypatch.setattr(cpu_mod, "flush_caches", lambda t: False)
    with pytest.raises(BenchError, match="no cache flush for this CPU"):
        _check_cache(Args(), "cpu")
    Args.cache = "warm"
    _check_cache(Args(), "cuda")  # warm: nothing to check anywhere


def test_presets_and_names_need_no_torch():
    """--help lists presets, dtypes and layouts from torch-free data, the same names the
    scenarios use, and does not import torch."""
    from kvcopy.bench.presets import DTYPE_NAMES, LAYOUT_NAMES, PRESETS
    from kvcopy.bench.scenarios import PRESETS as BUILT
    from kvcopy.testing import DTYPES, LAYOUTS

    assert tuple(DTYPES) == DTYPE_NAMES and tuple(LAYOUTS) == LAYOUT_NAMES
    assert list(PRESETS) == list(BUILT) and all(BUILT[n]["scenario"].name == n for n in BUILT)
    code = ("import sys; from kvcopy.bench.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("no torch"), proc.stdout[-500:] + proc.stderr[-2000:]
    assert "--num-kv-heads N" in proc.stdout and "(default: both)" in proc.stdout


def test_every_option_states_its_help_and_default():
    from kvcopy.bench.cli import SUBCOMMANDS

    for name in ("run", "sweep", "overhead", "fuzz"):
        p = SUBCOMMANDS[name].parser()
        for action in p._actions:
            if not action.option_strings or action.default is None or action.default is False:
                continue
            if action.nargs == 0:  # a switch: on or off
                continue
            assert "default" in (action.help or ""), (name, action.option_strings)


def test_plot_without_matplotlib_fails_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    t0 = len(capsys.readouterr().out)
    assert main(["sweep", "--chunk-sizes", "2K", "--quiet", "--plot", str(tmp_path / "p.png"), *SMALL[:-5]]) == 2
    out = capsys.readouterr()
    assert "--plot needs matplotlib" in out.err and "nothing was measured" in out.err
    assert "memcpy" not in out.out and t0 == 0
    assert not (tmp_path / "p.png").exists()


def test_a_file_git_tracks_is_not_overwritten(tmp_path, capsys):
    """The README's old command overwrote a committed result; now that needs --overwrite."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    kept = tmp_path / "committed.json"
    kept.write_text("{}\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "committed.json"], check=True)
    assert main(["--json", str(kept), *SMALL]) == 2
    assert "is a file git tracks" in capsys.readouterr().err and kept.read_text() == "{}\n"
    assert main(["--json", str(kept), "--overwrite", "--num-groups", "1", "--direction", "h2d", *SMALL]) == 0
    assert json.loads(kept.read_text())["tool"] == "kvcopy-bench"


def test_list_aligns_every_name(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    presets = lines[1:lines.index(next(line for line in lines if line.startswith("native")))]
    starts = {len(line) - len(line[2:].split("  ", 1)[1].lstrip()) for line in presets}
    assert len(presets) == 5 and len(starts) == 1, presets


def test_sweep_caps_layers_when_one_block_is_too_big(tmp_path):
    rc, res = run_json(tmp_path, "sweep", "--chunk-sizes", "64K", "--num-groups", "2", "--num-layers", "8",
                       "--max-call-bytes", "600K", "--backends", "cpu", "--iters", "1", "--warmup", "0",
                       "--quiet", "--direction", "h2d")
    assert rc == 0
    (row,) = [r for r in res["results"] if r["method"] == "cpu"]
    assert row["bytes"] <= 600 << 10 and row["layers"] == 2 and row["blocks_per_group"] == [1, 1]
    assert "fewer layers (down to 2)" in res["description"]


def test_check_device_accepts_what_run_and_calibrate_take():
    import torch

    from kvcopy.bench.args import BenchError, check_device

    assert check_device("cpu") == "cpu"
    with pytest.raises(BenchError, match="expected cpu, cuda or cuda:N"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        for dev in ("cuda", "cuda:1", "1"):
            with pytest.raises(BenchError, match="torch sees no CUDA device"):
                check_device(dev)


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


def test_summary_gives_each_checksum_cost():
    """The summary's 'checksum cost' line: each '+sum' row's median time over its
    backend's at the same point, the points with a flagged row counted."""
    from kvcopy.bench.output import noise_flags, summary

    def row(method, direction, median, spread=0.1):
        return {"method": method, "chunk_bytes": 64, "groups": 1, "direction": direction, "iters": 5,
                "median_us": median, "spread": spread, "x_memcpy": median / 10.0}

    rows = [row(m, d, med) for d in ("h2d", "d2h") for m, med in (("memcpy", 10.0), ("cpu", 12.0))]
    rows += [row("cpu+sum", "h2d", 13.2), row("cpu+sum", "d2h", 15.0, spread=1.0)]  # d2h: flagged
    for r in rows:
        r["verify"] = "n/a" if r["method"] == "memcpy" else "ok"
    result = {"results": rows}
    text = summary(result, noise_flags(result))
    line = next(x for x in text.splitlines() if "checksum cost" in x)
    assert line.split() == ["cpu+sum", "checksum", "cost:", "median", "1.25x", "worst", "1.25x", "best", "1.10x",
                            "over", "2", "points", "(its", "median", "time", "/", "cpu's,", "same", "point;", "1",
                            "with", "a", "row", "flagged", "as", "noise)"]
    assert "checksum cost" not in summary({"results": rows[:4]}, {})


@pytest.mark.parametrize("simd,loops", [("0", {"scalar"}), ("1", {"avx512", "avx2", "scalar"})])
def test_checksum_run_names_the_cpu_loop(tmp_path, monkeypatch, capsys, simd, loops):
    """A run with cpu+sum rows says which of the cpu backend's loops timed them (the
    cost differs by 2-5x between them), in the JSON and above the table."""
    from kvcopy.copy_backends.cpu import CpuBackend
    if CpuBackend().unavailable_reason():
        pytest.skip("CPU library not built")
    monkeypatch.setenv("KVCOPY_CPU_SIMD", simd)
    rc, res = run_json(tmp_path, "--backends", "cpu", "--checksum", *SMALL[:-1])
    assert rc == 0
    assert res["cpu_checksum_loop"] in loops and res["cpu_checksum_loop"] == CpuBackend().checksum_loop()
    assert f"cpu+sum: the {res['cpu_checksum_loop']} loop" in capsys.readouterr().out
    rc, res = run_json(tmp_path, "--backends", "cpu", *SMALL)
    assert rc == 0 and res["cpu_checksum_loop"] is None


def test_checksum_run_refuses_an_unknown_cpu_loop(monkeypatch, capsys):
    monkeypatch.setenv("KVCOPY_CPU_SIMD", "avx3")
    assert main(["--backends", "cpu", "--checksum", *SMALL]) == 2
    assert "KVCOPY_CPU_SIMD must be 1, 0 or avx2, got 'avx3'" in capsys.readouterr().err
