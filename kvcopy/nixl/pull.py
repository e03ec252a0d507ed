"""A pull as the caller holds it (:class:`PullHandle`), what ``complete`` did
(:class:`Completion`), and the refusal of a pull into memory a READ may still write
(:class:`PagesHeld`).

A :class:`PullHandle` shows a :class:`PullView` the manager writes and never reads:
everything the manager decides by (the pull's state, its NIXL handles, its plan's pages
and span) lives in its own record of the pull (:mod:`kvcopy.nixl.ledger`), found by the
handle's identity. Setting an attribute of a handle or of its view, even with
``object.__setattr__``, changes what the caller sees, never what the manager reads or
writes. ``state`` goes ``PROC`` -> ``DONE`` or ``ERR`` once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
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
    handed out again while a READ may land in it).

    ``read_pending``: a READ of this pull was given up on (deadline, abort, a removed
    peer, a failed sibling READ) and NIXL has not reported that it ended, so it may
    still land. Until it does, the manager holds what it may write: arena mode D's span
    (``stats()["held_spans"]``), host and device mode ``written_pages``, which no later
    pull may read or zero into (:class:`PagesHeld`). In device mode those are KV pages
    the engine owns: it must not reuse them for other work while
    :meth:`~kvcopy.nixl.TransferManager.held_blocks` lists them.
    """

    ok: bool
    failed_block_ids: Tuple[Tuple[int, ...], ...]  # per local group; empty lists when ok
    error: Optional[str] = None
    written_pages: Tuple[Tuple[int, ...], ...] = ()  # per local group, failed pulls only
    written_in: Optional[str] = None  # "host buffers", "device caches", or None
    read_pending: bool = False


class PagesHeld(RuntimeError):
    """A pull would read or zero into memory that a READ given up on may still write.

    Raised by ``pull`` before anything is posted; nothing moved. The pages are free
    again once NIXL reports that READ ended (every ``poll``, ``plan_pull``, ``pull`` and
    ``stats`` looks): retry later, or plan the request into other blocks. ``held`` is
    per local group the pages held, ``pulls`` the ids of the pulls whose READs hold them."""

    def __init__(self, message: str, held: Tuple[Tuple[int, ...], ...], pulls: Tuple[int, ...]):
        super().__init__(message)
        self.held = held
        self.pulls = pulls


@dataclass
class PullView:
    """What a handle shows: written by the manager, never read back by it."""

    id: int
    plan: "Plan"
    notify: bytes
    timeout_s: Optional[float]
    deadline: Optional[float]
    peers: Tuple[str, ...]
    state: str = PROC
    error: Optional[str] = None
    completed: bool = False


class PullHandle:
    """One pull in flight or finished, as its caller sees it: ``state`` (PROC, DONE or
    ERR), ``error`` (why it failed), its ``plan``, ``notify`` and deadline. Read-only
    views of what the manager wrote (see the module docstring)."""

    __slots__ = ("_view", "__weakref__")

    def __init__(self, view: PullView):
        self._view = view

    @property
    def id(self) -> int:
        return self._view.id

    @property
    def state(self) -> str:
        return self._view.state

    @property
    def error(self) -> Optional[str]:
        return self._view.error

    @property
    def completed(self) -> bool:
        return self._view.completed

    @property
    def plan(self) -> "Plan":
        return self._view.plan

    @property
    def notify(self) -> bytes:
        return self._view.notify

    @property
    def timeout_s(self) -> Optional[float]:
        return self._view.timeout_s

    @property
    def deadline(self) -> Optional[float]:
        """``time.monotonic()`` past which the pull fails at the next poll; None: none."""
        return self._view.deadline

    @property
    def peers(self) -> Tuple[str, ...]:
        return self._view.peers

    @property
    def peer(self) -> str:
        return self._view.peers[0]

    def __repr__(self) -> str:
        tail = f", error={self.error!r}" if self.error else ""
        return f"PullHandle(id={self.id}, peer={self.peer!r}, state={self.state}{tail})"
