"""kvcopy.copy_backends.cuda: the per-call host path of a call that fits the kernel parameters.

``InlineLaunch`` runs here over CPU tables with the launch replaced by a recording C
callback: it must hand the launch exactly the static-table arguments, the call array
(packed call + block prefix, as the numpy reference builds it), the bytes and the
grid of the kernel's rule, and say None (the staged path) for calls that do not fit.
"""
import ctypes

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy import native
from kvcopy.copy_backends import kernel_inputs
from kvcopy.copy_backends.cuda import InlineLaunch

pytestmark = pytest.mark.skipif(native.load("kvcopy_cpu")[0] is None, reason="CPU library not built")


def _copier(num_blocks=64):
    t = {f"l{i}": torch.zeros(num_blocks, 4, 16, dtype=torch.uint8) for i in range(3)}
    h = {k: torch.zeros_like(v) for k, v in t.items()}
    return kvcopy.BlockCopier(t, h, [["l0", "l1"], ["l2"]], copy_backend="cpu")


def _recorder(seen):
    """kvcopy_cuda_copy(tables, call, call_host, stream) stand-in recording what it is passed."""
    def launch(tables_at, call_at, call_host, stream):
        t = native.CudaTables.from_address(tables_at)
        c = native.CudaCall.from_address(call_at)
        arr = (ctypes.c_int64 * c.call_words).from_address(call_host)
        seen.append(dict(struct_bytes=(t.struct_bytes, c.struct_bytes), static=t.tables, entries=t.num_entries,
                         groups=t.num_groups, group_entries=t.num_group_entries, call=list(arr),
                         call_device=c.call_device, total=c.total_bytes, word=t.word_bytes, grid=c.grid,
                         stream=stream))
        return 0
    return ctypes.CFUNCTYPE(ctypes.c_int, *native.CUDA_COPY_ARGS)(launch)


def test_inline_launch_passes_the_call_array_and_grid():
    c = _copier()
    tables = c.tables("h2d")
    seen = []
    fn = _recorder(seen)
    path = InlineLaunch.stubbed(tables, fn, sm_count=132, max_ctas=16)
    for ids in ([[1, 2, 3], [9]], [[5, 4], [0, 1, 2, 3]], [[], [7]]):
        call = c.plan("h2d", ids)
        assert path(call) == 0
        got = seen[-1]
        assert got["call"] == kernel_inputs.call_array(call).tolist()
        assert (got["entries"], got["groups"], got["group_entries"]) == (3, 2, 3)
        assert got["total"] == call.total_bytes and got["word"] == tables.word_bytes
        assert got["grid"] == kernel_inputs.grid_size(call.total_bytes, 132, 16)
        assert got["call_device"] is None and not got["stream"]
        assert got["struct_bytes"] == (ctypes.sizeof(native.CudaTables), ctypes.sizeof(native.CudaCall))


@pytest.mark.parametrize("sm_count, max_ctas", [(132, None), (132, 5), (3, None), (3, 16), (1, 1)])
def test_inline_launch_grid_is_the_kernel_rule(sm_count, max_ctas):
    """InlineLaunch writes grid_size's rule out with its cap worked out at build: the
    grids agree where the call's bytes bind and where the cap does."""
    page = kernel_inputs.CTA_MIN_BYTES // 4  # 4 pages of a layer: one CTA's share
    t = {f"l{i}": torch.zeros(16, page, dtype=torch.uint8) for i in range(2)}
    h = {k: torch.zeros_like(v) for k, v in t.items()}
    c = kvcopy.BlockCopier(t, h, [["l0"], ["l1"]], copy_backend="cpu")
    seen = []
    path = InlineLaunch.stubbed(c.tables("h2d"), _recorder(seen), sm_count=sm_count, max_ctas=max_ctas)
    grids = set()
    for ids in ([[0], []], [[0, 1, 2, 3], [4]], [list(range(16)), list(range(16))], [[5, 9, 12], [0, 15]]):
        call = c.plan("h2d", ids)
        assert path(call) == 0
        assert seen[-1]["grid"] == kernel_inputs.grid_size(call.total_bytes, sm_count, max_ctas)
        grids.add(seen[-1]["grid"])
    # the 32-page call needs 8 CTAs: the cap binds below that, the bytes above
    assert max(grids) == min(8, kernel_inputs.grid_cap(sm_count, max_ctas))
    c.close()


@pytest.mark.parametrize("copier_cap", [None, 3, 64])
def test_a_calls_max_ctas_reaches_the_launchs_grid(copier_cap):
    """CudaBackend.copy(..., max_ctas=N) hands InlineLaunch the call's cap: the grid the
    launch gets is the rule's under the smaller of the two caps, call after call, and a
    call without one gets the copier's grid again."""
    page = kernel_inputs.CTA_MIN_BYTES // 4
    t = {f"l{i}": torch.zeros(64, page, dtype=torch.uint8) for i in range(2)}
    h = {k: torch.zeros_like(v) for k, v in t.items()}
    c = kvcopy.BlockCopier(t, h, [["l0"], ["l1"]], copy_backend="cpu")
    seen = []
    path = InlineLaunch.stubbed(c.tables("d2h"), _recorder(seen), sm_count=132, max_ctas=copier_cap)
    call = c.plan("d2h", [list(range(0, 64, 2)), list(range(1, 64, 2))])  # 64 pages: 16 CTAs by the bytes
    for per_call in (1, 2, 4, None, 100):
        assert path(call, per_call) == 0
        want = kernel_inputs.grid_size(call.total_bytes, 132, kernel_inputs.call_cap(copier_cap, per_call))
        assert seen[-1]["grid"] == want
        assert want == min([16] + [x for x in (copier_cap, per_call) if x is not None])
    c.close()


def test_inline_launch_declines_calls_that_do_not_fit():
    c = _copier(num_blocks=400)
    seen = []
    path = InlineLaunch.stubbed(c.tables("h2d"), _recorder(seen))
    scattered = np.random.default_rng(1).permutation(400)[:200].tolist()  # ~200 runs: > 480 words
    assert path(c.plan("h2d", [scattered, [0]])) is None
    assert seen == []


def test_triton_small_call_upload_stores_the_words_per_stream():
    """kvcopy.copy_backends.triton_backend.SmallCallUpload (the Triton path's call array upload
    through kvcopy_cuda_store_words): the words stored are the packed call, one buffer
    per stream, reused on that stream; calls over 480 words take the staged path."""
    from kvcopy.copy_backends.triton_backend import SmallCallUpload

    stored = []

    def store(dst, src, count, stream):
        stored.append((dst, list((ctypes.c_int64 * count).from_address(src)), stream))
        return 0
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *native.CUDA_STORE_ARGS)(store)
    current = {"stream": 11}
    up = SmallCallUpload(fn, 0, kernel_inputs.INLINE_WORDS, lambda device: current["stream"],
                         lambda n: torch.empty(n, dtype=torch.int64))
    c = _copier(num_blocks=400)
    call = c.plan("d2h", [[3, 4, 5], [8]])
    a = up(call)
    assert stored[-1] == (a.data_ptr(), call.packed.tolist(), 11)
    assert up(c.plan("d2h", [[1], [2]])) is a  # same stream: same buffer
    current["stream"] = 12
    b = up(call)
    assert b is not a and stored[-1][0] == b.data_ptr() and stored[-1][2] == 12
    scattered = np.random.default_rng(2).permutation(400)[:200].tolist()
    n = len(stored)
    assert up(c.plan("d2h", [scattered, [0]])) is None and len(stored) == n
