"""Page checksums computed by the copies (kvcopy.checksum): every backend's sums equal
the numpy oracle's bit for bit over the shared case matrix, the copies stay bit-exact,
and the faults the sums exist for change exactly the faulty page's sum.

Backends here: ``cpu`` (its AVX-512 loop and its scalar loop), ``torch``, the CUDA
kernel's work split and keying run on the host (``kvcopy_cpu_copy_ranges_sums``, as
``tests/test_cuda_cursor.py`` does for the copy) and the Triton kernel in Triton's
interpreter. The oracle reads the staging pages' bytes from their storage and knows
nothing of the kernels' tables beyond which layers a group copies.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy import backends
from kvcopy.backends import Backend, kernel_inputs, native
from kvcopy.checksum import (fold, mix64, page_sums, reference_checksums, seal, word_keys)
from kvcopy.layout import describe, pair_pages
from kvcopy.tables import ENTRY_FIELDS
from kvcopy.testing import CopyCase, prepare_check, standard_cases

lib, why = native.load("kvcopy_cpu")
CASES = standard_cases()
QUICK = standard_cases(quick=True)
DIRECTIONS = ("d2h", "h2d")
POISON_SUM = 0x5A5A5A5A5A5A5A5A


# ------------------------------------------------------------------ helpers
def oracle(check, case: CopyCase, direction: str) -> np.ndarray:
    """The oracle's sums for a prepared check: from the expected host pages (the
    reference copy's result for d2h, the untouched source for h2d)."""
    tables = check.copier.tables(direction)
    entries = [[tables.entry_names[e] for e in tables.group_entry_ids(g)] for g in range(tables.num_groups)]
    dev, host = check.expected
    bd, kv = case.block_dim(), case.kv_layout()
    runs = {}
    for names in entries:
        for n in names:
            d, h = describe(dev[n], bd, kv), describe(host[n], bd, kv)
            runs[n] = (pair_pages(d, h) if direction == "d2h" else pair_pages(h, d)).run_bytes
    return reference_checksums(host, entries, check.host_ids, runs, {n: bd for n in runs}, kv)


def copy_with_sums(check, direction: str, device="cpu") -> np.ndarray:
    n = sum(len(ids) for ids in check.dev_ids)
    out = torch.full((n,), POISON_SUM, dtype=torch.int64, device=device)
    if direction == "d2h":
        check.copier.to_host(check.dev_ids, check.host_ids, checksums=out)
    else:
        check.copier.to_device(check.dev_ids, check.host_ids, checksums=out)
    return out.cpu().numpy().view(np.uint64).copy()


def check_sums(backend: str, case: CopyCase, direction: str, device="cpu", **kw) -> np.ndarray:
    """Copy ``case`` with checksums: bytes as the reference's, sums as the oracle's."""
    check = prepare_check(backend, case, direction, device, **kw)
    got = copy_with_sums(check, direction, device)
    check.assert_matches()
    want = oracle(check, case, direction)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{check.label}: {len(bad)} of {len(want)} sums differ from the oracle, first {bad[:4]}"
    check.copier.close()
    return got


class RangesSumsBackend(Backend):
    """The CUDA checksum kernel's work split (equal word ranges, block ranges, run
    pieces or word-by-word gathers, the narrow words' owner rule), on the host."""

    name = "cpu-ranges-sums"

    def __init__(self, num_ranges: int, word_bytes=None):
        self.num_ranges, self.word_bytes = num_ranges, word_bytes
        fn = lib.kvcopy_cpu_copy_ranges_sums
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p, ctypes.c_int64]
        self._fn = fn

    def checksum_reason(self, tables):
        return None

    def copy(self, tables, call):
        raise AssertionError("this test backend only runs checksummed copies")

    def copy_with_checksums(self, tables, call, out):
        static = kernel_inputs.static_table(tables)
        e, g, ge = tables.num_entries, tables.num_groups, len(tables.group_entries)
        base = static.ctypes.data
        offsets = base + 8 * ENTRY_FIELDS * e
        prefix = offsets + 8 * (g + 1) + 8 * ge
        arr = kernel_inputs.call_array(call)
        rc = self._fn(base, offsets, offsets + 8 * (g + 1), prefix, g, arr.ctypes.data, call.total_bytes,
                      self.num_ranges, self.word_bytes or tables.word_bytes, out.data_ptr(), out.numel())
        assert rc == 0


