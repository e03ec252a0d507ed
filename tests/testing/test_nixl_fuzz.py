"""The byte-oracle fuzzer: random heterogeneous geometries planned and replayed on CPU
tensors (no NIXL), each byte-exact against an expectation built from token and head
semantics, or a clear ValueError. A silently wrong case fails the test."""
import pytest

from kvcopy.nixl.engine import geometry
from kvcopy.nixl.planning import routes as routes_mod
from kvcopy.testing.nixl import fuzz
from kvcopy.testing.nixl.engines import one_torch_thread


@pytest.fixture(autouse=True)
def _threads():
    with one_torch_thread():
        yield


def test_a_few_hundred_random_cases_are_exact_or_raise_clearly():
    report = fuzz.fuzz(300, seed=0)
    assert report.wrong == 0, str(report)
    assert report.num_raised < 0.05 * report.cases, str(report)
    assert report.exact + report.num_raised == report.cases == 300


def test_the_cases_cover_the_heterogeneous_geometries():
    specs = [fuzz.case(i) for i in range(300)]
    def count(pred):
        return sum(bool(pred(s)) for s in specs)
    assert count(lambda s: s.p.tp_size != s.d.tp_size) > 100
    assert count(lambda s: s.p.tokens_per_page != s.d.tokens_per_page) > 100
    assert count(lambda s: s.p.tokens_per_block != s.d.tokens_per_block) > 100
    assert count(lambda s: s.p.groups != s.d.groups) > 100
    assert count(lambda s: s.p.layout != s.d.layout) > 30
    assert count(lambda s: any(k == "mla" for _, k, _ in s.layers)) > 30
    assert count(lambda s: s.total_kv_heads < max(s.p.tp_size, s.d.tp_size)) > 30  # replicated heads
    assert count(lambda s: len(s.p_ranks) > 1) > 30
    assert count(lambda s: s.num_cached) > 30
    assert count(lambda s: any(a == "swa" for _, _, a in s.layers)) > 50
    assert count(lambda s: s.p.alias or s.d.alias) > 10
    assert len({s.dtype for s in specs}) >= 4


def test_the_fuzzer_catches_a_planted_bug(monkeypatch):
    """Read every head range from the peer's first head: the oracle must see it."""
    real = geometry.head_owners
    monkeypatch.setattr(routes_mod, "head_owners",
                        lambda lh, ph, prefer: [(i, a, 0, k) for i, a, _, k in real(lh, ph, prefer)])
    report = fuzz.fuzz(60, seed=0)
    assert report.wrong > 0


@pytest.mark.slow
def test_full_fuzz_run():
    report = fuzz.fuzz(10000, seed=0)
    print(report)
    assert report.wrong == 0, str(report)
    assert report.num_raised < 0.05 * report.cases, str(report)
