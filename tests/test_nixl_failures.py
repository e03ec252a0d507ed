"""Failures with real NIXL: a closed peer, descriptors NIXL rejects, aborts; no handle leaks.

A failed request reports its local block ids, leaves every byte of D's caches as it
was (compared against a snapshot, bit-exactly), releases its NIXL handle, and leaves
the other requests in flight alone.
"""
import dataclasses
import itertools

import numpy as np
import pytest

from kvcopy.nixl.testing import (
    allocate_blocks, build_case, clone_caches, expected_pull, fill_random, first_difference,
    ManagerPairs, one_torch_thread, same_bytes, wait,
)

NP = 192
_names = itertools.count()


@pytest.fixture
def pd():
    """make() -> (P, D, peer, P engine, D engine), hybrid case."""
    with one_torch_thread(), ManagerPairs() as pairs:
        yield lambda: pairs.make("hybrid", NP, seeds=(11, 12))


def requests(rng, pe, de, count):
    """``count`` disjoint random hybrid requests: (P ids, D ids, tokens)."""
    p_used, d_used, out = set(), set(), []
    for _ in range(count):
        n = int(rng.integers(1, 65))
        counts = [-(-n // 32), -(-n // 16)]
        out.append((allocate_blocks(rng, pe, counts, p_used, NP), allocate_blocks(rng, de, counts, d_used, NP), n))
    return out


def stale_peer(pd_make, d):
    """A live peer whose NIXL metadata D's agent no longer holds (as after the peer
    invalidates or re-registers it): the descriptors prepared at add_peer are stale
    and NIXL rejects every transfer made from them."""
    eng = build_case("hybrid", NP)
    fill_random(eng.device_caches, 14)
    p = eng.manager(f"Pstale{next(_names)}")
    name = d.add_peer(p.metadata())
    d._agent._agent.remove_remote_agent(name)
    return p, name


def assert_no_leak(d):
    assert d.stats()["in_flight"] == 0 and d.stats()["live_transfer_handles"] == 0
    assert not d._agent._agent._leaked_xfer_handles


def test_peer_closed_before_the_pull_fails_the_request_and_writes_nothing(pd):
    p, d, peer, pe, de = pd()
    (p_ids, d_ids, n), = requests(np.random.default_rng(1), pe, de, 1)
    p.save(p_ids)
    plan = d.plan_pull(peer, p_ids, n, d_ids)
    p.close()
    before = clone_caches(de.device_caches)
    h = d.pull(plan, notify=b"gone")
    assert wait(d, h) == "ERR" and h.error
    done = d.complete(h)
    assert not done.ok and done.failed_block_ids == plan.local_block_ids
    assert all(len(ids) for ids in done.failed_block_ids)
    assert same_bytes(before, de.device_caches), first_difference(before, de.device_caches)
    assert_no_leak(d)


def test_peer_closed_mid_flight(pd):
    """Pulls posted before P closes finish DONE (exact) or ERR (untouched); pulls
    posted after fail; nothing leaks."""
    p, d, peer, pe, de = pd()
    reqs = requests(np.random.default_rng(2), pe, de, 8)
    p.save([sum((r[0][g] for r in reqs), []) for g in range(2)])
    p_caches = clone_caches(pe.device_caches)
    before = clone_caches(de.device_caches)
    handles = [d.pull(d.plan_pull(peer, p_ids, n, d_ids)) for p_ids, d_ids, n in reqs[:6]]
    p.close()
    handles += [d.pull(d.plan_pull(peer, p_ids, n, d_ids)) for p_ids, d_ids, n in reqs[6:]]
    expected = before
    states = []
    for h, (p_ids, d_ids, n) in zip(handles, reqs):
        states.append(wait(d, h))
        done = d.complete(h)
        assert done.ok == (states[-1] == "DONE")
        if done.ok:
            expected = expected_pull(expected, de, d_ids, p_caches, pe, p_ids, n)
        else:
            assert done.failed_block_ids == h.plan.local_block_ids
    assert states[6:] == ["ERR", "ERR"]
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
    assert_no_leak(d)


def test_tampered_plan_is_refused_before_anything_moves(pd):
    """A page past its region is still inside NIXL's descriptor list (the next region):
    pull refuses it rather than read the wrong bytes."""
    p, d, peer, pe, de = pd()
    (p1, d1, n1), = requests(np.random.default_rng(3), pe, de, 1)
    plan = d.plan_pull(peer, p1, n1, d1)
    pair = plan.pairs[0]
    bad = dataclasses.replace(pair, remote_pages=(pair.remote.num_pages + 5,) + pair.remote_pages[1:])
    before = clone_caches(de.device_caches)
    with pytest.raises(ValueError, match="out of range"):
        d.pull(dataclasses.replace(plan, pairs=(bad,) + plan.pairs[1:]))
    assert same_bytes(before, de.device_caches)
    assert_no_leak(d)


def test_rejected_descriptors_fail_only_their_request(pd):
    p, d, peer, pe, de = pd()
    stale, stale_name = stale_peer(pd, d)
    (p1, d1, n1), (p2, d2, n2) = requests(np.random.default_rng(3), pe, de, 2)
    p.save(p1)
    stale.save(p2)
    before = clone_caches(de.device_caches)
    good = d.pull(d.plan_pull(peer, p1, n1, d1), notify=b"good")
    bad = d.pull(d.plan_pull(stale_name, p2, n2, d2), notify=b"bad")
    assert wait(d, bad) == "ERR" and "NIXL rejected" in bad.error
    assert wait(d, good) == "DONE"
    assert not d.complete(bad).ok and d.complete(good).ok
    expected = expected_pull(before, de, d1, pe.device_caches, pe, p1, n1)
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
    assert_no_leak(d)
    stale.close()


def test_abort_and_remove_peer_fail_what_is_in_flight(pd):
    p, d, peer, pe, de = pd()
    (p1, d1, n1), (p2, d2, n2) = requests(np.random.default_rng(4), pe, de, 2)
    p.save([p1[g] + p2[g] for g in range(2)])
    before = clone_caches(de.device_caches)
    h1 = d.pull(d.plan_pull(peer, p1, n1, d1))
    d.abort(h1)
    h2 = d.pull(d.plan_pull(peer, p2, n2, d2))
    d.remove_peer(peer)
    expected = before
    for h, (p_ids, d_ids, n) in ((h1, (p1, d1, n1)), (h2, (p2, d2, n2))):
        # a transfer can finish before the abort reaches it; then it is DONE and exact
        if d.complete(h).ok:
            expected = expected_pull(expected, de, d_ids, pe.device_caches, pe, p_ids, n)
        else:
            assert h.error in ("aborted", f"peer {peer!r} was removed")
    assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
    assert d.peers() == []
    assert_no_leak(d)


def run_transfers(pd, total, batch=20, seed=5):
    """``total`` pulls in batches in flight: good ones, ones NIXL rejects (stale
    descriptors), and pulls from a peer that closed. Every request is checked; nothing may leak."""
    p, d, peer, pe, de = pd()
    gone_eng = build_case("hybrid", NP)
    fill_random(gone_eng.device_caches, 13)
    gone = gone_eng.manager(f"Pgone{next(_names)}")
    gone_peer = d.add_peer(gone.metadata())
    gone.close()
    stale, stale_name = stale_peer(pd, d)
    rng = np.random.default_rng(seed)
    counts = {"DONE": 0, "ERR": 0}
    done_so_far = 0
    while done_so_far < total:
        reqs = requests(rng, pe, de, min(batch, total - done_so_far))
        p.save([sum((r[0][g] for r in reqs), []) for g in range(2)])
        before = clone_caches(de.device_caches)
        handles = []
        for i, (p_ids, d_ids, n) in enumerate(reqs):
            kind = i % 5
            if kind == 3:
                plan = d.plan_pull(stale_name, p_ids, n, d_ids)
            elif kind == 4:
                plan = d.plan_pull(gone_peer, p_ids, n, d_ids)
            else:
                plan = d.plan_pull(peer, p_ids, n, d_ids)
            handles.append((kind, d.pull(plan, notify=b"%d" % i)))
        expected = before
        for (kind, h), (p_ids, d_ids, n) in zip(handles, reqs):
            state = wait(d, h)
            counts[state] += 1
            assert state == ("DONE" if kind < 3 else "ERR"), h
            done = d.complete(h)
            if done.ok:
                expected = expected_pull(expected, de, d_ids, pe.device_caches, pe, p_ids, n)
            else:
                assert done.failed_block_ids == h.plan.local_block_ids
        assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
        assert_no_leak(d)
        done_so_far += len(reqs)
        p.notifications()  # drain
    assert counts["DONE"] + counts["ERR"] == total and counts["ERR"] >= total * 2 // 5 - 2
    stale.close()
    return counts


def test_a_thousand_transfers_with_failures_leak_no_handle(pd):
    run_transfers(pd, 1000)


@pytest.mark.slow
def test_ten_thousand_transfers_with_failures_leak_no_handle(pd):
    run_transfers(pd, 10000, batch=20, seed=6)
