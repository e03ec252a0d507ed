"""Host mode's page sums: P's ``save`` leaves them where D's READ fetches them with the pages.

Host mode reads P's mirror pages by block id, with no record per request, so P's sums
travel the way the pages do: each engine registers a **page-sums region** with NIXL and
advertises it in the handshake (:class:`~kvcopy.nixl.engine.info.SumsRegion`).

Layout: int64 slots (pinned when the KV is on a GPU), group after group
(:func:`~kvcopy.nixl.engine.regions.sum_slots`): slot ``offsets[g] + p`` holds the checksum of
page ``p`` of group ``g`` (summed over the group's layers, each keyed by its place in
the group: :mod:`kvcopy.core.checksum`) as P's last ``save`` of that page computed it, in the
same ``BlockCopier.to_host`` call that copied it (no second pass).

P (:meth:`HostSums.save`): one ``to_host(pages, checksums=out)``, then ``out`` into the
pages' slots: at once on the CPU; on CUDA once the copy ended (:class:`PendingSums`:
``save(wait=True)`` waits for the copy anyway, ``save(wait=False)`` hands it back with
the event, to finish before the blocks are advertised).

D (:meth:`HostSums.plan`): where the sums are comparable, the pull's READ gets one 8-byte
descriptor per page read, P's slot -> D's slot of that page; ``complete``
(:meth:`HostSums.complete`) runs ``to_device(pages, checksums=out)`` and compares ``out``
with its slots (read once the READ is DONE). Comparable: one peer, the peer advertises a
sums region whose fingerprint (per group: each copy entry's layer, run and key geometry,
the block bytes; tokens per page) equals D's, whole pages moved (no byte pieces, no rows
zeroed), and for each group one remote group and one page mapping. Else the request is
unchecked, with the reason.

What it does not catch beyond arena mode's limits: host mode's sums are per page, not
per request, so a P page that was never saved for this request (a stale mirror page)
comes with its own stale sum and passes; arena mode's records bind the sums to the
request. Everything between P's mirror and D's KV (the READ, D's mirror) is covered.
"""
from __future__ import annotations

import hashlib
import json
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core.copier import BlockCopier
from ...core.layout import MAX_RUN_DIMS
from ...core.tables import KEY_STRIDES, RUN_BYTES, RUN_DIMS, RUNS_PER_PAGE, CopyTables
from .base import Peer, Read
from ..engine.info import SumsRegion
from ..planning.plan import PullPlan
from ..wire.record import LAYOUT_HEX
from ..engine.regions import RegionSet, sum_slots
from ..sum_check import PendingResult, Readback, SumCheck, SumStats, mismatch_message

UNLIKE = "P's pages are not D's (page sizes, TP slices, group plans or in-page layouts differ)"
HOST_SUMS_VERSION = "kvcopy-host-sums:v2"  # v2: the page sums' word term is product_term


def fingerprint(tables: CopyTables, tokens_per_page: Sequence[int]) -> str:
    """How a copier direction sums a group's pages: equal on P (``d2h``) and D (``h2d``)
    exactly when their sums of the same host pages are equal."""
    groups = []
    for g in range(tables.num_groups):
        entries = []
        for e in tables.group_entry_ids(g).tolist():
            row = tables.entries[e]
            entries.append([tables.entry_names[e], int(row[RUN_BYTES]), int(row[RUNS_PER_PAGE]),
                            [int(row[RUN_DIMS + 3 * i]) for i in range(MAX_RUN_DIMS)],
                            [int(x) for x in row[KEY_STRIDES:KEY_STRIDES + MAX_RUN_DIMS]]])
        groups.append([int(tables.group_block_bytes[g]), entries])
    desc = {"version": HOST_SUMS_VERSION, "tokens_per_page": [int(t) for t in tokens_per_page], "groups": groups}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:LAYOUT_HEX]


class HostCheck(NamedTuple):
    """What D's ``to_device`` of one pull is compared with: D's slots of the pages read,
    in the call's order, and those pages per group (to name them)."""

    slots: np.ndarray  # int64, read-only
    pages: Tuple[Tuple[int, ...], ...]


class PendingSums(PendingResult):
    """P's sums on their way from the GPU: :meth:`result` puts them in their slots."""

    def __init__(self, readback: Readback, values: torch.Tensor, slots: np.ndarray):
        self._readback, self._values, self._slots = readback, values, slots
        self._done = False

    def ready(self) -> bool:
        return self._done or self._readback.ready()

    def result(self) -> None:
        if not self._done:
            self._values.numpy().view(np.uint64)[self._slots] = self._readback.arrays()[0]
            self._done = True


