"""The byte oracle: plans replayed on CPU tensors equal the token-position expectation."""
import dataclasses

import pytest
import torch

from kvcopy.nixl import NO_BLOCK
from kvcopy.nixl.planning.plan import build_pull_plan
from kvcopy.nixl.engine.info import pair_layers
from kvcopy.testing.nixl.oracle import replay
from kvcopy.core.layout import as_words
from kvcopy.testing.nixl.engines import build_case, engine_info, expected_pull, one_torch_thread
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes

NP = 40


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


def engines(case, p_tpb=None, d_tpb=None):
    pe, de = build_case(case, NP, p_tpb), build_case(case, NP, d_tpb)
    fill_random(pe.device_caches, 5)
    fill_random(de.device_caches, 6)
    return pe, de


def plan_for(de, pe, p_ids, n, d_ids, cached=0):
    d, p = engine_info(de, "D"), engine_info(pe, "P")
    return build_pull_plan(d, p, pair_layers(d, p), p_ids, n, d_ids, cached)


CASES = {
    "one_group": ("one_group", None, None, [[3, 4, 5]], [[7, 8, 9, 10]], 40, 0),
    "hybrid_swa_prefix": ("hybrid", None, None, [[1, 2, 3], [NO_BLOCK, NO_BLOCK, 10, 11, 12, 13]],
                          [[12, 13, 14], [NO_BLOCK, NO_BLOCK, 30, 31, 32, 33]], 90, 48),
    "seeds3": ("seeds3", [128], [64], [[5, 9]], [[10, 11, 12]], 160, 0),
    "seeds3_reverse": ("seeds3", [64], [128], [[1, 2, 3]], [[5, 6]], 160, 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_matches_the_token_position_rule(name):
    case, p_tpb, d_tpb, p_ids, d_ids, n, cached = CASES[name]
    pe, de = engines(case, p_tpb, d_tpb)
    plan = plan_for(de, pe, p_ids, n, d_ids, cached)
    before = clone_caches(de.device_caches)
    expected = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n, cached)
    replay(plan, de.device_caches, pe.device_caches)
    assert not same_bytes(before, expected)
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)


def test_replay_across_different_group_numbering():
    pe, de = engines("hybrid")
    de.layer_groups = [["l1", "l3", "l5"], ["l0", "l2", "l4"]]
    de.tokens_per_block = [16, 32]
    p_ids, d_ids = [[2, 3], [30, 31, 32, 33]], [[20, 21, 22, 23], [7, 8]]
    plan = plan_for(de, pe, p_ids, 64, d_ids)
    expected = expected_pull(de.device_caches, de, d_ids, pe.device_caches, pe, p_ids, 64)
    replay(plan, de.device_caches, pe.device_caches)
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)


def test_zero_false_leaves_unread_pages_alone():
    pe, de = engines("one_group")
    plan = plan_for(de, pe, [[3]], 8, [[7, 8]])
    assert plan.zero_pages == ((8,),)
    before = clone_caches(de.device_caches)
    replay(plan, de.device_caches, pe.device_caches, zero=False)
    for name, t in de.device_caches.items():
        assert torch.equal(as_words(t[8]), as_words(before[name][8]))  # listed for zeroing, left alone
        assert torch.equal(as_words(t[7]), as_words(pe.device_caches[name][3]))


def test_replay_refuses_a_plan_that_reaches_outside_the_tensors():
    pe, de = engines("one_group")
    plan = plan_for(de, pe, [[3]], 8, [[7]])
    pair = dataclasses.replace(plan.pairs[0], remote_pages=(NP + 1,))
    with pytest.raises(ValueError, match="outside the tensor's storage"):
        replay(dataclasses.replace(plan, pairs=(pair,)), de.device_caches, pe.device_caches)
