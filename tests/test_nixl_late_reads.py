"""READs given up on that land later (kvcopy.nixl.late_reads), over real NIXL on UCX's
TCP transport on loopback, P in a second process stopped with SIGSTOP.

P1 (a spawned child) stages request A, then is stopped; D's pull of A is posted and
fails at its deadline. The READ was released by nothing: D keeps its handle, and what
it may write stays held, until NIXL reports it ended, which happens when P1 is continued
(the READ lands then). Meanwhile D serves request B from a healthy P2 (in this process):

* arena mode: B never gets A's span (it did once A's quarantine timer ran out, and
  ``complete(B)`` returned ok=True with A's bytes in B's pages);
* host and device mode: a pull into A's pages is refused (:class:`PagesHeld`) until the
  READ ended, then accepted and exact.

D's KV is compared whole, bit for bit, against the expectation (its other bytes
unchanged). ``-m slow`` repeats each case 20 times.
"""
import os
import signal
import time
import weakref

import pytest

from kvcopy.nixl import PagesHeld
from kvcopy.testing.nixl.engines import (
    PrefillProcess, build_case, clone_caches, expected_pull, fill_random, first_difference, from_wire,
    one_torch_thread, same_bytes, wait,
)

NP = 48
DEADLINE_S = 0.5
A_P, A_D = [[1, 2, 3]], [[10, 11, 12]]  # request A: P1's blocks, D's blocks
B_P = [[4, 5, 6]]  # request B: P2's blocks
N = 40  # tokens of each request: 3 blocks of 16


@pytest.fixture
def tcp(monkeypatch):
    """UCX on TCP over loopback only, for this process's new agents and the children
    it spawns (UCX reads these when a NIXL agent creates its UCX context)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return "T"


class Rig:
    """P1 stopped mid-READ in a child, P2 and D here (one buffer mode for all three)."""

    _serial = 0

    def __init__(self, buffer: str):
        Rig._serial += 1
        tag = f"{os.getpid()}-{Rig._serial}"
        kw = {"buffer": buffer}
        if buffer == "arena":
            kw.update(arena_bytes=1 << 20, arena_ttl_s=DEADLINE_S)  # P's TTL: as short as D's deadline
        self.buffer = buffer
        self.proc = PrefillProcess()
        self.made = []
        metadata, wire = self.proc.call("start", "one_group", NP, None, 5, f"P1-{tag}", kw)
        self.p1_caches = from_wire(wire)
        self.pe = build_case("one_group", NP)
        self.p2e = build_case("one_group", NP)
        fill_random(self.p2e.device_caches, 7)
        self.de = build_case("one_group", NP)
        fill_random(self.de.device_caches, 9)
        self.p2 = self._made(self.p2e.manager(f"P2-{tag}", **kw))
        self.d = self._made(self.de.manager(f"D-{tag}", pull_timeout_s=DEADLINE_S, **kw))
        self.peer1 = self.d.add_peer(metadata)
        self.peer2 = self.d.add_peer(self.p2.metadata())
        if buffer == "arena":
            (self.a_remote,) = self.proc.call("save_arena", A_P, N, "A")[0]
            self.b_remote = self.p2.save(B_P, num_tokens=N, request_id="B")
        else:
            self.proc.call("save", A_P)
            self.p2.save(B_P)
            self.a_remote, self.b_remote = A_P, B_P
        self.stopped = False

    def _made(self, m):
        self.made.append(m)
        return m

    def stop_p1(self):
        """SIGSTOP P1 and wait until every thread of it is stopped (delivery is
        asynchronous: a READ posted before that could still be answered)."""
        pid = self.proc.process.pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped = True
        end = time.monotonic() + 30  # hang guard only
        while not all(_thread_state(pid, t) == "T" for t in os.listdir(f"/proc/{pid}/task")):
            assert time.monotonic() < end, "P1 did not stop"
            time.sleep(0.001)

    def continue_p1(self):
        if self.stopped:
            os.kill(self.proc.process.pid, signal.SIGCONT)
            self.stopped = False

    def fail_a(self):
        """P1 stopped, D's pull of A posted; it fails at its deadline. -> (plan, completion)."""
        self.stop_p1()
        plan = self.d.plan_pull(self.peer1, self.a_remote, N, A_D)
        h = self.d.pull(plan, notify=b"A")
        assert wait(self.d, h, 30) == "ERR" and "deadline" in h.error, h
        return plan, self.d.complete(h)

    def wait_landed(self, timeout: float = 60.0):
        """P1 runs again: A's READ ends (lands), and D sees it at a stats() call."""
        self.continue_p1()
        end = time.monotonic() + timeout  # hang guard only
        while self.d.stats()["abandoned_reads"]:
            assert time.monotonic() < end, "the READ given up on never ended"
            time.sleep(0.01)

    def pull_b(self, d_ids):
        """B from P2 into ``d_ids``, completed; D's caches compared whole."""
        before = clone_caches(self.de.device_caches)
        h = self.d.pull(self.d.plan_pull(self.peer2, self.b_remote, N, d_ids), notify=b"B")
        assert wait(self.d, h, 30) == "DONE", h
        return before, h

    def check_b(self, before, h, d_ids):
        done = self.d.complete(h)
        want = expected_pull(before, self.de, d_ids, self.p2e.device_caches, self.p2e, B_P, N)
        assert done.ok, done.error
        assert not same_bytes(before, want)  # the request moves bytes: the check can fail
        assert same_bytes(self.de.device_caches, want), first_difference(self.de.device_caches, want)

    def close(self):
        self.continue_p1()
        for m in reversed(self.made):
            m.close()
        self.proc.stop()


