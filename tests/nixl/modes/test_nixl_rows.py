"""Row and run helpers: READ rows merged by address, bounds, zero runs and their byte index."""
import numpy as np
import pytest

from kvcopy.nixl.modes.rows import byte_index, check_inside, merge_rows, merged, overlaps, zero_runs


def test_merge_rows_merges_what_continues_on_both_sides():
    local = np.array([[300, 100, 0], [100, 100, 0], [200, 100, 0]], np.uint64)
    remote = np.array([[1350, 100, 0], [1100, 100, 0], [1250, 100, 0]], np.uint64)  # 200 and 300 continue
    lo, ro = merge_rows(local, remote)
    assert lo[:, :2].tolist() == [[100, 100], [200, 200]] and ro[:, :2].tolist() == [[1100, 100], [1250, 200]]
    local = np.array([[100, 50, 0], [200, 100, 0], [400, 10, 0]], np.uint64)
    remote = np.array([[1100, 50, 0], [1200, 100, 0], [1410, 10, 0]], np.uint64)
    lo, ro = merge_rows(local, remote, bridge=50)  # the 50-byte gap is the same on both sides
    assert lo[:, :2].tolist() == [[100, 200], [400, 10]] and ro[:, :2].tolist() == [[1100, 200], [1410, 10]]
    lo, ro = merge_rows(local, remote, bridge=49)  # one byte short: not read across
    assert len(lo) == 3


def test_check_inside_names_the_span():
    rows = np.array([[100, 50, 0], [150, 50, 0]], np.uint64)
    check_inside(rows, 100, 100, "D's span")
    with pytest.raises(ValueError, match=r"outside D's span \[100, \+99\)"):
        check_inside(rows, 100, 99, "D's span")
    with pytest.raises(ValueError, match="outside"):
        check_inside(rows, 101, 200, "D's span")


def test_zero_runs_and_their_byte_index_match_a_loop():
    pages, page_stride, base, chunks, chunk_stride, segs = [3, 7], 1000, 64, 2, 100, ((8, 4), (40, 2))
    starts, lens = zero_runs(pages, page_stride, base, chunks, chunk_stride, segs)
    want = [base + p * page_stride + c * chunk_stride + off + i
            for c in range(chunks) for off, n in segs for p in pages for i in range(n)]
    assert sorted(byte_index(starts, lens).tolist()) == sorted(want) and len(want) == 2 * 2 * 2 * 3
    empty = zero_runs([], 1, 0, 1, 0, ((0, 4),))
    assert byte_index(*empty).size == 0


def test_merged_ranges_are_sorted_disjoint_and_cover_the_same_bytes():
    rng = np.random.default_rng(3)
    for _ in range(200):
        starts = rng.integers(0, 200, size=int(rng.integers(0, 12)))
        ends = starts + rng.integers(0, 20, size=len(starts))
        s, e = merged(starts, ends)
        assert np.all(s[1:] > e[:-1]) and np.all(e >= s)
        want = np.zeros(260, bool)
        for a, b in zip(starts, ends):
            want[a:b] = True
        got = np.zeros(260, bool)
        for a, b in zip(s, e):
            got[a:b] = True
        assert np.array_equal(got, want)


def test_overlaps_is_a_byte_for_byte_intersection_test():
    rng = np.random.default_rng(4)
    for _ in range(500):
        hs, he = merged(*(lambda s: (s, s + rng.integers(1, 16, size=len(s))))(rng.integers(0, 100, size=5)))
        starts = rng.integers(0, 120, size=int(rng.integers(0, 6)))
        ends = starts + rng.integers(0, 10, size=len(starts))
        held = np.zeros(140, bool)
        for a, b in zip(hs, he):
            held[a:b] = True
        want = any(held[a:b].any() for a, b in zip(starts, ends))
        assert overlaps(starts, ends, hs, he) == want
    assert not overlaps(np.array([5]), np.array([5]), np.array([0]), np.array([10]))  # an empty range
    assert not overlaps(np.array([10]), np.array([20]), np.array([0]), np.array([10]))  # adjacent
    assert overlaps(np.array([9]), np.array([20]), np.array([0]), np.array([10]))
