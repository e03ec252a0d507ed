"""The staging arena's span allocator: first fit, coalescing, back-pressure, metrics."""
import numpy as np
import pytest

from kvcopy.nixl.modes.spans import Arena, ArenaFull, Span


def test_first_fit_and_coalescing():
    a = Arena(10 * 4096, 4096)
    s = [a.allocate(4096) for _ in range(10)]
    assert [x.offset for x in s] == [i * 4096 for i in range(10)]
    with pytest.raises(ArenaFull, match="staging arena full"):
        a.allocate(1)
    a.free(s[3])
    a.free(s[5])
    with pytest.raises(ArenaFull):
        a.allocate(2 * 4096)  # two free granules, not adjacent
    a.free(s[4])  # merges 3, 4, 5
    assert a.free_ranges() == [(3 * 4096, 3 * 4096)]
    big = a.allocate(3 * 4096 - 100)  # rounded up to whole granules
    assert big == Span(3 * 4096, 3 * 4096)
    st = a.stats()
    assert st["bytes_in_use"] == 10 * 4096 and st["high_water"] == 10 * 4096
    assert st["failed_allocations"] == 2 and st["spans"] == 8


def test_free_checks_ownership():
    a = Arena(4 * 4096, 4096)
    s = a.allocate(4096)
    a.free(s)
    with pytest.raises(ValueError, match="not a live span"):
        a.free(s)
    with pytest.raises(ValueError, match="not a live span"):
        a.free(Span(4096, 4096))


def test_reserved_bytes_are_never_handed_out():
    a = Arena(4 * 4096, 4096, reserved=1)
    spans = [a.allocate(4096) for _ in range(3)]
    assert min(x.offset for x in spans) == 4096
    with pytest.raises(ArenaFull):
        a.allocate(4096)
    assert a.stats()["arena_bytes"] == 3 * 4096


def test_random_churn_never_overlaps_and_frees_back_to_one_range():
    rng = np.random.default_rng(0)
    a = Arena(1 << 24, 4096)
    live = []
    for _ in range(3000):
        if live and (rng.random() < 0.5 or len(live) > 64):
            a.free(live.pop(int(rng.integers(len(live)))))
        else:
            try:
                live.append(a.allocate(int(rng.integers(1, 1 << 19))))
            except ArenaFull:
                continue
        ends = sorted((s.offset, s.offset + s.nbytes) for s in live)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))  # disjoint
        assert a.bytes_in_use == sum(s.nbytes for s in live)
    for s in live:
        a.free(s)
    assert a.free_ranges() == [(0, 1 << 24)] and a.bytes_in_use == 0


def test_sixty_four_equal_spans_fill_and_drain_in_any_order():
    a = Arena(1 << 30, 1 << 17)
    spans = [a.allocate(16 << 20) for _ in range(64)]
    assert a.stats()["failed_allocations"] == 0 and a.bytes_in_use == 1 << 30
    for s in spans[::2] + spans[1::2]:
        a.free(s)
    assert a.bytes_in_use == 0 and a.free_ranges() == [(0, 1 << 30)]
