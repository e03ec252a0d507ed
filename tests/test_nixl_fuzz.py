"""The byte-oracle fuzzer: random heterogeneous geometries planned and replayed on CPU
tensors (no NIXL), each byte-exact against an expectation built from token and head
semantics, or a clear ValueError. A silently wrong case fails the test."""
import numpy as np
import pytest

from kvcopy.nixl import geometry, plan as plan_mod
from kvcopy.testing.nixl import fuzz
from kvcopy.nixl.geometry import ChunkAxes, remote_ranks, segments
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
    monkeypatch.setattr(plan_mod, "head_owners",
                        lambda lh, ph, prefer: [(i, a, 0, k) for i, a, _, k in real(lh, ph, prefer)])
    report = fuzz.fuzz(60, seed=0)
    assert report.wrong > 0


def test_segments_token_slices_and_head_ranges():
    nhd = ChunkAxes(("token", "head", "o0"), (16, 4, 8), (32, 8, 1), 2)  # [16 tokens, 4 heads, 8]
    hnd = ChunkAxes(("head", "token", "o0"), (4, 16, 8), (128, 8, 1), 2)
    # a token slice of an NHD page is one run; of an HND page one run per head
    assert segments(nhd, nhd, ((0, 8), (0, 4)), ((8, 8), (0, 4))) == ((0, 512, 512),)
    assert len(segments(hnd, hnd, ((0, 8), (0, 4)), ((8, 8), (0, 4)))) == 4
    # a head range of an HND page is one run; of an NHD page one run per token
    two = ChunkAxes(("head", "token", "o0"), (2, 16, 8), (128, 8, 1), 2)
    assert segments(two, hnd, ((0, 16), (0, 2)), ((0, 16), (2, 2))) == ((0, 512, 512),)
    assert len(segments(ChunkAxes(("token", "head", "o0"), (16, 2, 8), (16, 8, 1), 2), nhd,
                        ((0, 16), (0, 2)), ((0, 16), (2, 2)))) == 16


@pytest.mark.parametrize("d_rank, d_tp, p_tp, heads, want", [
    (0, 4, 2, 8, [0]), (3, 4, 2, 8, [1]), (1, 2, 4, 8, [2, 3]), (0, 1, 8, 2, [0, 4]),
    (5, 8, 2, 4, [1]), (2, 4, 1, 4, [0]), (3, 4, 2, None, [1]),
])
def test_remote_ranks(d_rank, d_tp, p_tp, heads, want):
    assert remote_ranks(d_rank, d_tp, p_tp, heads) == want


@pytest.mark.slow
def test_full_fuzz_run():
    report = fuzz.fuzz(10000, seed=0)
    print(report)
    assert report.wrong == 0, str(report)
    assert report.num_raised < 0.05 * report.cases, str(report)
