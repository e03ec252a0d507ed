"""Pull plans by token position, without NIXL: engines described, not registered.

vLLM's NIXL pull selected "the last N pages" of P's allocation and loaded the wrong
prompt pages when P and D split blocks into pages differently; the ``seeds3`` engines
are that geometry (P: 128-token blocks of two 64-token pages, D: 64-token blocks)."""
import numpy as np
import pytest
import torch

from kvcopy.nixl import NO_BLOCK
from kvcopy.nixl.planning.plan import build_pull_plan, expand_blocks
from kvcopy.nixl.engine.info import pair_layers
from kvcopy.nixl.planning.plan import select_pages
from kvcopy.testing.nixl.engines import ToyEngine, build_case, engine_info

NP = 40


def plan_for(d_eng, p_eng, p_ids, n, d_ids, cached=0):
    d, p = engine_info(d_eng, "D"), engine_info(p_eng, "P")
    return build_pull_plan(d, p, pair_layers(d, p), p_ids, n, d_ids, cached)


def test_seeds3_reads_the_first_three_producer_pages_not_the_last_three():
    p_eng = build_case("seeds3", NP)  # 128-token blocks of two 64-token pages
    d_eng = build_case("seeds3", NP, tokens_per_block=[64])
    plan = plan_for(d_eng, p_eng, [[5, 9]], 160, [[20, 21, 22]])
    # P advertises [A | B | C | unused] = pages 10, 11, 18, 19
    assert [(p.local_pages, p.remote_pages) for p in plan.pairs] == [((20, 21, 22), (10, 11, 18))] * 2
    assert plan.pairs[0].remote_pages != (11, 18, 19)  # the "last three pages" selection
    assert plan.zero_pages == ((),) and plan.read_pages == ((20, 21, 22),)
    assert plan.local_block_ids == ((20, 21, 22),)


def test_seeds3_reverse_geometry_zeroes_the_page_d_reserved_but_p_did_not_fill():
    # D: two regions in two groups, 128-token blocks of 64-token pages; P: 64-token blocks
    def two_groups(tpb):
        caches = {f"m{i}": torch.empty(NP, 64, 32, dtype=torch.bfloat16) for i in range(2)}
        return ToyEngine(caches, [["m0"], ["m1"]], tpb, 64)

    plan = plan_for(two_groups([128, 128]), two_groups([64, 64]), [[1, 2, 3], [7, 8, 9]], 160,
                    [[5, 6], [10, 11]])
    assert [p.local_pages for p in plan.pairs] == [(10, 11, 12), (20, 21, 22)]
    assert [p.remote_pages for p in plan.pairs] == [(1, 2, 3), (7, 8, 9)]
    assert [p.pages_to_zero for p in plan.pairs] == [(13,), (23,)]
    assert plan.zero_pages == ((13,), (23,))
    assert "zero 13" in str(plan) and "zero 23" in str(plan)


@pytest.mark.parametrize("cached, read_positions, zero", [
    (0, [0, 1, 2], [3]),
    (64, [1, 2], [3]),  # one whole cached page skipped
    (100, [1, 2], [3]),  # a partially cached page is read whole
    (192, [], [3]),  # cached past the prompt: nothing read, cached pages kept
    (256, [], []),
])
def test_prefix_hits_skip_whole_pages(cached, read_positions, zero):
    local = np.array([30, 31, 32, 33])
    remote = np.array([4, 5, 6, 7])
    pos, l_read, r_read, l_zero = select_pages(local, remote, 64, 160, cached)
    assert pos.tolist() == read_positions
    assert l_read.tolist() == [30 + k for k in read_positions]
    assert r_read.tolist() == [4 + k for k in read_positions]
    assert l_zero.tolist() == [30 + k for k in zero]