@pytest.fixture
def ranges_backend(monkeypatch):
    def make(n, word=None):
        monkeypatch.setitem(backends._REGISTRY, RangesSumsBackend.name, "x:y")
        monkeypatch.setitem(backends._instances, RangesSumsBackend.name, RangesSumsBackend(n, word))
        return RangesSumsBackend.name
    return make


needs_lib = pytest.mark.skipif(lib is None, reason=f"CPU library not built: {why}")


# ------------------------------------------------------------------ the definition
def test_mix64_is_murmur3_finalizer_and_keys_wrap():
    # fmix64 of 1, computed by hand from the finalizer's steps (Python ints, mod 2^64)
    m = (1 << 64) - 1
    x = 1
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    x ^= x >> 33
    assert int(mix64(np.array([1], np.uint64))[0]) == x
    assert int(word_keys(np.array([7]), 3)[0]) == (8 * 0x9E3779B97F4A7C15 + 3 * 0xC2B2AE3D27D4EB4F) & m


def test_page_sums_zero_pad_the_last_word_of_each_run():
    rng = np.random.default_rng(0)
    page = rng.integers(0, 256, (1, 2 * 13), dtype=np.uint8)
    # two runs of 13 bytes: words at run offsets 0 and 8, the second 5 bytes + 3 zero bytes
    want = 0
    for r in range(2):
        run = page[0, 13 * r: 13 * (r + 1)]
        for j in (0, 8):
            chunk = np.zeros(8, np.uint8)
            chunk[: len(run[j:j + 8])] = run[j:j + 8]
            word = chunk.view("<u8").astype(np.uint64)
            want += int(mix64(word ^ word_keys(np.array([13 * r + j]), 2))[0])
    assert int(page_sums(page, 13, 2)[0]) == want % (1 << 64)
    with pytest.raises(ValueError, match="whole number"):
        page_sums(page, 5, 0)


# ------------------------------------------------------------------ every backend = the oracle
CPU_BACKENDS = [b for b in ("cpu", "torch") if kvcopy.available_backends()[b] is None]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sums_match_oracle(backend, case, direction):
    check_sums(backend, case, direction)


# Pages of 1.5-8 KiB: the vector loop's 128-byte steps, its streaming head and tail.
BIG_CASES = [CopyCase(layout="kv_first", block_size=16, num_heads=4, head_size=64, ids="runs", num_blocks=32),
             CopyCase(layout="nhd", dtype="fp8", block_size=16, num_heads=3, head_size=40, ids="scattered"),
             CopyCase(layout="lbnhc", num_heads=4, head_size=128, block_size=8, ids="odd")]


@needs_lib
@pytest.mark.parametrize("env", [("KVCOPY_CPU_SIMD", "1"), ("KVCOPY_CPU_SIMD", "0"), ("KVCOPY_CPU_STREAM_BYTES", "1")],
                         ids=["vector", "scalar", "streaming-stores"])
@pytest.mark.parametrize("case", QUICK + BIG_CASES, ids=[c.id for c in QUICK + BIG_CASES])
def test_cpu_loops_match_oracle(case, env, monkeypatch):
    """The cpu backend's other loops: scalar code, and the vector loop with
    non-temporal stores (64-byte aligned by a scalar head) that large calls use."""
    monkeypatch.setenv(*env)
    for direction in DIRECTIONS:
        check_sums("cpu", case, direction)


