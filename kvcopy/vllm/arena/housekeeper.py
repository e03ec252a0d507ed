"""The arena worker's housekeeping thread: turns between engine steps, hurried while P's WRITEs are in flight.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

A vLLM engine steps only while it has requests, but a worker has work between steps:
P's notifications, TTLs and give-ups, D's give-ups, and P's push WRITEs, whose end NIXL
reports to D (``f``, a chunk's ``c``) only once P's own status check sees them DONE.
:class:`Housekeeper` runs the worker's **turn** (``tick``, under the worker's lock)
every ``period_s``, and at once after :meth:`~Housekeeper.wake` (a long-poll reply
came, P posted a WRITE). While ``hurry()`` returns a period (work is in flight; None:
nothing is) it turns that often in between, with ``quick`` (only what is in flight: P
reaps its WRITEs) instead of the whole turn, which costs more (P matches waiting
reservations against every request it knows). The hurry stays at that period for
:data:`HURRY_FAST_S` after it began or after a turn saw a new post (``posts()``
changed), then doubles each turn up to ``period_s``: a WRITE that takes long (RDMA of a
large span, a D that died mid-WRITE and a transport that has not said so yet) costs a
few turns a second, not a thousand. (The arena worker's periods:
``PushSender.poll_s``, 1 ms for a final WRITE, 10 ms for a layer-wise push's chunks
while P's forward runs.) A wake without a new post (the long-poll's empty reply, every
second) runs a whole turn but keeps the backoff. A turn that raises is logged and the next comes after
``period_s``: never a spin. A wake is never lost: the wait takes it under the same lock
:meth:`~Housekeeper.wake` sets it with (:class:`Wakes`), so one that comes just as a
wait runs out is the next turn's, a whole one.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from vllm.logger import init_logger

logger = init_logger("vllm.kvcopy")

# How long a hurry keeps its shortest period: a WRITE between two arenas on one host ends
# in 1-3 ms (4 MiB, UCX cma; one posted right after a notice to D a round trip later), a
# request of a few hundred MiB over RDMA in tens of ms. After that the period doubles.
HURRY_FAST_S = 0.05


class Wakes:
    """A wake flag whose :meth:`wait` also takes it, under the lock :meth:`set` holds.
    (``threading.Event``'s wait, then clear, loses a set that comes between them: one
    made just as a timed wait ran out, which on a loaded machine, or with the hurry's
    1 ms waits, is often; an idle P's long-poll reply lost so waited the whole period.)"""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._set = False

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake; whether one came (taken: the next wait waits again)."""
        with self._cond:
            if not self._set:
                self._cond.wait(timeout)
            woke, self._set = self._set, False
            return woke


class Housekeeper:
    """A daemon thread running ``tick`` under ``lock`` (module docstring); ``quick`` is
    the hurried turn (None: ``tick`` again); ``posts``: how many WRITEs were posted so
    far, read under ``lock`` after each turn (None: only a hurry's start is fast)."""

    def __init__(self, tick: Callable[[], None], lock: threading.Lock, period_s: float, name: str,
                 hurry: Optional[Callable[[], Optional[float]]] = None,
                 quick: Optional[Callable[[], None]] = None, posts: Optional[Callable[[], int]] = None,
                 enter: Optional[Callable[[], None]] = None):
        self._tick, self._lock, self._period = tick, lock, period_s
        self._enter = enter  # first thing on the thread (a GPU worker: its device made the thread's)
        self._hurry, self._quick, self._posts = hurry, quick, posts
        self._stop = False
        self._wake = Wakes()
        self._thread = threading.Thread(target=self._run, name=f"kvcopy-arena-house-{name}", daemon=True)
        self.turns = self.quick_turns = 0  # for tests and the bench's timeline

    def start(self) -> "Housekeeper":
        self._thread.start()
        return self

    def _run(self) -> None:
        if self._enter is not None:
            try:
                self._enter()
            except Exception:  # noqa: BLE001 -- turns still run: a CPU worker needs no device
                logger.exception("kvcopy arena: the housekeeping thread could not take the KV's device")
        wait = 0.0  # the first turn at once (P's worker starts its long-poll there)
        next_full = time.monotonic()
        hurried_since: Optional[float] = None
        seen_posts: Optional[int] = None
        while True:
            woke = self._wake.wait(wait)
            if self._stop:
                return
            now = time.monotonic()
            posted = False
            try:
                with self._lock:
                    if woke or now >= next_full or self._quick is None:
                        next_full = now + self._period
                        self.turns += 1
                        self._tick()
                    else:
                        self.quick_turns += 1
                        self._quick()
                    fast = self._hurry() if self._hurry is not None else None
                    if self._posts is not None:
                        posts = self._posts()
                        posted, seen_posts = posts != seen_posts, posts
            except Exception:  # noqa: BLE001 -- the next turn tries again; the engine thread is not disturbed
                logger.exception("kvcopy arena: housekeeping failed")
                fast, next_full = None, time.monotonic() + self._period
            if fast is None:
                hurried_since, wait = None, max(0.0, next_full - time.monotonic())
                continue
            if hurried_since is None or posted:
                hurried_since = now
            if now - hurried_since < HURRY_FAST_S:
                wait = fast
            else:
                wait = min(self._period, max(fast, 2 * wait))

    def wake(self) -> None:
        """Run a whole turn now (any thread; it never blocks). It hurries afresh only if
        that turn sees a new post (``posts``)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(30)
