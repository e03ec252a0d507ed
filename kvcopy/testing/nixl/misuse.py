"""Requests used out of turn, over real NIXL in one process, as cases that return what
went wrong instead of asserting (``tests/nixl/test_nixl_ledger.py`` and
``tests/nixl/modes/test_nixl_arena_mode.py`` assert; ``bench/hardening_probe.py`` counts).

:class:`Requests`: P and D in one buffer mode, P holding requests A, B and C (host
mode: saved blocks; arena mode: staged records), D's caches poisoned (random bytes
unlike P's) and an expectation of them kept request by request. The cases:

* :func:`edit_case`: plans of A and B live at once; one edit of A's plan
  (:func:`~kvcopy.testing.nixl.hostile.plan_edits`); A, B and a later C of the same
  shape pulled and completed: each must land byte for byte, or be refused.
* :func:`discard_after_pull_case`: ``discard`` of a pulled plan is refused, B never
  gets A's span, A lands byte for byte.
* :func:`reader_gives_up_case`: a request staged for two readers; reader 1 gives up
  after its READ landed (``abort`` or ``close``); P must hear from it once and keep
  the span for reader 2, who must get the request's own bytes although P staged
  another request since.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import List

from .engines import ManagerPairs, build_case, collect_notifications, expected_pull, wait
from .oracle import clone_caches, fill_random, first_difference, same_bytes

NP = 48
N = 40  # tokens: 3 blocks of 16, and D's fourth block is zeroed
REMOTE = {"A": [[1, 2, 3]], "B": [[4, 5, 6]], "C": [[7, 8, 9]]}
LOCAL = {"A": [[10, 11, 12, 13]], "B": [[20, 21, 22, 23]], "C": [[30, 31, 32, 33]]}
_names = itertools.count()


@dataclass
class Outcome:
    """What one case saw: ``problems`` (each a broken promise), ``wrong_bytes`` (of
    them, completions that said ``ok=True`` with bytes other than the request's)."""

    problems: List[str] = field(default_factory=list)
    wrong_bytes: int = 0

    def expect(self, condition: bool, what: str) -> bool:
        if not condition:
            self.problems.append(what)
        return condition


class Requests:
    """P and D in one mode with requests A, B and C on P (module docstring)."""

    def __init__(self, pairs: ManagerPairs, buffer: str):
        kw = {"arena_bytes": 1 << 20} if buffer == "arena" else {}
        self.p, self.d, self.peer, self.pe, self.de = pairs.make("one_group", NP, buffer=buffer, **kw)
        self.buffer = buffer
        if buffer == "arena":
            self.remote = {k: self.p.save(v, num_tokens=N, request_id=k) for k, v in REMOTE.items()}
        else:
            self.p.save([[b for ids in REMOTE.values() for b in ids[0]]])
            self.remote = dict(REMOTE)
        self.expected = clone_caches(self.de.device_caches)

    def plan(self, which: str):
        return self.d.plan_pull(self.peer, self.remote[which], N, LOCAL[which], request_id=which)

    def landed(self, which: str) -> None:
        """Request ``which`` completed: D's caches must now also hold it."""
        self.expected = expected_pull(self.expected, self.de, LOCAL[which], self.pe.device_caches, self.pe,
                                      REMOTE[which], N)

    def pull_and_complete(self, plan, which: str, out: Outcome) -> None:
        h = self.d.pull(plan, notify=which.encode())
        if not out.expect(wait(self.d, h) == "DONE", f"{which} ended {h.state}: {h.error}"):
            return
        done = self.d.complete(h)
        if out.expect(done.ok, f"{which} failed: {done.error}"):
            self.landed(which)

    def check(self, out: Outcome, completed_ok: int = 0) -> None:
        """D's caches equal the expectation (``completed_ok``: completions said ok since
        the last check: each is a wrong one if the bytes differ), nothing left held."""
        got = self.de.device_caches
        if not out.expect(same_bytes(got, self.expected), f"D's KV: {first_difference(got, self.expected)}"):
            out.wrong_bytes += completed_ok
        if self.buffer == "arena":
            arena = self.d.arena
            out.expect(not arena.buffer[:arena.arena.granule].any(), "D's zero granule was written")
            out.expect(arena.stats()["spans"] == 0, f"D's spans left: {arena.stats()}")


def edit_case(buffer: str, edit) -> Outcome:
    """One plan edit (``(name, edit(plan A, plan B))``), then A, B and C pulled."""
    out = Outcome()
    name, apply = edit
    with ManagerPairs() as pairs:
        r = Requests(pairs, buffer)
        pa, pb = r.plan("A"), r.plan("B")
        try:
            apply(pa, pb)
        except (AttributeError, TypeError, ValueError):
            pass  # refused where it was made
        ok = 0
        try:
            r.pull_and_complete(pa, "A", out)
            ok += 1
        except (TypeError, ValueError):
            r.d.discard(pa)  # refused by the manager: nothing moved
        r.pull_and_complete(pb, "B", out)
        r.pull_and_complete(r.plan("C"), "C", out)  # a later plan of the same shape: caches intact
        r.check(out, ok + 2)
    out.problems = [f"{name}: {p}" for p in out.problems]
    return out


def discard_after_pull_case() -> Outcome:
    out = Outcome()
    with ManagerPairs() as pairs:
        r = Requests(pairs, "arena")
        pa = r.plan("A")
        h = r.d.pull(pa, notify=b"A")
        try:
            r.d.discard(pa)
            out.expect(False, "discard of a pulled plan was accepted")
        except ValueError as exc:
            out.expect("the plan is pulled" in str(exc), f"discard refused saying {exc}")
        pb = r.plan("B")
        out.expect(pb.span.offset != pa.span.offset, "B got the span of A, pulled and not completed")
        out.expect(wait(r.d, h) == "DONE", f"A ended {h.state}")
        done = r.d.complete(h)
        if out.expect(done.ok, f"A failed: {done.error}"):
            r.landed("A")
        r.pull_and_complete(pb, "B", out)
        r.check(out, 2)
    return out


def reader_gives_up_case(how: str, settle_s: float = 1.0) -> Outcome:
    """Reader 1 of 2 gives up (``how``: "abort" or "close") after its READ landed."""
    out = Outcome()
    with ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", NP, buffer="arena", arena_bytes=1 << 20)
        de2 = build_case("one_group", NP)
        fill_random(de2.device_caches, 34)
        d2 = de2.manager(f"{d.name}-second-{next(_names)}", buffer="arena", arena_bytes=1 << 20)
        try:
            peer2 = d2.add_peer(p.metadata())
            record = p.save([[1, 2, 3]], num_tokens=N, request_id="A", readers=2)
            plan2 = d2.plan_pull(peer2, record, N, [[10, 11, 12]], request_id="A")
            h = d.pull(d.plan_pull(peer, record, N, [[20, 21, 22]], request_id="A"), notify=b"A")
            time.sleep(0.2)  # the READ lands; D does not poll it
            if how == "abort":
                d.abort(h)  # a READ DONE when posted is not aborted: one notification all the same
                d.complete(h)
            else:
                d.close()
            got = collect_notifications(p, 2, settle_s)  # waits the whole while for a second one
            out.expect(got == [(d.name, b"A")], f"P heard {got} from reader 1")
            out.expect(p.arena.staged == ["A"], f"P's staged requests: {p.arena.staged}")
            p.save([[4, 5, 6]], num_tokens=N, request_id="C")  # takes A's span if P freed it
            before = clone_caches(de2.device_caches)
            h2 = d2.pull(plan2, notify=b"A")
            out.expect(wait(d2, h2) == "DONE", f"reader 2 ended {h2.state}")
            done = d2.complete(h2)
            want = expected_pull(before, de2, [[10, 11, 12]], pe.device_caches, pe, [[1, 2, 3]], N)
            exact = same_bytes(de2.device_caches, want)
            out.wrong_bytes += int(done.ok and not exact)
            out.expect(done.ok and exact, f"reader 2: ok={done.ok}, {first_difference(de2.device_caches, want)}")
        finally:
            d2.close()
    return out
