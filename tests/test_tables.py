"""kvcopy.tables: entry tables and the packed per-call array the kernels read."""
import numpy as np
import torch

import kvcopy
from kvcopy.tables import CHUNK_BYTES, NUM_CHUNKS, SRC_BLOCK_STRIDE, merge_runs


def test_merge_runs():
    a = np.array([3, 4, 5, 9, 10, 2], dtype=np.int64)
    b = np.array([0, 1, 2, 7, 9, 3], dtype=np.int64)
    assert merge_runs(a, b).tolist() == [[3, 0, 3], [9, 7, 1], [10, 9, 1], [2, 3, 1]]
    assert merge_runs(a[:0], b[:0]).shape == (0, 3)


def test_packed_layout_and_items():
    t = {f"l{i}": torch.zeros(2, 32, 4, 2, 8, dtype=torch.bfloat16) for i in range(5)}
    h = {k: torch.zeros_like(v) for k, v in t.items()}
    c = kvcopy.BlockCopier(t, h, [["l0", "l1"], ["l2", "l3", "l4"]], backend="torch")
    tab = c.tables("d2h")
    assert tab.entries.shape == (5, 8) and tab.group_offsets.tolist() == [0, 2, 5]
    assert tab.entries[:, NUM_CHUNKS].tolist() == [2] * 5
    assert (tab.entries[:, CHUNK_BYTES] == tab.entries[:, SRC_BLOCK_STRIDE]).all()
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
    c = kvcopy.BlockCopier(t, {"a": torch.zeros_like(t["a"])}, [["a"]], backend="torch")
    assert c.tables("d2h").word_bytes == 8
    t = {"a": torch.zeros(8, 1, 1, 7, dtype=torch.uint8)}  # 7-byte pages: bytes
    c = kvcopy.BlockCopier(t, {"a": torch.zeros_like(t["a"])}, [["a"]], backend="torch")
    assert c.tables("d2h").word_bytes == 1
