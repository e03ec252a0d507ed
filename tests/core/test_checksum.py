"""Page checksums computed by the copies (kvcopy.core.checksum): every backend's sums equal
the numpy oracle's bit for bit over the shared case matrix, and the copies stay
bit-exact (what the sums catch: tests/core/test_checksum_faults.py).

Backends here: ``cpu`` (its vector loops, AVX-512 and AVX2 where the CPU has them, and
its scalar loop), ``torch``, the CUDA
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
from kvcopy import copy_backends as backends
from kvcopy.copy_backends import Backend, kernel_inputs
from kvcopy import native
from kvcopy.core.checksum import SumFold, mix64, page_sums, product_term, reference_checksums, word_keys
from kvcopy.core.layout import describe, pair_pages
from kvcopy.native import ENTRY_FIELDS
from kvcopy.testing import CopyCase, prepare_check, standard_cases
from kvcopy.testing.cases import storage_bytes

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
        self._fn = lib.kvcopy_cpu_copy_ranges_sums

    def checksum_reason(self, tables):
        return None

    def copy(self, tables, call, max_ctas=None):
        raise AssertionError("this test backend only runs checksummed copies")

    def copy_with_checksums(self, tables, call, out, max_ctas=None):
        static = kernel_inputs.static_table(tables)
        e, g, ge = tables.num_entries, tables.num_groups, len(tables.group_entries)
        base = static.ctypes.data
        offsets = base + 8 * ENTRY_FIELDS * e
        prefix = offsets + 8 * (g + 1) + 8 * ge
        arr = kernel_inputs.call_array(call)
        static_tables = native.Tables.make(entries=base, group_offsets=offsets, group_entries=offsets + 8 * (g + 1),
                                           entry_bytes_prefix=prefix, num_groups=g)
        ranges = native.Ranges.make(num_ranges=self.num_ranges, word_bytes=self.word_bytes or tables.word_bytes)
        rc = self._fn(ctypes.addressof(static_tables), arr.ctypes.data, call.total_bytes, ctypes.addressof(ranges),
                      out.data_ptr(), out.numel())
        assert rc == 0


@pytest.fixture
def ranges_backend(monkeypatch):
    def make(n, word=None):
        monkeypatch.setitem(backends._REGISTRY, RangesSumsBackend.name, "x:y")
        monkeypatch.setitem(backends._instances, RangesSumsBackend.name, RangesSumsBackend(n, word))
        return RangesSumsBackend.name
    return make


needs_lib = pytest.mark.skipif(lib is None, reason=f"CPU library not built: {why}")


def pieces(total, run, simd, stream, piece, piece_min) -> int:
    """kvcopy_cpu_sums_pieces for these tuning values."""
    tuning = native.CpuTuning.make(simd=simd, stream_min_bytes=stream, piece_bytes=piece, piece_min_bytes=piece_min)
    return lib.kvcopy_cpu_sums_pieces(total, run, ctypes.addressof(tuning))


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


def _term(x: int) -> int:
    """term(x) in Python integers: lo32(x) * hi32(x) + x mod 2^64."""
    return ((x & 0xFFFFFFFF) * (x >> 32) + x) % (1 << 64)


# words whose halves sit at the edges of the products: 0, 1, all ones, the top bit
EDGE_HALVES = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]


def test_product_term_is_the_product_of_the_halves_plus_the_word():
    rng = np.random.default_rng(5)
    xs = np.concatenate([rng.integers(0, 1 << 63, 200, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                         np.array([a | (b << 32) for a in EDGE_HALVES for b in EDGE_HALVES], np.uint64)])
    got = product_term(xs)
    assert [int(v) for v in got] == [_term(int(x)) for x in xs]


def test_product_term_changes_under_every_single_bit_flip():
    """Every flip of one bit of a keyed word changes its term (the docstring's
    argument), checked over all 64 bits of edge and random words."""
    rng = np.random.default_rng(6)
    words = [a | (b << 32) for a in EDGE_HALVES for b in EDGE_HALVES]
    words += [int(v) for v in rng.integers(0, 1 << 62, 300, dtype=np.uint64)]
    xs = np.array(words, np.uint64)
    flips = np.array([1 << i for i in range(64)], np.uint64)
    base = product_term(xs)[:, None]
    flipped = product_term(xs[:, None] ^ flips[None, :])
    assert not (flipped == base).any()


def test_product_term_changes_under_any_change_of_one_half():
    """Any change confined to one 32-bit half: for edge words, every change of the
    other half's value to an edge value or a random one; the two closed forms of the
    docstring cover what this samples."""
    rng = np.random.default_rng(7)
    halves = np.array(EDGE_HALVES + [int(v) for v in rng.integers(0, 1 << 32, 200, dtype=np.uint64)], np.uint64)
    for keep in halves[:12]:
        for shift in (0, 32):  # change the low half (keep the high) or the high half
            x = (halves << np.uint64(shift)) | (keep << np.uint64(32 - shift))
            t = product_term(x)
            same = t[:, None] == t[None, :]
            np.fill_diagonal(same, False)
            assert not same.any(), (int(keep), shift)


def test_product_term_is_not_one_to_one_across_halves():
    """What the docstring concedes: a change to both halves of a word can leave its
    term unchanged (its example), so a test claiming more would be wrong."""
    a = np.array([2 | (2 << 32), (2**31 + 3) | (1 << 32)], np.uint64)
    t = product_term(a)
    assert t[0] == t[1] and a[0] != a[1]


def test_product_term_misses_bits_31_and_63_exactly_when_the_halves_add_to_2_31_minus_1():
    """The structured two-bit miss the docstring states: flipping bits 31 and 63 of a
    word whose halves have both bits clear keeps its term iff the halves add up to
    2^31 - 1 (random words meeting the condition all collide; words one off never do)."""
    rng = np.random.default_rng(8)
    a = rng.integers(0, 2**31, 2000, dtype=np.uint64)
    flip = np.uint64((1 << 31) | (1 << 63))
    for b, same in ((np.uint64(2**31 - 1) - a, True), (np.uint64(2**31 - 1) - a ^ np.uint64(1), False)):
        x = a | (b << np.uint64(32))
        assert ((product_term(x) == product_term(x ^ flip)) == same).all()
    pair = product_term(np.array([0x7FFFFFFF, 0x80000000FFFFFFFF], np.uint64))
    assert pair[0] == pair[1]


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
            want += _term(int((word ^ word_keys(np.array([13 * r + j]), 2))[0]))
    assert int(page_sums(page, 13, 2)[0]) == want % (1 << 64)
    with pytest.raises(ValueError, match="whole number"):
        page_sums(page, 5, 0)


# ------------------------------------------------------------------ every backend = the oracle
CPU_BACKENDS = [b for b in ("cpu", "torch") if kvcopy.available_copy_backends()[b] is None]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sums_match_oracle(backend, case, direction):
    check_sums(backend, case, direction)


def _random_fold(sums: np.ndarray, rng, segments: int):
    """gather, bounds, starts over ``sums`` (empty segments among them) and the values
    they fold to, by the definition (SumFold's docstring), term by term."""
    gather = rng.integers(0, len(sums), size=3 * len(sums))
    bounds = rng.integers(0, 2**63, size=len(gather), dtype=np.int64).view(np.uint64)
    starts = np.sort(rng.integers(0, len(gather) + 1, size=segments))
    starts[0], starts[segments // 2] = 0, starts[segments // 2 - 1]  # a segment of no sums: value 0
    ends = list(starts[1:]) + [len(gather)]
    values = np.array([int(sum(int(t) for t in mix64(sums[gather[a:b]] ^ bounds[a:b]))) % (1 << 64)
                       for a, b in zip(starts, ends)], np.uint64)
    return gather, bounds, starts, values


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", QUICK[:6], ids=[c.id for c in QUICK[:6]])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_fold_in_the_copys_call_counts_what_differs(backend, case, direction):
    """run_and_fold: the bytes and sums of run(), and, on ``cpu``, in the same host call,
    the count of folded values that differ from the fold's want (one flipped bit in any
    value found), or a collecting fold's values; backends that cannot fold in the call
    return None, having copied."""
    check = prepare_check(backend, case, direction)
    call = check.copier.plan(direction, check.dev_ids, check.host_ids)
    want_sums = oracle(check, case, direction)
    rng = np.random.default_rng(len(want_sums))
    gather, bounds, starts, values = _random_fold(want_sums, rng, 6)
    for k in (None, [0], [2], [5], [1, 3, 5]):
        want = values.copy()
        for i in k or []:
            want[i] ^= np.uint64(1 << int(rng.integers(64)))
        fold = SumFold(gather, bounds, starts, want)
        out = torch.full((call.num_blocks,), POISON_SUM, dtype=torch.int64)
        differ = check.copier.run_and_fold(direction, call, out, fold)
        check.assert_matches()
        got = out.numpy().view(np.uint64)
        assert np.array_equal(got, want_sums), f"{check.label}: sums differ from the oracle"
        assert fold.differ(got) == len(k or [])  # the numpy oracle of the count
        assert differ == (None if backend != "cpu" else len(k or []))
    collect = SumFold(gather, bounds, starts, values).collecting()  # values written out, nothing compared
    out = torch.full((call.num_blocks,), POISON_SUM, dtype=torch.int64)
    assert check.copier.run_and_fold(direction, call, out, collect) == (None if backend != "cpu" else 0)
    check.assert_matches()
    assert np.array_equal(collect.values_of(out.numpy().view(np.uint64)), values)
    assert np.array_equal(collect.values, values if backend == "cpu" else np.zeros(len(values), np.uint64))
    with pytest.raises(ValueError, match="compares nothing"):
        collect.differ(want_sums)
    assert call.num_blocks == len(call.src_flat) == sum(call.group_lens)
    check.copier.close()


@needs_lib
def test_a_fold_outside_the_sums_writes_nothing():
    """A gather index past the call's sums, or a block whose starts or counts leave
    their ranges, is refused before any byte moves (the library checks the fold
    against every call's sums count); a call with no block folds nothing (None)."""
    case = QUICK[0]
    check = prepare_check("cpu", case, "d2h")
    call = check.copier.plan("d2h", check.dev_ids, check.host_ids)
    n = call.num_blocks
    before = {k: t.clone() for k, t in check.got[1].items()}
    out = torch.full((n,), POISON_SUM, dtype=torch.int64)
    for gather, starts in (([0, n], [0]), ([0, -1], [0]), ([0, 1], [1, 0])):
        fold = SumFold(gather, [1, 2], [0], [0]) if starts == [0] else None
        if fold is None:  # starts that fall are refused when the fold is made
            with pytest.raises(ValueError, match="segment starts"):
                SumFold(gather, [1, 2], starts, [0, 0])
            continue
        with pytest.raises(ValueError, match="outside the call's"):
            check.copier.run_and_fold("d2h", call, out, fold)
        assert all(torch.equal(t, before[k]) for k, t in check.got[1].items())
        assert (out == POISON_SUM).all()
    # the library's own checks, on blocks SumFold would refuse to make: -1, nothing written
    from kvcopy.copy_backends import get_backend
    backend = get_backend("cpu")
    _, static, tuning, _, _ = backend.state(check.copier.tables("d2h"))
    gather, bounds = np.zeros(4, np.int64), np.zeros(4, np.uint64)
    want = np.zeros(3, np.uint64)
    for starts, num_gather, num_values in (([0, 3, 2], 4, 3), ([0, 1, 5], 4, 3), ([-1, 0, 0], 4, 3),
                                           ([0, 0, 0], -1, 3), ([0, 0, 0], 4, -1)):
        st = np.array(starts, np.int64)
        fold = native.Fold.make(gather=gather.ctypes.data, bounds=bounds.ctypes.data, num_gather=num_gather,
                                starts=st.ctypes.data, num_values=num_values, values=0, want=want.ctypes.data)
        rc = backend._sums_fold(static, tuning, call.words, call.total_bytes, out.data_ptr(), n,
                                ctypes.addressof(fold))
        assert rc == -1, (starts, num_gather, num_values)
        assert all(torch.equal(t, before[k]) for k, t in check.got[1].items())
        assert (out == POISON_SUM).all()
    short = native.Fold.make()
    short.struct_bytes = ctypes.sizeof(short) - 8  # another build's struct: refused, nothing written
    assert backend._sums_fold(static, tuning, call.words, call.total_bytes, out.data_ptr(), n,
                              ctypes.addressof(short)) == -3
    assert all(torch.equal(t, before[k]) for k, t in check.got[1].items()) and (out == POISON_SUM).all()
    empty = check.copier.plan("d2h", [[] for _ in check.dev_ids], [[] for _ in check.host_ids])
    none = torch.full((0,), POISON_SUM, dtype=torch.int64)
    assert empty.num_blocks == 0 and check.copier.run_and_fold("d2h", empty, none, SumFold([], [], [], [])) is None
    with pytest.raises(TypeError, match="SumFold"):
        check.copier.run_and_fold("d2h", call, out, (0, 0))
    with pytest.raises(TypeError, match="checksums"):
        check.copier.run_and_fold("d2h", call, None, SumFold([0], [0], [0], [0]))
    check.copier.close()


def test_a_sum_fold_cannot_be_changed():
    """SumFold copies its arrays into bytes, with the block of their addresses: neither
    an edit of what it was made from nor of it reaches what the library reads (old
    code: a deleted block or a re-enabled write re-pointed the library: SIGSEGV)."""
    gather = np.array([0, 1, 1])
    fold = SumFold(gather, [3, 4, 5], [0, 2], [7, 8])
    gather[0] = 10**9
    sums = np.array([11, 12], np.uint64)
    want = SumFold([0, 1, 1], [3, 4, 5], [0, 2], [7, 8]).differ(sums)
    assert fold.differ(sums) == want
    with pytest.raises(AttributeError):
        fold.at = 0
    with pytest.raises(AttributeError):
        fold._block = None
    for name in ("_block", "_arrays", "_values", "_at"):
        with pytest.raises(AttributeError):
            delattr(fold, name)
    for a in fold._arrays + (fold._block,):
        with pytest.raises(ValueError):
            a[0] = 1
        with pytest.raises(ValueError):
            a.setflags(write=True)
    collect = fold.collecting()
    with pytest.raises(ValueError):  # the library writes len(starts) values there, whatever is done to it
        collect.values.resize(100, refcheck=False)
    assert len(collect.values) == 2 and fold.values is None
    with pytest.raises(ValueError, match="bounds"):
        SumFold([0, 1], [3], [0], [7])
    with pytest.raises(TypeError, match="integer"):
        SumFold([0.5], [3], [0], [7])


# Pages of 1.5-8 KiB: the vector loops' 64- and 128-byte steps; pages of odd sizes
# (3,216 and 3,360 bytes: runs that start off a 32/64-byte line) for a streaming head
# followed by vector steps and a scalar tail after them, which whole-line pages never
# reach (a key not advanced past the vector steps fails only these two).
BIG_CASES = [CopyCase(layout="kv_first", block_size=16, num_heads=4, head_size=64, ids="runs", num_blocks=32),
             CopyCase(layout="nhd", dtype="fp8", block_size=16, num_heads=3, head_size=40, ids="scattered"),
             CopyCase(layout="lbnhc", num_heads=4, head_size=128, block_size=8, ids="odd"),
             CopyCase(layout="nhd", dtype="uint8", block_size=16, num_heads=3, head_size=67, ids="runs", num_blocks=32),
             CopyCase(layout="kv_first", dtype="fp16", block_size=16, num_heads=3, head_size=35, ids="scattered",
                      num_blocks=32),
             # 201-byte runs: with 192-byte pieces, 128 + 73 bytes, the last word zero-padded
             CopyCase(layout="nhd", dtype="uint8", block_size=3, num_heads=1, head_size=67, ids="runs", num_blocks=32)]


HAS_AVX2 = lib is not None and bool(lib.kvcopy_cpu_sums_loops() & 1)
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="the CPU has no AVX2 (or the CPU library is not built)")
LOOPS = [
    pytest.param({"KVCOPY_CPU_SIMD": "1"}, id="vector"),
    pytest.param({"KVCOPY_CPU_SIMD": "0"}, id="scalar"),
    pytest.param({"KVCOPY_CPU_STREAM_BYTES": "1"}, id="streaming-stores"),
    pytest.param({"KVCOPY_CPU_SIMD": "avx2"}, id="avx2", marks=needs_avx2),
    pytest.param({"KVCOPY_CPU_SIMD": "avx2", "KVCOPY_CPU_STREAM_BYTES": "1"}, id="avx2-streaming", marks=needs_avx2),
    # runs copied piece by piece by memcpy and hashed after (every run of 192 bytes and
    # more: pieces of at most 192 bytes, multiples of 64 but the last), and never
    pytest.param({"KVCOPY_CPU_SUM_PIECE_BYTES": "192"}, id="pieces"),
    pytest.param({"KVCOPY_CPU_SIMD": "avx2", "KVCOPY_CPU_SUM_PIECE_BYTES": "192"}, id="avx2-pieces", marks=needs_avx2),
    pytest.param({"KVCOPY_CPU_SUM_PIECE_BYTES": "0"}, id="fused"),
]


@needs_lib
@pytest.mark.parametrize("env", LOOPS)
@pytest.mark.parametrize("case", QUICK + BIG_CASES, ids=[c.id for c in QUICK + BIG_CASES])
def test_cpu_loops_match_oracle(case, env, monkeypatch):
    """The cpu backend's other loops: scalar code, the vector loops (AVX2 also where
    the CPU would pick AVX-512) and their non-temporal stores (aligned by a scalar
    head) that large calls use."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for direction in DIRECTIONS:
        check_sums("cpu", case, direction)


@needs_lib
def test_cpu_default_loop_is_the_widest_the_cpu_has(monkeypatch):
    """What the library reports it can run decides the default loop, as the C side
    picks it (AVX-512, else AVX2, else scalar), and KVCOPY_CPU_SIMD overrides it."""
    from kvcopy.copy_backends.cpu import CpuBackend
    loops = lib.kvcopy_cpu_sums_loops()
    assert 0 <= loops <= 3
    monkeypatch.delenv("KVCOPY_CPU_SIMD", raising=False)
    assert CpuBackend().checksum_loop() == {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512"}[loops]
    monkeypatch.setenv("KVCOPY_CPU_SIMD", "0")
    assert CpuBackend().checksum_loop() == "scalar"
    if loops & 1:
        monkeypatch.setenv("KVCOPY_CPU_SIMD", "avx2")
        assert CpuBackend().checksum_loop() == "avx2"


def test_cpu_avx2_setting_on_a_cpu_without_it_is_refused(monkeypatch):
    from kvcopy.copy_backends import cpu
    monkeypatch.setenv("KVCOPY_CPU_SIMD", "avx2")
    with pytest.raises(ValueError, match="this CPU has no AVX2"):
        cpu._simd(0)
    assert cpu._simd(1) == 2


@needs_lib
@pytest.mark.parametrize("value", ["100", "-64", "16k"])
def test_cpu_piece_setting_is_checked(value, monkeypatch):
    """KVCOPY_CPU_SUM_PIECE_BYTES must be 0 or a positive multiple of 64 (pieces keep
    hash words whole): anything else is refused at prepare."""
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", value)
    with pytest.raises(ValueError, match="KVCOPY_CPU_SUM_PIECE_BYTES must be"):
        check_sums("cpu", QUICK[0], "d2h")


def test_cpu_pieces_default_to_the_vector_loops(monkeypatch):
    """Runs are pieced by default in both vector loops, never in the scalar one;
    KVCOPY_CPU_SUM_PIECE_BYTES sets it for every loop (the scalar one ignores it)."""
    from kvcopy.copy_backends.cpu import PIECE_BYTES_DEFAULT, _piece_bytes

    monkeypatch.delenv("KVCOPY_CPU_SUM_PIECE_BYTES", raising=False)
    assert [_piece_bytes(loop) for loop in (0, 1, 2)] == [0, PIECE_BYTES_DEFAULT, PIECE_BYTES_DEFAULT]
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", "4096")
    assert [_piece_bytes(loop) for loop in (0, 1, 2)] == [4096] * 3
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", "0")
    assert _piece_bytes(2) == 0


@needs_lib
@pytest.mark.parametrize("setting", [None, "16384"])
def test_cpu_pieces_start_at_two_mebibytes_unless_asked_for(setting, monkeypatch):
    """By default the library pieces a checksummed call's runs only from
    PIECE_MIN_CALL_BYTES up (under it the fused loop: faster where the caches hold the
    call); a set KVCOPY_CPU_SUM_PIECE_BYTES pieces calls of any size. The arguments
    both C entry points (the copy with sums, and the one that also folds them) receive,
    asked of the library's own decision (kvcopy_cpu_sums_pieces), and every call's
    bytes and sums as the torch backend's, destination and sums poisoned."""
    from kvcopy.copy_backends import cpu, get_backend
    from kvcopy.core.checksum import SumFold

    if setting is None:
        monkeypatch.delenv("KVCOPY_CPU_SUM_PIECE_BYTES", raising=False)
    else:
        monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", setting)
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", str(16 << 20))  # no call here streams
    monkeypatch.setenv("KVCOPY_CPU_SIMD", "1")
    if get_backend("cpu").checksum_loop() == "scalar":
        pytest.skip("the scalar loop never pieces")
    backend = get_backend("cpu")
    seen = []
    for attr in ("_sums", "_sums_fold"):
        real = getattr(backend, attr)

        def spy(*args, real=real, attr=attr):
            # (tables, tuning, call, total bytes, ...): total bytes, then the tuning's simd,
            # stream threshold, piece, piece_min
            t = native.CpuTuning.from_address(args[1])
            seen.append((attr, args[3], t.simd, t.stream_min_bytes, t.piece_bytes, t.piece_min_bytes))
            return real(*args)

        monkeypatch.setattr(backend, attr, spy)
    gen = torch.Generator().manual_seed(5)
    dev = {f"l{i}": torch.randint(-100, 100, (96, 16, 8, 128), dtype=torch.int16, generator=gen) for i in range(2)}
    results = {}
    for name in ("torch", "cpu"):
        host = {n: torch.full_like(t, -7) for n, t in dev.items()}
        copier = kvcopy.BlockCopier(dev, host, [list(dev)], copy_backend=name)
        sums = []
        for n in (31, 32, 40):  # 1.94 MiB, 2 MiB and 2.5 MiB of 32 KiB pages
            ids = [list(range(0, 2 * n, 2))]
            call = copier.plan("d2h", ids, ids)
            out = torch.full((call.num_blocks,), POISON_SUM, dtype=torch.int64)
            if name == "cpu":
                copier.run_and_fold("d2h", call, out, SumFold([0], [0], [0], [0]).collecting())
                out2 = torch.full((call.num_blocks,), POISON_SUM, dtype=torch.int64)
                copier.run("d2h", call, checksums=out2)
                assert torch.equal(out, out2)
            else:
                copier.run("d2h", call, checksums=out)
            sums.append(out.clone())
        copier.close()
        results[name] = ({n: t.clone() for n, t in host.items()}, sums)
    (want_host, want_sums), (host, got_sums) = results["torch"], results["cpu"]
    assert all(torch.equal(want_host[n], host[n]) for n in host)
    assert all(torch.equal(a, b) for a, b in zip(want_sums, got_sums))
    assert [s[1] for s in seen] == [31 << 16, 31 << 16, 32 << 16, 32 << 16, 40 << 16, 40 << 16]
    assert {s[0] for s in seen} == {"_sums", "_sums_fold"}
    assert cpu.PIECE_MIN_CALL_BYTES == 32 << 16  # the 2 MiB call is the first pieced by default
    # 32 KiB runs: pieced (bit 0) from 2 MiB by default, at every size when set
    how = [pieces(total, 32 << 10, simd, stream, piece, piece_min) & 1
           for _, total, simd, stream, piece, piece_min in seen]
    assert how == ([1] * 6 if setting else [0, 0, 1, 1, 1, 1])


@needs_lib
def test_cpu_simd_setting_is_checked(monkeypatch):
    """A KVCOPY_CPU_SIMD the backend does not know is refused when a copier direction
    is prepared, not taken as the default loop."""
    monkeypatch.setenv("KVCOPY_CPU_SIMD", "avx3")
    with pytest.raises(ValueError, match="KVCOPY_CPU_SIMD must be"):
        check_sums("cpu", QUICK[0], "d2h")


@needs_lib
@pytest.mark.parametrize("case", [
    CopyCase(num_groups=2, layers_per_group=4, num_blocks=64, ids="all", block_size=16, num_heads=8, head_size=128),
    # merged items of two runs per page (K and V halves), walked page by page
    CopyCase(layout="kv_first", num_groups=1, num_blocks=16, ids="all", block_size=64, num_heads=8, head_size=128),
], ids=["nhd", "kv_first-merged"])
@pytest.mark.parametrize("pieces", ["0", "1024"])
def test_cpu_threads_add_shared_slots(monkeypatch, case, pieces):
    """Above 1 MiB the items of one call run on OpenMP threads, several layers of a
    group adding into one block's slot at once (each thread into a row of its own),
    runs hashed as they are stored or piece by piece after memcpy."""
    monkeypatch.setenv("KVCOPY_CPU_THREADS", "2")
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", pieces)
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", "0")  # cached stores on every CPU (Intel's default streams)
    check = prepare_check("cpu", case, "d2h")
    call = check.copier.plan("d2h", check.dev_ids, check.host_ids)
    check.copier.close()
    assert call.total_bytes >= 1 << 20 and call.num_items > 1  # what takes the OpenMP path
    for direction in DIRECTIONS:
        check_sums("cpu", case, direction)


def _three_shapes(poison: str, num_blocks: int):
    """(device caches, host buffers, layer groups): groups of 1 KiB, 128-byte and
    512-byte runs (NHD bf16, 4 tokens x 2 heads x 64, 8 or 32 elements), 8 layers each:
    the ``poison`` side filled with POISON_BYTE."""
    dev, host, groups = {}, {}, []
    for tag, head in (("a", 64), ("b", 8), ("c", 32)):
        case = CopyCase(num_groups=1, layers_per_group=8, num_blocks=num_blocks, block_size=4, num_heads=2,
                        head_size=head, seed=head)
        d, h = case.build(poison=poison)
        groups.append([f"{tag}.{n}" for n in case.layer_groups()[0]])
        dev.update({f"{tag}.{n}": t for n, t in d.items()})
        host.update({f"{tag}.{n}": t for n, t in h.items()})
    return dev, host, groups


@needs_lib
@pytest.mark.parametrize("loop", [pytest.param("1", id="vector"), pytest.param("avx2", id="avx2", marks=needs_avx2)])
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("num_blocks", [pytest.param(160, id="1MiB"), pytest.param(1200, id="9MiB")])
def test_cpu_pieces_carry_across_pages_items_and_shapes(monkeypatch, num_blocks, direction, threads, loop):
    """A piece is hashed when the thread's next piece comes (its source prefetched under
    the hash, whole in calls under 8 MiB, above its first half: as the library reports
    it): the next piece of the page, of another page or item, after items of runs too
    short for pieces (group 1's, copied by the fused loop between group 0's and group
    2's pieces), or, for the thread's last piece, at the end of the call. Bytes and sums
    as the torch backend's, destination and sums poisoned first, one thread and two."""
    from kvcopy.copy_backends import get_backend

    monkeypatch.setenv("KVCOPY_CPU_SIMD", loop)
    monkeypatch.setenv("KVCOPY_CPU_THREADS", threads)
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", "192")  # 1 KiB runs: 6 pieces, 512 B: 3
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", str(16 << 20))  # 9 MiB calls pieced, not streamed
    rng = np.random.default_rng(7)
    ids = [sorted(rng.permutation(num_blocks)[:num_blocks - 10].tolist()), rng.permutation(num_blocks)[:40].tolist(),
           rng.permutation(num_blocks)[:40].tolist()]
    results = []
    for backend in ("torch", "cpu"):
        dev, host, groups = _three_shapes("host" if direction == "d2h" else "device", num_blocks)
        copier = kvcopy.BlockCopier(dev, host, groups, copy_backend=backend)
        out = torch.full((sum(map(len, ids)),), POISON_SUM, dtype=torch.int64)
        if direction == "d2h":
            copier.to_host(ids, ids, checksums=out)
        else:
            copier.to_device(ids, ids, checksums=out)
        if backend == "cpu":
            call = copier.plan(direction, ids, ids)
            assert call.num_items > 1 and call.total_bytes >= 1 << 20  # the threads' path at 2
            tuning = get_backend("cpu").state(copier.tables(direction)).tuning
            simd, stream, piece, piece_min = tuning.simd, tuning.stream_min_bytes, tuning.piece_bytes, \
                tuning.piece_min_bytes
            assert piece_min == 0  # the piece size is set: pieces at every size
            how = [pieces(call.total_bytes, run, simd, stream, piece, piece_min) for run in (1024, 128, 512)]
            assert how == ([3, 0, 3] if num_blocks == 160 else [1, 0, 1])  # pieced (+2: prefetched whole)
        copier.close()
        results.append((dev, host, out.numpy().view(np.uint64).copy()))
    (want_dev, want_host, want_sums), (dev, host, sums) = results
    for want, got in ((want_dev, dev), (want_host, host)):
        for name in want:
            assert torch.equal(storage_bytes(want[name]), storage_bytes(got[name])), name
    bad = np.flatnonzero(sums != want_sums)
    assert not len(bad), f"{len(bad)} of {len(sums)} sums differ from torch's, first {bad[:4]}"


@needs_lib
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("pieces, stream", [pytest.param("0", "0", id="fused"), pytest.param("4096", "0", id="pieces"),
                                            pytest.param("4096", "1", id="streaming")])
def test_cpu_sums_are_of_the_bytes_written(monkeypatch, pieces, stream, threads):
    """The sums are of what the copy wrote, not of a source that changes under it (a
    late write into the pages being saved): d2h while another thread keeps adding to
    every source page, each call's sums equal the oracle's over the destination's
    bytes, hashed as stored (cached or streaming stores) or piece by piece after memcpy.
    Pieces hashed in their source instead disagreed in 11 and 18 of the 60 calls (one
    thread, two)."""
    import threading

    from kvcopy.core.checksum import as_unsigned, table_checksums

    monkeypatch.setenv("KVCOPY_CPU_THREADS", threads)
    monkeypatch.setenv("KVCOPY_CPU_SUM_PIECE_BYTES", pieces)
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", stream)  # 0: never (Intel's default streams 7.5 MiB)
    gen = torch.Generator().manual_seed(3)
    dev = {f"l{i}": torch.randint(-100, 100, (64, 16, 8, 128), dtype=torch.int16, generator=gen) for i in range(8)}
    host = {n: torch.zeros_like(t) for n, t in dev.items()}
    copier = kvcopy.BlockCopier(dev, host, [list(dev)], copy_backend="cpu")
    ids = [list(range(0, 60, 2))]  # 30 pages of 32 KiB per layer: 7.5 MiB, pieces prefetched
    call = copier.plan("d2h", ids, ids)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            for t in dev.values():
                t.add_(1)

    thread = threading.Thread(target=writer)
    thread.start()
    differing = 0
    try:
        for _ in range(60):
            out = torch.full((call.num_blocks,), POISON_SUM, dtype=torch.int64)
            copier.run("d2h", call, checksums=out)
            differing += int((as_unsigned(out) != table_checksums(copier.tables("d2h"), call)).any())
    finally:
        stop.set()
        thread.join()
    copier.close()
    assert differing == 0, f"{differing} of 60 calls' sums differ from the bytes they wrote"


@needs_lib
def test_cpu_sums_without_rows_write_nothing(monkeypatch):
    """The threads' sums rows are allocated before any byte moves: a call that cannot
    have them (a sums count too large to allocate) returns 2, destination untouched."""
    from kvcopy.copy_backends import get_backend

    monkeypatch.setenv("KVCOPY_CPU_THREADS", "2")
    case = CopyCase(num_groups=2, layers_per_group=4, num_blocks=64, ids="all", block_size=16, num_heads=8,
                    head_size=128)
    check = prepare_check("cpu", case, "d2h")
    call = check.copier.plan("d2h", check.dev_ids, check.host_ids)
    tables = check.copier.tables("d2h")
    backend = get_backend("cpu")
    _, static, tuning, _, tuning_struct = backend.state(tables)
    assert call.total_bytes >= 1 << 20 and call.num_items > 1 and tuning_struct.num_threads == 2  # threaded path
    before = {n: t.clone() for n, t in check.got[1].items()}
    out = torch.zeros(8, dtype=torch.int64)
    rc = backend._sums(static, tuning, call.words, call.total_bytes, out.data_ptr(), 1 << 61)
    assert rc == 2
    assert all(torch.equal(t, before[n]) for n, t in check.got[1].items())
    assert not out.any()
    check.copier.close()


@needs_lib
@pytest.mark.parametrize("num_ranges", [1, 3, 64, 5000])
@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_cuda_kernel_split_matches_oracle(case, num_ranges, ranges_backend):
    name = ranges_backend(num_ranges)
    for direction in DIRECTIONS:
        check_sums(name, case, direction)


# (case, a word width the kernel could use on it: at most the tables' alignment)
KV_FIRST = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48)  # 16-byte aligned
PAGES_21 = CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="runs")  # 1-byte
RUNS_14 = CopyCase(layout="lbnhc", dtype="uint8", num_heads=5, head_size=7, ids="scattered")  # 2-byte aligned
NARROW = [(KV_FIRST, w) for w in (1, 2, 4, 8)] + [(PAGES_21, 1), (RUNS_14, 1), (RUNS_14, 2)]


