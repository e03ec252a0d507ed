"""TransferManager end to end with real NIXL (UCX, DRAM): P and D managers in one process.

P's KV is random, D's is poisoned (random, another seed). After save / plan_pull / pull /
poll / complete, every byte of every D storage must equal the token-position
expectation (P's bytes at each group's read pages, zero in pages listed for zeroing,
D's poison everywhere else, KV-sharing and ungrouped layers included) and the byte
oracle's replay of the plan.
"""
import dataclasses
import pickle

import numpy as np
import pytest
import torch

from kvcopy.nixl import NO_BLOCK
from kvcopy.core.layout import as_words
from kvcopy.testing.nixl.engines import (
    allocate_blocks, collect_notifications, ManagerPairs, one_torch_thread, pull_and_complete, wait,
)
from kvcopy.testing.nixl.oracle import clone_caches, first_difference, same_bytes

NP = 48


@pytest.fixture
def pd():
    """make(case, p_tpb=None, d_tpb=None, buffer="host", num_pages=NP) -> (P, D, peer, P engine, D engine)."""
    with one_torch_thread(), ManagerPairs() as pairs:
        yield lambda case, p_tpb=None, d_tpb=None, buffer="host", num_pages=NP: pairs.make(
            case, num_pages, p_tpb, d_tpb, buffer)


def check(out):
    assert out.completion.ok and out.completion.failed_block_ids == tuple(() for _ in out.plan.read_pages)
    assert same_bytes(out.expected, out.replayed), first_difference(out.expected, out.replayed)
    assert not same_bytes(out.before, out.expected)  # the case moves bytes: it can fail


def check_result(out, d_caches):
    check(out)
    assert same_bytes(d_caches, out.expected), first_difference(d_caches, out.expected)


@pytest.mark.parametrize("buffer", ["host", "device"])
def test_one_group(pd, buffer):
    p, d, peer, pe, de = pd("one_group", buffer=buffer)
    p_ids, d_ids = [[3, 4, 9, 10]], [[20, 21, 5, 6, 7]]  # D reserved one page more than P filled
    p.save(p_ids)
    out = pull_and_complete(d, peer, de, d_ids, pe.device_caches, pe, p_ids, 60)
    assert out.plan.zero_pages == ((7,),)
    check_result(out, de.device_caches)


@pytest.mark.parametrize("buffer", ["host", "device"])
def test_hybrid_groups_with_aliasing_and_kv_sharing(pd, buffer):
    """The layout in which vLLM's host-buffer sync overwrote received KV: l0/l1 share a
    tensor across groups, l2..l5 view one pool, l6 is l2's tensor in no group, l7 is in
    no group: each group lands at its own pages only."""
    p, d, peer, pe, de = pd("hybrid", buffer=buffer)
    rng = np.random.default_rng(0)
    p_ids = allocate_blocks(rng, pe, [3, 6], set(), NP)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    p_ids[1][:2] = [NO_BLOCK, NO_BLOCK]  # sliding window: the first 32 tokens are gone
    d_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    poison_l7 = de.device_caches["l7"].clone()
    p.save(p_ids)
    out = pull_and_complete(d, peer, de, d_ids, pe.device_caches, pe, p_ids, 90)
    check_result(out, de.device_caches)
    assert torch.equal(as_words(de.device_caches["l7"]), as_words(poison_l7))  # in no group: untouched


def test_seeds3_geometry(pd):
    p, d, peer, pe, de = pd("seeds3", p_tpb=[128], d_tpb=[64])
    p_ids, d_ids = [[5, 9]], [[20, 21, 22]]
    p.save(p_ids)
    out = pull_and_complete(d, peer, de, d_ids, pe.device_caches, pe, p_ids, 160)
    assert out.plan.pairs[0].remote_pages == (10, 11, 18)
    check_result(out, de.device_caches)


