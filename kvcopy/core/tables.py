"""The tables every backend consumes: static entry tables and the packed per-call runs.

Static, built once per copier and direction (:class:`CopyTables`):

* ``entries``: int64 ``[E, 20]``, one row per copied layer, deduplicated by storage
  within a group (two names for the same bytes are copied once). Columns, in the order
  of ``kernels/block_copy.cuh``'s ``EntryField`` (bytes throughout): src base address,
  dst base address, src block stride, dst block stride, run bytes, runs per page, then
  three nested run dims ``(count, src stride, dst stride)``, outermost first, one
  zero, then the three dims' **key strides** and two zeros. A page is ``runs per
  page`` runs of ``run bytes``, run ``r`` at the offsets its digits over the dims
  give (:class:`kvcopy.core.layout.PagePairing`, computed here once per entry from both
  sides' layouts): one run per page when both sides order a dense page alike, two for
  KV-first, ``C``-element runs for a head-major page against a token-major one.
  Addresses are ``data_ptr()`` values: host pointers of pinned memory are valid on the
  device under unified addressing. The key strides place run ``r``
  in the *staging* side's page (the host buffer: ``staging="dst"`` for ``d2h``,
  ``"src"`` for ``h2d``) counted densely, chunk ``c`` of a chunked page at ``c x
  chunk bytes`` whatever its chunk stride: the position :mod:`kvcopy.core.checksum` keys
  each word with, so both copies of a transfer (P's ``d2h``, D's ``h2d``) agree.
* ``group_offsets`` int64 ``[G+1]`` and ``group_entries``: group ``g`` copies entries
  ``group_entries[group_offsets[g]:group_offsets[g+1]]``, its layer mask. A layer in no
  group (KV-sharing) has no entry and is never touched.

Per call (:class:`CallPlan`, made by :class:`kvcopy.core.planner.CallPlanner`), one int64
array so a GPU backend uploads it in one copy: ``[run_offsets (G+1) | item_offsets
(G+1) | runs (R x 3)]``, followed in the same buffer by the block prefix (R+1 words:
blocks in the runs before run ``r``) that the ``cuda`` kernel reads. A run is ``(src
first block, dst first block, count)``: consecutive ids on both sides merge into one
run, so a run of adjacent pages moves as one large segment. Item ``i`` is one (entry,
run) pair; ``item_offsets[g+1] - item_offsets[g] = entries(g) * runs(g)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import native
from .layout import MAX_RUN_DIMS, PageLayout, PagePairing, alignment, pair_pages

# The row's columns; they and its width (native.ENTRY_FIELDS) are defined once, in
# kernels/entry_layout.cuh.
_COLUMN = native.ENTRY_COLUMNS
SRC_BASE, DST_BASE = _COLUMN["SrcBase"], _COLUMN["DstBase"]
SRC_BLOCK_STRIDE, DST_BLOCK_STRIDE = _COLUMN["SrcBlockStride"], _COLUMN["DstBlockStride"]
RUN_BYTES, RUNS_PER_PAGE = _COLUMN["RunBytes"], _COLUMN["RunsPerPage"]
RUN_DIMS = _COLUMN["RunDims"]  # first of MAX_RUN_DIMS x (count, src stride, dst stride) columns
KEY_STRIDES = _COLUMN["KeyStrides"]  # MAX_RUN_DIMS columns: each dim's stride in the staging page counted densely


@dataclass
class CopyTables:
    """Static description of one direction of a copier."""

    entries: np.ndarray  # int64 [E, 20]
    group_offsets: np.ndarray  # int64 [G+1]
    group_entries: np.ndarray  # int64 [sum]
    src_tensors: List[torch.Tensor]  # per entry (kept alive: the table holds raw addresses)
    dst_tensors: List[torch.Tensor]
    src_block_dims: List[int]
    dst_block_dims: List[int]
    entry_names: List[str]  # a layer name per entry, for messages
    src_device: torch.device
    dst_device: torch.device
    word_bytes: int  # widest word (<= 16) every address, stride and size is aligned to
    group_block_bytes: np.ndarray  # int64 [G]: bytes one block id moves in group g
    max_ctas: Optional[int] = None  # grid cap of the kernel backends (CopyOptions.max_ctas; None: uncapped)
    staging: str = "dst"  # the side whose pages key the checksums (the host buffers)
    backend_state: dict = field(default_factory=dict)  # what backends cache per table

    @property
    def num_groups(self) -> int:
        return len(self.group_offsets) - 1

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def group_entry_ids(self, g: int) -> np.ndarray:
        return self.group_entries[self.group_offsets[g] : self.group_offsets[g + 1]]

    def max_run_bytes(self) -> int:
        return int(self.entries[:, RUN_BYTES].max()) if len(self.entries) else 0

    def min_run_bytes(self) -> int:
        return int(self.entries[:, RUN_BYTES].min()) if len(self.entries) else 0

    def page_bytes(self) -> np.ndarray:
        """int64 [E]: bytes one block moves per entry."""
        return self.entries[:, RUN_BYTES] * self.entries[:, RUNS_PER_PAGE]

    def abi_struct(self, entry_bytes_prefix: Optional[np.ndarray] = None) -> native.Tables:
        """The ``kvcopy_tables`` struct over these arrays, the host C functions' first
        argument (valid while this object and ``entry_bytes_prefix`` live)."""
        prefix = 0 if entry_bytes_prefix is None else entry_bytes_prefix.ctypes.data
        return native.Tables.make(entries=self.entries.ctypes.data, group_offsets=self.group_offsets.ctypes.data,
                                  group_entries=self.group_entries.ctypes.data, num_groups=self.num_groups,
                                  entry_bytes_prefix=prefix)


def build_tables(
    group_entry_lists: Sequence[Sequence[int]],
    src: Sequence[Tuple[torch.Tensor, PageLayout]],
    dst: Sequence[Tuple[torch.Tensor, PageLayout]],
    names: Sequence[str],
    staging: str = "dst",
) -> CopyTables:
    """Tables for entries ``src[i] -> dst[i]``; group g copies ``group_entry_lists[g]``.
    ``staging`` ("src" or "dst") names the side whose page order keys the checksums."""
    if staging not in ("src", "dst"):
        raise ValueError(f"staging must be 'src' or 'dst', got {staging!r}")
    rows = []
    for (st, sl), (dt, dl), name in zip(src, dst, names):
        try:
            pair = pair_pages(sl, dl)
        except ValueError as exc:
            raise ValueError(f"layer {name!r}: {exc}") from None
        row = [st.data_ptr(), dt.data_ptr(), sl.block_stride, dl.block_stride,
               pair.run_bytes, pair.runs_per_page]
        for dim in pair.dims:
            row.extend(dim)
        row.append(0)
        row.extend(key_strides(pair, sl if staging == "src" else dl, staging))
        rows.append(row + [0] * (native.ENTRY_FIELDS - len(row)))
    entries = np.array(rows, dtype=np.int64).reshape(-1, native.ENTRY_FIELDS)
    offsets = np.zeros(len(group_entry_lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(e) for e in group_entry_lists])
    flat = np.array([i for e in group_entry_lists for i in e], dtype=np.int64)
    # The widest word dividing every address, stride and size the item body adds up
    # (counts excluded; trivial dims' zero strides divide by anything).
    sized = [SRC_BASE, DST_BASE, SRC_BLOCK_STRIDE, DST_BLOCK_STRIDE, RUN_BYTES]
    sized += [RUN_DIMS + 3 * k + j for k in range(MAX_RUN_DIMS) for j in (1, 2)]
    word = alignment(*entries[:, sized].ravel().tolist()) if len(entries) else 16
    page_bytes = entries[:, RUN_BYTES] * entries[:, RUNS_PER_PAGE]
    group_bytes = np.array([int(page_bytes[list(e)].sum()) for e in group_entry_lists], dtype=np.int64)
    src_dev = src[0][0].device if src else torch.device("cpu")
    dst_dev = dst[0][0].device if dst else torch.device("cpu")
    return CopyTables(
        entries=entries,
        group_offsets=offsets,
        group_entries=flat,
        src_tensors=[t for t, _ in src],
        dst_tensors=[t for t, _ in dst],
        src_block_dims=[l.block_dim for _, l in src],
        dst_block_dims=[l.block_dim for _, l in dst],
        entry_names=list(names),
        src_device=src_dev,
        dst_device=dst_dev,
        word_bytes=word,
        group_block_bytes=group_bytes,
        staging=staging,
    )


def key_strides(pair: PagePairing, staging_layout: PageLayout, staging: str) -> List[int]:
    """Per run dim (outermost first): its stride on the staging side with the page's
    chunks counted densely (chunk stride -> chunk bytes). A run's digits times these
    give its byte position in the staging page read chunk after chunk: runs are
    contiguous there and tile it, so run ``r`` in that order starts at ``r x run bytes``."""
    side = 2 if staging == "dst" else 1
    cs, cb = staging_layout.chunk_stride, staging_layout.chunk_bytes
    out = []
    for dim in pair.dims:
        stride = dim[side]
        out.append((stride // cs) * cb + stride % cs if staging_layout.num_chunks > 1 and cs > 0 else stride)
    return out


class CallPlan:
    """One call's checked ids and their packed runs, as its planner made them; immutable.

    Made only by :class:`kvcopy.core.planner.CallPlanner` (through ``BlockCopier.plan``,
    ``to_host`` and ``to_device``), and run as it is: a backend hands :attr:`words` to C
    code and kernels without looking at it again. So nothing reachable from a plan can
    change: its attributes cannot be set or deleted, its buffers are ``bytes``, and
    the arrays it hands out are read-only numpy views of those bytes (numpy refuses to
    make a view of ``bytes`` writable). ``BlockCopier.run`` takes only the plans of its
    own direction's planner (:attr:`origin`, an opaque token).

    :attr:`words` is the kernels' call array: the packed call (:attr:`packed`,
    ``[run_offsets | item_offsets | runs]``) followed by the block prefix over its runs
    (:attr:`prefix_words` = runs + 1 words).
    """

    __slots__ = ("_fields",)
    # (words, packed words, runs, items, src ids, dst ids, group lens, groups, total
    # bytes, origin), set once by call_plan()
    _fields: Tuple[Any, ...]

    def __setattr__(self, name, value):
        raise AttributeError(f"CallPlan is immutable: cannot set {name!r} (plan the call again)")

    def __delattr__(self, name):
        raise AttributeError(f"CallPlan is immutable: cannot delete {name!r}")

    def __copy__(self) -> "CallPlan":
        return self

    def __deepcopy__(self, memo) -> "CallPlan":
        return self

    def __repr__(self) -> str:
        return (f"CallPlan(groups={self.num_groups}, ids={list(self.group_lens)}, runs={self.num_runs}, "
                f"items={self.num_items}, total_bytes={self.total_bytes})")

    @property
    def words(self) -> bytes:
        """The call array: packed call, then block prefix (int64, native byte order)."""
        return self._fields[0]

    @property
    def packed(self) -> np.ndarray:
        """The packed call (read-only int64 view of :attr:`words`)."""
        return np.frombuffer(self._fields[0], dtype=np.int64, count=self._fields[1])

    @property
    def prefix_words(self) -> int:
        return self._fields[2] + 1

    @property
    def num_words(self) -> int:
        """Words of the call array: the packed call and its block prefix."""
        return self._fields[1] + self._fields[2] + 1

    @property
    def num_runs(self) -> int:
        return self._fields[2]

    @property
    def num_items(self) -> int:
        return self._fields[3]

    @property
    def num_blocks(self) -> int:
        """Blocks of the call, every group's (``len(src_flat)``, without making an array:
        the checksummed calls ask right after a copy, where each numpy call costs)."""
        return len(self._fields[4]) // 8

    @property
    def src_flat(self) -> np.ndarray:
        """Every group's source ids concatenated (read-only int64)."""
        return np.frombuffer(self._fields[4], dtype=np.int64)

    @property
    def dst_flat(self) -> np.ndarray:
        return np.frombuffer(self._fields[5], dtype=np.int64)

    @property
    def group_lens(self) -> Tuple[int, ...]:
        return self._fields[6]

    @property
    def num_groups(self) -> int:
        return self._fields[7]

    @property
    def total_bytes(self) -> int:
        return self._fields[8]

    @property
    def origin(self) -> object:
        """The token of the planner that made this plan."""
        return self._fields[9]

    @property
    def src_ids(self) -> List[np.ndarray]:
        """Per-group source ids (read-only numpy views)."""
        return self._split(self.src_flat)

    @property
    def dst_ids(self) -> List[np.ndarray]:
        return self._split(self.dst_flat)

    def _split(self, flat: np.ndarray) -> List[np.ndarray]:
        return np.split(flat, np.cumsum(np.asarray(self.group_lens, dtype=np.int64))[:-1])

    def run_offsets(self) -> np.ndarray:
        return self.packed[: self.num_groups + 1]

    def item_offsets(self) -> np.ndarray:
        return self.packed[self.num_groups + 1 : 2 * (self.num_groups + 1)]

    def runs(self) -> np.ndarray:
        return self.packed[2 * (self.num_groups + 1) :].reshape(-1, 3)


_new_plan = object.__new__
_set_fields = CallPlan.__dict__["_fields"].__set__


def call_plan(words: bytes, packed_words: int, runs: int, items: int, src: bytes, dst: bytes,
              group_lens: Tuple[int, ...], total_bytes: int, origin: object) -> CallPlan:
    """A :class:`CallPlan` over the planner's buffers (for :mod:`kvcopy.core.planner` only)."""
    plan = _new_plan(CallPlan)
    _set_fields(plan, (words, packed_words, runs, items, src, dst, group_lens, len(group_lens), total_bytes,
                       origin))
    return plan