@needs_lib
def test_cpu_threads_add_shared_slots(monkeypatch):
    """Above 1 MiB the items of one call run on OpenMP threads, several layers of a
    group adding into one block's slot at once."""
    monkeypatch.setenv("KVCOPY_CPU_THREADS", "2")
    case = CopyCase(num_groups=2, layers_per_group=4, num_blocks=64, ids="all", block_size=16, num_heads=8,
                    head_size=128)
    for direction in DIRECTIONS:
        check_sums("cpu", case, direction)


@needs_lib
@pytest.mark.parametrize("num_ranges", [1, 3, 64, 5000])
@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_cuda_kernel_split_matches_oracle(case, num_ranges, ranges_backend):
    name = ranges_backend(num_ranges)
    for direction in DIRECTIONS:
        check_sums(name, case, direction)


@needs_lib
@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("case", [
    CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48),
    CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="runs"),  # 21-byte pages
    CopyCase(layout="lbnhc", dtype="uint8", num_heads=5, head_size=7, ids="scattered"),  # 14-byte runs
], ids=lambda c: c.id + f"-b{c.block_size}")
def test_cuda_kernel_narrow_words(word, case, ranges_backend):
    """Words narrower than 8 bytes: each 8-byte hash word is added by the range that
    holds its first byte, reading the rest from the source; range cuts fall inside
    hash words. (A word wider than the tables' alignment is skipped: it would not be
    the kernel's.)"""
    for direction in DIRECTIONS:
        check = prepare_check("cpu", case, direction)
        if check.copier.tables(direction).word_bytes % word:
            pytest.skip(f"tables aligned to {check.copier.tables(direction).word_bytes} bytes")
        check.copier.close()
        for n in (1, 7, 300):
            check_sums(ranges_backend(n, word), case, direction)


@needs_lib
@pytest.mark.parametrize("num_ranges", [1, 7, 300])
@pytest.mark.parametrize("case", [
    CopyCase(layout="bhlnc", num_heads=3, head_size=256, block_size=4, ids="runs"),  # 4 KiB runs: run pieces
    CopyCase(layout="lbnhc", num_heads=8, head_size=128, block_size=4, ids="scattered"),  # 512 B runs: gathers
    CopyCase(layout="flashinfer_hnd", num_heads=3, head_size=8, ids="runs", dtype="fp8"),  # 8 B runs, 3 dims
    CopyCase(layout="kv_first", num_heads=8, head_size=128, block_size=16, ids="runs", num_blocks=16),  # merged
], ids=lambda c: c.id + f"-h{c.num_heads}-d{c.head_size}")
def test_cuda_kernel_long_and_short_runs(case, num_ranges, ranges_backend):
    name = ranges_backend(num_ranges)
    for direction in DIRECTIONS:
        check_sums(name, case, direction)


# ------------------------------------------------------------------ Triton (interpreter)
@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVCOPY_MAX_CTAS", "3")
    return monkeypatch


@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_triton_matches_oracle(interpret, case):
    for direction in DIRECTIONS:
        check_sums("triton", case, direction)


TRITON_GRID_CASES = [
    CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48),  # merged runs of K/V halves
    CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="runs"),  # 21-byte pages
    CopyCase(layout="nhd", dtype="fp16", head_size=3, ids="all", num_groups=1),  # 2-byte words, merged
    CopyCase(layout="mla", head_size=41, num_heads=1, dtype="fp8", ids="runs"),  # 164-byte pages, 4-byte words
    CopyCase(layout="lbnhc", dtype="uint8", num_heads=5, head_size=7, ids="scattered"),  # 14-byte runs
    CopyCase(layout="flashinfer_hnd", num_heads=2, head_size=64, ids="runs"),  # 128-byte runs, 3 dims
]