@pytest.mark.parametrize("cached", [32, 48, 64])
def test_prefix_hits_skip_cached_pages(pd, cached):
    p, d, peer, pe, de = pd("hybrid")
    p_ids, d_ids = [[1, 2, 3], [10, 11, 12, 13, 14, 15]], [[20, 21, 22], [4, 5, 6, 7, 8, 9]]
    p.save(p_ids)
    out = pull_and_complete(d, peer, de, d_ids, pe.device_caches, pe, p_ids, 90, num_cached_tokens=cached)
    check_result(out, de.device_caches)
    first_g1 = cached // 16
    assert out.plan.read_pages[1] == tuple(d_ids[1][first_g1:])
    assert all(p_ not in out.plan.read_pages[0] for p_ in range(40, 40 + (cached // 16)))


def test_many_requests_in_flight_complete_in_any_order(pd):
    p, d, peer, pe, de = pd("hybrid", num_pages=256)
    rng = np.random.default_rng(7)
    p_used, d_used, reqs = set(), set(), []
    for _ in range(12):
        n = int(rng.integers(1, 97))
        g0, g1 = -(-n // 32), -(-n // 16)
        p_ids = allocate_blocks(rng, pe, [g0, g1], p_used, 256)
        d_ids = allocate_blocks(rng, de, [g0, g1], d_used, 256)
        reqs.append((p_ids, d_ids, n, int(rng.integers(0, 2)) * 16 * int(rng.integers(0, 3))))
    p.save([sum((r[0][g] for r in reqs), []) for g in range(2)])  # one save for every request
    before = clone_caches(de.device_caches)
    handles = []
    for i, (p_ids, d_ids, n, cached) in enumerate(reqs):
        plan = d.plan_pull(peer, p_ids, n, d_ids, cached)
        handles.append(d.pull(plan, notify=f"req-{i}".encode()))
    assert d.stats()["in_flight"] <= len(reqs)
    unchecked = []
    for h in reversed(handles):
        assert wait(d, h) == "DONE"
        done = d.complete(h)
        assert done.ok and (done.checked or done.unchecked)
        unchecked += [done.unchecked] if done.unchecked else []
    from kvcopy.testing.nixl.engines import expected_pull

    expected = before
    for p_ids, d_ids, n, cached in reqs:
        expected = expected_pull(expected, de, d_ids, pe.device_caches, pe, p_ids, n, cached)
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
    assert set(unchecked) <= {"D reads no page of this request (all cached)"}  # host mode: pages compared
    assert d.stats() == {"in_flight": 0, "live_transfer_handles": 0, "abandoned_reads": 0, "peers": 1, "held_reads": 0,
                         "notifications_refused": 0, "checksum_checked": 12 - len(unchecked), "checksum_failed": 0,
                         "checksum_unchecked": len(unchecked), "checksum_pending": 0}
    got = collect_notifications(p, len(reqs))
    assert sorted(got) == sorted((d.name, f"req-{i}".encode()) for i in range(len(reqs)))


def test_nothing_to_read_is_done_at_once_and_still_notifies(pd):
    p, d, peer, pe, de = pd("one_group")
    before = clone_caches(de.device_caches)
    plan = d.plan_pull(peer, [[1, 2]], 32, [[5, 6]], num_cached_tokens=32)
    assert plan.empty and plan.read_pages == ((),)
    h = d.pull(plan, notify=b"cached")
    assert d.poll(h) == "DONE" and d.complete(h).ok
    assert same_bytes(before, de.device_caches)
    assert collect_notifications(p, 1) == [(d.name, b"cached")]


def test_api_misuse_raises(pd):
    p, d, peer, pe, de = pd("one_group")
    with pytest.raises(ValueError, match="one block id list per KV cache group"):
        p.save([[1], [2]])
    with pytest.raises(ValueError, match="out of range"):
        p.save([[NP]])
    with pytest.raises(ValueError, match="unknown peer"):
        d.plan_pull("nobody", [[1]], 16, [[2]])
    plan = d.plan_pull(peer, [[1]], 16, [[2]])
    with pytest.raises(TypeError, match="notify must be bytes"):
        d.pull(plan, notify="text")
    p.save([[1]])  # (a page P never saved has no page sum: its pull would fail)
    h = d.pull(plan)
    wait(d, h)
    assert d.complete(h).ok
    with pytest.raises(ValueError, match="already completed"):
        d.complete(h)
    d.close()
    with pytest.raises(ValueError, match="closed"):
        d.plan_pull(peer, [[1]], 16, [[2]])


def edited_plans(plan, pe):
    """Plans a caller could build from a genuine one with other pages (old code: each
    made ``complete`` zero or copy wrong pages with ok=True, or raise IndexError after
    the READ)."""
    pair = plan.pairs[0]
    rp = dataclasses.replace
    return {
        "negative local page": rp(plan, pairs=(rp(pair, local_pages=(-1,) + pair.local_pages[1:]),) + plan.pairs[1:]),
        "out-of-range remote page": rp(plan, pairs=(rp(pair, remote_pages=(10**6,) + pair.remote_pages[1:]),)
                                       + plan.pairs[1:]),
        "page no pair reads": rp(plan, read_pages=((plan.read_pages[0][0] + 1,) + plan.read_pages[0][1:],)),
        "out-of-range zero page": rp(plan, zero_pages=((NP + 3,),)),
        "copied plan": rp(plan),
    }


def test_edited_or_foreign_plans_and_handles_are_refused_before_anything_moves(pd):
    p, d, peer, pe, de = pd("one_group")
    p2, d2, peer2, _, de2 = pd("one_group")
    p.save([[1, 2, 3]])
    plan = d.plan_pull(peer, [[1, 2, 3]], 40, [[10, 11, 12, 13]])
    assert plan.zero_pages == ((13,),)
    before, host_before = clone_caches(de.device_caches), clone_caches(d.regions.host_views)
    for _, bad in edited_plans(plan, pe).items():
        with pytest.raises(ValueError, match="not a plan made by"):
            d.pull(bad)
    with pytest.raises(ValueError, match="not a plan made by"):
        d2.pull(plan)  # another manager's plan
    with pytest.raises(ValueError, match="not a plan made by"):
        d.pull(pickle.loads(pickle.dumps(plan)))  # a plan that crossed a process boundary
    assert same_bytes(before, de.device_caches) and same_bytes(host_before, d.regions.host_views)
    assert d.stats()["in_flight"] == 0

    h = d.pull(plan)
    for call in (d2.poll, d2.abort, d2.complete):  # a handle completed on another manager
        with pytest.raises(ValueError, match="is not a pull of"):
            call(h)
    assert wait(d, h) == "DONE"
    # the manager completes its own record of the pull, whatever the handle shows
    shown = h._view
    object.__setattr__(h, "_view", None)
    assert d.complete(h).ok
    object.__setattr__(h, "_view", shown)
    assert not same_bytes(before, de.device_caches)
    assert d2.stats()["in_flight"] == 0 and same_bytes(clone_caches(de2.device_caches), de2.device_caches)


def test_a_plan_for_a_peer_removed_or_re_added_since_is_refused(pd):
    p, d, peer, pe, de = pd("one_group")
    p.save([[1]])
    plan = d.plan_pull(peer, [[1]], 16, [[2]])
    d.remove_peer(peer)
    with pytest.raises(ValueError, match="removed or re-added"):
        d.pull(plan)
    d.add_peer(p.metadata())
    with pytest.raises(ValueError, match="removed or re-added"):
        d.pull(plan)
    h = d.pull(d.plan_pull(peer, [[1]], 16, [[2]]))
    assert wait(d, h) == "DONE" and d.complete(h).ok