def test_sliding_window_positions_and_missing_producer_pages():
    local = expand_blocks([NO_BLOCK, NO_BLOCK, 7, 8], 1)
    remote = expand_blocks([NO_BLOCK, NO_BLOCK, 3, 4], 1)
    pos, l_read, r_read, _ = select_pages(local, remote, 16, 64, 0)
    assert (pos.tolist(), l_read.tolist(), r_read.tolist()) == ([2, 3], [7, 8], [3, 4])
    with pytest.raises(ValueError, match=r"tokens \[16, 32\).*P holds no page"):
        select_pages(expand_blocks([NO_BLOCK, 6, 7, 8], 1), remote, 16, 64, 0, "g")
    with pytest.raises(ValueError, match=r"tokens \[48, 64\)"):
        select_pages(local, remote[:3], 16, 64, 0, "g")


def test_expand_blocks_keeps_no_block():
    assert expand_blocks([3, NO_BLOCK, 0], 2).tolist() == [6, 7, -1, -1, 0, 1]


def test_hybrid_groups_each_use_their_own_blocks_and_pages():
    eng = build_case("hybrid", NP)
    plan = plan_for(eng, eng, [[2, 3], [NO_BLOCK, 30, 31, 32]], 60, [[7, 8], [NO_BLOCK, 20, 21, 22]])
    by_group = {p.local_group: p for p in plan.pairs}
    assert by_group[0].local_pages == (14, 15, 16, 17) and by_group[0].remote_pages == (4, 5, 6, 7)
    assert by_group[1].local_pages == (20, 21, 22) and by_group[1].remote_pages == (30, 31, 32)
    assert sorted(l for p in plan.pairs for l in p.layers) == ["l0", "l1", "l2", "l3", "l4", "l5"]


def test_groups_numbered_differently_on_each_side_pair_by_layer_name():
    p_eng = build_case("hybrid", NP)
    d_eng = build_case("hybrid", NP)
    d_eng.layer_groups = [["l1", "l3", "l5"], ["l0", "l2", "l4"]]
    d_eng.tokens_per_block = [16, 32]
    plan = plan_for(d_eng, p_eng, [[2, 3], [30, 31, 32, 33]], 64, [[20, 21, 22, 23], [7, 8]])
    assert {(p.local_group, p.remote_group) for p in plan.pairs} == {(0, 1), (1, 0)}


@pytest.mark.parametrize("p_ids, n, d_ids, cached, exc, match", [
    ([[5, 9]], 160, [[20, 21, 22], [1]], 0, ValueError, "one block id list per KV cache group"),
    ([[5, 39]], 160, [[20, 21, 22]], 0, ValueError, r"remote_block_ids.*group 0: block id 39 out of range"),
    ([[5, 9]], 160, [[20, 21, 40]], 0, ValueError, r"local_block_ids, group 0: block id 40 out of range"),
    ([[5, 9]], 160, [[20, 21]], 0, ValueError, r"2 block\(s\) of 64 tokens hold 128 tokens; the pull is for 160"),
    ([[5, 9]], 160, [[20, True, 22]], 0, TypeError, "integers"),
    ([[5, 9]], 160, [[20, 21, 2**62]], 0, ValueError, "out of range"),
    ([[5, 9]], 160, [[20, 21, 20]], 0, ValueError, "page 20 appears at two token positions"),
    ([[5, 9]], 160, [[20, -3, 22]], 0, ValueError, "negative block id"),
    ([[5, 9]], 160, [[20.0, 21, 22]], 0, TypeError, "integers"),
    ([[5, 9]], -1, [[20, 21, 22]], 0, ValueError, "negative"),
    ([[5, 9]], 160, [[20, 21, 22]], [0, 0], ValueError, "num_cached_tokens"),
])
def test_bad_requests_raise_before_anything_moves(p_ids, n, d_ids, cached, exc, match):
    p_eng = build_case("seeds3", NP)
    d_eng = build_case("seeds3", NP, tokens_per_block=[64])
    with pytest.raises(exc, match=match):
        plan_for(d_eng, p_eng, p_ids, n, d_ids, cached)


def test_plan_is_printable_and_counts_bytes():
    eng = build_case("one_group", NP)
    plan = plan_for(eng, eng, [[1, 2, 3]], 40, [[4, 5, 6]])
    text = str(plan)
    assert "PullPlan from 'P': 40 tokens" in text and "pages 4-6 <- 1-3" in text
    assert plan.num_bytes == 3 * 3 * 16 * 2 * 8 * 2  # 3 layers x 3 pages
