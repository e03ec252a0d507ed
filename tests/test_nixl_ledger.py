"""A manager's own records of its plans and pulls (kvcopy.nixl.ledger), over real NIXL
(UCX, DRAM), in host and arena mode.

* A plan's life is a state machine: planned -> pulled -> completed, or planned ->
  discarded; every other step raises ValueError naming the state (``discard`` after
  ``pull`` was accepted, and the next plan got the pulled plan's span).
* Nothing done to a plan or a handle handed out reaches memory: every field of the
  plan (and of what it holds: region pairs, refs, spans, row arrays, through their
  bases too) is set to the other live request's value or to garbage, with
  ``object.__setattr__`` where the object is frozen; each edit is refused or harmless,
  and both requests and a third of the same shape land byte for byte.
* Plans and handles the caller drops free what they hold.
"""
import dataclasses

import numpy as np
import pytest

from kvcopy.testing.nixl.engines import (
    ManagerPairs, clone_caches, expected_pull, first_difference, one_torch_thread, same_bytes, wait,
)

NP = 48
N = 40  # tokens: 3 blocks of 16, and D's fourth block is zeroed
REMOTE = {"A": [[1, 2, 3]], "B": [[4, 5, 6]], "C": [[7, 8, 9]]}
LOCAL = {"A": [[10, 11, 12, 13]], "B": [[20, 21, 22, 23]], "C": [[30, 31, 32, 33]]}


class Case:
    """P and D in one mode, P holding requests A, B and C (host mode: saved blocks;
    arena mode: staged records)."""

    def __init__(self, pairs: ManagerPairs, buffer: str):
        kw = {"arena_bytes": 1 << 20} if buffer == "arena" else {}
        self.p, self.d, self.peer, self.pe, self.de = pairs.make("one_group", NP, buffer=buffer, **kw)
        self.buffer = buffer
        if buffer == "arena":
            self.remote = {k: self.p.save(v, num_tokens=N, request_id=k) for k, v in REMOTE.items()}
        else:
            self.p.save([[b for ids in REMOTE.values() for b in ids[0]]])
            self.remote = REMOTE
        self.expected = clone_caches(self.de.device_caches)

    def plan(self, which: str):
        return self.d.plan_pull(self.peer, self.remote[which], N, LOCAL[which])

    def landed(self, which: str) -> None:
        """Request ``which`` completed: D's caches must now also hold it."""
        self.expected = expected_pull(self.expected, self.de, LOCAL[which], self.pe.device_caches, self.pe,
                                      REMOTE[which], N)

    def pull_and_complete(self, plan, which: str) -> None:
        h = self.d.pull(plan, notify=which.encode())
        assert wait(self.d, h) == "DONE", h
        assert self.d.complete(h).ok
        self.landed(which)

    def exact(self) -> None:
        got = self.de.device_caches
        assert same_bytes(got, self.expected), first_difference(got, self.expected)
        if self.buffer == "arena":
            arena = self.d.arena
            assert not arena.buffer[:arena.arena.granule].any()  # D's zero granule
            assert arena.stats()["spans"] == 0


@pytest.fixture(params=["host", "arena"])
def case(request):
    with one_torch_thread(), ManagerPairs() as pairs:
        yield Case(pairs, request.param)


# ---------------------------------------------------------------- the state machine
def test_a_plan_is_pulled_once_then_completed_once(case):
    d = case.d
    pa = case.plan("A")
    h = d.pull(pa, notify=b"A")
    with pytest.raises(ValueError, match="the plan is pulled: only a planned plan can be discarded"):
        d.discard(pa)
    with pytest.raises(ValueError, match="the plan is pulled: only a planned plan can be pulled"):
        d.pull(pa)
    pb = case.plan("B")
    if case.buffer == "arena":
        assert pb.span.offset != pa.span.offset  # A's span is A's until A is completed
    assert wait(d, h) == "DONE" and d.complete(h).ok
    case.landed("A")
    with pytest.raises(ValueError, match="already completed"):
        d.complete(h)
    for step, verb in ((d.discard, "discarded"), (d.pull, "pulled")):
        with pytest.raises(ValueError, match=f"the plan is completed: only a planned plan can be {verb}"):
            step(pa)
    d.discard(pb)
    for step, verb in ((d.discard, "discarded"), (d.pull, "pulled")):
        with pytest.raises(ValueError, match=f"the plan is discarded: only a planned plan can be {verb}"):
            step(pb)
    case.pull_and_complete(case.plan("B"), "B")
    case.exact()


