"""The checksum fault injector (kvcopy/testing/nixl/inject.py): fuzzer geometries with
P's geometry on D, a clean pull whose sums must match, then five faults per case (bit
flips in P's and D's spans, swapped pages, an earlier request's page, a truncated READ)
that D's comparison must catch, naming exactly the faulted pages. No NIXL (the byte
oracle's READ rows); the real copiers pack and scatter."""
import numpy as np
import pytest

from kvcopy.nixl.modes import span_sums
from kvcopy.testing.nixl import inject
from kvcopy.testing.nixl.engines import one_torch_thread
from kvcopy.testing.nixl.geometries import arena_order


@pytest.fixture(autouse=True)
def _threads():
    with one_torch_thread():
        yield


def test_every_injected_fault_is_caught_and_no_clean_pull_fails():
    report = inject.inject(200, seed=1)
    assert report.failures == 0, str(report)
    assert report.clean["compared"] >= 190 and report.clean["wrong"] == 0, str(report)
    for fault in inject.FAULTS:
        assert report.faults[fault]["caught"] >= 180, str(report)
    assert report.injected >= 950


def test_the_injector_sees_a_comparison_that_looks_away(monkeypatch):
    """A comparison that passes everything: every fault is missed, none caught (D
    names the pages that differ only once a comparison, in the copy's call or after
    it, found them: a naming that finds none, and no fallback message, passes all)."""
    monkeypatch.setattr(span_sums.ScatterCheck, "differences", lambda self, arrays: None)
    monkeypatch.setattr(span_sums.ScatterCheck, "named", lambda self, arrays: None)
    report = inject.inject(20, seed=2)
    assert report.clean["compared"] == 20 and report.injected > 0
    assert sum(c["missed"] for c in report.faults.values()) == report.injected == report.failures


def test_a_comparison_naming_other_pages_is_wrong(monkeypatch):
    real = span_sums.ScatterCheck.differences

    def shifted(self, arrays):
        found = real(self, arrays)
        return found and found.replace("page position ", "page position 1")
    monkeypatch.setattr(span_sums.ScatterCheck, "differences", shifted)
    report = inject.inject(10, seed=3)
    assert sum(c["wrong"] for c in report.faults.values()) > 0


def test_the_geometries_vary():
    specs = [inject.homogeneous(np.random.default_rng(i), i) for i in range(300)]

    def count(pred):
        return sum(bool(pred(s)) for s in specs)
    assert count(lambda s: s.p.tp_size > 1) > 100
    assert count(lambda s: arena_order(s) == "head") > 30
    assert count(lambda s: any(k == "mla" for _, k, _ in s.layers)) > 30
    assert count(lambda s: s.num_cached) > 30
    assert count(lambda s: s.p.alias) > 10
    assert count(lambda s: len(s.p.groups) > 1) > 100
    assert count(lambda s: any(ids[0] < 0 for ids in s.d.block_ids)) > 30  # sliding-window holes
    assert all(s.d.groups == s.p.groups and s.d.tokens_per_page == s.p.tokens_per_page for s in specs)


@pytest.mark.slow
def test_ten_thousand_injections():
    report = inject.inject(2100, seed=0)
    print(report)
    assert report.failures == 0 and report.injected >= 10_000, str(report)