@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("case", TRITON_GRID_CASES, ids=[c.id + f"-b{c.block_size}" for c in TRITON_GRID_CASES])
def test_triton_rows_cross_pages(interpret, monkeypatch, case, programs):
    """Rows of 16-64 bytes cut runs, and rows of merged segments cross page boundaries
    (their other page's terms are added one by one); workers of several programs add
    into the same page's slot."""
    from kvcopy.kernels import triton_copy as tc

    monkeypatch.setattr(tc, "grid_size", lambda total, cfg, cap: programs)
    monkeypatch.setattr(tc, "MAX_ROW_BYTES", 16 if case.dtype == "uint8" else 64)
    monkeypatch.setattr(tc, "MIN_ROW_BYTES", 16)
    for direction in DIRECTIONS:
        check_sums("triton", case, direction)


def _compile_sums(cfg, capability: int):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcopy.kernels import triton_copy as tc

    kernel = tc.kernels(interpret=False).fused_copy_sums_kernel
    signature = {"entries": "*i64", "group_offsets": "*i64", "group_entries": "*i64", "call": "*i64",
                 "num_groups": "i32", "sums": "*i64"}
    constexprs = cfg.constexprs()
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": cfg.num_warps, **tc.COMPILE_OPTIONS})


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("word,chunk", [(16, 2048), (8, 4096), (4, 164), (1, 57)], ids=["w16", "w8", "w4", "w1"])
def test_triton_sums_kernel_compiles_offline(capability, word, chunk):
    """The checksum kernel through Triton's compiler to PTX and cubin (no GPU): 8-byte
    words and wider move as 64-bit vectors, and the slots get 64-bit atomic adds."""
    import re

    from kvcopy.kernels import triton_copy as tc

    cfg = tc.launch_config(word, chunk, checksums=True)
    compiled = _compile_sums(cfg, capability)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx and ".entry fused_copy_sums_kernel" in ptx
    assert len(compiled.asm["cubin"]) > 0
    assert re.search(r"(atom|red)\.global[\w.]*\.add\.u64", ptx), "no 64-bit atomic add"
    loads = set(re.findall(r"ld\.global[^\s]*", ptx))
    if word == 16:
        assert any(x.endswith(".v2.b64") for x in loads), sorted(loads)


