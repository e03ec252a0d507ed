"""Failures with real NIXL: a closed peer, descriptors NIXL rejects, aborts; no handle leaks.

A failed request reports its local block ids, leaves every byte of D's caches as it
was (compared against a snapshot, bit-exactly), releases its NIXL handle, and leaves
the other requests in flight alone.
"""
import dataclasses
import itertools
import os
import signal
import time

import numpy as np
import pytest

from kvcopy.testing.nixl.engines import (
    allocate_blocks, build_case, expected_pull, ManagerPairs, one_torch_thread, PrefillProcess, wait,
)
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes
from kvcopy.testing.nixl.stopped_peer import stop_process, tcp_loopback

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


def until_d_knows_peer_is_gone(d, peer, probe, expected, de, p_caches, pe, timeout=30.0):
    """Pull ``probe`` (P ids, D ids, tokens) until it fails; returns D's expected caches.

    Closing P does not happen-before anything on D: NIXL tells D's agent that P's agent
    is gone by a message D's progress thread handles some time later. A READ posted
    before that message is handled still reaches P's memory, which in one process is
    still mapped and holds the saved bytes, so it can finish DONE with exact bytes.
    This waits for the message (``timeout`` is a hang guard): a probe that finishes
    DONE is checked like any pull, and from the first failed probe on, D knows.
    """
    p_ids, d_ids, n = probe
    deadline = time.monotonic() + timeout
    while True:
        h = d.pull(d.plan_pull(peer, p_ids, n, d_ids))
        state = wait(d, h)
        done = d.complete(h)
        if not done.ok:
            assert state == "ERR" and done.failed_block_ids == h.plan.local_block_ids
            return expected
        expected = expected_pull(expected, de, d_ids, p_caches, pe, p_ids, n)
        assert time.monotonic() < deadline, "D's agent never heard that P closed"


def test_peer_closed_before_the_pull_fails_the_request_and_writes_nothing(pd):
    """Once D's agent has heard that P closed (see until_d_knows_peer_is_gone)."""
    p, d, peer, pe, de = pd()
    (p_ids, d_ids, n), probe = requests(np.random.default_rng(1), pe, de, 2)
    p.save([p_ids[g] + probe[0][g] for g in range(2)])
    p_caches = clone_caches(pe.device_caches)
    plan = d.plan_pull(peer, p_ids, n, d_ids)
    p.close()
    before = until_d_knows_peer_is_gone(d, peer, probe, clone_caches(de.device_caches), de, p_caches, pe)
    h = d.pull(plan, notify=b"gone")
    assert wait(d, h) == "ERR" and h.error
    done = d.complete(h)
    assert not done.ok and done.failed_block_ids == plan.local_block_ids
    assert all(len(ids) for ids in done.failed_block_ids)
    assert same_bytes(before, de.device_caches), first_difference(before, de.device_caches)
    assert_no_leak(d)
    assert "NIXL_ERR_REMOTE_DISCONNECT" in h.error and d._agent.connection_failed(peer)
    d.remove_peer(peer)  # a failed connection is unloaded, not parked: add_peer would connect anew
    assert peer not in d._agent.parked and not d._agent.has_remote(peer)


def test_peer_closed_mid_flight(pd):
    """Pulls posted around P's close finish DONE (exact) or ERR (untouched); once D's
    agent has heard that P closed, every pull fails; nothing leaks.

    A pull posted right after ``close`` may still finish DONE (see
    :func:`until_d_knows_peer_is_gone`): this test asserted it always failed, which
    held only when D's progress thread won the race (it lost about 1 run in 4)."""
    p, d, peer, pe, de = pd()
    reqs = requests(np.random.default_rng(2), pe, de, 11)
    p.save([sum((r[0][g] for r in reqs), []) for g in range(2)])
    p_caches = clone_caches(pe.device_caches)
    before = clone_caches(de.device_caches)
    handles = [d.pull(d.plan_pull(peer, p_ids, n, d_ids)) for p_ids, d_ids, n in reqs[:6]]
    p.close()
    handles += [d.pull(d.plan_pull(peer, p_ids, n, d_ids)) for p_ids, d_ids, n in reqs[6:8]]
    expected = before
    for h, (p_ids, d_ids, n) in zip(handles, reqs):
        state = wait(d, h)
        done = d.complete(h)
        assert done.ok == (state == "DONE")
        if done.ok:
            expected = expected_pull(expected, de, d_ids, p_caches, pe, p_ids, n)
        else:
            assert done.failed_block_ids == h.plan.local_block_ids
    expected = until_d_knows_peer_is_gone(d, peer, reqs[8], expected, de, p_caches, pe)
    late = [d.pull(d.plan_pull(peer, p_ids, n, d_ids)) for p_ids, d_ids, n in reqs[9:]]
    assert [wait(d, h) for h in late] == ["ERR", "ERR"]
    for h in late:
        done = d.complete(h)
        assert not done.ok and done.failed_block_ids == h.plan.local_block_ids
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
    with pytest.raises(ValueError, match="not a plan made by"):
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


