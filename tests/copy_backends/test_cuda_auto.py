"""``auto``'s rule on a GPU, checked without one: the pick, the per-call descriptor size,
the calibration table's place and format."""
import json

import pytest
import torch

from kvcopy import BlockCopier
from kvcopy.copy_backends import calibration
from kvcopy.copy_backends.auto import _Shape, mean_descriptor_bytes
from kvcopy.copy_backends.calibration import DEFAULT_CE_MIN_BYTES, pick


def test_default_rule_ce_for_large_descriptors_sm_kernel_below():
    both = ["cuda", "ce", "triton"]
    assert pick("h2d", 2048, both) == "cuda"
    assert pick("h2d", DEFAULT_CE_MIN_BYTES - 1, both) == "cuda"
    assert pick("d2h", DEFAULT_CE_MIN_BYTES, both) == "ce"
    assert pick("h2d", 2 << 20, ["cuda", "triton"]) == "cuda"
    assert pick("h2d", 4096, ["triton", "ce"]) == "triton"
    assert pick("h2d", 4096, ["ce"]) == "ce"
    assert pick("h2d", 4096, []) is None


def test_table_rule_nearest_bucket_fastest_ties_to_ce():
    table = {"h2d": [
        {"bytes": 4096, "gbps": {"cuda": 50.0, "ce": 6.0, "triton": 48.0}},
        {"bytes": 32768, "gbps": {"cuda": 50.0, "ce": 49.0, "triton": 47.0}},  # within 3%: ce
        {"bytes": 262144, "gbps": {"cuda": 40.0, "ce": 53.0, "triton": None}},
    ]}
    assert pick("h2d", 3000, ["cuda", "ce", "triton"], table) == "cuda"
    assert pick("h2d", 30000, ["cuda", "ce", "triton"], table) == "ce"
    assert pick("h2d", 1 << 21, ["cuda", "ce"], table) == "ce"
    assert pick("h2d", 4096, ["ce", "triton"], table) == "triton"  # cuda not usable here
    # no rows for the direction: the built-in default
    assert pick("d2h", 4096, ["cuda", "ce"], table) == "cuda"


def test_mean_descriptor_bytes_merged_and_unmerged():
    # NHD: blocks adjacent, so a run of n pages is one descriptor of n pages
    dev = {"a": torch.zeros(32, 4, 2, 8, dtype=torch.uint8), "b": torch.zeros(32, 4, 2, 8, dtype=torch.uint8)}
    host = {k: torch.zeros_like(v) for k, v in dev.items()}
    c = BlockCopier(dev, host, [["a"], ["b"]], copy_backend="cpu")
    t = c.tables("h2d")
    page = 4 * 2 * 8
    call = c.plan("h2d", [[0, 1, 2, 3], [10, 12]])
    # group 0: one run of 4 pages (1 descriptor); group 1: two runs (2 descriptors)
    assert mean_descriptor_bytes(_Shape(t), call) == pytest.approx(6 * page / 3)
    # pages with a gap between blocks (a slice of a wider tensor): one descriptor per page
    dv = {"a": torch.zeros(32, 2, 64, dtype=torch.uint8)[:, 0]}
    hv = {"a": torch.zeros(32, 2, 64, dtype=torch.uint8)[:, 0]}
    c2 = BlockCopier(dv, hv, [["a"]], copy_backend="cpu")
    t2 = c2.tables("h2d")
    call2 = c2.plan("h2d", [[0, 1, 2, 5]])
    assert _Shape(t2).any_unmerged
    assert mean_descriptor_bytes(_Shape(t2), call2) == pytest.approx(64)
    c.close()
    c2.close()


def test_auto_counts_runs_not_pages_for_converting_layouts():
    """A 128 KiB page of 512-byte runs (LBNHC cache, contiguous [B, H, N, C] host) is
    256 descriptors per block: auto sees 512-byte descriptors and keeps to the SM
    kernel, though the page alone would pass the copy engines' 64 KiB threshold."""
    nb, n, h, c = 8, 32, 8, 256  # 128 KiB pages of bf16, runs of C = 512 B
    dev = {"a": torch.zeros(nb, n, h, c, dtype=torch.bfloat16).permute(0, 2, 1, 3)}
    host = {"a": torch.zeros(nb, h, n, c, dtype=torch.bfloat16)}
    cp = BlockCopier(dev, host, [["a"]], copy_backend="cpu")
    call = cp.plan("h2d", [[0, 1, 2, 5]])
    size = mean_descriptor_bytes(_Shape(cp.tables("h2d")), call)
    assert size == pytest.approx(512)
    assert pick("h2d", size, ["ce", "cuda", "triton"]) == "cuda"
    assert cp.tables("h2d").page_bytes()[0] >= DEFAULT_CE_MIN_BYTES
    cp.close()


def test_table_path_respects_xdg_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCOPY_CALIBRATION", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.table_path() == tmp_path / "xdg" / "kvcopy" / "calibration.json"
    monkeypatch.setenv("KVCOPY_CALIBRATION", str(tmp_path / "t.json"))
    assert calibration.table_path() == tmp_path / "t.json"


def test_save_and_load_roundtrip(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOPY_CALIBRATION", str(tmp_path / "cal.json"))
    rows = {"h2d": [{"bytes": 4096, "memcpy_gbps": 55.0, "gbps": {"cuda": 52.0, "ce": 7.0}}]}
    calibration.save("GPU X|sm_90|13000", rows)
    calibration.save("GPU Y|sm_80|12080", {"d2h": []})
    data = json.loads((tmp_path / "cal.json").read_text())
    assert set(data["devices"]) == {"GPU X|sm_90|13000", "GPU Y|sm_80|12080"}
    calibration._cache.clear()
    entry = calibration.load_table("GPU X|sm_90|13000")
    assert entry["h2d"][0]["gbps"]["cuda"] == 52.0
    assert calibration.load_table("unknown") is None


def test_calibrate_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU: the GPU check script runs calibrate")
    from kvcopy.bench import calibrate

    assert calibrate.main(["--dry-run"]) == 1
    assert "no CUDA device" in capsys.readouterr().out
