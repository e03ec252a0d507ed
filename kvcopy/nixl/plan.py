"""Pull plans: which of P's pages land in which of D's pages, chosen by token position.

Block lists, on both sides, are per KV cache group and anchored at token 0: entry
``i`` of a group's list is the logical block holding tokens ``[i * B, (i + 1) * B)``
(``B`` = that side's tokens per block). ``NO_BLOCK`` (-1) marks a position the side
does not hold (a sliding-window group's blocks outside the window). Entries past the
last token are spare capacity. Each logical block ``b`` is ``r = B // tokens_per_page``
kernel pages ``b*r ... b*r + r - 1``; expanding gives each side's pages by page
position, and page position ``k`` holds tokens ``[k * T, (k + 1) * T)``.

For one (local group, remote group) pair, with ``N = remote_num_tokens`` and
``C = num_cached_tokens`` (D's prefix hit for that local group):

* **read**: positions ``k`` from ``C // T`` (whole cached pages are skipped) to
  ``ceil(N / T) - 1`` where D has a page; P must have one there too, else the plan
  raises. A partial last page moves whole (its unused rows too).
* **zero**: positions where D has a page whose first token is at or past
  ``max(N, C)``: allocated, holding no prompt token, not read (seeds/3's
  ``region_blocks_to_zero``).
* everything else (cached pages, P's spare capacity, positions D does not hold) is
  neither read nor written. P's spare pages at the end never shift the selection:
  seeds/3's 160-token prompt over P's 128-token blocks of 64-token pages reads P's
  pages 0, 1, 2, never "the last three".

A :class:`PullPlan` holds one :class:`RegionPair` per (local region, remote region)
of each group pair, each with its local and remote page ids and its pages to zero;
it is plain data, printable, and everything :func:`kvcopy.nixl.replay` needs to
apply it to CPU tensors. Within a chunk of a page pair, ``segments`` says which bytes
move: ``(local offset, remote offset, bytes)``; this version always moves whole
chunks. Heterogeneous P/D (different page sizes, head ranges) grows here: a page
pair moving a token slice or a head range is a region pair with other segments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .handshake import EngineInfo, LayerPair
from .regions import RegionInfo

NO_BLOCK = -1


@dataclass(frozen=True)
class RegionRef:
    """The addressing of one region, as a plan needs it (offsets relative to page 0)."""

    index: int
    num_pages: int
    num_chunks: int
    chunk_bytes: int
    page_stride: int
    chunk_stride: int

    @classmethod
    def of(cls, r: RegionInfo) -> "RegionRef":
        return cls(r.index, r.num_pages, r.num_chunks, r.chunk_bytes, r.page_stride, r.chunk_stride)


@dataclass(frozen=True)
class RegionPair:
    """One local region filled from one remote region, page by page."""

    local_group: int
    remote_group: int
    layers: Tuple[str, ...]  # layer names, the same on both sides
    local: RegionRef
    remote: RegionRef
    local_pages: Tuple[int, ...]
    remote_pages: Tuple[int, ...]  # remote_pages[i] is read into local_pages[i]
    pages_to_zero: Tuple[int, ...]  # local pages allocated but not read
    segments: Tuple[Tuple[int, int, int], ...] = ()  # (local off, remote off, bytes) per chunk; () = whole

    def byte_segments(self) -> Tuple[Tuple[int, int, int], ...]:
        return self.segments or ((0, 0, self.local.chunk_bytes),)

    @property
    def num_bytes(self) -> int:
        per_chunk = sum(n for _, _, n in self.byte_segments())
        return len(self.local_pages) * self.local.num_chunks * per_chunk


@dataclass(frozen=True)
class PullPlan:
    """One request's pull from one peer (see the module docstring)."""

    peer: str
    remote_num_tokens: int
    num_cached_tokens: Tuple[int, ...]  # per local group
    pairs: Tuple[RegionPair, ...]
    read_pages: Tuple[Tuple[int, ...], ...]  # per local group: pages complete() copies to the device
    zero_pages: Tuple[Tuple[int, ...], ...]  # per local group: pages complete() zeroes
    local_block_ids: Tuple[Tuple[int, ...], ...]  # per local group: logical blocks this pull writes
    extra: Dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pairs)

    @property
    def empty(self) -> bool:
        return not any(p.local_pages for p in self.pairs)

    def __str__(self) -> str:
        lines = [
            f"PullPlan from {self.peer!r}: {self.remote_num_tokens} tokens, cached "
            f"{list(self.num_cached_tokens)}, {len(self.pairs)} region pair(s), {self.num_bytes} bytes"
        ]
        for p in self.pairs:
            lines.append(
                f"  group {p.local_group}<-{p.remote_group} region {p.local.index}<-{p.remote.index} "
                f"{list(p.layers)}: pages {_runs(p.local_pages)} <- {_runs(p.remote_pages)}"
                + (f", zero {_runs(p.pages_to_zero)}" if p.pages_to_zero else "")
            )
        return "\n".join(lines)


