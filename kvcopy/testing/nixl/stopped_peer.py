"""A prefill engine stopped mid-READ, and the late-READ cases run on it.

:class:`StoppedPeer`: P1 in a spawned child process, P2 and D in this one, every NIXL
agent on UCX's TCP transport over loopback (:func:`tcp_loopback`: with shared memory,
two processes of one machine would not need P1 to answer). P1 stages (or saves)
request A and is stopped with ``SIGSTOP`` (every thread of it, checked in ``/proc``);
D's pull of A is posted and fails at its deadline; D then serves request B from P2;
P1 is continued and A's READ lands. The cases check what :mod:`kvcopy.nixl.late_reads`
promises: arena mode never hands A's held span to B, host and device mode refuse B's
pull into A's pages (``PagesHeld``) until NIXL reported A's READ ended, and D's KV is
compared whole, bit for bit, against the expectation. Each case returns an
:class:`Outcome` (what went wrong, and how many completions said ``ok=True`` with
wrong bytes) rather than asserting, so ``tests/nixl/test_nixl_late_reads.py`` asserts and
``bench/hardening_probe.py`` counts.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Dict, Iterator

from .engines import PrefillProcess, build_case, expected_pull, from_wire, wait
from .oracle import clone_caches, fill_random, first_difference, same_bytes
from .misuse import Outcome

TCP_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
NP = 48
DEADLINE_S = 0.5
A_P, A_D = [[1, 2, 3]], [[10, 11, 12]]  # request A: P1's blocks, D's blocks
B_P = [[4, 5, 6]]  # request B: P2's blocks
N = 40  # tokens of each request: 3 blocks of 16


@contextlib.contextmanager
def tcp_loopback() -> Iterator[None]:
    """UCX on TCP over loopback only, for the NIXL agents made inside and the children
    spawned inside (UCX reads these when an agent creates its UCX context)."""
    saved = {k: os.environ.get(k) for k in TCP_LOOPBACK}
    os.environ.update(TCP_LOOPBACK)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return "T"


def stop_process(pid: int, guard_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: delivery is
    asynchronous, and a READ posted before the peer's UCX progress thread stopped can
    still be answered (a test expecting the READ to hang then sees it DONE)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + guard_s  # hang guard only
    while not all(_thread_state(pid, t) == "T" for t in os.listdir(f"/proc/{pid}/task")):
        if time.monotonic() > end:
            raise TimeoutError(f"process {pid} did not stop")
        time.sleep(0.001)


class StoppedPeer:
    """P1 (a child), P2 and D (here), one buffer mode for all three (module docstring).
    Make it inside :func:`tcp_loopback`; ``close`` continues and stops P1."""

    _serial = 0

    def __init__(self, buffer: str):
        StoppedPeer._serial += 1
        tag = f"{os.getpid()}-{StoppedPeer._serial}"
        kw: Dict[str, object] = {"buffer": buffer}
        if buffer == "arena":
            kw.update(arena_bytes=1 << 20, arena_ttl_s=DEADLINE_S)  # P's TTL: as short as D's deadline
        self.buffer = buffer
        self.proc = PrefillProcess()
        self.stopped = False
        self.made: list = []
        try:
            metadata, wire = self.proc.call("start", "one_group", NP, None, 5, f"P1-{tag}", kw)
            self.p1_caches = from_wire(wire)
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
        except BaseException:
            self.close()
            raise

    def _made(self, m):
        self.made.append(m)
        return m

    def stop_p1(self, guard_s: float = 30.0) -> None:
        """SIGSTOP P1 and wait until every thread of it is stopped (delivery is
        asynchronous: a READ posted before that could still be answered)."""
        self.stopped = True
        stop_process(self.proc.process.pid, guard_s)

    def continue_p1(self) -> None:
        if self.stopped:
            os.kill(self.proc.process.pid, signal.SIGCONT)
            self.stopped = False

    def fail_a(self, out: Outcome):
        """P1 stopped, D's pull of A posted; it fails at its deadline. -> (plan, completion)."""
        self.stop_p1()
        plan = self.d.plan_pull(self.peer1, self.a_remote, N, A_D, request_id="A")
        h = self.d.pull(plan, notify=b"A")
        out.expect(wait(self.d, h, 30) == "ERR" and "deadline" in str(h.error), f"A did not fail at its deadline: {h}")
        return plan, self.d.complete(h)

    def wait_ended(self, guard_s: float = 60.0) -> None:
        """P1 runs again: A's READ ends (lands), and D sees it at a ``stats()`` call."""
        self.continue_p1()
        end = time.monotonic() + guard_s  # hang guard only
        while self.d.stats()["abandoned_reads"]:
            if time.monotonic() > end:
                raise TimeoutError("the READ given up on never ended")
            time.sleep(0.01)

    def pull_b(self, d_ids, out: Outcome, plan=None):
        """Post B from P2 into ``d_ids`` (or ``plan``) and wait for it -> (D's caches before, handle)."""
        before = clone_caches(self.de.device_caches)
        h = self.d.pull(plan or self.d.plan_pull(self.peer2, self.b_remote, N, d_ids, request_id="B"), notify=b"B")
        out.expect(wait(self.d, h, 30) == "DONE", f"B did not end DONE: {h}")
        return before, h

    def complete_b(self, before, h, d_ids, out: Outcome) -> None:
        """Complete B; D's caches must be exactly ``before`` with P2's B at ``d_ids``."""
        done = self.d.complete(h)
        want = expected_pull(before, self.de, d_ids, self.p2e.device_caches, self.p2e, B_P, N)
        exact = same_bytes(self.de.device_caches, want)
        if done.ok and not exact:
            out.wrong_bytes += 1
        out.expect(done.ok, f"B failed: {done.error}")
        out.expect(exact, f"D's KV after B: {first_difference(self.de.device_caches, want)}")

    def close(self) -> None:
        self.continue_p1()
        for m in reversed(self.made):
            m.close()
        self.made = []
        self.proc.stop()


