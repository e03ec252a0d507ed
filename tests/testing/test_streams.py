"""The recorded streams (kvcopy.testing.streams) and the order check the GPU path's CPU
tests rest on: each rule of ``check_layerwise_order`` refuses a log that breaks it, and a
thread that never entered may not use a stream or wait for an event."""
from __future__ import annotations

import threading

import pytest

from kvcopy.testing.streams import RecordedStreams, check_layerwise_order

F, C, W = "forward", "copy", "waits"


def _log(*entries):
    return [tuple(e) for e in entries]


def _good():
    """Two layers: each marked by the forward, waited for by the side stream, copied,
    their job events waited for by the waiter, then the join and a sweep."""
    return _log(
        (F, "record", "e1", "current"),
        (F, "record", "e2", "current"),
        (C, "wait_event", "side1", "e1"), (C, "use", "side1"), (C, "copy", 0, "side1", 4),
        (C, "record", "e3", "side1"),
        (C, "wait_event", "side1", "e2"), (C, "use", "side1"), (C, "copy", 1, "side1", 4),
        (C, "record", "e4", "side1"),
        (W, "synchronize", "e3"), (W, "synchronize", "e4"),
        (F, "wait_stream", "current", "side1"), (F, "copy", 2, "current", None))


def test_a_good_log_passes():
    assert check_layerwise_order(_good(), "side1", F, 4) == 2


def _without(log, i):
    return log[:i] + log[i + 1:]


@pytest.mark.parametrize("broken,why", [
    (lambda g: _without(g, 6), "no new wait"),  # the second layer's copies wait for nothing new
    (lambda g: g[:6] + [(C, "wait_event", "side1", "e1")] + g[7:], "no new wait|not after"),  # an earlier event
    (lambda g: g[:10] + [(C, "synchronize", "e3")] + g[11:], "copy thread"),  # the copy thread waits on the host
    (lambda g: g[:10] + [(F, "synchronize", "e3")] + g[11:], "forward's thread"),
    (lambda g: _without(g, 12), "not joined"),  # the sweep before the join
    (lambda g: g[:4] + [(C, "copy", 0, "side1", None)] + g[5:], None),  # a side copy without the cap
])
def test_each_rule_refuses_a_log_that_breaks_it(broken, why):
    with pytest.raises(AssertionError, match=why):
        check_layerwise_order(broken(_good()), "side1", F, 4)


def test_a_thread_that_never_entered_may_not_use_a_stream_or_wait():
    ops = RecordedStreams()
    side = ops.stream()
    event = ops.event(blocking=True)
    event.record(side)
    with pytest.raises(AssertionError, match="enter_thread"):
        with ops.use(side):
            pass
    with pytest.raises(AssertionError, match="enter_thread"):
        event.synchronize()
    errors = []

    def entered():
        try:
            ops.enter_thread()
            with ops.use(side):
                pass
            event.synchronize()
        except AssertionError as exc:  # pragma: no cover - reported below
            errors.append(exc)
    t = threading.Thread(target=entered, name="entered")
    t.start()
    t.join()
    assert errors == [] and "entered" in ops.entered and threading.current_thread().name not in ops.entered


def test_one_event_after_several_jobs_copies_passes_the_order_check():
    """A layer's one event after every request's copies of it (SideStream.copy): the
    record follows the last copy on the side stream, which the check asks for."""
    log = _log(
        (F, "record", "e1", "current"),
        (C, "wait_event", "side1", "e1"), (C, "use", "side1"),
        (C, "copy", 0, "side1", 4), (C, "copy", 0, "side1", 4), (C, "copy", 0, "side1", 4),
        (C, "record", "e2", "side1"),
        (W, "synchronize", "e2"),
        (F, "wait_stream", "current", "side1"))
    assert check_layerwise_order(log, "side1", F, 4) == 3


def test_a_destroyed_stream_is_noted_and_refuses_any_use():
    ops = RecordedStreams()
    ops.enter_thread()
    side = ops.stream()
    event = ops.event(blocking=True)
    ops.close_stream(side)
    assert [e[1:] for e in ops.entries("destroy")] == [("destroy", "side1")]
    for use in (lambda: side.wait_event(event), lambda: ops.current().wait_stream(side),
                lambda: event.record(side), lambda: ops.use(side).__enter__(), lambda: ops.close_stream(side)):
        with pytest.raises(AssertionError, match="side1 used after it was destroyed"):
            use()
    assert len(ops.entries("destroy")) == 1
