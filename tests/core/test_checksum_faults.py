"""What page checksums catch (kvcopy.core.checksum): faults injected between P's pack
(``to_host`` with checksums) and D's scatter (``to_device`` with checksums) change
exactly the faulty pages' sums; identical bytes at the same place sum the same
whatever the call, run, backend or device layout; and the API refuses what it cannot
do before a byte moves. The sums themselves are checked against the oracle, backend
by backend, in tests/core/test_checksum.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_checksum import POISON_SUM, RangesSumsBackend, needs_lib

import kvcopy
from kvcopy import copy_backends as backends
from kvcopy.copy_backends import Backend
from kvcopy.core.checksum import fold, seal
from kvcopy.core.layout import describe
from kvcopy.testing import CopyCase


@pytest.fixture
def ranges_backend(monkeypatch):
    """The CUDA kernel's split on the host (test_checksum.RangesSumsBackend), registered."""
    def make(n, word=None):
        monkeypatch.setitem(backends._REGISTRY, RangesSumsBackend.name, "x:y")
        monkeypatch.setitem(backends._instances, RangesSumsBackend.name, RangesSumsBackend(n, word))
        return RangesSumsBackend.name
    return make


# ------------------------------------------------------------------ what the sums catch
def page_bytes_view(t: torch.Tensor, bd: int, kv: str) -> torch.Tensor:
    """A writable uint8 ``[blocks, page bytes in staging order]`` view of a host tensor
    (chunks as rows of a 3-D view: flattened by the callers through ``page``)."""
    layout = describe(t, bd, kv)
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw.as_strided((layout.num_blocks, layout.num_chunks, layout.chunk_bytes),
                          (layout.block_stride, max(layout.chunk_stride, 1), 1),
                          t.storage_offset() * t.element_size())


class Transfer:
    """P's pack (to_host with checksums), faults injected into the host pages, D's
    scatter (to_device with checksums) on the same copier: which slots differ."""

    def __init__(self, backend: str, case: CopyCase):
        self.case = case
        self.dev, self.host = case.build("cpu", "host")
        self.copier = kvcopy.BlockCopier(self.dev, self.host, case.layer_groups(), copy_backend=backend,
                                         block_dim=case.block_dim(), kv_layout=case.kv_layout())
        self.ids, _ = case.block_ids()
        self.n = sum(map(len, self.ids))
        out = torch.zeros(self.n, dtype=torch.int64)
        self.copier.to_host(self.ids, checksums=out)
        self.packed = out.numpy().view(np.uint64).copy()

    def page(self, layer: str, block: int) -> torch.Tensor:
        """The host page (uint8, staging order, writable view when one chunk)."""
        return page_bytes_view(self.host[layer], self.case.block_dim(), self.case.kv_layout())[block]

    def write_page(self, layer: str, block: int, data: torch.Tensor) -> None:
        view = self.page(layer, block)
        view.copy_(data.reshape(view.shape))

    def read_page(self, layer: str, block: int) -> torch.Tensor:
        return self.page(layer, block).reshape(-1).clone()

    def scattered(self) -> np.ndarray:
        out = torch.full((self.n,), POISON_SUM, dtype=torch.int64)
        self.copier.to_device(self.ids, checksums=out)
        return out.numpy().view(np.uint64)

    def changed(self) -> list:
        """Flat (group, i) indices whose sums differ between pack and scatter."""
        return np.flatnonzero(self.scattered() != self.packed).tolist()

    def slot(self, g: int, i: int) -> int:
        return sum(map(len, self.ids[:g])) + i


DETECT_BACKENDS = [b for b in ("cpu", "torch") if kvcopy.available_copy_backends()[b] is None]
TAIL_CASE = CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="scattered")  # 21 B
DETECT_CASES = [CopyCase(layout="kv_first", ids="scattered"), TAIL_CASE,
                CopyCase(layout="lbnhc", num_heads=3, ids="scattered")]


