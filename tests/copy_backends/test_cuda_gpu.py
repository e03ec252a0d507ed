"""GPU tests of the ``cuda`` backend and ``auto`` (skipped without a CUDA device).

Bit-exact against the reference with the destination poisoned, over the shared cases,
both directions; pageable host buffers (pinned in place); max_ctas; CUDA graph
capture and replay of ``to_device`` (inline call parameters and the staged path);
the NVRTC launcher; ``auto``. The ``ce`` backend's: tests/copy_backends/test_ce.py.
"""
import numpy as np
import pytest
import torch

from kvcopy import BlockCopier, native
from kvcopy.testing import CopyCase, bytes_equal, check_copy, prepare_check, standard_cases

pytestmark = pytest.mark.gpu
CASES = standard_cases()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_bit_exact(case, direction):
    check_copy("cuda", case, direction, device="cuda").close()


@pytest.mark.parametrize("max_ctas", [1, 16])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_cuda_max_ctas(max_ctas, direction):
    for case in (CopyCase(ids="all", num_groups=1, layout="nhd", num_blocks=64, dtype="fp32", head_size=256),
                 CopyCase(layout="kv_first", num_groups=7, ids="scattered", num_blocks=48)):
        check_copy("cuda", case, direction, device="cuda", max_ctas=max_ctas).close()


def test_cuda_nvrtc_launcher(monkeypatch):
    from kvcopy import copy_backends as backends
    from kvcopy.copy_backends import nvrtc

    if nvrtc.available() is not None:
        pytest.skip(f"no NVRTC here: {nvrtc.available()}")
    monkeypatch.setenv("KVCOPY_CUDA_NVRTC", "1")
    monkeypatch.setitem(backends._instances, "cuda", backends.cuda.CudaBackend())
    assert backends.get_backend("cuda").launcher_kind == "nvrtc"
    for case in (CopyCase(layout="kv_first", num_groups=2), CopyCase(head_size=7, dtype="uint8", ids="runs")):
        for direction in ("h2d", "d2h"):
            check_copy("cuda", case, direction, device="cuda").close()


def _record_grids(monkeypatch, st, grids):
    """Wrap the launches of a copier direction's ``cuda`` state (the inline path's C
    function and the launcher's general and checksum launches) to note each grid."""
    from kvcopy import native

    if st.inline is not None:
        real_inline = st.inline.launch

        def inline(tables_at, packed, words, stream):
            grids.append(native.CUDA_CALL.unpack(packed)[4])  # struct_bytes, device, words, bytes, grid
            return real_inline(tables_at, packed, words, stream)
        monkeypatch.setattr(st.inline, "launch", inline)
    for name in ("launch", "launch_sums"):
        real = getattr(st.launcher, name)

        def general(*args, _real=real):
            grids.append(args[10])  # device, tables, e, g, ge, call_host, call_device, words, total, word, grid
            return _real(*args)
        monkeypatch.setattr(st.launcher, name, general)


def _capped_calls(monkeypatch, launcher_kind):
    """Per-call caps 1, 2, 4 through ``launcher_kind``: the grid launched is the cap, the
    copy bit-exact over a poisoned destination, checksummed calls too."""
    case = CopyCase(ids="all", num_groups=2, layout="nhd", num_blocks=64, dtype="fp32", head_size=256)
    for direction in ("d2h", "h2d"):
        for cap in (1, 2, 4):
            check = prepare_check("cuda", case, direction, device="cuda")
            st = check.copier.tables(direction).backend_state["cuda"]
            assert st.launcher.kind == launcher_kind
            grids = []
            _record_grids(monkeypatch, st, grids)
            check.run(direction, max_ctas=cap)
            assert grids == [cap]  # 64 pages of 16 KiB: far more CTAs by the bytes
            check.assert_matches()
            if direction == "d2h":
                call = check.copier.plan("d2h", check.dev_ids, check.host_ids)
                capped = torch.empty(call.num_blocks, dtype=torch.int64, device="cuda")
                full = torch.empty_like(capped)
                check.copier.run("d2h", call, capped, max_ctas=cap)
                check.copier.run("d2h", call, full)
                assert grids[-2] == cap and grids[-1] > cap
                assert torch.equal(capped.cpu(), full.cpu())
            check.copier.close()


def test_cuda_a_calls_max_ctas_is_its_grid(monkeypatch):
    _capped_calls(monkeypatch, "library" if native.load("kvcopy_cuda")[0] is not None else "nvrtc")


