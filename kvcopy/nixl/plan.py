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

Heterogeneous P/D (:func:`build_multi_pull_plan`): each local layer is served by the
peers (P's TP ranks) holding its KV heads, one holder per head
(:func:`~kvcopy.nixl.geometry.head_owners`), through its own remote group's block ids.
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

Cost (a plan is made per request): what depends on the handshakes only (which peer
and regions serve each layer, head ranges, byte runs per token piece) is computed
once per (engine, peers) (:func:`_routes`); the pairs of one token piece share one
page tuple (``RegionPair.local_pages`` of every layer is the same object), so the
per-request work is a few numpy calls per group plus one small object per pair. 64
layers x 500 pages, one peer: ~1 ms on an idle core (was ~40-60 ms).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..checks import block_ids, integer, per_group_counts, sequence, shown
from .handshake import EngineInfo, LayerPair
from .geometry import head_owners, local_segments, segments, token_pieces
from .identity_cache import IdentityCache
from .regions import RegionRef

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
    peers: Tuple[str, ...] = ()  # every peer read from (several: the TP ranks of one engine)

    @property
    def all_peers(self) -> Tuple[str, ...]:
        return self.peers or (self.peer,)

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
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or len(ids) != n_groups:
        raise ValueError(f"{what}: expected one block id list per KV cache group ({n_groups}), got {shown(ids)}")
    sequence(ids, what, n_groups)
    out = []
    for g, lst in enumerate(ids):
        arr = block_ids(lst, f"{what}, group {g}")
        if arr.size and (arr < NO_BLOCK).any():
            raise ValueError(f"{what}, group {g}: negative block id {int(arr.min())} (only {NO_BLOCK} = none)")
        out.append(arr)
    return out


def build_pull_plan(local: EngineInfo, remote: EngineInfo, layer_pairs: Sequence[LayerPair],
                    remote_block_ids, remote_num_tokens: int, local_block_ids,
                    num_cached_tokens=0) -> PullPlan:
    """Plan one request's pull from one peer; raises ``ValueError`` before anything moves."""
    return build_multi_pull_plan(local, [(remote, layer_pairs)], {remote.name: remote_block_ids},
                                 remote_num_tokens, local_block_ids, num_cached_tokens)


def build_multi_pull_plan(local: EngineInfo, peers: Sequence[Tuple[EngineInfo, Sequence[LayerPair]]],
                          remote_block_ids, remote_num_tokens: int, local_block_ids,
                          num_cached_tokens=0) -> PullPlan:
    """Plan one request's pull from one or several peers (the TP ranks of one engine).

    ``remote_block_ids`` is one block id list per remote group, shared by every peer
    (the ranks of one engine share its scheduler), or a mapping peer name -> such lists.
    Each local layer's KV heads are read from peers that hold them (one holder per head,
    see :func:`~kvcopy.nixl.geometry.head_owners`); its pages by token position through
    its remote group's block ids, in token pieces where the page sizes differ.
    """
    if not peers:
        raise ValueError("plan_pull needs at least one peer")
    names = [p.name for p, _ in peers]
    if len(set(names)) != len(names):
        raise ValueError(f"peers {names}: a peer is given twice")
    local_ids = _id_lists(local_block_ids, local.num_groups, "local_block_ids")
    if isinstance(remote_block_ids, Mapping):
        missing = [n for n in names if n not in remote_block_ids]
        if missing:
            raise ValueError(f"remote_block_ids: no block ids for peer(s) {missing}")
        remote_ids = [_id_lists(remote_block_ids[p.name], p.num_groups, f"remote_block_ids of {p.name!r}")
                      for p, _ in peers]
    else:
        remote_ids = [_id_lists(remote_block_ids, p.num_groups, "remote_block_ids") for p, _ in peers]
    n_tok = integer(remote_num_tokens, "remote_num_tokens", minimum=0)
    cached = per_group_counts(num_cached_tokens, local.num_groups, "num_cached_tokens")

    # Local side, per group: page positions read, pages read, pages zeroed (by token
    # position; they do not depend on the peers).
    positions, l_pages, read, zero = [], [], [], []
    for g in range(local.num_groups):
        tpp = local.tokens_per_page[g]
        lp = expand_blocks(local_ids[g], local.tokens_per_block[g] // tpp)
        n_pages = -(-n_tok // tpp)
        pos = np.arange(cached[g] // tpp, min(n_pages, len(lp)), dtype=np.int64)
        pos = pos[lp[pos] != NO_BLOCK]
        tail = lp[-(-max(n_tok, cached[g]) // tpp):]
        positions.append(pos)
        l_pages.append(lp)
        read.append(lp[pos])
        zero.append(tail[tail != NO_BLOCK])
    routes = _routes(local, peers, names)

    pairs: List[RegionPair] = []
    pieces_cache: Dict[tuple, Dict[tuple, _Piece]] = {}
    zero_pieces: Dict[tuple, Tuple[List[str], set]] = {}
    zero_owner: Dict[Tuple[int, int], int] = {}
    zero_t = [tuple(z.tolist()) for z in zero]
    for r in routes:
        g, i, rg, lr = r.local_group, r.peer_index, r.remote_group, r.local.index
        layers, lref, rref, where = r.layers, r.local, r.remote, r.where
        ckey = (g, i, rg)
        if ckey not in pieces_cache:
            peer = peers[i][0]
            rpages = expand_blocks(remote_ids[i][rg], peer.tokens_per_block[rg] // r.remote_tpp)
            pieces_cache[ckey] = _read_pieces(positions[g], l_pages[g], rpages, r.local_tpp, r.remote_tpp,
                                              n_tok, where)
        pieces = pieces_cache[ckey]
        # The first pair of each (local group, local region) carries its whole pages to zero.
        owns_zero = (g, lr) not in zero_owner
        made = 0
        for piece_key, piece in sorted(pieces.items()):
            lt, rt, n = piece_key
            if rt < 0:
                zk = (g, lr, lt, n)
                entry = zero_pieces.setdefault(zk, ([], set()))
                entry[0].extend(x for x in layers if x not in entry[0])
                entry[1].update(piece.local_t)
                continue
            if piece.local_max >= lref.num_pages:
                _check_max(piece.local_max, lref.num_pages, f"{where}, layer {layers[0]!r}: local page")
            if piece.remote_max >= rref.num_pages:
                _check_max(piece.remote_max, rref.num_pages, f"{where}, layer {layers[0]!r}: remote page")
            segs = r.segments(piece_key)
            pairs.append(RegionPair(
                local_group=g, remote_group=rg, layers=layers, local=lref, remote=rref,
                local_pages=piece.local_t, remote_pages=piece.remote_t,
                pages_to_zero=zero_t[g] if owns_zero and not made else (), segments=segs, peer=r.peer,
            ))
            made += 1
        if not made:  # nothing read for this layer set: keep a (possibly empty) pair for its zeroing
            pairs.append(RegionPair(
                local_group=g, remote_group=rg, layers=layers, local=lref, remote=rref,
                local_pages=(), remote_pages=(), pages_to_zero=zero_t[g] if owns_zero else (), peer=r.peer,
            ))
        zero_owner.setdefault((g, lr), len(pairs) - made if made else len(pairs) - 1)

    # Whole pages to zero (already on the first pair of each (local group, local region)).
    zero_max = [int(z.max()) if len(z) else -1 for z in zero]
    for g, lr in zero_owner:
        if zero_max[g] >= local.regions[lr].num_pages:
            _check_max(zero_max[g], local.regions[lr].num_pages, f"local group {g}, region {lr}: local page")
    # Token pieces past the prompt inside read pages: zeroed, not read.
    for (g, lr, lt, n), (layers, pages) in sorted(zero_pieces.items()):
        zsegs = local_segments(local.region_axes[lr], (lt, n))
        lref = local.region_refs[lr]
        pairs.append(RegionPair(
            local_group=g, remote_group=-1, layers=tuple(layers), local=lref,
            remote=lref, local_pages=(), remote_pages=(), pages_to_zero=tuple(sorted(pages)),
            zero_segments=zsegs,
        ))
    for g in range(local.num_groups):
        _check_local_pages(read[g], zero[g], g)
    _check_writes(pairs, local, read)

    read_pages, zero_pages, blocks = [], [], []
    for g in range(local.num_groups):
        has = any(p.local_group == g for p in pairs)
        l_read = read[g] if has else np.empty(0, np.int64)
        l_zero = zero[g] if has else np.empty(0, np.int64)
        read_pages.append(tuple(l_read.tolist()))
        zero_pages.append(tuple(l_zero.tolist()))
        r = local.tokens_per_block[g] // local.tokens_per_page[g]
        touched = np.concatenate([l_read, l_zero]) // r
        _, first = np.unique(touched, return_index=True)
        blocks.append(tuple(touched[np.sort(first)].tolist()))
    return PullPlan(
        peer=names[0], remote_num_tokens=n_tok, num_cached_tokens=tuple(cached),
        pairs=tuple(pairs), read_pages=tuple(read_pages), zero_pages=tuple(zero_pages),
        local_block_ids=tuple(blocks), peers=tuple(names),
    )


class _Route:
    """One set of local layers served by one peer: (local group, peer, remote group,
    local region, remote region, head ranges) and everything static about it.

    Routes depend on the two engines' handshakes only, not on a request's block ids,
    so :func:`_routes` computes them once per (local engine, peers) and every plan
    reuses them (measured, 64 layers: the per-layer peer and head-owner search, region
    refs and error-context strings were ~0.3 ms of each ~1.5 ms plan on an idle core).
    ``segments`` memoizes the byte runs per token piece."""

    __slots__ = ("local_group", "peer_index", "remote_group", "layers", "local", "remote", "local_tpp",
                 "remote_tpp", "where", "peer", "_local_axes", "_remote_axes", "_heads", "_kind", "_segs")

    def __init__(self, key, layers, local: EngineInfo, peer: EngineInfo, multi: bool):
        g, i, rg, lr, rr, lh, rhd, k = key
        self.local_group, self.peer_index, self.remote_group = g, i, rg
        self.layers = tuple(layers)
        self.local, self.remote = local.region_refs[lr], peer.region_refs[rr]
        self.local_tpp, self.remote_tpp = local.tokens_per_page[g], peer.tokens_per_page[rg]
        self.where = f"local group {g} <- remote group {rg}" + (f" of {peer.name!r}" if multi else "")
        self.peer = peer.name if multi else ""
        self._local_axes, self._remote_axes = local.region_axes[lr], peer.region_axes[rr]
        lreg = local.regions[lr]
        self._heads = ((lh, k), (rhd, k)) if lreg.heads is not None else ((0, 1), (0, 1))
        self._kind = lreg.kind
        self._segs: Dict[Tuple[int, int, int], tuple] = {}

    def segments(self, piece: Tuple[int, int, int]) -> Tuple[Tuple[int, int, int], ...]:
        """Byte runs per chunk moving token piece ``(local offset, remote offset, tokens)``
        (``()``: the whole chunk); raises where the layouts cannot move it."""
        segs = self._segs.get(piece)
        if segs is not None:
            return segs
        lt, rt, n = piece
        la, ra, lref, rref = self._local_axes, self._remote_axes, self.local, self.remote
        if la is None or ra is None:
            if piece != (0, 0, self.local_tpp) or lref.chunk_bytes != rref.chunk_bytes:
                raise ValueError(f"{self.where}, layer {self.layers[0]!r}: layout {self._kind!r} names no token "
                                 "axis: only whole pages of equal size can move")
            segs = ()
        else:
            if la.size("head") == 1 and "head" not in la.names:
                lsel, rsel = ((lt, n), (0, 1)), ((rt, n), (0, 1))
            else:
                lsel, rsel = ((lt, n), self._heads[0]), ((rt, n), self._heads[1])
            segs = segments(la, ra, lsel, rsel)
            if segs == ((0, 0, lref.chunk_bytes),) and rref.chunk_bytes == lref.chunk_bytes:
                segs = ()
        self._segs[piece] = segs
        return segs


# Routes per (local engine, peers, their layer pairs), by identity
# (:class:`~kvcopy.nixl.identity_cache.IdentityCache`: records held weakly, least
# recently used out first). The routes hold the records they serve, so an entry keeps
# its peer's record (and regions) alive until it leaves: forget_routes drops a removed
# peer's entries at once. Arena mode plans over one pair of virtual engines per request
# shape (kvcopy.nixl.staging keeps up to 128 per D), so there is more than one entry
# per peer.
_ROUTES = IdentityCache(256)


def forget_routes(info: EngineInfo) -> None:
    """Drop every cached route entry that involves ``info`` (``remove_peer`` calls it)."""
    _ROUTES.forget(info)


def _routes(local: EngineInfo, peers: Sequence[Tuple[EngineInfo, Sequence[LayerPair]]],
            names: Sequence[str]) -> List[_Route]:
    """The routes serving every local layer, in plan order (sorted by key); cached by
    the identity of ``local``, each peer's ``EngineInfo`` (frozen) and each of its layer
    pairs (a list changed in place is not served stale)."""
    snapshot = tuple((info, tuple(pairs)) for info, pairs in peers)
    # The pairs are keyed by identity too; the entry holds them, so their ids stay theirs.
    key = tuple(tuple(map(id, pairs)) for _, pairs in snapshot)
    return _ROUTES.get((local, *(info for info, _ in snapshot)), key,
                       lambda: (snapshot, _make_routes(local, snapshot, names)))[1]


def _make_routes(local: EngineInfo, snapshot, names: Sequence[str]) -> List[_Route]:
    """The routes of a cache miss of :func:`_routes` (``snapshot``: per peer, its record
    and its layer pairs as a tuple)."""
    peers = snapshot
    peer_layers = [{lp.layer: lp for lp in pairs} for _, pairs in snapshot]
    # Every layer of a model asks head_owners the same question: ask once per distinct
    # (local heads, peers' heads) (seeds/2 in arena mode, 96 layers: ~2 ms of a ~10 ms
    # plan of a new request shape on this machine).
    owners_memo: Dict[tuple, list] = {}

    def owners_of(lh, ph):
        got = owners_memo.get((lh, ph))
        if got is None:
            got = owners_memo[(lh, ph)] = head_owners(lh, list(ph), local.tp_rank)
        return got

    # Who serves each local layer: (peer, remote group, remote region, head ranges).
    keyed: Dict[tuple, List[str]] = {}
    for region in local.regions:
        for name, g in region.members:
            cands = [i for i in range(len(peers)) if name in peer_layers[i]]
            if not cands:
                raise ValueError(f"layer {name!r} (local group {g}) is on none of the peers {names}")
            if region.heads is None:
                owners = owners_of(None, (None,) * len(cands))
            else:
                rh = tuple(peers[i][0].regions[peer_layers[i][name].remote_region].heads for i in cands)
                try:
                    owners = owners_of(region.heads, rh)
                except ValueError as exc:
                    held = {peers[i][0].name: h for i, h in zip(cands, rh)}
                    raise ValueError(f"layer {name!r}: this rank holds KV heads {region.heads} (first, count); "
                                     f"{exc} (they hold {held})") from None
            for ci, lh, rhd, k in owners:
                i = cands[ci]
                lp = peer_layers[i][name]
                key_ = (g, i, lp.remote_group, region.index, lp.remote_region, lh, rhd, k)
                keyed.setdefault(key_, []).append(name)
    multi = len(peers) > 1
    return [_Route(k, keyed[k], local, peers[k[1]][0], multi) for k in sorted(keyed)]


@dataclass(frozen=True)
class _Piece:
    """One token piece of a (local group, peer, remote group): local and remote pages
    (``remote`` None for a zero piece), as arrays and as the tuples every
    :class:`RegionPair` of the piece shares (one object, not one per layer: 64 layers x
    500 pages spent ~45 ms in per-element ``int()`` conversions before), and their
    largest ids for the range checks."""

    local: np.ndarray
    remote: Optional[np.ndarray]
    local_t: Tuple[int, ...]
    remote_t: Tuple[int, ...]
    local_max: int
    remote_max: int

    @classmethod
    def of(cls, local: np.ndarray, remote: Optional[np.ndarray]) -> "_Piece":
        rt = () if remote is None else tuple(remote.tolist())
        return cls(local, remote, tuple(local.tolist()), rt,
                   int(local.max()) if len(local) else -1,
                   int(remote.max()) if remote is not None and len(remote) else -1)


def _read_pieces(positions: np.ndarray, l_pages: np.ndarray, rpages: np.ndarray, ltpp: int, rtpp: int,
                 n_tok: int, where: str) -> Dict[Tuple[int, int, int], _Piece]:
    """``{(local token offset, remote token offset, tokens): _Piece}`` for one (local
    group, peer, remote group) (see :func:`~kvcopy.nixl.geometry.token_pieces`); raises
    where P holds no page D needs. Equal page sizes (the homogeneous case) are one piece
    per page, computed with array indexing instead of a per-page loop."""
    if ltpp == rtpp:
        items = {(0, 0, ltpp): (positions, positions)}
    else:
        items = {}
        for key, pairs in token_pieces(positions, ltpp, rtpp, n_tok).items():
            items[key] = (np.array([p for p, _ in pairs], dtype=np.int64),
                          np.array([q for _, q in pairs], dtype=np.int64))
    out = {}
    for (lt, rt, n), (pos, rpos) in items.items():
        if rt < 0:
            out[(lt, rt, n)] = _Piece.of(l_pages[pos], None)
            continue
        lacking = rpos[rpos >= len(rpages)]
        if not len(lacking):
            lacking = rpos[rpages[rpos] == NO_BLOCK]
        if len(lacking):
            q = int(lacking[0])
            raise ValueError(
                f"{where}: D needs tokens [{q * rtpp}, {(q + 1) * rtpp}) of the "
                f"{n_tok}-token prompt but P holds no page there ({len(rpages)} page positions, "
                f"{int((rpages != NO_BLOCK).sum())} held)")
        out[(lt, rt, n)] = _Piece.of(l_pages[pos], rpages[rpos])
    return out


def _check_writes(pairs: Sequence[RegionPair], local: EngineInfo, read: Sequence[np.ndarray]) -> None:
    """Every local page a pair writes is written once per byte, and every page read is
    written whole (read pieces, zeroed pieces), in every region of its group: else two
    sources would race for one byte, or ``complete`` would copy bytes nobody wrote."""
    by_region: Dict[int, List[RegionPair]] = {}
    for p in pairs:
        by_region.setdefault(p.local.index, []).append(p)
    sliced = []
    # Whole-chunk regions whose pairs write the same page tuples for the same groups pass
    # or fail together: check each such signature once. The planner shares one tuple
    # per token piece between all layers, so a homogeneous 64-layer plan is one check,
    # not 64 (each a unique + isin over its pages). ``id``s are stable: ``pairs`` holds
    # the tuples while this runs.
    checked = set()
    for lr, rps in by_region.items():
        if any(p.segments or p.zero_segments for p in rps):
            sliced.extend(rps)
            continue
        signature = tuple((id(p.local_pages), id(p.pages_to_zero), p.local_group) for p in rps)
        if signature in checked:
            continue
        # whole chunks only: every page written by at most one pair, read pages all written
        written = np.concatenate([np.asarray(p.local_pages + p.pages_to_zero, dtype=np.int64) for p in rps])
        uniq = np.unique(written)
        if len(uniq) != len(written):
            raise ValueError(f"local region {lr} ({list(local.regions[lr].layers)}): two sources write the "
                             "same bytes (layers that share this tensor on D are different tensors on P)")
        for g in {p.local_group for p in rps}:
            if len(read[g]) and not _all_in(read[g], uniq):
                raise ValueError(f"local group {g}, region {lr}: a page read is written by no peer")
        checked.add(signature)
    sliced_regions: Dict[int, List[Tuple[np.ndarray, Tuple[Tuple[int, int], ...]]]] = {}
    for p in sliced:
        parts = sliced_regions.setdefault(p.local.index, [])
        if p.local_pages:
            parts.append((np.asarray(p.local_pages, np.int64), tuple((lo, n) for lo, _, n in p.byte_segments())))
        if p.pages_to_zero:
            parts.append((np.asarray(p.pages_to_zero, np.int64),
                          tuple(p.zero_segments or ((0, p.local.chunk_bytes),))))
    rng = np.random.default_rng(0) if sliced_regions else None
    for lr, parts in sliced_regions.items():
        region = local.regions[lr]
        if not parts:  # its pairs read nothing and zero nothing
            continue
        where = f"local region {lr} ({list(region.layers)})"
        # pages written by the same set of parts are checked once
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
                    raise ValueError(f"{where}, page {int(pages[starts[k]])}: two sources write the same bytes "
                                     "(layers that share this tensor on D are different tensors on P)")
                end = off + n
            whole[keys == keys[k]] = sum(n for _, n in segs) == region.chunk_bytes
        full_pages = pages[starts][whole]
        for g in {p.local_group for p in sliced if p.local.index == lr}:
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


def _check_range(pages: np.ndarray, limit: int, what: str) -> None:
    if len(pages):
        _check_max(int(pages.max()), limit, what)


def _check_max(largest: int, limit: int, what: str) -> None:
    if largest >= limit:
        raise ValueError(f"{what} {largest} out of range [0, {limit})")