# ---------------------------------------------------------------- a stopped peer (two processes)
@pytest.fixture
def stopped_prefill():
    """start(**manager kwargs) -> (D, peer, D engine), ``D.stopped_pid`` P's pid. P runs
    in a spawned child that saved blocks 1-8 and was then stopped (SIGSTOP, every
    thread) before D's first READ, so the READ waits on a peer that never answers: UCX
    on TCP over loopback (with shared memory D could read a stopped P). P is continued
    and stopped at teardown."""
    with tcp_loopback():
        yield from _stopped_prefill()


def _stopped_prefill():
    proc = PrefillProcess()
    made = []

    def start(**kw):
        n = next(_names)
        metadata, _ = proc.call("start", "one_group", 64, None, 300 + n, f"Pstopped{n}")
        proc.call("save", [list(range(1, 9))])
        de = build_case("one_group", 64)
        fill_random(de.device_caches, 400 + n)
        d = de.manager(f"Dstopped{n}", **kw)
        made.append(d)
        peer = d.add_peer(metadata)
        stop_process(proc.process.pid)
        d.stopped_pid = proc.process.pid
        return d, peer, de

    with one_torch_thread():
        try:
            yield start
        finally:
            os.kill(proc.process.pid, signal.SIGCONT)
            for d in made:
                d.close()
            proc.stop()


def only_pages_changed(before, after, pages):
    """``before`` with ``after``'s bytes at ``pages`` (block axis 0): what ``after`` must
    equal if nothing outside those pages changed."""
    out = clone_caches(before)
    for name, t in out.items():
        t[list(pages)] = after[name][list(pages)]
    return out


def host_bytes(d):
    return {n: t.clone() for n, t in d.regions.host_views.items()}


@pytest.mark.parametrize("where", ["pull", "manager"])
def test_a_stopped_peer_fails_the_pull_at_its_deadline_and_nothing_is_written(stopped_prefill, where):
    """P alive but not answering: the pull is ERR at the first poll past its deadline
    (per pull, or the manager's default), its transfer is released, it completes as a
    failure (the request's block ids), and D's KV does not change, also after P runs
    again; its host buffers change at most in the request's own pages."""
    d, peer, de = stopped_prefill(**({"pull_timeout_s": 0.3} if where == "manager" else {}))
    before, host_before = clone_caches(de.device_caches), host_bytes(d)
    plan = d.plan_pull(peer, [[1, 2, 3, 4]], 64, [[20, 21, 22, 23]])
    start = time.monotonic()
    h = d.pull(plan, notify=b"late", **({"timeout_s": 0.3} if where == "pull" else {}))
    assert h.timeout_s == 0.3
    state = wait(d, h, timeout=30)
    assert state == "ERR" and "deadline" in h.error, h
    assert time.monotonic() - start >= 0.3
    done = d.complete(h)
    assert not done.ok and done.failed_block_ids == ((20, 21, 22, 23),) and "deadline" in done.error
    assert done.written_in == "host buffers" and done.written_pages == plan.read_pages == ((20, 21, 22, 23),)
    assert_no_leak(d)
    assert same_bytes(before, de.device_caches), first_difference(before, de.device_caches)
    os.kill(d.stopped_pid, signal.SIGCONT)
    time.sleep(0.5)  # the released READ lands when P runs again (UCX did not drop it)
    assert same_bytes(before, de.device_caches), first_difference(before, de.device_caches)
    only = only_pages_changed(host_before, host_bytes(d), done.written_pages[0])
    assert same_bytes(only, host_bytes(d)), first_difference(only, host_bytes(d))


def test_device_mode_failed_pull_writes_only_its_own_destination_pages(stopped_prefill):
    """buffer="device": NIXL reads into D's KV tensors, so a failed pull may leave
    bytes in that request's destination pages, and Completion says which; no other
    byte of D's KV changes (a second request's pages, already completed, included)."""
    d, peer, de = stopped_prefill(buffer="device", pull_timeout_s=0.3)
    before = clone_caches(de.device_caches)
    plan = d.plan_pull(peer, [[1, 2, 3]], 40, [[30, 31, 32, 33]])  # page 33: zeroed by complete only
    h = d.pull(plan)
    assert wait(d, h, timeout=30) == "ERR" and "deadline" in h.error
    done = d.complete(h)
    assert not done.ok and done.written_in == "device caches" and done.written_pages == ((30, 31, 32),)
    only = only_pages_changed(before, de.device_caches, done.written_pages[0])
    assert same_bytes(only, de.device_caches), first_difference(only, de.device_caches)  # page 33 not zeroed
    os.kill(d.stopped_pid, signal.SIGCONT)
    time.sleep(0.5)
    after = clone_caches(de.device_caches)
    only = only_pages_changed(before, after, done.written_pages[0])
    assert same_bytes(only, after), first_difference(only, after)


def test_a_pull_without_deadline_stays_in_flight_and_a_bad_deadline_is_refused(stopped_prefill):
    d, peer, de = stopped_prefill()
    plan = d.plan_pull(peer, [[1, 2]], 32, [[30, 31]])
    for bad, kind in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                      ("1", TypeError), (True, TypeError)):
        with pytest.raises(kind, match="timeout_s"):
            d.pull(plan, timeout_s=bad)
    assert d.stats()["in_flight"] == 0
    h = d.pull(plan)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        assert d.poll(h) == "PROC"
    d.abort(h)
    assert not d.complete(h).ok
    assert_no_leak(d)