@needs_lib
@pytest.mark.parametrize("case,word", NARROW, ids=[f"{c.id}-b{c.block_size}-w{w}" for c, w in NARROW])
def test_cuda_kernel_narrow_words(word, case, ranges_backend):
    """Words narrower than 8 bytes: each 8-byte hash word is added by the range that
    holds its first byte, reading the rest from the source; range cuts fall inside
    hash words."""
    for direction in DIRECTIONS:
        check = prepare_check("cpu", case, direction)
        assert check.copier.tables(direction).word_bytes % word == 0  # a width the kernel could run
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

    cfg = tc.launch_config(word, chunk, ENTRY_FIELDS, checksums=True)
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
    body = src[src.index("def _product_term"):src.index("class LaunchConfig")]
    for name in ("tl.sum", "tl.cumsum", "tl.zeros_like", "tl.zeros(", "tl.max(", "tl.min(", "tl.cdiv"):
        assert name not in body, name


# ------------------------------------------------------------------ the CUDA kernel, compiled
def test_cuda_sums_kernels_compile_without_spills(tmp_path):
    """nvcc builds the checksum kernels for sm_80 and sm_90 within the 128 registers of
    a 512-thread CTA, with no spills (the copy kernels' budget: a spill would put
    local-memory traffic on the copy's path)."""
    import os
    import re
    import shutil
    import subprocess

    from kvcopy.copy_backends import nvrtc
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
