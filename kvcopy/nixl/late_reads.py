"""READs given up on before they ended, and what they may still write.

The rule (docs/nixl.md, "Late READs", says why and where NIXL and UCX say so): memory
a READ may still write is not used for anything else until NIXL itself reports that
READ ended (``DONE`` or ``ERR``) on a handle D kept and did not release, or the local
NIXL agent, and so its UCX worker, is destroyed. Releasing a handle in flight is not a
cancel: UCX's request cancel leaves an RMA read running and the request is freed when
it completes, so a READ to a stopped peer lands whenever the peer runs again.

So a pull that fails while a READ of it is in flight (deadline, ``abort``,
``remove_peer``, a sibling READ's error, ``close``) fails for the caller at once, and
its READ handles come here instead of being released: :meth:`LateReads.abandon` counts
them on the plan's ledger record (``Issued.landing``) and, for the first, has the buffer
mode hold what the plan's READs write (arena mode: D's span is not freed; host and
device mode: their bytes are refused to later pulls). :meth:`LateReads.reap` asks NIXL
for each handle's state (no thread: the manager calls it from ``poll``, ``plan_pull``,
``pull``, ``stats`` and ``close``), releases the ended ones, and when the last READ of a
plan ended the mode lets go (``unhold``) and, if the plan is finished, frees it.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Tuple

from .modes.base import BufferMode
from .ledger import Issued
from .pull import PROC


class Abandoned(NamedTuple):
    """One READ given up on: its NIXL handle, kept; ``issued`` holds what it may write."""

    issued: Issued
    peer: str
    xfer: object
    pull_id: int


class LateReads:
    """The READs of one manager given up on and not yet reported ended."""

    def __init__(self, mode: BufferMode):
        self._mode = mode
        self._reads: List[Abandoned] = []

    def __len__(self) -> int:
        return len(self._reads)

    def abandon(self, issued: Issued, peer: str, xfer: object, pull_id: int) -> None:
        """Keep ``xfer`` (a READ of ``issued``'s plan, not ended) and hold what it may write."""
        self._reads.append(Abandoned(issued, peer, xfer, pull_id))
        issued.landing += 1
        if issued.landing == 1:
            self._mode.hold(issued.work, pull_id)

    def reap(self, state_of: Callable[[object], Tuple[str, object]], release: Callable[[object], None]) -> None:
        """Release the handles NIXL reports ended (``state_of``: DONE or ERR) and let
        go of what their plans hold once none of them may land."""
        if not self._reads:
            return
        keep = []
        for a in self._reads:
            if state_of(a.xfer)[0] == PROC:
                keep.append(a)
                continue
            release(a.xfer)
            issued = a.issued
            issued.landing -= 1
            if not issued.landing:
                self._mode.unhold(issued.work)
                if issued.finished:
                    self._mode.free(issued.work)
        self._reads = keep

    def blocks(self, num_groups: int) -> Tuple[Tuple[int, ...], ...]:
        """Per local group, the local blocks of plans with a READ that may still land."""
        held: List[set] = [set() for _ in range(num_groups)]
        for a in self._reads:
            for g, ids in enumerate(a.issued.work.local_block_ids):
                held[g].update(ids)
        return tuple(tuple(sorted(s)) for s in held)

    def drop(self, release: Callable[[object], object]) -> bool:
        """The manager closes: release every handle kept (they may land until the agent
        is destroyed) and forget them; whether there were any."""
        pending = bool(self._reads)
        for a in self._reads:
            release(a.xfer)
        self._reads = []
        return pending
