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


def test_max_ctas_reaches_the_tables(monkeypatch):
    """One rule for the kernel backends' grid cap: the copier's max_ctas (CopyOptions),
    else uncapped; anything but a positive integer raises at build. The environment
    plays no part."""
    t = {"a": torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)}
    h = {"a": torch.zeros_like(t["a"])}
    monkeypatch.setenv("KVCOPY_MAX_CTAS", "16")  # read nowhere now
    assert kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch").tables("d2h").max_ctas is None
    assert kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch", max_ctas=8).tables("h2d").max_ctas == 8
    for bad, error in ((0, ValueError), (-1, ValueError), ("x", TypeError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="max_ctas must be a positive integer"):
            kvcopy.BlockCopier(t, h, [["a"]], copy_backend="torch", max_ctas=bad)
