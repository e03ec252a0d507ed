"""The copiers that pack a request into an arena span (P) and scatter it out again (D).

One :class:`~kvcopy.core.copier.BlockCopier` per distinct block size and in-block geometry
(one for uniform models). Its "KV cache groups" are the units' (unit, chunk, head slab)
triples (:mod:`kvcopy.nixl.planning.pack_order`; head 0 only, the whole page chunk, in token
order): the device view of a triple is that chunk (and head slab) of the unit's
tensor, its host view is the whole arena seen as blocks of that size with the view's
own in-block strides. So host block ``b`` of a triple is bytes ``[b * block bytes, (b +
1) * block bytes)`` of the arena, and a unit's segment ``[head][chunk][page][block]``
puts triple (u, c, h) at block ``(segment offset + (h * chunks + c) * pages * block
bytes) / block bytes`` (span alignment makes it whole, see ``granule_for``).

P's pack is one d2h call per copier, D's scatter one h2d call per copier, both planned
(checked, packed) before the first byte moves; head order has ``heads`` times more,
smaller blocks (one head slab each) in the same call. The arena's first granule is
never handed out and stays zero: D zeroes its pages past the prompt by copying from
host block 0 in the same scatter call.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core.checksum import SumFold
from ...core.copier import BlockCopier, CallPlan
from ..planning.pack_order import Unit, natural_key

Ids = List[List[int]]


class SpanCopiers:
    """The copiers of one staging order's units (see the module docstring)."""

    def __init__(self, units: Sequence[Unit], device_caches: Mapping[str, torch.Tensor], layouts,
                 arena_buf: torch.Tensor, backend: str, max_ctas: Optional[int] = None):
        self.units = list(units)
        # per unit, its last layer's place in forward order (the order vLLM's save_kv_layer
        # comes in): a layer-wise step lays its sums out by it (partial_stage.StepCopies)
        last = [max(u.layers, key=natural_key) for u in self.units]
        place = {name: i for i, name in enumerate(sorted(set(last), key=natural_key))}
        self.last_layer = [place[name] for name in last]
        dev, host, block_dims, members = _views(self.units, device_caches, layouts, arena_buf)
        # Per copier, for ids(): (block bytes, unit, group and slab index (head * chunks +
        # chunk) per copier group, then per KV cache group the copier groups of its units).
        self.index = []
        self.keys = list(members)  # per copier: (block bytes, element size, in-block (size, stride) pairs)
        for ck, triples in members.items():
            unit = np.array([i for i, _, _ in triples], np.int64)
            group = np.array([self.units[i].group for i, _, _ in triples], np.int64)
            slab = np.array([h * self.units[i].num_chunks + c for i, c, h in triples], np.int64)
            self.index.append((ck[0], unit, group, slab,
                               [(g, np.flatnonzero(group == g)) for g in sorted(set(group.tolist()))]))
        self.copiers: List[BlockCopier] = []
        try:
            for ck, triples in members.items():
                names = [[f"u{i}c{c}h{h}"] for i, c, h in triples]
                self.copiers.append(BlockCopier(dev[ck], host[ck], names, copy_backend=backend, max_ctas=max_ctas,
                                                block_dim={n[0]: block_dims[n[0]] for n in names}))
        except Exception:
            self.close()
            raise

    def ids(self, span_offset: int, segs: Sequence[int], counts: Sequence[int], dev_pages, positions,
            zero_pages=None) -> List[Tuple[Ids, Ids]]:
        """Per copier: (device ids, host ids) per (unit, chunk, head slab) group, for a span
        at ``span_offset`` with these segment offsets and page counts per group: device
        pages ``dev_pages[g]`` at page positions ``positions[g]``, then (``zero_pages``,
        per group) pages copied from the zero granule (host block 0)."""
        # Plain int lists: the copier's native planner takes those (numpy arrays take its
        # numpy path, several times slower for a 192-group call). Host ids: one broadcast
        # add and one tolist per (copier, KV cache group), not per copier group.
        zeros = [None if zero_pages is None else np.asarray(z, np.int64) for z in (zero_pages or dev_pages)]
        dev_of = [np.concatenate([d, z]).tolist() if z is not None and len(z) else np.asarray(d).tolist()
                  for d, z in zip(dev_pages, zeros)]
        out = []
        for k, (_, unit, group, _, by_group) in enumerate(self.index):
            first = self._first_blocks(k, span_offset, segs, counts)
            host: List[List[int]] = [[] for _ in range(len(unit))]  # every one set below
            for g, at in by_group:
                rows = first[at][:, None] + np.asarray(positions[g], np.int64)[None, :]
                z = zeros[g]
                if z is not None and len(z):
                    rows = np.concatenate([rows, np.zeros((len(at), len(z)), np.int64)], 1)
                for j, row in zip(at.tolist(), rows.tolist()):
                    host[j] = row
            out.append(([dev_of[g] for g in group.tolist()], host))
        return out

    def flat_ids(self, span_offset: int, segs: Sequence[int], counts: Sequence[int], dev_pages: Sequence[np.ndarray],
                 positions: Sequence[np.ndarray]) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`ids` without zero pages, per copier as ``BlockCopier.plan_flat`` takes
        them: (device ids, host ids, ids per copier group), every copier group's ids
        concatenated in int64 arrays, made with array operations (no list per group)."""
        sizes = np.array([len(p) for p in positions], np.int64)
        at = np.concatenate(([0], np.cumsum(sizes)))  # each KV cache group's place in the concatenations
        dev_all = np.concatenate([np.asarray(d, np.int64) for d in dev_pages]) if len(dev_pages) else sizes
        pos_all = np.concatenate([np.asarray(p, np.int64) for p in positions]) if len(positions) else sizes
        out = []
        for k, (_, _, group, _, _) in enumerate(self.index):
            lens = sizes[group]
            starts = np.repeat(np.cumsum(lens) - lens, lens)  # each id's copier group's first id
            take = np.repeat(at[group], lens) + np.arange(int(lens.sum())) - starts
            first = self._first_blocks(k, span_offset, segs, counts)
            out.append((dev_all[take], np.repeat(first, lens) + pos_all[take], lens))
        return out

    def split_by_unit(self, k: int, direction: str, call: CallPlan,
                      live: Optional[np.ndarray] = None) -> List[Tuple[int, CallPlan, np.ndarray]]:
        """Copier ``k``'s planned ``call`` cut into one call per unit (of its ``live``
        copier groups, a mask; default all): ``(unit, its call, its copier groups in
        call order)`` in unit order (``BlockCopier.split``: nothing checked again)."""
        unit = self.index[k][1]
        live = np.ones(len(unit), bool) if live is None else live
        units = np.unique(unit[live])
        part_of = np.where(live, np.searchsorted(units, unit), -1)
        cut = self.copiers[k].split(direction, call, part_of, len(units))
        order = np.argsort(part_of, kind="stable")  # groups of no unit (-1) first
        ends = (len(order) - int(live.sum()) + np.cumsum(np.bincount(part_of[live], minlength=len(units)))).tolist()
        starts = [len(order) - int(live.sum())] + ends[:-1]
        return [(u, c, order[a:b]) for u, c, a, b in zip(units.tolist(), cut, starts, ends)]

    def _first_blocks(self, k: int, span_offset: int, segs: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """Copier ``k``'s host block of page position 0 per copier group (module docstring)."""
        cb, unit, group, slab, _ = self.index[k]
        seg_at, count = np.asarray(segs, np.int64), np.asarray(counts, np.int64)
        return (span_offset + seg_at[unit] + slab * count[group] * cb) // cb

    def plan(self, direction: str, ids: Sequence[Tuple[Ids, Ids]]) -> List[CallPlan]:
        """One planned call per copier (every call checked before any runs)."""
        return [copier.plan(direction, dev, host) for copier, (dev, host) in zip(self.copiers, ids)]

    def run(self, direction: str, calls: Sequence[CallPlan], sums: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Run the planned calls; ``sums``: one tensor per call for its page checksums
        (:mod:`kvcopy.nixl.modes.span_sums`), or None."""
        for k, (copier, call) in enumerate(zip(self.copiers, calls)):
            copier.run(direction, call, None if sums is None else sums[k])

    def run_and_fold(self, direction: str, calls: Sequence[CallPlan], sums: Sequence[torch.Tensor],
                     fold: SumFold) -> Optional[int]:
        """One copier's call with its sums folded by ``fold`` in the same host call where
        the backend can (:meth:`~kvcopy.core.copier.BlockCopier.run_and_fold`): the count of
        values that differ, or None (copied and summed, not folded)."""
        if len(self.copiers) != 1 or len(calls) != 1 or len(sums) != 1:
            raise ValueError(f"run_and_fold: one copier's call, got {len(self.copiers)} copiers, {len(calls)} calls")
        return self.copiers[0].run_and_fold(direction, calls[0], sums[0], fold)

    def close(self) -> None:
        for c in self.copiers:
            c.close()
        self.copiers = []


def _views(units: Sequence[Unit], device_caches: Mapping[str, torch.Tensor], layouts, arena_buf: torch.Tensor):
    """Per copier key (block bytes, in-block geometry): the device and host views of its
    (unit, chunk, head slab) triples by name, their block dims, and the triples."""
    dev: Dict[tuple, Dict[str, torch.Tensor]] = {}
    host: Dict[tuple, Dict[str, torch.Tensor]] = {}
    block_dims: Dict[str, int] = {}
    members: Dict[tuple, List[Tuple[int, int, int]]] = {}
    for i, u in enumerate(units):
        t = device_caches[u.layers[0]]
        layout = layouts[u.layers[0]]
        cd = _chunk_dim(t, layout) if u.num_chunks > 1 else None
        bd = layout.block_dim - (cd is not None and cd < layout.block_dim)  # after dropping the chunk axis
        for c in range(u.num_chunks):
            chunk = t if cd is None else t.select(cd, c)
            hd = _axis_dim(chunk, bd, u.heads, u.head_stride, "head") if u.heads > 1 else None
            for h in range(u.slabs):
                view = chunk if hd is None else chunk.select(hd, h // u.outer)
                vbd = bd - (hd is not None and hd < bd)
                if u.outer > 1:  # then the slab of this head: K or V
                    od = _axis_dim(view, vbd, u.outer, u.outer_stride, "K/V")
                    view = view.select(od, h % u.outer)
                    vbd -= od < vbd
                key = f"u{i}c{c}h{h}"
                # the whole arena as blocks of this block size, with the view's own in-block strides
                strides, shape = list(view.stride()), list(view.shape)
                strides[vbd] = u.block_bytes // view.element_size()
                shape[vbd] = arena_buf.numel() // u.block_bytes
                # one copier per block size and in-block geometry: the copier's host views
                # of one arena must be the same region (same bytes, same geometry)
                ck = (u.block_bytes, view.element_size(),
                      tuple((n, st) for d, (n, st) in enumerate(zip(view.shape, view.stride())) if d != vbd))
                dev.setdefault(ck, {})[key] = view
                host.setdefault(ck, {})[key] = torch.as_strided(arena_buf.view(view.dtype), shape, strides, 0)
                block_dims[key] = vbd
                members.setdefault(ck, []).append((i, c, h))
    return dev, host, block_dims, members


def _axis_dim(chunk: torch.Tensor, bd: int, size: int, stride: int, what: str) -> int:
    for d in range(chunk.dim()):
        if d != bd and chunk.shape[d] == size and chunk.stride(d) == stride:
            return d
    raise ValueError(f"cannot find the {what} axis ({size} of stride {stride}) of a page "
                     f"chunk of shape {tuple(chunk.shape)}")


def _chunk_dim(t: torch.Tensor, layout) -> int:
    for d in range(t.dim()):
        if d != layout.block_dim and t.shape[d] == layout.num_chunks and \
                t.stride(d) * layout.itemsize == layout.chunk_stride:
            return d
    raise ValueError(f"cannot find the chunk axis of a tensor of shape {tuple(t.shape)}")