def test_triton_sums_kernel_uses_only_own_helpers():
    import inspect

    from kvcopy.kernels import triton_copy as tc

    src = inspect.getsource(tc)
    body = src[src.index("def _mix64"):src.index("class LaunchConfig")]
    for name in ("tl.sum", "tl.cumsum", "tl.zeros_like", "tl.zeros(", "tl.max(", "tl.min(", "tl.cdiv"):
        assert name not in body, name


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
        self.copier = kvcopy.BlockCopier(self.dev, self.host, case.layer_groups(), backend=backend,
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


DETECT_BACKENDS = [b for b in ("cpu", "torch") if kvcopy.available_backends()[b] is None]
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
        c = kvcopy.BlockCopier(dev, host, case.layer_groups(), backend=backend, block_dim=case.block_dim())
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
    p = kvcopy.BlockCopier({"l": p_dev}, {"l": host}, [["l"]], backend="cpu", directions=("d2h",))
    d = kvcopy.BlockCopier({"l": d_dev}, {"l": host}, [["l"]], backend="cpu", directions=("h2d",))
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
    p = kvcopy.BlockCopier(p_dev, p_host, groups, backend="cpu", block_dim=1)
    d = kvcopy.BlockCopier(d_dev, d_host, groups, backend="cpu", block_dim=1)
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
    c = kvcopy.BlockCopier(dev, host, case.layer_groups(), backend=backend, **kw)
    ids, _ = case.block_ids()
    return c, host, ids


@pytest.mark.parametrize("bad,error,match", [
    ([0] * 6, TypeError, "torch.Tensor"),
    (torch.zeros(6, dtype=torch.float64), TypeError, "int64"),
    (torch.zeros(5, dtype=torch.int64), ValueError, "6 elements"),
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
    from kvcopy.backends.auto import AutoGpuBackend
    from kvcopy.backends.ce import CopyEngineBackend

    c, _, _ = _api_copier()
    tables = c.tables("d2h")
    assert "cannot compute checksums" in CopyEngineBackend().checksum_reason(tables)

    class Fake(Backend):
        def __init__(self, name, sums):
            self.name, self.sums, self.calls = name, sums, []

        def checksum_reason(self, tables):
            return None if self.sums else "no"

        def copy_with_checksums(self, tables, call, out):
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
    c = kvcopy.BlockCopier({"a": t, "b": t.clone()}, {"a": h, "b": h.clone()}, [["a"], ["b"]], backend="cpu")
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


# ------------------------------------------------------------------ the CUDA kernel, compiled
def test_cuda_sums_kernels_compile_without_spills(tmp_path):
    """nvcc builds the checksum kernels for sm_80 and sm_90 within the 128 registers of
    a 512-thread CTA, with no spills (the copy kernels' budget: a spill would put
    local-memory traffic on the copy's path)."""
    import os
    import re
    import shutil
    import subprocess

    from kvcopy.backends import nvrtc
    from kvcopy.kernels import include_dir

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.isfile(nvcc):
        pytest.skip("no nvcc")
    src = tmp_path / "k.cu"
    src.write_text(nvrtc.SOURCE)
    for arch in ("sm_80", "sm_90"):
        run = subprocess.run([nvcc, "-cubin", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v", "-I", str(include_dir()),
                              str(src), "-o", str(tmp_path / "k.cubin")], check=True, capture_output=True, text=True)
        report = dict(re.findall(r"Compiling entry function '(\w+)'.*?\n.*?\n(.*?)\n", run.stderr))
        for name in nvrtc.SUM_ENTRY_POINTS.values():
            assert name in report, (arch, name, run.stderr[-2000:])
            assert "0 bytes spill stores, 0 bytes spill loads" in report[name], (arch, name, report[name])


# ------------------------------------------------------------------ GPU
GPU_CASES = [CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48),
             CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="runs"),
             CopyCase(layout="lbnhc", num_heads=8, head_size=128, block_size=4, ids="scattered"),
             CopyCase(layout="bhlnc", num_heads=3, head_size=256, block_size=4, ids="runs"),
             CopyCase(aliasing=True, kv_sharing=2, num_groups=2, layout="kv_first"),
             CopyCase(head_size=3, dtype="fp16", layout="kv_first")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton", "auto"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id + f"-b{c.block_size}" for c in GPU_CASES])
def test_gpu_sums_match_oracle(backend, case):
    for direction in DIRECTIONS:
        check_sums(backend, case, direction, device="cuda")


@pytest.mark.gpu
def test_gpu_large_call_and_grid(monkeypatch):
    """A call array too large for the kernel parameters, many warps adding to the same
    pages (2 MiB merged runs), and a capped grid."""
    case = CopyCase(layout="kv_first", num_groups=2, layers_per_group=4, num_blocks=512, ids="all",
                    block_size=16, num_heads=8, head_size=128)
    for cap in (None, 4):
        for direction in DIRECTIONS:
            check_sums("cuda", case, direction, device="cuda", max_ctas=cap)


@pytest.mark.gpu
def test_gpu_sums_in_a_cuda_graph():
    case = CopyCase(layout="kv_first", num_groups=2, ids="scattered")
    check = prepare_check("cuda", case, "d2h", "cuda")
    n = sum(len(ids) for ids in check.dev_ids)
    out = torch.full((n,), POISON_SUM, dtype=torch.int64, device="cuda")
    check.copier.to_host(check.dev_ids, check.host_ids, checksums=out)  # warm up (pinning, compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        check.copier.to_host(check.dev_ids, check.host_ids, checksums=out)
    out.fill_(POISON_SUM)
    graph.replay()
    torch.cuda.synchronize()
    check.assert_matches()
    assert np.array_equal(out.cpu().numpy().view(np.uint64), oracle(check, case, "d2h"))
