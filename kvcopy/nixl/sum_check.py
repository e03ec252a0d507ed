"""Comparing the page sums of a transfer's two copies, without a hidden host wait.

The copies compute their page checksums as they move the bytes (:mod:`kvcopy.core.checksum`),
into int64 tensors on the copy's device. Comparing them is host work, so the sums must
reach host memory first:

* a CPU copy is synchronous: its sums are there when it returns (:class:`Readback`
  holds them as they are);
* a CUDA copy is enqueued: :class:`Readback` enqueues one device-to-host copy of every
  sums tensor into one pinned buffer on the same stream, right after the copy, and
  records an event. ``ready()`` asks the event (no wait); ``arrays()`` waits for it:
  the one host wait, taken only by whoever asks for the values.

:class:`SumCheck` is one request's comparison (a function of the arrays, made when the
request was planned), computed once, when first asked, and counted in
:class:`SumStats` exactly once. A caller that never asks is counted when
:meth:`SumStats.settle` finds its event complete (the manager's ``stats()``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch


class Readback:
    """The sums tensors of one set of copies, on their way to host memory."""

    __slots__ = ("_event", "_host", "_sizes", "_arrays")

    def __init__(self, outs: Sequence[torch.Tensor]):
        self._sizes = [int(o.numel()) for o in outs]
        self._event = None
        self._host: Optional[torch.Tensor] = None
        self._arrays: Optional[List[np.ndarray]] = None
        if any(o.device.type == "cuda" for o in outs):
            self._host = torch.empty(sum(self._sizes), dtype=torch.int64, pin_memory=True)
            at = 0
            for o, n in zip(outs, self._sizes):
                self._host[at:at + n].copy_(o, non_blocking=True)
                at += n
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._arrays = [o.numpy().view(np.uint64) for o in outs]

    def ready(self) -> bool:
        """The sums are in host memory (never waits)."""
        return self._event is None or bool(self._event.query())

    def arrays(self) -> List[np.ndarray]:
        """The sums as uint64 arrays, one per tensor (waits for the copy on CUDA)."""
        if self._arrays is None:
            assert self._event is not None and self._host is not None
            self._event.synchronize()
            flat = self._host.numpy().view(np.uint64)
            ends = np.cumsum(self._sizes)
            self._arrays = [flat[e - n:e] for e, n in zip(ends.tolist(), self._sizes)]
        return self._arrays


class Arriving(Protocol):
    """Sums on their way to host memory, as :class:`SumCheck` reads them: a
    :class:`Readback`, or a chunked push's :class:`~kvcopy.nixl.modes.push_units.UnitSums`."""

    def ready(self) -> bool:
        """They can be read without waiting."""

    def arrays(self) -> List[np.ndarray]:
        """They, waiting for them if not ready."""


class SumStats:
    """Per manager: requests whose sums were compared and matched (``checked``), compared
    and differed (``failed``), not compared (``unchecked``), and comparisons not yet
    made (``pending``: their sums are still on the way)."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {"checked": 0, "failed": 0, "unchecked": 0}
        self._pending: List["SumCheck"] = []

    def unchecked(self) -> None:
        self.counts["unchecked"] += 1

    def settle(self) -> None:
        """Make the comparisons whose sums arrived (none waits)."""
        for check in [c for c in self._pending if c.ready()]:
            check.result()

    def as_dict(self) -> Dict[str, int]:
        self.settle()
        out = {f"checksum_{k}": v for k, v in self.counts.items()}
        out["checksum_pending"] = len(self._pending)
        return out


class SumCheck:
    """One request's comparison: ``compare(arrays)`` gives None (every page matched) or
    the message naming the pages that differ. Made once, counted once."""

    __slots__ = ("_readback", "_compare", "_stats", "_result", "_done")

    def __init__(self, readback: Arriving, compare: Callable[[List[np.ndarray]], Optional[str]], stats: SumStats):
        self._readback = readback
        self._compare = compare
        self._stats = stats
        self._result: Optional[str] = None
        self._done = False
        stats._pending.append(self)

    @classmethod
    def made(cls, result: Optional[str], stats: SumStats) -> "SumCheck":
        """A comparison already made (in the copy's own host call), counted now."""
        check = cls.__new__(cls)
        check._readback = check._compare = None  # type: ignore[assignment]
        check._stats = stats
        check._result = result
        check._done = True
        stats.counts["failed" if result else "checked"] += 1
        return check

    def ready(self) -> bool:
        """The comparison can be made without waiting."""
        return self._done or self._readback.ready()

    def result(self) -> Optional[str]:
        """None if every compared page matched, else what differs (waits for the sums on CUDA)."""
        if not self._done:
            self._result = self._compare(self._readback.arrays())
            self._done = True
            self._stats._pending.remove(self)
            self._stats.counts["failed" if self._result else "checked"] += 1
            self._readback = self._compare = None  # type: ignore[assignment]
        return self._result


def mismatch_message(bad: Sequence[tuple], limit: int = 4) -> str:
    """``bad``: (group, page position or None, local page) of each page whose sums differ."""
    shown = ", ".join(f"group {g} page position {k} (local page {p})" if k is not None else f"group {g} local page {p}"
                      for g, k, p in bad[:limit])
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return (f"checksum mismatch: the bytes D received differ from those P staged in {len(bad)} page(s): "
            f"{shown}{more}")


class PendingResult:
    """What ``save`` hands back while its page sums are on their way from the GPU
    (``save(wait=False)`` on CUDA with checksums): :meth:`ready` never waits;
    :meth:`result` waits for the copy if it has not ended, and finishes the save."""

    def ready(self) -> bool:
        raise NotImplementedError

    def result(self):
        raise NotImplementedError


def finished(value):
    """``value``, or what a :class:`PendingResult` gives (waiting if needed)."""
    return value.result() if isinstance(value, PendingResult) else value


class ChecksumRequired(ValueError):
    """``require_checksum``: the pull would read pages whose page sums cannot be compared
    (``Completion.unchecked`` would say why); refused before anything moved."""


def unchecked_refusal(work) -> Optional[ChecksumRequired]:
    """The refusal of a planned pull (a mode's work) that reads pages it will not compare,
    or None (also for a pull that reads none: it has nothing to check)."""
    if work.unchecked is None or not any(work.read_pages):
        return None
    return ChecksumRequired(f"require_checksum: this pull's pages cannot be compared ({work.unchecked}); "
                            "refused before anything was read")


# What a buffer mode's complete() returns when nothing was copied (a failed pull).
NOT_WRITTEN: Tuple[Optional[SumCheck], Optional[str]] = (None, "nothing was written")