class HostSums:
    """One host-mode engine's page-sums region (see the module docstring)."""

    def __init__(self, regions: RegionSet, copier: BlockCopier, tokens_per_page: Sequence[int], pin: bool,
                 device: torch.device, stats: SumStats):
        self.offsets = sum_slots(regions.regions, len(tokens_per_page))
        self.values = torch.zeros(max(1, int(self.offsets[-1])), dtype=torch.int64, pin_memory=pin)
        self.device = device
        self.stats = stats
        self.layout_in = fingerprint(copier.tables("h2d"), tokens_per_page)
        self.region = SumsRegion(self.values.data_ptr(), 8 * int(self.offsets[-1]),
                                 fingerprint(copier.tables("d2h"), tokens_per_page))

    def rows(self) -> np.ndarray:
        """The local descriptor rows of the slots (one per slot, 8 bytes)."""
        n = int(self.offsets[-1])
        rows = np.zeros((n, 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(self.region.address) + np.arange(n, dtype=np.uint64) * np.uint64(8)
        rows[:, 1] = 8
        return rows

    def _slots(self, pages: Sequence[Sequence[int]]) -> np.ndarray:
        parts = [int(self.offsets[g]) + np.asarray(p, np.int64) for g, p in enumerate(pages)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    # P
    def save(self, copier: BlockCopier, pages: List) -> Optional[PendingSums]:
        out = torch.empty(sum(len(p) for p in pages), dtype=torch.int64, device=self.device)
        copier.to_host(pages, checksums=out)
        pending = PendingSums(Readback([out]), self.values, self._slots(pages))
        if self.device.type == "cuda":
            return pending
        pending.result()
        return None

    # D
    def plan(self, peer: Peer, plan: PullPlan, read: Read, zeroes: bool, read_pages, local_base: int):
        """(the READ with the slots' descriptors added, the check, None), or (``read``,
        None, why the pull is not compared)."""
        info = peer.info
        if info.sums is None:
            return read, None, "P sent no page sums (checksum off on P)"
        if info.sums.layout != self.layout_in or not read.prepared or zeroes:
            return read, None, UNLIKE
        remote_offsets = sum_slots(info.regions, info.num_groups)
        local, remote = [], []
        for g, pages in enumerate(read_pages):
            if not pages:
                continue
            pairs = [p for p in plan.pairs if p.local_group == g and p.local_pages]
            first = pairs[0]
            if sorted(first.local_pages) != sorted(pages) or any(
                    p.remote_group != first.remote_group or p.local_pages != first.local_pages
                    or p.remote_pages != first.remote_pages for p in pairs):
                return read, None, UNLIKE
            by_local = dict(zip(first.local_pages, first.remote_pages))
            theirs = np.array([by_local[d] for d in pages], np.int64)
            g2 = first.remote_group
            if theirs.max() >= remote_offsets[g2 + 1] - remote_offsets[g2] or \
                    max(pages) >= self.offsets[g + 1] - self.offsets[g]:
                return read, None, UNLIKE
            local.append(local_base + int(self.offsets[g]) + np.asarray(pages, np.int64))
            remote.append(int(peer.descriptor_offsets[-1]) + int(remote_offsets[g2]) + theirs)
        if not local:
            return read, None, "D reads no page of this request (all cached)"
        rows = [np.concatenate([read.local, *local]).astype(np.int32),
                np.concatenate([read.remote, *remote]).astype(np.int32)]
        for r in rows:
            r.setflags(write=False)
        slots = self._slots(read_pages)
        slots.setflags(write=False)
        return Read(read.peer, True, rows[0], rows[1]), HostCheck(slots, tuple(map(tuple, read_pages))), None

    def complete(self, copier: BlockCopier, read_pages, check: HostCheck) -> SumCheck:
        """D's copy with checksums, compared with the slots the READ filled (read now)."""
        out = torch.empty(len(check.slots), dtype=torch.int64, device=self.device)
        copier.to_device([list(p) for p in read_pages], checksums=out)
        expected = self.values.numpy().view(np.uint64)[check.slots].copy()

        def compare(arrays) -> Optional[str]:
            bad = np.flatnonzero(arrays[0] != expected)
            if not len(bad):
                return None
            ends = np.cumsum([len(p) for p in check.pages])
            named = []
            for i in bad.tolist():
                g = int(np.searchsorted(ends, i, side="right"))
                named.append((g, None, check.pages[g][i - (int(ends[g - 1]) if g else 0)]))
            return mismatch_message(named)
        return SumCheck(Readback([out]), compare, self.stats)
