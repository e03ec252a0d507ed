"""kvcopy.copy_backends.kernel_inputs: the fused kernel's static table, call array and grid rule."""
import numpy as np
import torch

import kvcopy
from kvcopy.copy_backends import kernel_inputs
from kvcopy.core.tables import RUN_BYTES, RUNS_PER_PAGE
from kvcopy.native import ENTRY_FIELDS


def _copier(backend="torch"):
    t = {"a": torch.zeros(16, 2, 8, dtype=torch.uint8), "b": torch.zeros(16, 4, 8, dtype=torch.uint8),
         "c": torch.zeros(16, 2, 8, dtype=torch.uint8)}
    return kvcopy.BlockCopier(t, {k: torch.zeros_like(v) for k, v in t.items()}, [["a", "c"], ["b"]],
                              copy_backend=backend)


def test_call_array_block_prefix():
    """The call array the kernel reads: the packed call, then the block prefix over
    its runs, as the planner wrote them in one buffer."""
    c = _copier()
    # 2 groups, runs (5,5,3) | (9,1,1), (2,7,4): the block prefix is 0, 3, 4, 8
    call = c.plan("h2d", [[5, 6, 7], [1, 7, 8, 9, 10]], [[5, 6, 7], [9, 2, 3, 4, 5]])
    packed = [0, 1, 3, 0, 2, 4, 5, 5, 3, 9, 1, 1, 2, 7, 4]
    arr = kernel_inputs.call_array(call)
    assert arr[: len(packed)].tolist() == packed
    assert arr[len(packed):].tolist() == [0, 3, 4, 8]
    assert type(call.words) is bytes and len(call.words) >= 8 * call.num_words  # what the inline launch passes
    assert call.num_words == len(packed) + 4
    assert not arr.flags.writeable


def test_static_table_layout():
    """entries | group offsets | group entries | byte prefix of one block over the
    group entries (what a warp's binary search reads)."""
    tables = _copier().tables("d2h")
    static = kernel_inputs.static_table(tables)
    e, g, ge = tables.num_entries, tables.num_groups, len(tables.group_entries)
    assert static.dtype == np.int64 and len(static) == e * ENTRY_FIELDS + (g + 1) + ge + ge + 1
    assert static[: e * ENTRY_FIELDS].reshape(e, ENTRY_FIELDS).tolist() == tables.entries.tolist()
    offsets = static[e * ENTRY_FIELDS: e * ENTRY_FIELDS + g + 1]
    assert offsets.tolist() == [0, 2, 3]
    entries = static[e * ENTRY_FIELDS + g + 1: e * ENTRY_FIELDS + g + 1 + ge]
    page = tables.entries[:, RUN_BYTES] * tables.entries[:, RUNS_PER_PAGE]
    assert static[-(ge + 1):].tolist() == [0] + np.cumsum(page[entries]).tolist()
    assert page[entries].tolist() == [16, 16, 32]  # a and c: 2 x 8 bytes, b: 4 x 8
    moved = tables.entries.copy()
    moved[:, 0] += 4096
    assert kernel_inputs.static_table(tables, moved)[0] == tables.entries[0, 0] + 4096


def test_grid_size_rule():
    assert kernel_inputs.grid_size(1, 132, None) == 1
    assert kernel_inputs.grid_size(1 << 30, 132, None) == 132 * kernel_inputs.CTAS_PER_SM
    assert kernel_inputs.grid_size(1 << 30, 132, 16) == 16
    per_cta = kernel_inputs.THREADS // 32 * kernel_inputs.MIN_BYTES_PER_WARP
    assert kernel_inputs.grid_size(3 * per_cta, 132, None) == 3
    assert kernel_inputs.grid_size(3 * per_cta + 1, 132, None) == 4
    assert kernel_inputs.grid_size(0, 132, None) == 1


def test_a_calls_cap_lowers_the_copiers_never_raises_it():
    """call_cap: BlockCopier.run(..., max_ctas=N) against the copier's max_ctas, then the
    grid rule: the smaller cap holds, and the bytes still bind below both."""
    cap = kernel_inputs.call_cap
    assert cap(None, None) is None and cap(16, None) == 16 and cap(None, 4) == 4
    assert cap(16, 4) == 4 and cap(2, 4) == 2
    big = 1 << 30
    assert kernel_inputs.grid_size(big, 132, cap(None, 4)) == 4
    assert kernel_inputs.grid_size(big, 132, cap(2, 4)) == 2
    assert kernel_inputs.grid_size(big, 3, cap(None, 400)) == 3 * kernel_inputs.CTAS_PER_SM  # one wave at most
    per_cta = kernel_inputs.THREADS // 32 * kernel_inputs.MIN_BYTES_PER_WARP
    assert kernel_inputs.grid_size(2 * per_cta, 132, cap(None, 4)) == 2
