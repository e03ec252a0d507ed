"""A pull as the caller holds it: its handle while READs are in flight, and what ``complete`` did.

A :class:`PullHandle` is made by ``TransferManager.pull`` and bound to that manager (its
token): ``poll``, ``abort`` and ``complete`` on another manager refuse it. It tracks,
per peer, the NIXL transfer handle not yet released and whether that peer's READ
finished; ``state`` goes ``PROC`` -> ``DONE`` or ``ERR`` once. A :class:`Completion` is
``complete``'s answer: ok, or the request's local block ids and what a failed pull may
have written where.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .plan import Plan

PROC, DONE, ERR = "PROC", "DONE", "ERR"


@dataclass(frozen=True)
class Completion:
    """What ``complete`` did: ``ok``, else the request's local block ids that failed.

    A failed pull may have written, or may still write, the bytes of ``written_pages``
    (per local group, the request's local kernel pages NIXL reads into) in
    ``written_in``: ``"host buffers"`` in host mode (the device caches are untouched),
    ``"device caches"`` in device mode (NIXL writes there directly). Never another
    page, never another request's bytes. Both are empty / None when the pull is ok, no
    READ was ever posted, or in arena mode (NIXL writes D's own span, which is not
    handed out again while a READ may land in it). A READ whose release NIXL reported
    done can still land later (a READ to a stopped peer, released, completes when the
    peer runs again): treat those pages as garbage until they are written again.
    """

    ok: bool
    failed_block_ids: Tuple[Tuple[int, ...], ...]  # per local group; empty lists when ok
    error: Optional[str] = None
    written_pages: Tuple[Tuple[int, ...], ...] = ()  # per local group, failed pulls only
    written_in: Optional[str] = None  # "host buffers", "device caches", or None


class PullHandle:
    """One pull in flight or finished. ``state`` is PROC, DONE or ERR; ``error`` says why."""

    __slots__ = ("id", "_plan", "notify", "state", "error", "completed", "timeout_s", "deadline", "_xfers",
                 "_done", "_posted", "_owner", "_abandoned")

    def __init__(self, id_: int, plan: Plan, notify: bytes, timeout_s: Optional[float] = None,
                 owner: object = None):
        self.id = id_
        self._plan = plan
        self._owner = owner  # the token of the manager that posted it
        self.notify = notify
        self.timeout_s = timeout_s  # None: no deadline
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s  # time.monotonic()
        self.state = PROC
        self.error: Optional[str] = None
        self.completed = False
        self._xfers: Dict[str, object] = {}  # peer -> NIXL transfer handle not yet released
        self._done: set = set()  # peers whose READ finished
        self._posted = False  # a READ was handed to NIXL (it may write the plan's local pages)
        # D released a READ of it that had not ended (deadline, abort, removed peer, a
        # failed sibling READ): it may still land (docs/nixl.md, "Deadlines")
        self._abandoned = False

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def peers(self) -> Tuple[str, ...]:
        return self.plan.all_peers

    @property
    def peer(self) -> str:
        return self.plan.peer

    def __repr__(self) -> str:
        tail = f", error={self.error!r}" if self.error else ""
        return f"PullHandle(id={self.id}, peer={self.peer!r}, state={self.state}{tail})"
