"""A manager's own records of the plans it handed out and the pulls it posted.

The caller holds plans and :class:`~kvcopy.nixl.pull.PullHandle` s; the manager decides
by these records alone, found by the identity of the caller's object, so no edit of a
plan or a handle (``dataclasses.replace``, ``object.__setattr__``, an array written
through its base) reaches NIXL or memory:

* :class:`Issued`: one plan of ``plan_pull``: the peer records it was made for, the
  buffer mode's *work* (its READ rows, D's span, the scatter calls, the pages to zero:
  made by the mode with the plan and never handed out), the plan's state, and how many
  READs given up on may still land in what the work holds.
* :class:`PullRecord`: one pull: its NIXL handles not yet ended, which peers' READs
  ended, which peers were notified, its deadline and outcome.

A plan's life is a state machine; every other transition raises ``ValueError`` naming
the state the plan is in::

    planned --pull--> pulled --complete--> completed
       |
       +--discard--> discarded

A plan whose object dies while planned is discarded; a handle that dies before its pull
was completed is completed as a failure (its pull aborted first, if in flight).

What the work holds is freed when the plan is completed or discarded *and* no READ
of it may still land (``landing == 0``; see :mod:`kvcopy.nixl.manager`, "late READs").
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Set, Tuple

from .modes.base import Work
from .planning.plan import Plan
from .pull import PROC, PullHandle, PullView

PLANNED, PULLED, COMPLETED, DISCARDED = "planned", "pulled", "completed", "discarded"
_NEXT = {PLANNED: (PULLED, DISCARDED), PULLED: (COMPLETED,)}
_HINT = {
    (PULLED, DISCARDED): "a pulled plan is finished by complete() on its handle (abort() it first to give it up)",
    (PULLED, PULLED): "one pull per plan: plan_pull the request again",
    (COMPLETED, PULLED): "plan_pull the request again",
    (DISCARDED, PULLED): "plan_pull the request again",
}


class Issued:
    """One plan this manager's ``plan_pull`` returned (held weakly), the peer records it
    was made for, the buffer mode's work, the plan's state, and the READs of it given
    up on that NIXL has not reported ended (``landing``)."""

    __slots__ = ("ref", "peers", "work", "state", "landing")

    def __init__(self, ref: weakref.ref, peers: Tuple[Tuple[str, object], ...], work: Work):
        self.ref = ref
        self.peers = peers  # (name, the manager's record of that peer when the plan was made)
        self.work = work
        self.state = PLANNED
        self.landing = 0

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.peers)

    def check(self, to: str) -> None:
        """Raise ``ValueError`` unless the plan may go to state ``to`` now."""
        if to not in _NEXT.get(self.state, ()):
            need = next(state for state, nxt in _NEXT.items() if to in nxt)
            hint = _HINT.get((self.state, to), "")
            raise ValueError(f"the plan is {self.state}: only a {need} plan can be {to}"
                             + (f" ({hint})" if hint else ""))

    def advance(self, to: str) -> None:
        self.check(to)
        self.state = to

    @property
    def finished(self) -> bool:
        return self.state in (COMPLETED, DISCARDED)


class PullRecord:
    """One pull (see the module docstring); ``xfers`` holds the NIXL handles of READs
    that have not ended, ``done`` the peers whose READ ended DONE, ``notified`` the
    peers sent the pull's notification (each at most once). ``state``, ``error`` and
    ``completed`` are written through to the caller's :class:`PullView`."""

    __slots__ = ("id", "issued", "notify", "deadline", "timeout_s", "_state", "_error", "_completed", "xfers",
                 "done", "notified", "posted", "handle", "view")

    def __init__(self, id_: int, issued: Issued, plan: Plan, notify: bytes, timeout_s: Optional[float],
                 deadline: Optional[float]):
        self.id = id_
        self.issued = issued
        self.notify = notify
        self.timeout_s = timeout_s
        self.deadline = deadline
        self._state = PROC
        self._error: Optional[str] = None
        self._completed = False
        self.xfers: Dict[str, object] = {}
        self.done: Set[str] = set()
        self.notified: Set[str] = set()
        self.posted = False  # a READ was handed to NIXL (it may write the plan's local pages)
        self.handle: Optional[weakref.ref] = None
        # the caller's plan object is shown by the handle, never read by the manager
        self.view = PullView(id_, plan, notify, timeout_s, deadline, issued.names)

    @property
    def peers(self) -> Tuple[str, ...]:
        return self.issued.names

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = self.view.state = value

    @property
    def error(self) -> Optional[str]:
        return self._error

    @error.setter
    def error(self, value: Optional[str]) -> None:
        self._error = self.view.error = value

    @property
    def completed(self) -> bool:
        return self._completed

    @completed.setter
    def completed(self, value: bool) -> None:
        self._completed = self.view.completed = value


class Ledger:
    """The plans and pulls of one manager, by the identity of the caller's objects.

    Entries go when the caller's object dies (weak references; the callbacks only queue,
    so the manager acts on them at its next call, in its own thread: :meth:`dropped`)."""

    def __init__(self) -> None:
        self._plans: Dict[int, Issued] = {}
        self._pulls: Dict[int, PullRecord] = {}
        self._dead_plans: List[Issued] = []
        self._dead_pulls: List[PullRecord] = []

    # ------------------------------------------------------------ plans
    def bind(self, plan: Plan, peers: Tuple[Tuple[str, object], ...], work: Work) -> Issued:
        key, plans, dead = id(plan), self._plans, self._dead_plans

        def forget(ref, key=key, plans=plans, dead=dead):  # no reference to the manager: no cycle
            entry = plans.get(key)
            if entry is not None and entry.ref is ref:
                del plans[key]
                if entry.state == PLANNED:
                    dead.append(entry)

        issued = Issued(weakref.ref(plan, forget), peers, work)
        plans[key] = issued
        return issued

    def issued(self, plan, who: str) -> Issued:
        """The record of ``plan``; ``ValueError`` unless it is a plan this manager made."""
        entry = self._plans.get(id(plan)) if isinstance(plan, Plan) else None
        if entry is None or entry.ref() is not plan:
            raise ValueError(
                f"{type(plan).__name__} is not a plan made by TransferManager {who!r}'s plan_pull "
                "(plans are bound to the manager that made them; an edited or copied plan is refused)")
        return entry

    # ------------------------------------------------------------ pulls
    def add_pull(self, record: PullRecord) -> PullHandle:
        handle = PullHandle(record.view)
        key, pulls, dead = id(handle), self._pulls, self._dead_pulls

        def forget(ref, key=key, pulls=pulls, dead=dead):
            entry = pulls.get(key)
            if entry is not None and entry.handle is ref:
                del pulls[key]
                if not entry.completed:
                    dead.append(entry)

        record.handle = weakref.ref(handle, forget)
        pulls[key] = record
        return handle

    def pull(self, handle, who: str) -> PullRecord:
        """The record of ``handle``; ``ValueError`` unless this manager's ``pull`` made it."""
        entry = self._pulls.get(id(handle)) if isinstance(handle, PullHandle) else None
        if entry is None or entry.handle is None or entry.handle() is not handle:
            raise ValueError(f"{handle!r} is not a pull of TransferManager {who!r}")
        return entry

    def dropped(self, discard: Callable[[Issued], None], complete: Callable[[PullRecord], None]) -> None:
        """Act on the plans and handles the caller dropped since the last call."""
        while self._dead_plans:
            entry = self._dead_plans.pop()
            if entry.state == PLANNED:
                discard(entry)
        while self._dead_pulls:
            complete(self._dead_pulls.pop())
