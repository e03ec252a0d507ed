"""A staging arena: one pinned host range, spans handed to requests, nothing reused early.

Layout: ``nbytes`` bytes (rounded down to a whole number of ``granule`` bytes) of one
host buffer (pinned when the KV caches are on CUDA), registered with NIXL once by the
manager. A *span* is ``[offset, offset + nbytes)`` of it, a whole number of granules,
owned by one request from ``allocate`` until ``free``; a span is never handed out
again while it is owned, so a READ still posted on it (by the peer, or by this rank)
can only ever touch that request's bytes.

Allocator: first fit over a list of free ranges kept sorted by offset, coalesced on
free (a freed span merges with its free neighbours). Why not size classes: requests of
one model differ in size by their token counts (36 MiB for a prompt of the ``seeds2``
preset of ``kvcopy-bench nixl``, 1 MiB for a short one), so power-of-two classes waste
up to half of the arena to internal fragmentation, and the arena's point is to hold as
many requests as its size allows. First fit over at most a few hundred live spans is a short Python
loop (microseconds per call; ``tests/nixl/modes/test_nixl_spans.py`` churns 64 spans in random
order).

Back-pressure: a span that does not fit raises :class:`ArenaFull`; nothing is evicted.
(``TransferManager.save(..., space_timeout_s=)`` retries until D's notifications or
the TTL free enough space, then raises.) On D a span is freed only once no READ may
still write it (:mod:`kvcopy.nixl.modes.arena`), so spans held by READs given up on count
as used here.
Metrics (:meth:`Arena.stats`): bytes in use, high-water mark, failed allocations, live
spans.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, NamedTuple, Tuple


class ArenaFull(RuntimeError):
    """No free span of the requested size: the caller retries later (nothing was dropped).
    ``ever_fits`` is False where the request is larger than the whole arena: no retry helps."""

    ever_fits: bool = True


class Span(NamedTuple):
    """``[offset, offset + nbytes)`` of the arena, owned by one request (a tuple: no
    attribute of a span handed out can be changed)."""

    offset: int
    nbytes: int


class Arena:
    """First-fit span allocator over ``[reserved, nbytes)`` in units of ``granule``
    bytes (the first ``reserved`` bytes are never handed out: the manager keeps zeros there)."""

    def __init__(self, nbytes: int, granule: int = 4096, reserved: int = 0):
        if granule <= 0:
            raise ValueError(f"arena granule {granule} must be positive")
        self.granule = int(granule)
        self.nbytes = int(nbytes) // self.granule * self.granule
        self.reserved = self.round_up(reserved)
        if self.nbytes <= self.reserved:
            raise ValueError(f"arena of {nbytes} bytes holds no {granule}-byte granule past its "
                             f"{self.reserved} reserved bytes")
        self._free_starts: List[int] = [self.reserved]  # sorted offsets of free ranges
        self._free_len: Dict[int, int] = {self.reserved: self.nbytes - self.reserved}
        self._owned: Dict[int, int] = {}  # offset -> bytes of live spans
        self.bytes_in_use = 0
        self.high_water = 0
        self.failed_allocations = 0

    def round_up(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.granule) * self.granule

    def allocate(self, nbytes: int, count_failure: bool = True) -> Span:
        """A free span of at least ``nbytes`` (rounded up to granules); raises ArenaFull
        (counted in ``failed_allocations`` unless ``count_failure`` is False: a caller
        that will retry counts only its last attempt)."""
        need = max(self.round_up(nbytes), self.granule)
        for start in self._free_starts:
            have = self._free_len[start]
            if have >= need:
                self._take(start, have, need)
                return Span(start, need)
        if need > self.nbytes - self.reserved:
            self.failed_allocations += 1
            exc = ArenaFull(f"staging arena full: {need} bytes requested, more than the whole arena "
                            f"({self.nbytes - self.reserved} bytes): make arena_bytes larger")
            exc.ever_fits = False
            raise exc
        self.failed_allocations += bool(count_failure)
        raise ArenaFull(
            f"staging arena full: {need} bytes requested, {self.nbytes - self.reserved - self.bytes_in_use} "
            f"of {self.nbytes - self.reserved} free, largest free span {max(self._free_len.values(), default=0)}"
        )

    def _take(self, start: int, have: int, need: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        del self._free_len[start]
        if have > need:
            self._free_starts.insert(i, start + need)
            self._free_len[start + need] = have - need
        self._owned[start] = need
        self.bytes_in_use += need
        self.high_water = max(self.high_water, self.bytes_in_use)

    def free(self, span: Span) -> None:
        """Give a span back (merged with free neighbours); freeing twice raises."""
        n = self._owned.get(span.offset)
        if n is None or n != span.nbytes:
            raise ValueError(f"{span} is not a live span of this arena")
        del self._owned[span.offset]
        self.bytes_in_use -= n
        start, end = span.offset, span.offset + n
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge the next free range
            end += self._free_len.pop(end)
            del self._free_starts[i]
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:  # merge into the previous free range
                self._free_len[prev] = end - prev
                return
        self._free_starts.insert(i, start)
        self._free_len[start] = end - start

    def owns(self, span: Span) -> bool:
        return self._owned.get(span.offset) == span.nbytes

    def free_ranges(self) -> List[Tuple[int, int]]:
        return [(s, self._free_len[s]) for s in self._free_starts]

    def stats(self) -> Dict[str, int]:
        return {
            "arena_bytes": self.nbytes - self.reserved,
            "bytes_in_use": self.bytes_in_use,
            "high_water": self.high_water,
            "failed_allocations": self.failed_allocations,
            "spans": len(self._owned),
        }
