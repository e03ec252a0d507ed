"""kvcopy.nixl.planning.descriptors: the vectorized rows equal a plain per-pair, per-chunk loop
(the code ``pull`` used before), row for row, on the fuzzer's random geometries."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvcopy.testing.nixl import fuzz, geometries
from kvcopy.nixl.planning.descriptors import Pieces, check_pairs, desc_rows, index_rows
from kvcopy.nixl.engine.info import pair_layers
from kvcopy.nixl.planning.plan import build_multi_pull_plan
from kvcopy.nixl.engine.regions import descriptor_table
from kvcopy.testing.nixl.engines import one_torch_thread


def loop_indices(pairs, local_off, remote_off):
    loc, rem = [], []
    for p in pairs:
        lp, rp = np.asarray(p.local_pages, np.int64), np.asarray(p.remote_pages, np.int64)
        for c in range(p.local.num_chunks):
            loc.append(local_off[p.local.index] + c * p.local.num_pages + lp)
            rem.append(remote_off[p.remote.index] + c * p.remote.num_pages + rp)
    if not loc:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    return np.concatenate(loc).astype(np.int32), np.concatenate(rem).astype(np.int32)


def loop_descs(pairs, local, remote):
    la, ra, n = [], [], []
    for p in pairs:
        lr, rr = local.regions[p.local.index], remote.regions[p.remote.index]
        lp = np.asarray(p.local_pages, np.int64) * lr.page_stride + lr.address
        rp = np.asarray(p.remote_pages, np.int64) * rr.page_stride + rr.address
        for c in range(p.local.num_chunks):
            for lo, ro, k in p.byte_segments():
                la.append(lp + c * lr.chunk_stride + lo)
                ra.append(rp + c * rr.chunk_stride + ro)
                n.append(np.full(len(lp), k, np.int64))
    la, ra, n = np.concatenate(la), np.concatenate(ra), np.concatenate(n)
    cont = (la[:-1] + n[:-1] == la[1:]) & (ra[:-1] + n[:-1] == ra[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    total = np.add.reduceat(n, starts)
    return (np.stack([la[starts], total], 1).astype(np.uint64), np.stack([ra[starts], total], 1).astype(np.uint64))


def planned(seed):
    spec = fuzz.case(seed)
    d_info = geometries.engine_info(spec, "d", spec.d_rank, geometries.build_caches(spec, "d", spec.d_rank), "D")
    logical = geometries.logical_kv(spec)
    peers = []
    for r in spec.p_ranks:
        info = geometries.engine_info(spec, "p", r, geometries.build_caches(spec, "p", r, logical), f"P{r}")
        try:
            peers.append((info, pair_layers(d_info, info)))
        except ValueError:
            continue
    if not peers:
        return None
    try:
        plan = build_multi_pull_plan(d_info, peers, spec.p.block_ids, spec.num_tokens, spec.d.block_ids,
                                     spec.num_cached)
    except ValueError:
        return None
    return d_info, {p.name: p for p, _ in peers}, plan


def test_rows_equal_the_per_pair_loop_on_fuzzed_plans():
    compared = sliced = one_piece = 0
    with one_torch_thread():
        for seed in range(120):
            got = planned(seed)
            if got is None:
                continue
            d_info, peers, plan = got
            for name in plan.all_peers:
                pairs = [p for p in plan.pairs if p.local_pages and plan.peer_of(p) == name]
                if not pairs:
                    continue
                remote = peers[name]
                pieces = check_pairs(pairs, d_info, remote, name)
                li, ri = index_rows(pairs, pieces, descriptor_table(d_info.regions)[1],
                                    descriptor_table(remote.regions)[1])
                el, er = loop_indices(pairs, descriptor_table(d_info.regions)[1], descriptor_table(remote.regions)[1])
                assert li.dtype == el.dtype and np.array_equal(li, el) and np.array_equal(ri, er), seed
                ld, rd = desc_rows(pairs, pieces, d_info, remote)
                el, er = loop_descs(pairs, d_info, remote)
                assert np.array_equal(ld[:, :2], el) and np.array_equal(rd[:, :2], er), seed
                compared += 1
                sliced += any(p.segments for p in pairs)
                one_piece += len(pieces.local) == 1
    # both paths of Pieces.expand: one shared piece (broadcast) and several (gather)
    assert compared > 60 and sliced > 5 and 5 < one_piece < compared - 5, (compared, sliced, one_piece)


def test_pieces_are_shared_between_layers_and_checked_by_value_too():
    got = None
    for seed in range(40):
        got = planned(seed)
        if got is not None and len([p for p in got[2].pairs if p.local_pages]) > 2:
            break
    d_info, peers, plan = got
    name = plan.all_peers[0]
    pairs = [p for p in plan.pairs if p.local_pages and plan.peer_of(p) == name]
    pieces = check_pairs(pairs, d_info, peers[name], name)
    assert len(pieces.local) <= len(pairs)
    # a pair with equal but not identical refs and page tuples is accepted and gives the same rows
    copy = [replace(p, local=p.local._replace(), local_pages=tuple(list(p.local_pages))) for p in pairs]
    a = desc_rows(pairs, pieces, d_info, peers[name])
    b = desc_rows(copy, check_pairs(copy, d_info, peers[name], name), d_info, peers[name])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    bad = replace(pairs[0], local_pages=(pairs[0].local.num_pages,) + pairs[0].local_pages[1:])
    with pytest.raises(ValueError, match="out of range"):
        check_pairs([bad], d_info, peers[name], name)
    bad = replace(pairs[0], local=pairs[0].local._replace(num_pages=pairs[0].local.num_pages + 1))
    with pytest.raises(ValueError, match="is not this manager's region"):
        check_pairs([bad], d_info, peers[name], name)


def test_empty():
    p = Pieces()
    assert p.bounds == []
    li, ri = index_rows([], p, np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert li.shape == (0,) and ri.shape == (0,)
