"""READs given up on that land later (kvcopy.nixl.late_reads), over real NIXL on UCX's
TCP transport on loopback, P in a second process stopped with SIGSTOP.

P1 (a spawned child) stages request A, then is stopped; D's pull of A is posted and
fails at its deadline. D does not release the READ: it keeps its handle, and what it may
write stays held, until NIXL reports it ended, which happens when P1 is continued (the
READ lands then). Meanwhile D serves request B from a healthy P2 (in this process):

* arena mode: B never gets A's span (it did once A's quarantine timer ran out, and
  ``complete(B)`` returned ok=True with A's bytes in B's pages);
* host and device mode: a pull into A's pages is refused (``PagesHeld``) until the
  READ ended, then accepted and exact.

D's KV is compared whole, bit for bit, against the expectation (its other bytes
unchanged). The rig and the cases: :mod:`kvcopy.testing.nixl.stopped_peer`. ``-m slow``
repeats each case 20 times. ``close`` with a READ held destroys the NIXL agent before
the memory could be freed. In one process (UCX's default transports): an aborted READ
holds D's span until it ended, and a reader that gives up notifies P once.
"""
import time
import weakref

import pytest

from kvcopy.testing.nixl.engines import ManagerPairs, collect_notifications, one_torch_thread
from kvcopy.testing.nixl.oracle import clone_caches, same_bytes
from kvcopy.testing.nixl.misuse import reader_gives_up_case
from kvcopy.testing.nixl.stopped_peer import N, Outcome, StoppedPeer, arena_case, paged_case, tcp_loopback


@pytest.fixture
def rig():
    made = []

    def make(buffer):
        made.append(StoppedPeer(buffer))
        return made[-1]

    with one_torch_thread(), tcp_loopback():
        try:
            yield make
        finally:
            for r in made:
                r.close()


def check(out):
    assert out.wrong_bytes == 0 and not out.problems, out


def test_a_late_read_never_lands_in_a_span_given_to_another_request(rig):
    check(arena_case(rig("arena")))


@pytest.mark.parametrize("buffer", ["host", "device"])
def test_a_pull_into_pages_a_late_read_may_write_is_refused_until_it_ended(rig, buffer):
    check(paged_case(rig(buffer)))


def test_a_save_into_mirror_pages_a_late_read_may_write_is_refused(rig):
    """A host-mode rank that is also a P: its save writes the mirror pages its own READ
    given up on may still write: refused while it may, nothing copied."""
    from kvcopy.nixl import PagesHeld

    r = rig("host")
    r.fail_a(Outcome())
    mirror = {n: t.clone() for n, t in r.d.regions.host_views.items()}
    with pytest.raises(PagesHeld, match="save would write"):
        r.d.save([[12, 40]])
    assert all(bool((mirror[n] == t).all()) for n, t in r.d.regions.host_views.items())
    r.d.save([[40, 41]])  # other pages: saved
    r.wait_ended()
    r.d.save([[12, 40]])


@pytest.mark.slow
@pytest.mark.parametrize("rep", range(20))
@pytest.mark.parametrize("buffer", ["arena", "host", "device"])
def test_late_read_cases_repeated(rig, buffer, rep):
    r = rig(buffer)
    check(arena_case(r) if buffer == "arena" else paged_case(r))


@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_reader_that_gives_up_notifies_once(how):
    """Reader 1 of 2 gives up after its READ landed, before polling it (abort, or close
    of D): P hears from it once (NIXL's notification of the READ used to come too, and
    P freed the span after one reader); reader 2 then gets the request's own bytes
    although P staged another request since (kvcopy.testing.nixl.misuse)."""
    with one_torch_thread():
        out = reader_gives_up_case(how)
    assert out.wrong_bytes == 0 and not out.problems, out


def test_abort_mid_flight_holds_d_span_until_the_read_ended():
    """An aborted READ may still land (its peer is alive): the pull fails at once, D's
    span stays D's until NIXL reports the READ ended, then it is free; the KV is
    untouched. (A READ that cannot end while held: tests/nixl/test_nixl_failures.py.)"""
    with one_torch_thread(), ManagerPairs() as pairs:
        _abort_mid_flight(*pairs.make("one_group", 48, buffer="arena", arena_bytes=1 << 20))


def _abort_mid_flight(p, d, peer, pe, de):
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="ab")
    before = clone_caches(de.device_caches)
    plan = d.plan_pull(peer, record, 40, [[10, 11, 12]], request_id="ab")
    h = d.pull(plan, notify=b"ab")
    d.abort(h)
    assert h.state == "ERR" and h.error == "aborted"
    done = d.complete(h)
    assert not done.ok and done.failed_block_ids == ((10, 11, 12),) and done.written_in is None
    assert same_bytes(de.device_caches, before)
    st = d.stats()
    assert st["live_transfer_handles"] == 0 and st["in_flight"] == 0
    assert st["held_spans"] == st["abandoned_reads"] <= int(done.read_pending)  # it may have ended since
    if st["held_spans"]:  # still D's: the next plan gets another span
        assert st["bytes_in_use"] == plan.span.nbytes
        again = d.plan_pull(peer, record, 40, [[10, 11, 12]], request_id="ab")
        assert again.span.offset != plan.span.offset
        d.discard(again)
    end = time.monotonic() + 30
    while d.stats()["abandoned_reads"] and time.monotonic() < end:  # the READ ends: P is alive
        time.sleep(0.01)
    st = d.stats()
    assert st["abandoned_reads"] == st["held_spans"] == st["bytes_in_use"] == st["spans"] == 0, st
    assert same_bytes(de.device_caches, before)
    assert collect_notifications(p, 1, 10) == [(d.name, b"ab")]


@pytest.mark.parametrize("buffer", ["arena", "host"])
def test_close_with_a_read_that_may_land_destroys_the_agent_first(rig, buffer):
    """D closes while A's READ is given up on and P1 is stopped: the handles are
    released and the NIXL agent (its UCX worker) is destroyed before the memory could be
    freed (nothing is kept alive), also while the caller still holds A's plan and handle.
    (What P1's UCX does when it runs again and finds D gone is UCX's: docs/nixl.md.)"""
    from kvcopy.nixl import manager

    r = rig(buffer)
    plan, _ = r.fail_a(Outcome())
    # in flight at close
    h = r.d.pull(r.d.plan_pull(r.peer1, r.a_remote, N, [[30, 31, 32]], request_id="A"), notify=b"A")
    assert r.d.stats()["abandoned_reads"] == 1 and h.state == "PROC"
    agent = weakref.ref(r.d._agent._agent.agent)
    kept = len(manager._KEPT_ALIVE)
    r.d.close()
    assert h.state == "ERR" and h.error == "manager closed"
    assert agent() is None  # the C++ agent and its worker are gone
    assert len(manager._KEPT_ALIVE) == kept
    assert not r.d.complete(h).ok  # completing after close writes nothing


def test_close_keeps_the_memory_when_the_agent_outlives_it(rig):
    """Where something else still holds the NIXL agent, close cannot show the worker
    gone: the registered memory a READ may still write is kept alive, not freed."""
    from kvcopy.nixl import manager

    r = rig("arena")
    r.fail_a(Outcome())
    holder = r.d._agent._agent  # the NIXL wrapper, kept past close
    kept = len(manager._KEPT_ALIVE)
    r.d.close()
    assert manager._KEPT_ALIVE[kept:] == [r.d.arena.buffer]
    del manager._KEPT_ALIVE[kept:], holder