def _runs(ids: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5,9"``."""
    if not len(ids):
        return "-"
    out, start, prev = [], ids[0], ids[0]
    for x in list(ids[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def expand_blocks(block_ids: Sequence[int], pages_per_block: int) -> np.ndarray:
    """Logical block ids -> kernel page ids by page position (``NO_BLOCK`` stays)."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    pages = ids[:, None] * pages_per_block + np.arange(pages_per_block, dtype=np.int64)
    pages[ids == NO_BLOCK] = NO_BLOCK
    return pages.reshape(-1)


def select_pages(
    local_pages: np.ndarray, remote_pages: np.ndarray, tokens_per_page: int, num_tokens: int,
    num_cached_tokens: int, where: str = "",
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(read positions, local pages read, remote pages read, local pages to zero) by token position."""
    n_pages = -(-num_tokens // tokens_per_page)
    first = num_cached_tokens // tokens_per_page
    positions = np.arange(first, min(n_pages, len(local_pages)), dtype=np.int64)
    positions = positions[local_pages[positions] != NO_BLOCK]
    lacking = positions[(positions >= len(remote_pages))]
    if not len(lacking):
        held = remote_pages[positions]
        lacking = positions[held == NO_BLOCK]
    if len(lacking):
        k = int(lacking[0])
        raise ValueError(
            f"{where}: D needs tokens [{k * tokens_per_page}, {(k + 1) * tokens_per_page}) of the "
            f"{num_tokens}-token prompt but P holds no page there ({len(remote_pages)} page positions, "
            f"{int((remote_pages != NO_BLOCK).sum())} held)"
        )
    zero_from = -(-max(num_tokens, num_cached_tokens) // tokens_per_page)
    tail = local_pages[zero_from:]
    return positions, local_pages[positions], remote_pages[positions], tail[tail != NO_BLOCK]


def _id_lists(ids, n_groups: int, what: str) -> List[np.ndarray]:
    if isinstance(ids, (str, bytes)) or len(ids) != n_groups:
        raise ValueError(f"{what}: expected one block id list per KV cache group ({n_groups})")
    out = []
    for g, lst in enumerate(ids):
        arr = np.asarray(lst)
        if arr.ndim != 1:
            raise ValueError(f"{what}, group {g}: block ids must be a flat list")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{what}, group {g}: block ids must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64)
        if arr.size and (arr < NO_BLOCK).any():
            raise ValueError(f"{what}, group {g}: negative block id {int(arr.min())} (only {NO_BLOCK} = none)")
        out.append(arr)
    return out


def build_pull_plan(local: EngineInfo, remote: EngineInfo, layer_pairs: Sequence[LayerPair],
                    remote_block_ids, remote_num_tokens: int, local_block_ids,
                    num_cached_tokens=0) -> PullPlan:
    """Plan one request's pull; raises ``ValueError`` before anything moves."""
    remote_ids = _id_lists(remote_block_ids, remote.num_groups, "remote_block_ids")
    local_ids = _id_lists(local_block_ids, local.num_groups, "local_block_ids")
    if int(remote_num_tokens) < 0:
        raise ValueError(f"remote_num_tokens {remote_num_tokens} is negative")
    remote_num_tokens = int(remote_num_tokens)
    if isinstance(num_cached_tokens, (int, np.integer)):
        cached = [int(num_cached_tokens)] * local.num_groups
    else:
        cached = [int(c) for c in num_cached_tokens]
        if len(cached) != local.num_groups:
            raise ValueError(f"num_cached_tokens: expected an int or one per local group ({local.num_groups})")
    if any(c < 0 for c in cached):
        raise ValueError(f"num_cached_tokens {cached} is negative")

    # Region pairs by (local group, remote group), layers in registration order.
    grouped: Dict[Tuple[int, int], Dict[Tuple[int, int], List[str]]] = {}
    for lp in layer_pairs:
        regions = grouped.setdefault((lp.local_group, lp.remote_group), {})
        regions.setdefault((lp.local_region, lp.remote_region), []).append(lp.layer)

    read: Dict[int, Tuple[np.ndarray, np.ndarray, Tuple[int, int]]] = {}
    pairs: List[RegionPair] = []
    for (g, rg), regions in sorted(grouped.items()):
        tpp = local.tokens_per_page[g]
        if remote.tokens_per_page[rg] != tpp:  # pair_layers refuses this per layer already
            raise ValueError(f"group {g}<-{rg}: tokens per page {tpp} vs {remote.tokens_per_page[rg]}")
        where = f"local group {g} <- remote group {rg}"
        lpages = expand_blocks(local_ids[g], local.tokens_per_block[g] // tpp)
        rpages = expand_blocks(remote_ids[rg], remote.tokens_per_block[rg] // tpp)
        positions, l_read, r_read, l_zero = select_pages(
            lpages, rpages, tpp, remote_num_tokens, cached[g], where
        )
        if g in read:
            prev_read, prev_zero, prev_rg = read[g]
            if not (np.array_equal(prev_read, l_read) and np.array_equal(prev_zero, l_zero)):
                raise ValueError(
                    f"local group {g}: its layers would read different pages from remote groups "
                    f"{prev_rg} and {rg}; one masked copy per group cannot complete that"
                )
        else:
            _check_local_pages(l_read, l_zero, g)
            read[g] = (l_read, l_zero, rg)
        for (lr, rr), layers in regions.items():
            lref, rref = RegionRef.of(local.regions[lr]), RegionRef.of(remote.regions[rr])
            _check_range(l_read, lref.num_pages, f"{where}, layer {layers[0]!r}: local page")
            _check_range(l_zero, lref.num_pages, f"{where}, layer {layers[0]!r}: local page")
            _check_range(r_read, rref.num_pages, f"{where}, layer {layers[0]!r}: remote page")
            pairs.append(RegionPair(
                local_group=g, remote_group=rg, layers=tuple(layers), local=lref, remote=rref,
                local_pages=tuple(int(x) for x in l_read), remote_pages=tuple(int(x) for x in r_read),
                pages_to_zero=tuple(int(x) for x in l_zero),
            ))

    empty = np.empty(0, dtype=np.int64)
    read_pages, zero_pages, blocks = [], [], []
    for g in range(local.num_groups):
        l_read, l_zero, _ = read.get(g, (empty, empty, -1))
        read_pages.append(tuple(int(x) for x in l_read))
        zero_pages.append(tuple(int(x) for x in l_zero))
        r = local.tokens_per_block[g] // local.tokens_per_page[g]
        touched = np.concatenate([l_read, l_zero]) // r
        _, first = np.unique(touched, return_index=True)
        blocks.append(tuple(int(x) for x in touched[np.sort(first)]))
    return PullPlan(
        peer=remote.name, remote_num_tokens=remote_num_tokens, num_cached_tokens=tuple(cached),
        pairs=tuple(pairs), read_pages=tuple(read_pages), zero_pages=tuple(zero_pages),
        local_block_ids=tuple(blocks),
    )


def _check_local_pages(l_read: np.ndarray, l_zero: np.ndarray, g: int) -> None:
    both = np.concatenate([l_read, l_zero])
    if len(np.unique(both)) != len(both):
        s = np.sort(both)
        dup = int(s[np.flatnonzero(s[1:] == s[:-1])[0]])
        raise ValueError(f"local group {g}: page {dup} appears at two token positions")


def _check_range(pages: np.ndarray, limit: int, what: str) -> None:
    if len(pages) and (int(pages.max()) >= limit):
        raise ValueError(f"{what} {int(pages.max())} out of range [0, {limit})")
