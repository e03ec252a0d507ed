"""Routes: which peer, remote group, regions and head ranges serve each local layer.

A *route* is one set of local layers served the same way: (local group, peer, remote
group, local region, remote region, local head range, remote head range). Each local
layer is served by the peers (P's TP ranks) holding its KV heads, one holder per head
(:func:`~kvcopy.nixl.engine.geometry.head_owners`), through its own remote group. Routes
depend on the two engines' handshakes only, never on a request's block ids, so a caller
that plans many requests against the same peers makes them once (:func:`plan_routes`)
and hands them to :func:`~kvcopy.nixl.planning.plan.build_multi_pull_plan` with every plan: the
per-layer peer and head-owner search, region refs and error-context strings were about
a fifth of a 64-layer plan's host time (``bench/nixl_plan_cost.py``). Where to keep
them is the caller's choice and key (:mod:`kvcopy.nixl.modes.keyed_cache`): the manager keys
them by its peers' keys, arena mode keeps them with each request shape.

A :class:`Routes` knows the engine records it was made for; the planner refuses routes
made for other records (compared by identity first, by value otherwise), so a cached
value can only make the plan slower to get, never different.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..engine.geometry import head_owners, segments
from ..engine.info import EngineInfo, LayerPair

Sources = Sequence[Tuple[EngineInfo, Sequence[LayerPair]]]  # per peer: its record and the layer pairing


class Route:
    """One set of local layers served by one peer, and everything static about it;
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


@dataclass(frozen=True)
class Routes:
    """The routes serving every local layer, in plan order, and the records they were made for."""

    local: EngineInfo
    sources: Tuple[Tuple[EngineInfo, Tuple[LayerPair, ...]], ...]
    routes: Tuple[Route, ...]

    def check(self, local: EngineInfo, sources: Sources) -> None:
        """Refuse use with records other than those these routes were made for."""
        same = self.local is local or self.local == local
        same = same and len(sources) == len(self.sources) and all(
            (info is mine or info == mine) and (pairs is my_pairs or tuple(pairs) == my_pairs)
            for (info, pairs), (mine, my_pairs) in zip(sources, self.sources))
        if not same:
            raise ValueError("routes made for other engine records were handed to the planner")


def plan_routes(local: EngineInfo, sources: Sources) -> Routes:
    """The routes of ``local`` read from ``sources`` (per peer: record, layer pairs)."""
    snapshot = tuple((info, tuple(pairs)) for info, pairs in sources)
    names = [info.name for info, _ in snapshot]
    peer_layers = [{lp.layer: lp for lp in pairs} for _, pairs in snapshot]
    # Every layer of a model asks head_owners the same question: ask once per distinct
    # (local heads, peers' heads) (96 layers ask 2 distinct questions in a 6-group model).
    owners_memo: Dict[tuple, list] = {}

    def owners_of(lh, ph):
        got = owners_memo.get((lh, ph))
        if got is None:
            got = owners_memo[(lh, ph)] = head_owners(lh, list(ph), local.tp_rank)
        return got

    keyed: Dict[tuple, List[str]] = {}
    for region in local.regions:
        for name, g in region.members:
            cands = [i for i in range(len(snapshot)) if name in peer_layers[i]]
            if not cands:
                raise ValueError(f"layer {name!r} (local group {g}) is on none of the peers {names}")
            if region.heads is None:
                owners = owners_of(None, (None,) * len(cands))
            else:
                rh = tuple(snapshot[i][0].regions[peer_layers[i][name].remote_region].heads for i in cands)
                try:
                    owners = owners_of(region.heads, rh)
                except ValueError as exc:
                    held = {snapshot[i][0].name: h for i, h in zip(cands, rh)}
                    raise ValueError(f"layer {name!r}: this rank holds KV heads {region.heads} (first, count); "
                                     f"{exc} (they hold {held})") from None
            for ci, lh, rhd, k in owners:
                i = cands[ci]
                lp = peer_layers[i][name]
                key = (g, i, lp.remote_group, region.index, lp.remote_region, lh, rhd, k)
                keyed.setdefault(key, []).append(name)
    multi = len(snapshot) > 1
    routes = tuple(Route(k, keyed[k], local, snapshot[k[1]][0], multi) for k in sorted(keyed))
    return Routes(local, snapshot, routes)