def test_cuda_nvrtc_a_calls_max_ctas_is_its_grid(monkeypatch):
    from kvcopy import copy_backends as backends
    from kvcopy.copy_backends import nvrtc

    if nvrtc.available() is not None:
        pytest.skip(f"no NVRTC here: {nvrtc.available()}")
    monkeypatch.setenv("KVCOPY_CUDA_NVRTC", "1")
    monkeypatch.setitem(backends._instances, "cuda", backends.cuda.CudaBackend())
    _capped_calls(monkeypatch, "nvrtc")


def test_pageable_host_buffers_are_pinned_and_released():
    case = CopyCase(layout="nhd", num_groups=2, ids="scattered")
    dev, host = case.build("cuda", "device")
    assert not any(t.is_pinned() for t in host.values())
    copier = BlockCopier(dev, host, case.layer_groups(), copy_backend="cuda")
    assert all(t.is_pinned() for t in host.values())
    copier.close()
    assert not any(t.is_pinned() for t in host.values())


def _graph_case(blocks_per_group, scattered):
    # NHD, 4 layers x 2 groups; scattered ids make one run per block (a long call array)
    case = CopyCase(layout="nhd", num_groups=2, layers_per_group=2, num_blocks=4 * blocks_per_group)
    dev, host = case.build("cuda", "device")
    rng = np.random.default_rng(0)
    perm = rng.permutation(case.num_blocks)
    if scattered:
        ids = [sorted(perm[:blocks_per_group].tolist())[::1], perm[blocks_per_group:2 * blocks_per_group].tolist()]
    else:
        ids = [list(range(blocks_per_group)), list(range(blocks_per_group, 2 * blocks_per_group))]
    return case, dev, host, ids


@pytest.mark.parametrize("blocks,scattered", [(6, False), (600, True)], ids=["inline", "staged"])
def test_graph_capture_and_replay_to_device(blocks, scattered):
    case, dev, host, ids = _graph_case(blocks, scattered)
    copier = BlockCopier(dev, host, case.layer_groups(), copy_backend="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        copier.to_device(ids)  # warm-up outside the graph (compiles/loads, pins)
    torch.cuda.synchronize()
    for t in dev.values():
        t.view(torch.uint8).fill_(0xA5)
    with torch.cuda.graph(graph, stream=stream):
        copier.to_device(ids)
    # capture enqueued nothing: the destination is still poisoned
    torch.cuda.synchronize()
    # new host contents, then replay: the graph copies what the host holds now
    for t in host.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    # other calls between capture and replay must not disturb the captured call array
    copier.to_device([ids[1][:1], ids[0][:1]])
    torch.cuda.synchronize()
    for t in dev.values():
        t.view(torch.uint8).fill_(0xA5)
    graph.replay()
    torch.cuda.synchronize()
    for g, layers in enumerate(case.layer_groups()):
        idx = torch.tensor(ids[g])
        for name in layers:
            got = dev[name].cpu()[idx]
            assert bytes_equal(got, host[name][idx]), (name, g)
            rest = torch.ones(case.num_blocks, dtype=torch.bool)
            rest[idx] = False
            assert bool((dev[name].cpu()[rest].view(torch.uint8) == 0xA5).all()), (name, "untouched blocks")
    copier.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("case", [c for c in CASES if c.ids in ("runs", "all", "scattered")][:8], ids=lambda c: c.id)
def test_auto_bit_exact(case, direction):
    check_copy("auto", case, direction, device="cuda").close()


def test_auto_picks_ce_for_large_merged_runs_and_cuda_for_small_pages(monkeypatch, tmp_path):
    from kvcopy.copy_backends import calibration

    monkeypatch.setenv("KVCOPY_CALIBRATION", str(tmp_path / "none.json"))  # built-in default
    calibration._cache.clear()
    big = {"l0": torch.zeros(64, 256 << 10, dtype=torch.uint8, device="cuda")}
    small = {"l0": torch.zeros(64, 2048, dtype=torch.uint8, device="cuda")}
    for dev, expect in ((big, "ce"), (small, "cuda")):
        host = {k: torch.zeros(v.shape, dtype=torch.uint8, pin_memory=True) for k, v in dev.items()}
        copier = BlockCopier(dev, host, [["l0"]], copy_backend="auto")
        copier.to_device([list(range(0, 64, 2))])
        torch.cuda.synchronize()
        assert copier._h2d.backend.last_choice == expect
        copier.close()
