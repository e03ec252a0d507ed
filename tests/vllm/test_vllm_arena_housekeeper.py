"""The arena worker's housekeeping thread (kvcopy.vllm.arena.housekeeper): a turn that
raises never makes it spin, hurried turns run ``quick`` (not the whole turn) and back off
once work stays in flight, a wake runs a whole turn at once. Run in the vLLM environment;
skipped where vLLM 0.33 is not installed.

Each test counts turns over a span of time that only bounds them from above (a loaded
machine runs fewer turns, never more), so none can fail for lack of CPU; the backoff
across wakes and posts is counted on a simulated clock.
"""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from kvcopy.vllm.arena import housekeeper as hk  # noqa: E402
from kvcopy.vllm.arena.housekeeper import Housekeeper  # noqa: E402


def _until(cond, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "the housekeeper never got there"
        time.sleep(0.001)


def test_a_turn_that_raises_waits_its_period_instead_of_spinning():
    calls = []

    def tick():
        calls.append(time.monotonic())
        raise RuntimeError("a turn that fails every time")
    house = Housekeeper(tick, threading.Lock(), 3600.0, "raises", hurry=lambda: 0.0).start()
    try:
        _until(lambda: calls)
        time.sleep(0.3)  # before the fix: the first turn's 0 s wait kept, ~100,000 turns here
        assert len(calls) == 1, len(calls)
    finally:
        house.stop()


def test_hurried_turns_run_quick_and_the_whole_turn_waits_its_period():
    full, quick, lock = [], [], threading.Lock()
    house = Housekeeper(lambda: full.append(1), lock, 3600.0, "quick", hurry=lambda: 0.001,
                        quick=lambda: quick.append(1)).start()
    try:
        _until(lambda: len(quick) >= 5)
        assert len(full) == 1  # the first turn; the next whole one is an hour away
        house.wake()  # a wake (a post, a long-poll reply) is a whole turn at once
        _until(lambda: len(full) == 2)
        assert house.turns == 2 and house.quick_turns == len(quick)
    finally:
        house.stop()


def test_a_hurry_that_lasts_backs_off_to_the_period(monkeypatch):
    monkeypatch.setattr(hk, "HURRY_FAST_S", 0.02)
    turns = []  # whole and quick
    house = Housekeeper(lambda: turns.append(time.monotonic()), threading.Lock(), 0.2, "backoff",
                        hurry=lambda: 0.001, quick=lambda: turns.append(time.monotonic())).start()
    try:
        _until(lambda: turns and turns[-1] - turns[0] >= 1.0)
        # 1 ms turns for 20 ms, then 2, 4, ... up to the 200 ms period: about 20 + 7 + 4 turns
        # in this second (without the backoff, up to 1,000)
        assert len(turns) < 60, len(turns)
        gaps = [b - a for a, b in zip(turns[-4:], turns[-3:])]
        assert min(gaps) >= 0.1, gaps  # at the period by now
    finally:
        house.stop()


def test_without_work_in_flight_it_turns_every_period_only():
    full = []
    house = Housekeeper(lambda: full.append(1), threading.Lock(), 3600.0, "idle", hurry=lambda: None,
                        quick=lambda: pytest.fail("a quick turn with nothing in flight")).start()
    try:
        _until(lambda: full)
        time.sleep(0.1)
        assert len(full) == 1 and house.quick_turns == 0
    finally:
        house.stop()


def test_a_wake_is_never_lost_wherever_it_lands_in_the_loop():
    """Each wake (a long-poll reply, from the side channel's thread) is followed by a whole
    turn, whatever the housekeeper's thread was doing when it came: here it hurries with
    a hurry of 0 s (a wait that runs out at once, then a quick turn, over and over), so the
    wakes land all over its loop. Before, a wake that came after a wait had run out and
    before the loop cleared the event was cleared with it: no whole turn until the period
    (an idle P's long-poll dead, its reservations not taken or posted): here, before, every
    one of 10 runs lost one within its first 4 wakes."""
    asked, seen = [0], []
    house = Housekeeper(lambda: seen.append(asked[0]), threading.Lock(), 3600.0, "wakes", hurry=lambda: 0.0,
                        quick=lambda: None).start()
    try:
        _until(lambda: seen)
        for i in range(1, 301):
            asked[0] = i
            house.wake()
            _until(lambda i=i: seen[-1] == i, limit_s=10.0)  # the period is an hour: only the wake turns
    finally:
        house.stop()


class _FakeClock:
    """The housekeeper's time and wake event, simulated: its waits advance the clock, the
    long-poll's empty reply wakes it every ``reply_s``, and it stops at ``until``."""

    def __init__(self, house, reply_s: float, until: float):
        self.now, self.house, self.reply_s, self.until = 0.0, house, reply_s, until
        self.next_reply = reply_s
        self.waits = 0

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.waits += 1  # a loop that never advances the clock (waits of 0 s) fails instead of hanging
        assert self.waits < 1_000_000, f"the clock stuck at {self.now}"
        if self.next_reply <= self.now + timeout:
            self.now, self.next_reply = self.next_reply, self.next_reply + self.reply_s
            woke = True
        else:
            self.now, woke = self.now + timeout, False
        self.house._stop = self.now >= self.until
        return woke


def test_a_wake_without_a_new_post_keeps_the_backoff_and_a_post_restarts_it(monkeypatch):
    """A WRITE stuck in flight (a D that died mid-WRITE): hurried turns back off to the
    period, and the long-poll's empty reply every second (a wake, no post) runs a whole
    turn without restarting the 1 ms phase (before: ~50 quick turns after each reply); a
    new post (at 6.5 s) does restart it. Turns counted on a simulated clock: no timing
    involved."""
    period, hurry_s = 0.05, 0.001  # the connector's HOUSEKEEPING_S and push_send.WRITE_POLL_S
    monkeypatch.setattr(hk, "HURRY_FAST_S", 0.05)
    turns = []  # (kind, when)
    house = Housekeeper(lambda: turns.append(("full", clock.now)), threading.Lock(), period, "fake",
                        hurry=lambda: hurry_s, quick=lambda: turns.append(("quick", clock.now)),
                        posts=lambda: 1 if clock.now < 6.5 else 2)
    clock = _FakeClock(house, reply_s=1.0, until=7.0)
    monkeypatch.setattr(hk, "time", clock)
    house._wake = clock

    def quick_in(lo, hi):
        return sum(kind == "quick" and lo <= t < hi for kind, t in turns)

    house._run()  # on this thread, until the simulated clock reaches 7 s
    assert quick_in(0.0, 0.06) >= 45  # the hurry's start: 1 ms turns for 50 ms
    for second in range(1, 6):  # each begins with a reply's wake
        assert quick_in(second, second + 1) <= 2, (second, quick_in(second, second + 1))
    whole = sum(kind == "full" and 1.0 <= t < 6.0 for kind, t in turns)
    assert whole >= 5 * round(1 / period) - 5, whole  # at the period by then: whole turns
    assert quick_in(6.5, 6.65) >= 45, quick_in(6.5, 6.65)  # the post's turn and 1 ms turns after it


def test_the_hurry_turns_at_the_period_it_asks_for(monkeypatch):
    """``hurry()`` returns the period: chunk WRITEs only (a layer-wise push while P's
    forward runs, push_send.CHUNK_POLL_S) get a turn every 10 ms, not every 1 ms (each
    turn takes P's CPU and the GIL from the forward); once a turn sees a final WRITE
    posted (at 0.3 s) it turns every 1 ms. Simulated clock."""
    monkeypatch.setattr(hk, "HURRY_FAST_S", 0.05)
    turns = []
    house = Housekeeper(lambda: turns.append(("full", clock.now)), threading.Lock(), 0.05, "fake",
                        hurry=lambda: 0.01 if clock.now < 0.3 else 0.001,
                        quick=lambda: turns.append(("quick", clock.now)),
                        posts=lambda: 1 if clock.now < 0.3 else 2)
    clock = _FakeClock(house, reply_s=10.0, until=0.4)
    monkeypatch.setattr(hk, "time", clock)
    house._wake = clock

    def quick_in(lo, hi):
        return sum(kind == "quick" and lo <= t < hi for kind, t in turns)

    house._run()
    assert 3 <= quick_in(0.0, 0.05) <= 5, quick_in(0.0, 0.05)  # every 10 ms (before: 1 ms, ~49 turns)
    seen = min(t for _, t in turns if t >= 0.3)  # the turn that saw the final post (the connector also wakes it)
    assert quick_in(seen, seen + 0.05) >= 45, quick_in(seen, seen + 0.05)  # from there every 1 ms


@pytest.mark.parametrize("fails", [False, True])
def test_enter_runs_first_on_the_housekeeping_thread_and_a_failure_keeps_the_turns(fails):
    """``enter`` (a GPU worker: its KV's device made the thread's) runs once, on the
    housekeeper's own thread, before its first turn; one that raises is logged and the
    turns still come (a CPU worker needs no device)."""
    seen = []

    def enter():
        seen.append(("enter", threading.current_thread().name))
        if fails:
            raise RuntimeError("no device")
    house = Housekeeper(lambda: seen.append(("tick", threading.current_thread().name)), threading.Lock(), 3600.0,
                        "enter", enter=enter).start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 2:
            assert time.monotonic() < deadline, seen
            time.sleep(0.001)
        house.wake()
        while len(seen) < 3:
            assert time.monotonic() < deadline, seen
            time.sleep(0.001)
    finally:
        house.stop()
    assert seen[0] == ("enter", "kvcopy-arena-house-enter")
    assert [k for k, _ in seen[1:]] == ["tick"] * (len(seen) - 1) and {t for _, t in seen} == {seen[0][1]}
