"""kvcopy.core.tables: entry tables and the packed per-call array the kernels read."""
import pytest
import torch

import kvcopy
from kvcopy.core.tables import RUN_BYTES, RUNS_PER_PAGE, SRC_BLOCK_STRIDE
from kvcopy.native import ENTRY_FIELDS


def test_packed_layout_and_items():
    t = {f"l{i}": torch.zeros(2, 32, 4, 2, 8, dtype=torch.bfloat16) for i in range(5)}
    h = {k: torch.zeros_like(v) for k, v in t.items()}
    c = kvcopy.BlockCopier(t, h, [["l0", "l1"], ["l2", "l3", "l4"]], copy_backend="torch")
    tab = c.tables("d2h")
    assert tab.entries.shape == (5, ENTRY_FIELDS) and tab.group_offsets.tolist() == [0, 2, 5]
    assert tab.entries[:, RUNS_PER_PAGE].tolist() == [2] * 5
    assert (tab.entries[:, RUN_BYTES] == tab.entries[:, SRC_BLOCK_STRIDE]).all()
    assert tab.word_bytes == 16
    call = c.plan("d2h", [[1, 2, 3], [7, 20]], [[4, 5, 6], [8, 9]])
    assert call.run_offsets().tolist() == [0, 1, 3]
    assert call.item_offsets().tolist() == [0, 2, 2 + 3 * 2]
    assert call.runs().tolist() == [[1, 4, 3], [7, 8, 1], [20, 9, 1]]
    page = 2 * 4 * 2 * 8 * 2
    assert call.total_bytes == (2 * 3 + 3 * 2) * page  # blocks x layers x page bytes
    assert tab.entries[0, 0] == t["l0"].data_ptr() and tab.entries[0, 1] == h["l0"].data_ptr()
    assert c.tables("h2d").entries[0, 0] == h["l0"].data_ptr()


def test_word_bytes_follows_the_narrowest_alignment():
    t = {"a": torch.zeros(8, 4, 2, 3, dtype=torch.uint8)}  # 24-byte pages: 8-byte words
    c = kvcopy.BlockCopier(t, {"a": torch.zeros_like(t["a"])}, [["a"]], copy_backend="torch")
    assert c.tables("d2h").word_bytes == 8
    t = {"a": torch.zeros(8, 1, 1, 7, dtype=torch.uint8)}  # 7-byte pages: bytes
    c = kvcopy.BlockCopier(t, {"a": torch.zeros_like(t["a"])}, [["a"]], copy_backend="torch")
    assert c.tables("d2h").word_bytes == 1


def test_cta_cap(monkeypatch):
    """One rule for the kernel backends' grid cap: the copier's max_ctas, else the
    environment, else uncapped; anything but a positive integer raises."""
    t = {"a": torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)}
    h = {"a": torch.zeros_like(t["a"])}
    monkeypatch.delenv("KVCOPY_MAX_CTAS", raising=False)
    assert kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch").tables("d2h").cta_cap() is None
    monkeypatch.setenv("KVCOPY_MAX_CTAS", "16")
    assert kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch").tables("h2d").cta_cap() == 16
    assert kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch", max_ctas=8).tables("d2h").cta_cap() == 8
    for bad in (0, -1, "x", True, 2.5):
        with pytest.raises(ValueError, match="max_ctas must be a positive integer"):
            kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch", max_ctas=bad)
    monkeypatch.setenv("KVCOPY_MAX_CTAS", "zero")
    with pytest.raises(ValueError, match="KVCOPY_MAX_CTAS must be a positive integer"):
        kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch")