def test_a_failed_pull_is_completed_not_discarded(case):
    d = case.d
    pa = case.plan("A")
    h = d.pull(pa, notify=b"A")
    d.abort(h)
    with pytest.raises(ValueError, match="the plan is pulled"):
        d.discard(pa)
    done = d.complete(h)
    if h.state == "DONE":  # the READ was DONE when posted: abort had nothing to give up
        case.landed("A")
    else:
        assert not done.ok
    with pytest.raises(ValueError, match="the plan is completed"):
        d.discard(pa)
    wait_reads_ended(d)
    case.exact()


def wait_reads_ended(d, timeout: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout  # hang guard only
    while d.stats()["abandoned_reads"]:
        assert time.monotonic() < end
        time.sleep(0.01)


# ---------------------------------------------------------------- edits never reach memory
def _set(obj, name, value):
    object.__setattr__(obj, name, value)


def _edits(buffer: str):
    """(name, edit(plan A, plan B)) for every field of the plan and of what it holds."""
    from kvcopy.nixl import ArenaPlan, PullPlan, RegionPair

    plan_type = ArenaPlan if buffer == "arena" else PullPlan
    out = []
    for f in dataclasses.fields(plan_type):
        out.append((f"{f.name} <- B's", lambda a, b, n=f.name: _set(a, n, getattr(b, n))))
        out.append((f"{f.name} <- None", lambda a, b, n=f.name: _set(a, n, None)))
    if buffer == "arena":
        def arrays(a):
            return [x for rows in a.reads.values() for x in rows] + list(a.zero_runs)

        out += [
            ("reads[peer] <- B's rows", lambda a, b: a.reads.__setitem__(a.peers[0], b.reads[b.peers[0]])),
            ("span.offset <- B's", lambda a, b: _set(a.span, "offset", b.span.offset)),
            ("span.nbytes <- 0", lambda a, b: _set(a.span, "nbytes", 0)),
            ("row arrays made writable", lambda a, b: [x.setflags(write=True) for x in arrays(a)]),
            ("row arrays' bases made writable", lambda a, b: [x.base.setflags(write=True) for x in arrays(a)]),
            ("row arrays written in place", lambda a, b: [x.__setitem__(..., 0) for x in arrays(a)]),
            ("row arrays reshaped", lambda a, b: [setattr(x, "shape", (x.size,)) for x in arrays(a)]),
            ("row arrays' bytes rebuilt as B's", lambda a, b: _set(a, "reads", b.reads)),
        ]
    else:
        for f in dataclasses.fields(RegionPair):
            out.append((f"pairs[0].{f.name} <- B's",
                        lambda a, b, n=f.name: _set(a.pairs[0], n, getattr(b.pairs[0], n))))
        for name in ("index", "num_pages", "page_stride", "chunk_bytes"):
            out.append((f"pairs[0].local.{name} <- 0", lambda a, b, n=name: _set(a.pairs[0].local, n, 0)))
        out.append(("pairs <- B's, reversed", lambda a, b: _set(a, "pairs", tuple(reversed(b.pairs)))))
    out.append(("a copy with B's pages (dataclasses.replace)",
                lambda a, b: _set(a, "read_pages", dataclasses.replace(b).read_pages)))
    return out


EDITS = {buffer: _edits(buffer) for buffer in ("host", "arena")}


@pytest.mark.parametrize("buffer,edit", [(b, i) for b in ("host", "arena") for i in range(len(EDITS[b]))],
                         ids=[f"{b}-{name}" for b in ("host", "arena") for name, _ in EDITS[b]])
def test_an_edited_plan_is_refused_or_harmless(buffer, edit):
    name, apply = EDITS[buffer][edit]
    with one_torch_thread(), ManagerPairs() as pairs:
        c = Case(pairs, buffer)
        pa, pb = c.plan("A"), c.plan("B")
        try:
            apply(pa, pb)
        except (AttributeError, TypeError, ValueError):
            pass  # refused where it was made
        try:
            c.pull_and_complete(pa, "A")
        except (TypeError, ValueError):
            c.d.discard(pa)  # refused by the manager: nothing moved
        c.pull_and_complete(pb, "B")
        c.pull_and_complete(c.plan("C"), "C")  # a later plan of the same shape: caches intact
        c.exact()


def test_every_plan_field_is_edited():
    from kvcopy.nixl import ArenaPlan, PullPlan, RegionPair

    for buffer, plan_type in (("host", PullPlan), ("arena", ArenaPlan)):
        names = " ".join(name for name, _ in EDITS[buffer])
        for f in dataclasses.fields(plan_type):
            assert f"{f.name} <- B's" in names and f"{f.name} <- None" in names
    host = " ".join(n for n, _ in EDITS["host"])
    assert all(f"pairs[0].{f.name} <- B's" in host for f in dataclasses.fields(RegionPair))


def test_an_edited_handle_shows_the_edit_and_completes_its_own_pull(case):
    d = case.d
    ha, hb = d.pull(case.plan("A"), notify=b"A"), d.pull(case.plan("B"), notify=b"B")
    view_a, view_b = ha._view, hb._view
    object.__setattr__(ha, "_view", view_b)  # shows B's pull
    view_b.state, view_b.plan = "DONE", None
    assert ha.state == "DONE"
    with pytest.raises(AttributeError):
        object.__setattr__(ha, "_record", None)  # a handle holds nothing else
    assert wait(d, ha) == "DONE" and d.complete(ha).ok  # A's own pull, whatever it shows
    case.landed("A")
    object.__setattr__(ha, "_view", view_a)
    assert view_a.completed and not hb.completed
    assert wait(d, hb) == "DONE" and d.complete(hb).ok
    case.landed("B")
    case.exact()


# ---------------------------------------------------------------- dropped plans and handles
def test_dropped_plans_and_handles_free_what_they_hold(case):
    d = case.d
    case.plan("A")  # dropped while planned: discarded at the next call
    h = d.pull(case.plan("B"), notify=b"B")
    assert wait(d, h) == "DONE"
    del h  # dropped after its READ ended, before complete: finished without writing the KV
    st = d.stats()
    assert st["in_flight"] == 0 and st["abandoned_reads"] == 0
    if case.buffer == "arena":
        assert st["spans"] == 0 and st["bytes_in_use"] == 0
    h = d.pull(case.plan("C"), notify=b"C")
    del h  # dropped in flight: failed, and finished once its READ ended
    wait_reads_ended(d)
    case.exact()  # neither B nor C was written into D's KV


def test_plans_and_handles_refused_by_another_manager():
    with one_torch_thread(), ManagerPairs() as pairs:
        a, b = Case(pairs, "arena"), Case(pairs, "arena")
        plan = a.plan("A")
        for step in (b.d.pull, b.d.discard):
            with pytest.raises(ValueError, match="not a plan made by"):
                step(plan)
        h = a.d.pull(plan, notify=b"A")
        for step in (b.d.poll, b.d.abort, b.d.complete):
            with pytest.raises(ValueError, match="is not a pull of"):
                step(h)
        assert wait(a.d, h) == "DONE" and a.d.complete(h).ok
        a.landed("A")
        a.exact()
        b.exact()


def test_read_only_arrays_handed_out_cannot_be_made_writable():
    with one_torch_thread(), ManagerPairs() as pairs:
        c = Case(pairs, "arena")
        plan = c.plan("A")
        for arr in [x for rows in plan.reads.values() for x in rows] + list(plan.zero_runs):
            with pytest.raises(ValueError, match="WRITEABLE"):
                arr.setflags(write=True)
            base = arr
            while isinstance(base, np.ndarray):
                base = base.base
            assert isinstance(base, bytes)
        c.d.discard(plan)
