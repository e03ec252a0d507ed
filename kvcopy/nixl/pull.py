"""A pull as the caller holds it (:class:`PullHandle`), what ``complete`` did
(:class:`Completion`), and the refusal of a pull into memory a READ may still write
(:class:`PagesHeld`).

A :class:`Completion` may carry a page-sums comparison still to be made (CUDA: the
sums are on their way to host memory); its fields wait for it, ``ready`` never does.

A :class:`PullHandle` shows a :class:`PullView` the manager writes and never reads:
everything the manager decides by (the pull's state, its NIXL handles, its plan's pages
and span) lives in its own record of the pull (:mod:`kvcopy.nixl.ledger`), found by the
handle's identity. Setting an attribute of a handle or of its view, even with
``object.__setattr__``, changes what the caller sees, never what the manager reads or
writes. ``state`` goes ``PROC`` -> ``DONE`` or ``ERR`` once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from .planning.plan import Plan

PROC, DONE, ERR = "PROC", "DONE", "ERR"


class _Outcome(NamedTuple):
    ok: bool
    failed_block_ids: Tuple[Tuple[int, ...], ...]
    error: Optional[str]
    written_pages: Tuple[Tuple[int, ...], ...]
    written_in: Optional[str]
    read_pending: bool
    checked: bool
    unchecked: Optional[str]


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

    Checksums (docs/nixl.md, "Checksums"): ``checked`` says the pages the pull wrote
    were compared with the sums P computed; a mismatch makes the completion a failure
    (``ok`` False, ``error`` naming the group, page position and local page) whose
    ``written_pages`` (the pages read and zeroed) are in ``"device caches"``: the
    copy wrote them before the comparison could be made. ``unchecked`` says why an ok
    pull was not compared (None when it was). On CUDA the comparison needs the copy's
    sums in host memory: ``ready`` says (without waiting) whether they are; reading
    ``ok``, ``error``, ``failed_block_ids``, ``written_pages``, ``written_in`` or
    ``checked`` before that **waits** for the copy (a CUDA event). Poll ``ready`` to
    never wait. On the CPU, ``ready`` is always True.
    """

    __slots__ = ("_outcome", "_check", "_if_failed")

    def __init__(self, ok: bool, failed_block_ids, error: Optional[str] = None, written_pages=(),
                 written_in: Optional[str] = None, read_pending: bool = False, checked: bool = False,
                 unchecked: Optional[str] = None, *, check=None, if_failed: Optional[_Outcome] = None):
        self._outcome = _Outcome(ok, failed_block_ids, error, written_pages, written_in, read_pending, checked,
                                 unchecked)
        self._check = check  # a kvcopy.nixl.sum_check.SumCheck still to be made, or None
        self._if_failed = if_failed  # the outcome should it find a mismatch

    @classmethod
    def of_done(cls, groups: int, check, unchecked: Optional[str], work) -> "Completion":
        """An ok pull of a plan's ``work`` (``check``: its sums comparison, which may
        still fail it, naming its blocks and the pages the copy wrote)."""
        none = tuple(() for _ in range(groups))
        if check is None:
            return cls(True, none, None, unchecked=unchecked)
        written = tuple(tuple(r) + tuple(z) for r, z in zip(work.read_pages, work.zero_pages))
        failed = _Outcome(False, work.local_block_ids, None, written, "device caches", False, True, None)
        return cls(True, none, None, checked=True, check=check, if_failed=failed)

    @classmethod
    def of_failed(cls, work, error: Optional[str], written_in: Optional[str], read_pending: bool) -> "Completion":
        """A failed pull of a plan's ``work`` whose READs may have written ``written_in``
        (None: nowhere that outlives the request, or no READ was posted)."""
        if written_in is None:
            return cls(False, work.local_block_ids, error, read_pending=read_pending)
        return cls(False, work.local_block_ids, error, work.read_pages, written_in, read_pending)

    @property
    def ready(self) -> bool:
        """Every field can be read without waiting (see the class docstring)."""
        return self._check is None or self._check.ready()

    def _final(self) -> _Outcome:
        if self._check is not None:
            error = self._check.result()  # waits on CUDA while not ready
            if error is not None and self._if_failed is not None:
                self._outcome = self._if_failed._replace(error=error)
            self._check = self._if_failed = None
        return self._outcome

    @property
    def ok(self) -> bool:
        return self._final().ok

    @property
    def failed_block_ids(self) -> Tuple[Tuple[int, ...], ...]:
        """Per local group; empty tuples when ok."""
        return self._final().failed_block_ids

    @property
    def error(self) -> Optional[str]:
        return self._final().error

    @property
    def written_pages(self) -> Tuple[Tuple[int, ...], ...]:
        """Per local group, failed pulls only."""
        return self._final().written_pages

    @property
    def written_in(self) -> Optional[str]:
        """``"host buffers"``, ``"device caches"``, or None."""
        return self._final().written_in

    @property
    def read_pending(self) -> bool:
        return self._outcome.read_pending

    @property
    def checked(self) -> bool:
        return self._final().checked

    @property
    def unchecked(self) -> Optional[str]:
        return self._outcome.unchecked

    def __repr__(self) -> str:
        if not self.ready:
            return "Completion(checksum comparison pending)"
        o = self._final()
        return (f"Completion(ok={o.ok}, error={o.error!r}, checked={o.checked}"
                + (f", unchecked={o.unchecked!r}" if o.unchecked else "") + ")")


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