def arena_case(rig: StoppedPeer) -> Outcome:
    """A's span stays held while A's READ may land; B gets another; both end clean."""
    out = Outcome()
    before_a = clone_caches(rig.de.device_caches)
    plan_a, done = rig.fail_a(out)
    out.expect(not done.ok and done.read_pending, f"A's completion: {done}")
    out.expect(same_bytes(before_a, rig.de.device_caches), "A's failure wrote D's KV")
    st = rig.d.stats()
    out.expect((st["abandoned_reads"], st["held_spans"], st["held_bytes"]) == (1, 1, plan_a.span.nbytes),
               f"A's READ not held: {st}")
    time.sleep(DEADLINE_S * 1.2)  # past P's TTL, and past what D's quarantine timer was
    before, hb = rig.pull_b(A_D, out)
    out.expect(hb.plan.span.offset != plan_a.span.offset, "B got A's held span")
    rig.wait_ended()  # A's READ lands in A's span, which nobody else has
    rig.complete_b(before, hb, A_D, out)
    st = rig.d.stats()
    out.expect((st["abandoned_reads"], st["held_spans"], st["spans"], st["bytes_in_use"]) == (0, 0, 0, 0),
               f"not everything freed: {st}")
    return out


def paged_case(rig: StoppedPeer) -> Outcome:
    """B's pull into A's pages is refused while A's READ may land, accepted after."""
    from ...nixl import PagesHeld

    out = Outcome()
    before_a = clone_caches(rig.de.device_caches)
    _, done = rig.fail_a(out)
    out.expect(not done.ok and done.read_pending and done.written_pages == tuple(map(tuple, A_D)),
               f"A's completion: {done}")
    out.expect(rig.d.held_blocks() == tuple(map(tuple, A_D)), f"held blocks: {rig.d.held_blocks()}")
    if rig.buffer == "host":
        out.expect(same_bytes(before_a, rig.de.device_caches), "A's failure wrote D's KV")
    held = rig.d.plan_pull(rig.peer2, rig.b_remote, N, A_D, request_id="B")
    try:
        rig.d.pull(held, notify=b"B")
        out.expect(False, "B's pull into A's pages was accepted while A's READ may land")
    except PagesHeld as exc:
        out.expect(exc.held == tuple(map(tuple, A_D)) and exc.pulls == (0,), f"PagesHeld names {exc.held}")
    out.expect(rig.d.stats()["in_flight"] == 0, "something was posted")
    before, hb = rig.pull_b([[20, 21, 22]], out)  # other blocks: no conflict
    rig.complete_b(before, hb, [[20, 21, 22]], out)
    rig.wait_ended()
    out.expect(rig.d.held_blocks() == ((),) and rig.d.stats()["held_reads"] == 0, "pages still held")
    before, hb = rig.pull_b(A_D, out, plan=held)  # the plan refused before is still planned
    rig.complete_b(before, hb, A_D, out)
    return out


def run_case(buffer: str) -> Outcome:
    """One late-READ case, set up and torn down (inside :func:`tcp_loopback`)."""
    with tcp_loopback():
        rig = StoppedPeer(buffer)
        try:
            return arena_case(rig) if buffer == "arena" else paged_case(rig)
        finally:
            rig.close()
