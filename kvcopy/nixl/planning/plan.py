"""Pull plans: which of P's pages land in which of D's pages, chosen by token position.

Block lists, on both sides, are per KV cache group and anchored at token 0: entry
``i`` of a group's list is the logical block holding tokens ``[i * B, (i + 1) * B)``
(``B`` = that side's tokens per block). ``NO_BLOCK`` (-1) marks a position the side
does not hold (a sliding-window group's blocks outside the window). Entries past the
last token are spare capacity; D's lists must cover the prompt (a plan for ``N``
tokens over blocks holding fewer raises, naming both numbers). Each logical block
``b`` is ``r = B // tokens_per_page`` kernel pages ``b*r ... b*r + r - 1``; expanding
gives each side's pages by page position, and page position ``k`` holds tokens
``[k * T, (k + 1) * T)``. Every id is checked once, on the way in
(:func:`request_block_ids`): ``NO_BLOCK`` or a block every region of its group holds.

For one (local group, remote group) pair, with ``N = remote_num_tokens`` and
``C = num_cached_tokens`` (D's prefix hit for that local group), :func:`select_pages`:

* **read**: positions ``k`` from ``C // T`` (whole cached pages are skipped) to
  ``ceil(N / T) - 1`` where D has a page; P must have one there too, else the plan
  raises. A partial last page moves whole (its unused rows too).
* **zero**: positions where D has a page whose first token is at or past
  ``max(N, C)``: allocated, holding no prompt token, not read (what vLLM's connector
  calls ``region_blocks_to_zero``).
* everything else (cached pages, P's spare capacity, positions D does not hold) is
  neither read nor written. P's spare pages at the end never shift the selection: a
  160-token prompt over P's 128-token blocks of 64-token pages reads P's pages 0, 1,
  2, never "the last three" (the selection that read wrong pages in vLLM's connector
  when P's and D's block sizes differed).

Heterogeneous P/D (:func:`build_multi_pull_plan`): each local layer is served by the
peers (P's TP ranks) holding its KV heads, one holder per head
(:func:`~kvcopy.nixl.engine.geometry.head_owners`), through its own remote group's block ids.
Where page sizes differ, a local page is cut at both sides' page boundaries into token
pieces: a piece starting before ``N`` is read from the remote page holding it, a piece
starting at or past ``N`` is zeroed (its rows hold no prompt token; they are the
"unused rows" of a partial page). With equal page sizes a page is one piece, which is
the rule above.

A :class:`PullPlan` holds :class:`RegionPair` s: per (local group, remote group, peer,
local region, remote region, head range, token piece), the local and remote page ids
and, within each chunk of a page pair, the byte ``segments`` ``(local offset, remote
offset, bytes)`` that move (``()``: the whole chunk). Pages to zero hang on the first
pair of each (local group, local region); zeroed pieces are pairs with no page pairs,
their pages in ``pages_to_zero`` and their runs in ``zero_segments``. It is plain
data, printable, and everything :func:`kvcopy.nixl.replay` needs to apply it to CPU
tensors. Before returning, the planner checks that every byte of every local page it
writes is written once, and every page read is written whole.

Cost (a plan is made per request): what depends on the handshakes only is the
caller's :class:`~kvcopy.nixl.planning.routes.Routes`, made once per set of peers; the pairs of
one token piece share one page tuple (``RegionPair.local_pages`` of every layer is the
same object), so the per-request work is a few numpy calls per group plus one small
object per pair (figures: ``docs/nixl.md``, "Host cost per request").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ...checks import block_id_lists, integer, per_group_counts
from ..engine.geometry import local_segments, token_pieces
from ..engine.info import EngineInfo, LayerPair
from ..engine.regions import RegionRef
from .routes import Route, Routes, Sources, plan_routes

NO_BLOCK = -1


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
    peer: str = ""  # the peer read from; "" = the plan's only peer
    zero_segments: Tuple[Tuple[int, int], ...] = ()  # (local off, bytes) per chunk of pages_to_zero; () = whole

    def byte_segments(self) -> Tuple[Tuple[int, int, int], ...]:
        if not self.local_pages:
            return ()
        return self.segments or ((0, 0, self.local.chunk_bytes),)

    @property
    def num_bytes(self) -> int:
        per_chunk = sum(n for _, _, n in self.byte_segments())
        return len(self.local_pages) * self.local.num_chunks * per_chunk


@dataclass(frozen=True)
class Plan:
    """What every plan of one request's pull says, whatever the buffer mode: who it
    reads from, for how many tokens, and which of D's pages ``complete`` fills.

    Plans are frozen values: a manager refuses any plan its own ``plan_pull`` did not
    return, and keeps a plan's life (planned, pulled, completed or discarded) itself,
    never in the plan (see :mod:`kvcopy.nixl.manager`)."""

    peers: Tuple[str, ...]  # every peer read from (several: the TP ranks of one engine)
    remote_num_tokens: int
    num_cached_tokens: Tuple[int, ...]  # per local group
    read_pages: Tuple[Tuple[int, ...], ...]  # per local group: the local pages the pull fills
    zero_pages: Tuple[Tuple[int, ...], ...]  # per local group: the local pages complete() zeroes
    local_block_ids: Tuple[Tuple[int, ...], ...]  # per local group: logical blocks this pull writes

    @property
    def peer(self) -> str:
        return self.peers[0]

    @property
    def all_peers(self) -> Tuple[str, ...]:
        return self.peers

    @property
    def num_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class PullPlan(Plan):
    """One request's pull of pages (host and device modes; see the module docstring)."""

    pairs: Tuple[RegionPair, ...]

    def peer_of(self, pair: RegionPair) -> str:
        return pair.peer or self.peer

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pairs)

    @property
    def empty(self) -> bool:
        return not any(p.local_pages for p in self.pairs)

    def __str__(self) -> str:
        lines = [
            f"PullPlan from {', '.join(map(repr, self.all_peers))}: {self.remote_num_tokens} tokens, cached "
            f"{list(self.num_cached_tokens)}, {len(self.pairs)} region pair(s), {self.num_bytes} bytes"
        ]
        for p in self.pairs:
            if not p.local_pages and p.zero_segments:
                lines.append(
                    f"  group {p.local_group} region {p.local.index} {list(p.layers)}: zero "
                    f"{len(p.zero_segments)} byte run(s) of {sum(n for _, n in p.zero_segments)} bytes "
                    f"(rows past the prompt) in pages {_runs(p.pages_to_zero)}"
                )
                continue
            peer = f" of {p.peer!r}" if p.peer else ""
            segs = f" [{len(p.segments)} byte run(s) per chunk]" if p.segments else ""
            lines.append(
                f"  group {p.local_group}<-{p.remote_group}{peer} region {p.local.index}<-{p.remote.index} "
                f"{list(p.layers)}: pages {_runs(p.local_pages)} <- {_runs(p.remote_pages)}{segs}"
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


# ------------------------------------------------------------------ block ids and pages
def request_block_ids(info: EngineInfo, ids, what: str, num_tokens: Optional[int] = None) -> List[np.ndarray]:
    """One block id list per group of ``info``, each id ``NO_BLOCK`` or a block every
    region of its group holds (:attr:`EngineInfo.group_blocks`); with ``num_tokens``,
    each list must cover that many tokens (a shorter list would move fewer tokens than
    the plan says)."""
    arrs = block_id_lists(ids, info.num_groups, what, lowest=NO_BLOCK, limits=info.group_blocks)
    if num_tokens is not None:
        for g, arr in enumerate(arrs):
            tpb = info.tokens_per_block[g]
            if len(arr) * tpb < num_tokens:
                raise ValueError(f"{what}, group {g}: {len(arr)} block(s) of {tpb} tokens hold {len(arr) * tpb} "
                                 f"tokens; the pull is for {num_tokens} tokens")
    return arrs


def expand_blocks(block_ids: Union[np.ndarray, Sequence[int]], pages_per_block: int) -> np.ndarray:
    """Logical block ids -> kernel page ids by page position (``NO_BLOCK`` stays)."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    pages = ids[:, None] * pages_per_block + np.arange(pages_per_block, dtype=np.int64)
    pages[ids == NO_BLOCK] = NO_BLOCK
    return pages.reshape(-1)


def local_selection(local_pages: np.ndarray, tokens_per_page: int, num_tokens: int, num_cached_tokens: int
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """D's side of :func:`select_pages` (it does not depend on P): (page positions read,
    local pages read, local pages to zero)."""
    n_pages = -(-num_tokens // tokens_per_page)
    positions = np.arange(num_cached_tokens // tokens_per_page, min(n_pages, len(local_pages)), dtype=np.int64)
    positions = positions[local_pages[positions] != NO_BLOCK]
    tail = local_pages[-(-max(num_tokens, num_cached_tokens) // tokens_per_page):]
    return positions, local_pages[positions], tail[tail != NO_BLOCK]


def remote_at(remote_pages: np.ndarray, positions: np.ndarray, tokens_per_page: int, num_tokens: int,
              where: str) -> np.ndarray:
    """P's pages at these page positions (P's page size); raises where P holds none."""
    lacking = positions[positions >= len(remote_pages)]
    if not len(lacking):
        lacking = positions[remote_pages[positions] == NO_BLOCK]
    if len(lacking):
        k = int(lacking[0])
        raise ValueError(
            f"{where}: D needs tokens [{k * tokens_per_page}, {(k + 1) * tokens_per_page}) of the "
            f"{num_tokens}-token prompt but P holds no page there ({len(remote_pages)} page positions, "
            f"{int((remote_pages != NO_BLOCK).sum())} held)")
    return remote_pages[positions]


def select_pages(
    local_pages: np.ndarray, remote_pages: np.ndarray, tokens_per_page: int, num_tokens: int,
    num_cached_tokens: int, where: str = "",
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(read positions, local pages read, remote pages read, local pages to zero) by token
    position, for one page size on both sides (the planner's own two steps)."""
    positions, read, zero = local_selection(local_pages, tokens_per_page, num_tokens, num_cached_tokens)
    return positions, read, remote_at(remote_pages, positions, tokens_per_page, num_tokens, where), zero


