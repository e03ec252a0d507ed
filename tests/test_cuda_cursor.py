"""The GPU kernel's addressing, run on the CPU: every shared case, bit-exact.

``kvcopy_cpu_copy_ranges`` (csrc/cpu_copy.cpp) cuts a call into N equal word ranges
and walks each with the byte cursor of ``kernels/block_copy.cuh`` exactly as one warp
of the fused CUDA kernel walks its range, over the same static table and per-call
array the CUDA backend builds (:mod:`kvcopy.backends.kernel_inputs`). Range counts from 1 to more
ranges than words put range boundaries inside pages, chunks and merged runs.
"""
import ctypes

import pytest

from kvcopy import backends
from kvcopy.backends import kernel_inputs, native
from kvcopy.backends import Backend
from kvcopy.tables import ENTRY_FIELDS
from kvcopy.testing import CopyCase, check_copy, standard_cases

lib, why = native.load("kvcopy_cpu")
pytestmark = pytest.mark.skipif(lib is None, reason=f"CPU library not built: {why}")


class RangesBackend(Backend):
    """CPU backend walking the call the way the CUDA kernel's warps do."""

    name = "cpu-ranges"

    def __init__(self, num_ranges, word_bytes=None):
        self.num_ranges = num_ranges
        self.word_bytes = word_bytes
        fn = lib.kvcopy_cpu_copy_ranges
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3

    def copy(self, tables, call):
        static = kernel_inputs.static_table(tables)
        e, g, ge = tables.num_entries, tables.num_groups, len(tables.group_entries)
        base = static.ctypes.data
        offsets = base + 8 * ENTRY_FIELDS * e
        group_entries = offsets + 8 * (g + 1)
        prefix = group_entries + 8 * ge
        arr = kernel_inputs.call_array(call)
        word = self.word_bytes or tables.word_bytes
        rc = lib.kvcopy_cpu_copy_ranges(base, offsets, group_entries, prefix, g, arr.ctypes.data,
                                        call.total_bytes, self.num_ranges, word)
        assert rc == 0


@pytest.fixture
def ranges_backend(monkeypatch):
    def make(n, word=None):
        monkeypatch.setitem(backends._REGISTRY, "cpu-ranges", "x:y")
        monkeypatch.setitem(backends._instances, "cpu-ranges", RangesBackend(n, word))
        return "cpu-ranges"
    return make


@pytest.mark.parametrize("num_ranges", [1, 3, 64, 5000])
@pytest.mark.parametrize("case", standard_cases(quick=True), ids=lambda c: c.id)
def test_cursor_ranges_bit_exact(case, num_ranges, ranges_backend):
    name = ranges_backend(num_ranges)
    for direction in ("d2h", "h2d"):
        check_copy(name, case, direction).close()


@pytest.mark.parametrize("word", [1, 2, 4])
def test_cursor_narrow_words(word, ranges_backend):
    name = ranges_backend(7, word)
    case = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48)
    check_copy(name, case, "h2d").close()
    check_copy(name, case, "d2h").close()


def test_call_array_block_prefix():
    """The call array the kernel reads: the packed call, then the block prefix over
    its runs, as the planner wrote them in one buffer."""
    import kvcopy
    import torch

    t = {"a": torch.zeros(16, 2, 8, dtype=torch.uint8), "b": torch.zeros(16, 2, 8, dtype=torch.uint8)}
    c = kvcopy.BlockCopier(t, {k: torch.zeros_like(v) for k, v in t.items()}, [["a"], ["b"]], backend="cpu")
    # 2 groups, runs (5,5,3) | (9,1,1), (2,7,4): the block prefix is 0, 3, 4, 8
    call = c.plan("h2d", [[5, 6, 7], [1, 7, 8, 9, 10]], [[5, 6, 7], [9, 2, 3, 4, 5]])
    packed = [0, 1, 3, 0, 1, 3, 5, 5, 3, 9, 1, 1, 2, 7, 4]
    arr = kernel_inputs.call_array(call)
    assert arr[: len(packed)].tolist() == packed
    assert arr[len(packed):].tolist() == [0, 3, 4, 8]


def test_grid_size_rule():
    assert kernel_inputs.grid_size(1, 132, None) == 1
    assert kernel_inputs.grid_size(1 << 30, 132, None) == 132 * kernel_inputs.CTAS_PER_SM
    assert kernel_inputs.grid_size(1 << 30, 132, 16) == 16
    per_cta = kernel_inputs.THREADS // 32 * kernel_inputs.MIN_BYTES_PER_WARP
    assert kernel_inputs.grid_size(3 * per_cta, 132, None) == 3


@pytest.mark.parametrize("num_ranges", [1, 7, 300])
@pytest.mark.parametrize("case", [
    CopyCase(layout="bhlnc", num_heads=3, head_size=256, block_size=4, ids="runs"),  # 4 KiB runs: whole segments
    CopyCase(layout="lbnhc", num_heads=8, head_size=128, block_size=4, ids="scattered"),  # 512 B runs: word by word
    CopyCase(layout="flashinfer_hnd", num_heads=3, head_size=8, ids="runs", dtype="fp8"),  # 8 B runs, 3 dims
], ids=lambda c: c.id + f"-h{c.num_heads}-d{c.head_size}")
def test_cursor_converting_runs_long_and_short(case, num_ranges, ranges_backend):
    """Runs above the kernel's gather threshold (2 KiB) move segment by segment, runs
    below it word by word through Item::byte_address; range cuts land inside runs."""
    name = ranges_backend(num_ranges)
    for direction in ("d2h", "h2d"):
        check_copy(name, case, direction).close()