@pytest.mark.parametrize("case", DETECT_CASES, ids=lambda c: c.id + f"-b{c.block_size}")
@pytest.mark.parametrize("backend", DETECT_BACKENDS)
def test_every_single_bit_flip_is_caught(backend, case):
    """A bit flipped at the first and last byte of a page, around word edges, in the
    zero-padded tail word and in the middle: exactly that page's sum changes."""
    t = Transfer(backend, case)
    g, i = 1, 2
    layer, block = case.layer_groups()[g][1], t.ids[g][i]
    original = t.read_page(layer, block)
    size = len(original)
    for pos in sorted({0, 1, 7, 8, size // 2, size - 8, size - 2, size - 1}):
        for bit in (0, 3, 7):
            flipped = original.clone()
            flipped[pos] ^= 1 << bit
            t.write_page(layer, block, flipped)
            assert t.changed() == [t.slot(g, i)], (pos, bit)
    t.write_page(layer, block, original)
    assert t.changed() == []


@pytest.mark.parametrize("case", DETECT_CASES, ids=lambda c: c.id + f"-b{c.block_size}")
@pytest.mark.parametrize("backend", DETECT_BACKENDS)
def test_swapped_stale_torn_and_shuffled_pages_are_caught(backend, case):
    t = Transfer(backend, case)
    groups = case.layer_groups()
    g = 0
    a, b = groups[g]
    pa, pb = t.ids[g][0], t.ids[g][3]
    other = next(x for x in range(case.num_blocks) if all(x not in ids for ids in t.ids))
    keep = {(layer, blk): t.read_page(layer, blk) for layer in (a, b) for blk in (pa, pb, other)}

    def restore():
        for (layer, blk), data in keep.items():
            t.write_page(layer, blk, data)
        assert t.changed() == []

    # two pages of the request swapped
    t.write_page(a, pa, keep[(a, pb)])
    t.write_page(a, pb, keep[(a, pa)])
    assert t.changed() == sorted([t.slot(g, 0), t.slot(g, 3)])
    restore()
    # a page of another request (or an earlier use of the block) served instead
    t.write_page(a, pa, keep[(a, other)])
    assert t.changed() == [t.slot(g, 0)]
    restore()
    # a torn page: its first half new, the rest another page's
    torn = keep[(a, other)].clone()
    half = len(torn) // 2
    torn[:half] = keep[(a, pa)][:half]
    t.write_page(a, pa, torn)
    assert t.changed() == [t.slot(g, 0)]
    restore()
    # two 8-byte words of a page exchanged, and a page shifted by 8 bytes (a misplaced READ)
    page = keep[(a, pa)].clone()
    page[0:8], page[8:16] = keep[(a, pa)][8:16], keep[(a, pa)][0:8]
    t.write_page(a, pa, page)
    assert t.changed() == [t.slot(g, 0)]
    t.write_page(a, pa, torch.roll(keep[(a, pa)], 8))
    assert t.changed() == [t.slot(g, 0)]
    restore()
    # the two layers' pages of one block exchanged: same bytes in the slot, other layers
    t.write_page(a, pa, keep[(b, pa)])
    t.write_page(b, pa, keep[(a, pa)])
    assert t.changed() == [t.slot(g, 0)]
    restore()


@needs_lib
def test_a_page_sums_the_same_alone_in_a_run_and_on_every_backend(ranges_backend, monkeypatch):
    """Identical bytes at the same position give identical sums: a page copied inside a
    long merged run, alone, under another id, and by every backend's split."""
    case = CopyCase(layout="kv_first", num_groups=1, layers_per_group=3, num_blocks=24)
    dev, host = case.build("cpu", "host")

    def sums(backend, ids, host_ids):
        c = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend=backend, block_dim=case.block_dim())
        out = torch.zeros(len(ids), dtype=torch.int64)
        c.to_host([ids], [host_ids], checksums=out)
        c.close()
        return out.numpy().view(np.uint64).copy()

    run = sums("cpu", list(range(4, 12)), list(range(4, 12)))  # one merged run of 8 blocks
    for k, block in enumerate(range(4, 12)):
        assert sums("cpu", [block], [block]) == run[k]
        assert sums("cpu", [block], [20 - k]) == run[k]  # the page's sum does not depend on where it lands
    for backend in ["torch", ranges_backend(1), ranges_backend(64)]:
        assert np.array_equal(sums(backend, list(range(4, 12)), list(range(4, 12))), run), backend
    assert len(set(run.tolist())) == len(run)  # different pages, different sums


@needs_lib
def test_p_and_d_agree_across_their_device_layouts():
    """P packs from a contiguous [B, H, N, C] cache (whole pages), D scatters into an
    LBNHC view (C-element runs of a layout-converting copy): the same staging pages
    sum the same, because words are keyed by their place in the staging page."""
    nb, h, n, c = 12, 3, 4, 16
    gen = torch.Generator().manual_seed(3)
    p_dev = torch.randint(-2**15, 2**15, (nb, h, n, c), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    host = torch.zeros(nb, h, n, c, dtype=torch.bfloat16)
    d_raw = torch.zeros(nb, n, h, c, dtype=torch.bfloat16)
    d_dev = d_raw.permute(0, 2, 1, 3)
    ids = [[3, 7, 1, 8]]
    p = kvcopy.BlockCopier({"l": p_dev}, {"l": host}, [["l"]], copy_backend="cpu", directions=("d2h",))
    d = kvcopy.BlockCopier({"l": d_dev}, {"l": host}, [["l"]], copy_backend="cpu", directions=("h2d",))
    assert d.tables("h2d").entries[0, 5] == h * n  # C-element runs: a converting copy
    packed, scattered = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    p.to_host(ids, checksums=packed)
    d.to_device(ids, checksums=scattered)
    assert torch.equal(d_dev[ids[0]].view(torch.int16), p_dev[ids[0]].view(torch.int16))
    assert torch.equal(packed, scattered)


@needs_lib
def test_kv_first_staging_buffers_of_different_block_counts_agree():
    """A K/V-first staging page is keyed chunk after chunk, not by its chunk stride: P's
    and D's host buffers with different block counts give the same sums."""
    p_case = CopyCase(layout="kv_first", num_groups=1, num_blocks=24)
    d_case = CopyCase(layout="kv_first", num_groups=1, num_blocks=24, host_num_blocks=13, seed=5)
    p_dev, p_host = p_case.build("cpu", "host")
    d_dev, d_host = d_case.build("cpu", "device")
    groups = p_case.layer_groups()
    p = kvcopy.BlockCopier(p_dev, p_host, groups, copy_backend="cpu", block_dim=1)
    d = kvcopy.BlockCopier(d_dev, d_host, groups, copy_backend="cpu", block_dim=1)
    p_ids, d_host_ids = [[2, 9, 17]], [[12, 0, 5]]
    packed, scattered = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    p.to_host(p_ids, checksums=packed)
    for name in groups[0]:  # the transfer: P's host pages into D's (the K and V chunks apart)
        src, dst = p_host[name], d_host[name]
        for s, t in zip(p_ids[0], d_host_ids[0]):
            dst[:, t] = src[:, s]
    d.to_device([[4, 6, 8]], d_host_ids, checksums=scattered)
    assert torch.equal(packed, scattered)


def test_seal_binds_pages_to_their_positions_and_request():
    sums = np.array([11, 22, 33], dtype=np.uint64)
    swapped = sums[[1, 0, 2]]
    assert int(sums.sum()) == int(swapped.sum())  # a plain sum cannot see a swap
    assert fold(seal(sums, 7)) != fold(seal(swapped, 7))
    assert fold(seal(sums, 7)) != fold(seal(sums, 8))  # another request's sums
    assert fold(seal(sums, 7)) == fold(seal(sums, 7, positions=[0, 1, 2]))
    assert seal(torch.tensor([11, -1]), 1).dtype == np.uint64  # int64 bits read as uint64


# ------------------------------------------------------------------ the API
def _api_copier(backend="cpu", **kw):
    case = CopyCase(num_groups=2, ids="odd")
    dev, host = case.build("cpu", "host")
    c = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend=backend, **kw)
    ids, _ = case.block_ids()
    return c, host, ids


@pytest.mark.parametrize("bad,error,match", [
    ([0] * 6, TypeError, "torch.Tensor"),
    (torch.zeros(6, dtype=torch.float64), TypeError, "int64"),
    (torch.zeros(5, dtype=torch.int64), ValueError, "6 elements"),
    (torch.zeros(6, 1, dtype=torch.int64), ValueError, "1-D tensor of 6"),
    (torch.zeros(3, 2, dtype=torch.int64), ValueError, "1-D tensor of 6"),
    (torch.zeros(6, 2, dtype=torch.int64)[:, 0], ValueError, "contiguous"),
    (torch.zeros(6, dtype=torch.int64, device="meta"), ValueError, "device"),
])
def test_bad_checksum_output_is_refused_before_a_byte_moves(bad, error, match):
    c, host, ids = _api_copier()
    before = {k: v.clone() for k, v in host.items()}
    with pytest.raises(error, match=match):
        c.to_host(ids, checksums=bad)
    assert all(torch.equal(before[k], host[k]) for k in host)


def test_a_backend_without_checksums_raises_instead_of_skipping(monkeypatch):
    c, host, ids = _api_copier()
    before = {k: v.clone() for k, v in host.items()}
    impl = backends.get_backend("cpu")
    monkeypatch.setattr(type(impl), "checksum_reason", lambda self, tables: "it cannot")
    with pytest.raises(ValueError, match="checksums requested but it cannot"):
        c.to_host(ids, checksums=torch.zeros(6, dtype=torch.int64))
    assert all(torch.equal(before[k], host[k]) for k in host)
    c.to_host(ids)  # without checksums the copy runs


def test_ce_says_it_cannot_sum_and_auto_hands_sums_to_a_kernel():
    from kvcopy.copy_backends.auto import AutoGpuBackend
    from kvcopy.copy_backends.ce import CopyEngineBackend

    c, _, _ = _api_copier()
    tables = c.tables("d2h")
    assert "cannot compute checksums" in CopyEngineBackend().checksum_reason(tables)

    class Fake(Backend):
        def __init__(self, name, sums):
            self.name, self.sums, self.calls = name, sums, []

        def checksum_reason(self, tables):
            return None if self.sums else "no"

        def copy_with_checksums(self, tables, call, out, max_ctas=None):
            self.calls.append(call)

    ce, cuda = Fake("ce", False), Fake("cuda", True)
    auto = AutoGpuBackend({"ce": ce, "cuda": cuda}, "d2h", None)
    assert auto.checksum_reason(tables) is None
    auto.copy_with_checksums(tables, c.plan("d2h", [[1], [2]]), None)
    assert len(cuda.calls) == 1 and auto.last_choice == "cuda"
    assert "computes checksums" in AutoGpuBackend({"ce": ce}, "d2h", None).checksum_reason(tables)


def test_planned_calls_get_sums_that_overwrite_the_output():
    """run() takes checksums too, and the output is overwritten, not accumulated."""
    t = torch.randint(0, 255, (8, 4, 2, 8), dtype=torch.uint8)
    h = torch.zeros_like(t)
    c = kvcopy.BlockCopier({"a": t, "b": t.clone()}, {"a": h, "b": h.clone()}, [["a"], ["b"]], copy_backend="cpu")
    out = torch.full((3,), POISON_SUM, dtype=torch.int64)
    call = c.plan("d2h", [[1, 5], [3]])
    c.run("d2h", call, checksums=out)
    again = torch.full((3,), 1, dtype=torch.int64)
    c.run("d2h", call, checksums=again)
    assert torch.equal(out, again) and POISON_SUM not in out.tolist()
    one = torch.zeros(1, dtype=torch.int64)
    c.to_host([[], [3]], checksums=one)
    assert one[0] == out[2]
    c.to_host([[], []], checksums=torch.zeros(0, dtype=torch.int64))