# ------------------------------------------------------------------ the planner
def build_pull_plan(local: EngineInfo, remote: EngineInfo, layer_pairs: Sequence[LayerPair],
                    remote_block_ids, remote_num_tokens: int, local_block_ids,
                    num_cached_tokens=0) -> PullPlan:
    """Plan one request's pull from one peer; raises ``ValueError`` before anything moves."""
    return build_multi_pull_plan(local, [(remote, layer_pairs)], {remote.name: remote_block_ids},
                                 remote_num_tokens, local_block_ids, num_cached_tokens)


def build_multi_pull_plan(local: EngineInfo, peers: Sources, remote_block_ids, remote_num_tokens: int,
                          local_block_ids, num_cached_tokens=0, routes: Optional[Routes] = None) -> PullPlan:
    """Plan one request's pull from one or several peers (the TP ranks of one engine).

    ``remote_block_ids`` is one block id list per remote group, shared by every peer
    (the ranks of one engine share its scheduler), or a mapping peer name -> such lists.
    Each local layer's KV heads are read from peers that hold them (one holder per head,
    see :func:`~kvcopy.nixl.engine.geometry.head_owners`); its pages by token position through
    its remote group's block ids, in token pieces where the page sizes differ.
    ``routes``: :func:`~kvcopy.nixl.planning.routes.plan_routes` of these records, made earlier
    (None: made here).
    """
    names = [p.name for p, _ in peers]
    if not names:
        raise ValueError("plan_pull needs at least one peer")
    if len(set(names)) != len(names):
        raise ValueError(f"peers {names}: a peer is given twice")
    n_tok = integer(remote_num_tokens, "remote_num_tokens", minimum=0)
    local_ids = request_block_ids(local, local_block_ids, "local_block_ids", n_tok)
    remote_ids = _remote_ids(peers, remote_block_ids)
    cached = per_group_counts(num_cached_tokens, local.num_groups, "num_cached_tokens")
    if routes is None:
        routes = plan_routes(local, peers)
    else:
        routes.check(local, peers)
    sel = [_Selection.of(local, g, local_ids[g], n_tok, cached[g]) for g in range(local.num_groups)]
    pairs = _Pairs(local, peers, remote_ids, sel, n_tok).build(routes.routes)
    for g, s in enumerate(sel):
        _check_local_pages(s.read, s.zero, g)
    _check_writes(pairs, local, [s.read for s in sel])
    read_pages, zero_pages, blocks = [], [], []
    for g, s in enumerate(sel):
        has = any(p.local_group == g for p in pairs)
        l_read = s.read if has else np.empty(0, np.int64)
        l_zero = s.zero if has else np.empty(0, np.int64)
        read_pages.append(tuple(l_read.tolist()))
        zero_pages.append(tuple(l_zero.tolist()))
        touched = np.concatenate([l_read, l_zero]) // (local.tokens_per_block[g] // local.tokens_per_page[g])
        _, first = np.unique(touched, return_index=True)
        blocks.append(tuple(touched[np.sort(first)].tolist()))
    return PullPlan(peers=tuple(names), remote_num_tokens=n_tok, num_cached_tokens=tuple(cached),
                    read_pages=tuple(read_pages), zero_pages=tuple(zero_pages), local_block_ids=tuple(blocks),
                    pairs=tuple(pairs))


