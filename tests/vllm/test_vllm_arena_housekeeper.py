"""The arena worker's housekeeping thread (kvcopy.vllm.arena.housekeeper): a turn that
raises never makes it spin, hurried turns run ``quick`` (not the whole turn) and back off
once work stays in flight, a wake runs a whole turn at once. Run in the vLLM environment;
skipped where vLLM 0.33 is not installed.

Each test counts turns over a span of time that only bounds them from above (a loaded
machine runs fewer turns, never more), so none can fail for lack of CPU.
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
    house = Housekeeper(tick, threading.Lock(), 3600.0, "raises", hurry=lambda: True, hurry_s=0.0).start()
    try:
        _until(lambda: calls)
        time.sleep(0.3)  # before the fix: the first turn's 0 s wait kept, ~100,000 turns here
        assert len(calls) == 1, len(calls)
    finally:
        house.stop()


def test_hurried_turns_run_quick_and_the_whole_turn_waits_its_period():
    full, quick, lock = [], [], threading.Lock()
    house = Housekeeper(lambda: full.append(1), lock, 3600.0, "quick", hurry=lambda: True, hurry_s=0.001,
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
                        hurry=lambda: True, hurry_s=0.001, quick=lambda: turns.append(time.monotonic())).start()
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
    house = Housekeeper(lambda: full.append(1), threading.Lock(), 3600.0, "idle", hurry=lambda: False,
                        hurry_s=0.001, quick=lambda: pytest.fail("a quick turn with nothing in flight")).start()
    try:
        _until(lambda: full)
        time.sleep(0.1)
        assert len(full) == 1 and house.quick_turns == 0
    finally:
        house.stop()