@pytest.fixture
def rig(tcp):
    made = []

    def make(buffer):
        made.append(Rig(buffer))
        return made[-1]

    with one_torch_thread():
        try:
            yield make
        finally:
            for r in made:
                r.close()


def arena_case(rig):
    r = rig("arena")
    before_a = clone_caches(r.de.device_caches)
    plan_a, done = r.fail_a()
    assert not done.ok and done.read_pending and done.failed_block_ids == tuple(map(tuple, A_D))
    assert same_bytes(before_a, r.de.device_caches)  # nothing written to D's KV
    st = r.d.stats()
    assert (st["abandoned_reads"], st["held_spans"], st["in_flight"]) == (1, 1, 0), st
    assert st["held_bytes"] == plan_a.span.nbytes
    time.sleep(DEADLINE_S * 1.2)  # past what the quarantine timer was
    before, hb = r.pull_b(A_D)
    span_b = hb.plan.span
    assert span_b.offset != plan_a.span.offset  # A's span is still held
    r.wait_landed()  # A's READ lands in A's span, which nobody else has
    r.check_b(before, hb, A_D)
    st = r.d.stats()
    assert (st["abandoned_reads"], st["held_spans"], st["spans"], st["bytes_in_use"]) == (0, 0, 0, 0), st


def paged_case(rig, buffer):
    r = rig(buffer)
    before_a = clone_caches(r.de.device_caches)
    _, done = r.fail_a()
    assert not done.ok and done.read_pending and done.written_pages == ((10, 11, 12),)
    assert r.d.held_blocks() == tuple(map(tuple, A_D))
    if buffer == "host":
        assert same_bytes(before_a, r.de.device_caches)
    held = r.d.plan_pull(r.peer2, B_P, N, A_D)
    with pytest.raises(PagesHeld, match=r"pull\(s\) \[0\]") as err:
        r.d.pull(held, notify=b"B")
    assert err.value.held == ((10, 11, 12),) and err.value.pulls == (0,)
    assert r.d.stats()["in_flight"] == 0  # nothing was posted
    before, hb = r.pull_b([[20, 21, 22]])  # other blocks: no conflict
    r.check_b(before, hb, [[20, 21, 22]])
    r.wait_landed()
    assert r.d.held_blocks() == ((),) and r.d.stats()["held_reads"] == 0
    before = clone_caches(r.de.device_caches)
    h = r.d.pull(held, notify=b"B")  # the plan refused before is still planned: pulled now
    assert wait(r.d, h, 30) == "DONE"
    r.check_b(before, h, A_D)


def test_a_late_read_never_lands_in_a_span_given_to_another_request(rig):
    arena_case(rig)


@pytest.mark.parametrize("buffer", ["host", "device"])
def test_a_pull_into_pages_a_late_read_may_write_is_refused_until_it_ended(rig, buffer):
    paged_case(rig, buffer)


@pytest.mark.slow
@pytest.mark.parametrize("rep", range(20))
@pytest.mark.parametrize("buffer", ["arena", "host", "device"])
def test_late_read_cases_repeated(rig, buffer, rep):
    if buffer == "arena":
        arena_case(rig)
    else:
        paged_case(rig, buffer)


@pytest.mark.parametrize("buffer", ["arena", "host"])
def test_close_with_a_read_that_may_land_destroys_the_agent_first(rig, buffer):
    """D closes while A's READ is given up on and P1 is stopped: the handles are
    released and the NIXL agent (its UCX worker) is destroyed before the memory could be
    freed (nothing is kept alive), also while the caller still holds A's plan and handle.
    (What P1's UCX does when it runs again and finds D gone is UCX's: docs/nixl.md.)"""
    from kvcopy.nixl import manager

    r = rig(buffer)
    plan, _ = r.fail_a()
    h = r.d.pull(r.d.plan_pull(r.peer1, r.a_remote, N, [[30, 31, 32]]), notify=b"A")  # in flight at close
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
    r.fail_a()
    holder = r.d._agent._agent  # the NIXL wrapper, kept past close
    kept = len(manager._KEPT_ALIVE)
    r.d.close()
    assert manager._KEPT_ALIVE[kept:] == [r.d.arena.buffer]
    del manager._KEPT_ALIVE[kept:], holder