def _remote_ids(peers: Sources, remote_block_ids) -> List[List[np.ndarray]]:
    """Per peer, its block id lists (one per remote group), checked against its record."""
    if isinstance(remote_block_ids, Mapping):
        missing = [p.name for p, _ in peers if p.name not in remote_block_ids]
        if missing:
            raise ValueError(f"remote_block_ids: no block ids for peer(s) {missing}")
        return [request_block_ids(p, remote_block_ids[p.name], f"remote_block_ids of {p.name!r}") for p, _ in peers]
    return [request_block_ids(p, remote_block_ids, "remote_block_ids") for p, _ in peers]


@dataclass(frozen=True)
class _Selection:
    """D's side of one local group: pages by position, positions read, pages read and
    pages zeroed (:func:`local_selection`), and the zero pages as the tuple every pair
    of the group shares."""

    pages: np.ndarray
    positions: np.ndarray
    read: np.ndarray
    zero: np.ndarray
    zero_t: Tuple[int, ...]

    @classmethod
    def of(cls, local: EngineInfo, g: int, ids: np.ndarray, n_tok: int, cached: int) -> "_Selection":
        tpp = local.tokens_per_page[g]
        pages = expand_blocks(ids, local.tokens_per_block[g] // tpp)
        positions, read, zero = local_selection(pages, tpp, n_tok, cached)
        return cls(pages, positions, read, zero, tuple(zero.tolist()))


class _Pairs:
    """The region pairs of one plan, route by route (:meth:`build`)."""

    def __init__(self, local: EngineInfo, peers: Sources, remote_ids, sel: Sequence[_Selection], n_tok: int):
        self.local, self.peers, self.remote_ids, self.sel, self.n_tok = local, peers, remote_ids, sel, n_tok
        self.pairs: List[RegionPair] = []
        self._pieces: Dict[tuple, Dict[tuple, _Piece]] = {}  # per (local group, peer, remote group)
        self._zero_pieces: Dict[tuple, Tuple[List[str], set]] = {}  # (group, region, offset, tokens) -> layers, pages
        self._zero_owner: set = set()  # (local group, local region) whose first pair carries the zero pages

    def build(self, routes: Sequence[Route]) -> List[RegionPair]:
        for r in routes:
            self._add(r)
        # Token pieces past the prompt inside read pages: zeroed, not read.
        for (g, lr, lt, n), (layers, pages) in sorted(self._zero_pieces.items()):
            lref = self.local.region_refs[lr]
            self.pairs.append(RegionPair(
                local_group=g, remote_group=-1, layers=tuple(layers), local=lref, remote=lref, local_pages=(),
                remote_pages=(), pages_to_zero=tuple(sorted(pages)),
                zero_segments=local_segments(self.local.region_axes[lr], (lt, n)),
            ))
        return self.pairs

    def _pieces_of(self, r: Route) -> Dict[tuple, "_Piece"]:
        key = (r.local_group, r.peer_index, r.remote_group)
        if key not in self._pieces:
            peer = self.peers[r.peer_index][0]
            rpages = expand_blocks(self.remote_ids[r.peer_index][r.remote_group],
                                   peer.tokens_per_block[r.remote_group] // r.remote_tpp)
            s = self.sel[r.local_group]
            self._pieces[key] = _read_pieces(s.positions, s.pages, rpages, r.local_tpp, r.remote_tpp, self.n_tok,
                                             r.where)
        return self._pieces[key]

    def _add(self, r: Route) -> None:
        """The pairs of one route: one per token piece read; the first pair of each
        (local group, local region) carries its whole pages to zero."""
        g, lr = r.local_group, r.local.index
        zero_t = self.sel[g].zero_t if (g, lr) not in self._zero_owner else ()
        self._zero_owner.add((g, lr))
        made = 0
        for piece_key, piece in sorted(self._pieces_of(r).items()):
            lt, rt, n = piece_key
            if rt < 0:
                layers, pages = self._zero_pieces.setdefault((g, lr, lt, n), ([], set()))
                layers.extend(x for x in r.layers if x not in layers)
                pages.update(piece.local_t)
                continue
            self.pairs.append(RegionPair(
                local_group=g, remote_group=r.remote_group, layers=r.layers, local=r.local, remote=r.remote,
                local_pages=piece.local_t, remote_pages=piece.remote_t, pages_to_zero=() if made else zero_t,
                segments=r.segments(piece_key), peer=r.peer,
            ))
            made += 1
        if not made:  # nothing read for this layer set: keep a (possibly empty) pair for its zeroing
            self.pairs.append(RegionPair(
                local_group=g, remote_group=r.remote_group, layers=r.layers, local=r.local, remote=r.remote,
                local_pages=(), remote_pages=(), pages_to_zero=zero_t, peer=r.peer,
            ))


@dataclass(frozen=True)
class _Piece:
    """One token piece of a (local group, peer, remote group): local and remote pages
    (none remote for a zero piece), as the tuples every
    :class:`RegionPair` of the piece shares (one object, not one per layer: the
    per-element conversion to Python ints is then paid once per piece)."""

    local_t: Tuple[int, ...]
    remote_t: Tuple[int, ...]

    @classmethod
    def of(cls, local: np.ndarray, remote: Optional[np.ndarray]) -> "_Piece":
        return cls(tuple(local.tolist()), () if remote is None else tuple(remote.tolist()))


def _read_pieces(positions: np.ndarray, l_pages: np.ndarray, rpages: np.ndarray, ltpp: int, rtpp: int,
                 n_tok: int, where: str) -> Dict[Tuple[int, int, int], _Piece]:
    """``{(local token offset, remote token offset, tokens): _Piece}`` for one (local
    group, peer, remote group) (see :func:`~kvcopy.nixl.engine.geometry.token_pieces`); raises
    where P holds no page D needs (:func:`remote_at`). Equal page sizes (the homogeneous
    case) are one piece per page, computed with array indexing instead of a per-page loop."""
    if ltpp == rtpp:
        items = {(0, 0, ltpp): (positions, positions)}
    else:
        items = {}
        for key, pairs in token_pieces(positions, ltpp, rtpp, n_tok).items():
            items[key] = (np.array([p for p, _ in pairs], dtype=np.int64),
                          np.array([q for _, q in pairs], dtype=np.int64))
    out = {}
    for (lt, rt, n), (pos, rpos) in items.items():
        remote = None if rt < 0 else remote_at(rpages, rpos, rtpp, n_tok, where)
        out[(lt, rt, n)] = _Piece.of(l_pages[pos], remote)
    return out


_TWO_SOURCES = "two sources write the same bytes (layers that share this tensor on D are different tensors on P)"


def _check_writes(pairs: Sequence[RegionPair], local: EngineInfo, read: Sequence[np.ndarray]) -> None:
    """Every local page a pair writes is written once per byte, and every page read is
    written whole (read pieces, zeroed pieces), in every region of its group: else two
    sources would race for one byte, or ``complete`` would copy bytes nobody wrote."""
    by_region: Dict[int, List[RegionPair]] = {}
    for p in pairs:
        by_region.setdefault(p.local.index, []).append(p)
    # Whole-chunk regions whose pairs write the same page tuples for the same groups pass
    # or fail together: check each such signature once. The planner shares one tuple
    # per token piece between all layers, so a homogeneous 64-layer plan is one check,
    # not 64 (each a unique + isin over its pages). ``id``s are stable: ``pairs`` holds
    # the tuples while this runs.
    checked = set()
    rng = None
    for lr, rps in by_region.items():
        if any(p.segments or p.zero_segments for p in rps):
            rng = rng or np.random.default_rng(0)
            _check_sliced_region(local.regions[lr], rps, read, rng)
            continue
        signature = tuple((id(p.local_pages), id(p.pages_to_zero), p.local_group) for p in rps)
        if signature not in checked:
            _check_whole_region(local.regions[lr], rps, read)
            checked.add(signature)


def _check_whole_region(region, rps: Sequence[RegionPair], read: Sequence[np.ndarray]) -> None:
    """Whole chunks only: every page written by at most one pair, read pages all written."""
    written = np.concatenate([np.asarray(p.local_pages + p.pages_to_zero, dtype=np.int64) for p in rps])
    uniq = np.unique(written)
    if len(uniq) != len(written):
        raise ValueError(f"local region {region.index} ({list(region.layers)}): {_TWO_SOURCES}")
    for g in {p.local_group for p in rps}:
        if len(read[g]) and not _all_in(read[g], uniq):
            raise ValueError(f"local group {g}, region {region.index}: a page read is written by no peer")


def _check_sliced_region(region, rps: Sequence[RegionPair], read: Sequence[np.ndarray], rng) -> None:
    """Pairs moving byte runs: per page, the runs of every pair writing it do not
    overlap, and the pages read are covered whole. Pages written by the same set of
    parts are checked once (grouped by a sum of random tags per part)."""
    parts: List[Tuple[np.ndarray, Tuple[Tuple[int, int], ...]]] = []
    for p in rps:
        if p.local_pages:
            parts.append((np.asarray(p.local_pages, np.int64), tuple((lo, n) for lo, _, n in p.byte_segments())))
        if p.pages_to_zero:
            parts.append((np.asarray(p.pages_to_zero, np.int64),
                          tuple(p.zero_segments or ((0, p.local.chunk_bytes),))))
    if not parts:  # its pairs read nothing and zero nothing
        return
    where = f"local region {region.index} ({list(region.layers)})"
    ids = np.concatenate([np.full(len(pg), i, np.int64) for i, (pg, _) in enumerate(parts)])
    pages = np.concatenate([pg for pg, _ in parts])
    order = np.lexsort((ids, pages))
    pages, ids = pages[order], ids[order]
    starts = np.flatnonzero(np.concatenate([[True], pages[1:] != pages[:-1]]))
    counts = np.diff(np.concatenate([starts, [len(pages)]]))
    tags = rng.integers(0, 2**62, size=len(parts), dtype=np.int64)
    keys = np.add.reduceat(tags[ids], starts) ^ counts
    _, first = np.unique(keys, return_index=True)
    whole = np.zeros(len(starts), dtype=bool)
    for k in first:
        segs = sorted(sg for i in ids[starts[k]:starts[k] + counts[k]] for sg in parts[i][1])
        end = 0
        for off, n in segs:
            if off < end:
                raise ValueError(f"{where}, page {int(pages[starts[k]])}: {_TWO_SOURCES}")
            end = off + n
        whole[keys == keys[k]] = sum(n for _, n in segs) == region.chunk_bytes
    full_pages = pages[starts][whole]
    for g in {p.local_group for p in rps}:
        missing = read[g][~np.isin(read[g], full_pages)]
        if len(missing):
            raise ValueError(f"local group {g}, {where}, page {int(missing[0])}: the peers do not write "
                             f"all of its {region.chunk_bytes} bytes per chunk")


def _all_in(values: np.ndarray, sorted_unique: np.ndarray) -> bool:
    """``np.isin(values, sorted_unique).all()`` by binary search (``isin`` sorts both
    sides again: ~0.4 ms against ~20 us for 500 pages)."""
    if not len(sorted_unique):
        return not len(values)
    at = np.minimum(np.searchsorted(sorted_unique, values), len(sorted_unique) - 1)
    return bool((sorted_unique[at] == values).all())


def _check_local_pages(l_read: np.ndarray, l_zero: np.ndarray, g: int) -> None:
    both = np.concatenate([l_read, l_zero])
    if len(np.unique(both)) != len(both):
        s = np.sort(both)
        dup = int(s[np.flatnonzero(s[1:] == s[:-1])[0]])
        raise ValueError(f"local group {g}: page {dup} appears at two token positions")
