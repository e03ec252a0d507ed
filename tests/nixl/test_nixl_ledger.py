"""A manager's own records of its plans and pulls (kvcopy.nixl.ledger), over real NIXL
(UCX, DRAM), in host and arena mode (the requests and cases: kvcopy.testing.nixl.misuse).

* A plan's life is a state machine: planned -> pulled -> completed, or planned ->
  discarded; every other step raises ValueError naming the state (``discard`` after
  ``pull`` was accepted, and the next plan got the pulled plan's span).
* Nothing done to a plan or a handle handed out reaches memory: every field of the
  plan (and of what it holds: region pairs, refs, spans, row arrays, through their
  bases too) is set to the other live request's value or to garbage, with
  ``object.__setattr__`` where the object is frozen (kvcopy.testing.nixl.hostile); each
  edit is refused or harmless, and both requests and a third of the same shape land
  byte for byte.
* Plans and handles the caller drops free what they hold.
"""
import dataclasses

import numpy as np
import pytest

from kvcopy.testing.nixl.engines import ManagerPairs, one_torch_thread, wait
from kvcopy.testing.nixl.hostile import plan_edits
from kvcopy.testing.nixl.misuse import Outcome, Requests, edit_case

def exact(case, out=None):
    """D's caches hold exactly the requests completed, and nothing is left held."""
    out = out or Outcome()
    case.check(out)
    assert not out.problems, out.problems


@pytest.fixture(params=["host", "arena"])
def case(request):
    with one_torch_thread(), ManagerPairs() as pairs:
        yield Requests(pairs, request.param)


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
    out = Outcome()
    case.pull_and_complete(case.plan("B"), "B", out)
    exact(case, out)


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
    exact(case)


def wait_reads_ended(d, timeout: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout  # hang guard only
    while d.stats()["abandoned_reads"]:
        assert time.monotonic() < end
        time.sleep(0.01)


# ---------------------------------------------------------------- edits never reach memory
EDITS = {buffer: plan_edits(buffer) for buffer in ("host", "arena")}


@pytest.mark.parametrize("buffer,edit", [(b, i) for b in ("host", "arena") for i in range(len(EDITS[b]))],
                         ids=[f"{b}-{name}" for b in ("host", "arena") for name, _ in EDITS[b]])
def test_an_edited_plan_is_refused_or_harmless(buffer, edit):
    with one_torch_thread():
        out = edit_case(buffer, EDITS[buffer][edit])
    assert out.wrong_bytes == 0 and not out.problems, out


def test_every_plan_field_is_edited():
    from kvcopy.nixl.modes.arena import ArenaPlan
    from kvcopy.nixl.planning.plan import PullPlan, RegionPair

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
    exact(case)


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
    exact(case)  # neither B nor C was written into D's KV


def test_plans_and_handles_refused_by_another_manager():
    with one_torch_thread(), ManagerPairs() as pairs:
        a, b = Requests(pairs, "arena"), Requests(pairs, "arena")
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
        exact(a)
        exact(b)


def test_read_only_arrays_handed_out_cannot_be_made_writable():
    with one_torch_thread(), ManagerPairs() as pairs:
        c = Requests(pairs, "arena")
        plan = c.plan("A")
        for arr in [x for rows in plan.reads.values() for x in rows] + list(plan.zero_runs):
            with pytest.raises(ValueError, match="WRITEABLE"):
                arr.setflags(write=True)
            base = arr
            while isinstance(base, np.ndarray):
                base = base.base
            assert isinstance(base, bytes)
        c.d.discard(plan)
