"""``auto`` on a GPU: the measured choice between ``ce`` and the SM kernels, per call.

Built by :func:`kvcopy.copy_backends.choose_backend` when more than one GPU backend can run
the tables. ``prepare`` prepares every candidate (each uploads its tables; host pages
are pinned once, the later pinnings find them pinned). Each call computes its mean
descriptor size (total bytes / segments: two numpy reductions over the packed call)
and hands the call to the backend :func:`kvcopy.copy_backends.calibration.pick` names for it, from
this device's calibration table or the built-in default. ``last_choice`` says which.
A call with checksums goes to ``cuda`` (else ``triton``) whatever its size.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from ..core.tables import DST_BLOCK_STRIDE, RUN_BYTES, RUNS_PER_PAGE, SRC_BLOCK_STRIDE, CallPlan, CopyTables
from . import Backend


class _Shape:
    """Static facts the per-call estimate needs."""

    def __init__(self, tables: CopyTables):
        e = tables.entries
        merge = (e[:, SRC_BLOCK_STRIDE] == e[:, RUN_BYTES]) & (e[:, DST_BLOCK_STRIDE] == e[:, RUN_BYTES])
        chunks = e[:, RUNS_PER_PAGE]
        g = tables.num_groups
        # per group: descriptors per run (merged entries) and per block (the others)
        self.per_run = np.zeros(g, dtype=np.int64)
        self.per_block = np.zeros(g, dtype=np.int64)
        for k in range(g):
            ids = tables.group_entry_ids(k)
            self.per_run[k] = int(chunks[ids][merge[ids]].sum())
            self.per_block[k] = int(chunks[ids][~merge[ids]].sum())
        self.any_unmerged = bool(self.per_block.any())
        self.groups = g


def mean_descriptor_bytes(shape: _Shape, call: CallPlan) -> float:
    g = shape.groups
    packed = call.packed
    runs = np.diff(packed[: g + 1])
    segments = int(np.dot(shape.per_run, runs))
    if shape.any_unmerged:
        counts = packed[2 * (g + 1) + 2 :: 3]
        blocks = np.add.reduceat(counts, packed[:g][runs > 0]) if len(counts) else np.zeros(0, np.int64)
        segments += int(np.dot(shape.per_block[runs > 0], blocks))
    return call.total_bytes / max(segments, 1)


class AutoGpuBackend(Backend):
    name = "auto"

    def __init__(self, candidates: Dict[str, Backend], direction: str, table: Optional[dict]):
        self.candidates = candidates
        self.direction = direction
        self.table = table
        self.last_choice: Optional[str] = None
        self._shape: Optional[_Shape] = None

    def unsupported_reason(self, tables: CopyTables) -> Optional[str]:
        return None

    def prepare(self, tables: CopyTables) -> None:
        done: List[Backend] = []
        try:
            for b in self.candidates.values():
                b.prepare(tables)
                done.append(b)
        except BaseException:
            for b in done:
                b.release(tables)
            raise
        self._shape = _Shape(tables)

    def release(self, tables: CopyTables) -> None:
        for b in self.candidates.values():
            b.release(tables)

    def choose(self, call: CallPlan) -> str:
        from .calibration import pick

        if self._shape is None:
            raise RuntimeError("AutoGpuBackend.choose before prepare")
        size = mean_descriptor_bytes(self._shape, call)
        return pick(self.direction, size, list(self.candidates), self.table) or next(iter(self.candidates))

    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:
        if self._shape is None:
            self.prepare(tables)
        name = self.choose(call)
        self.last_choice = name
        self.candidates[name].copy(tables, call, max_ctas)

    # Checksummed calls go to an SM kernel whatever the descriptor size: the copy
    # engines never read the bytes into an SM.
    def _summing(self, tables: CopyTables) -> Optional[str]:
        return next((n for n in ("cuda", "triton") if n in self.candidates
                     and self.candidates[n].checksum_reason(tables) is None), None)

    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        if self._summing(tables) is None:
            return f"none of auto's backends ({', '.join(self.candidates)}) computes checksums"
        return None

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out, max_ctas: Optional[int] = None) -> None:
        if self._shape is None:
            self.prepare(tables)
        name = self._summing(tables)
        assert name is not None, "checked by checksum_reason before the call"
        self.last_choice = name
        self.candidates[name].copy_with_checksums(tables, call, out, max_ctas)
