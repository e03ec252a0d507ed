"""D's half of a push in arena mode: a request planned before P staged it, landed from its trailer.

A pull plans from P's record (:mod:`kvcopy.nixl.modes.arena`). A push is planned before
P has one: D plans over *assumed* records (every page position of the prompt held, D's
own staging order, P's engine, rank and generation from its checked handshake), which
fixes the rows between P's span and D's exactly as a pull of a fully held request
would, span-relative on P's side. D's span is ``[payload][one record slot per peer]``;
each peer's rows gain one row ``P's record slot -> D's slot`` (P's span is
``[payload][record slot]``, :meth:`ArenaStaging.stage`), so for equal geometry the rows
merge into one: one descriptor per P rank, record included. Slots are sized by
:func:`~kvcopy.nixl.wire.record.record_capacity` on both sides.

Landing (:func:`land`, after every peer said its WRITE ended): each slot is read through
the one record checker (frame, digest, key, then :func:`~kvcopy.nixl.wire.record.check_record`:
request, engine, rank, generation, tokens), the plan D would have made from the real
records must read exactly what the assumed one did (a page P did not hold, or held in
another order, fails the load), and the scatter's page sums are compared with the
record's as in a pull. Nothing is written to D's KV before all of that passed (but the
units of a chunked push scattered at their ``c``, CPU and GPU D alike:
:mod:`~kvcopy.nixl.modes.push_units`; a GPU D's comparison then waits, without a host
wait, for the read-backs of their sums: ``Completion.ready``).
"""
from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..planning.plan import NO_BLOCK
from ..wire.record import StagedRequest, check_record, record_capacity, request_key
from ..sum_check import SumCheck, mismatch_message
from . import push_units
from .arena import ArenaPlan, ArenaStaging, ArenaWork, _real_pages
from .base import Peer
from .push_units import UnitScatter, plan_units
from .rows import merge_rows

LENGTH = struct.Struct("<I")  # the record's length at the start of its slot


class ReservedWork(NamedTuple):
    """One reservation on D: the pull-shaped work (D's span, scatter calls, zero runs),
    the rows per peer (``[P offset, D offset, bytes]`` relative to the two spans), each
    peer's record slot in D's span (offset, bytes), and what :func:`land` re-plans with."""

    plan: ArenaPlan
    work: ArenaWork
    rows: Dict[str, np.ndarray]
    slots: Dict[str, Tuple[int, int]]
    peers: Tuple[Peer, ...]
    request: Any  # arena._Request over the assumed records
    shape: Any  # arena._Shape
    virtual: Any  # arena._VirtualPlan
    units: Optional[UnitScatter] = None  # the per-unit landing of a chunked push (push_units)


def reserve(staging: ArenaStaging, info, peers: Sequence[Peer], num_tokens: int, local_block_ids, cached,
            request_id, order: Optional[str] = None) -> ReservedWork:
    """Plan a pushed request (module docstring) in ``order`` (a record's order name;
    default: the one D stages in, which P must stage in too); allocates D's span
    (``ArenaFull`` if it does not fit: nothing held)."""
    rid = request_key(request_id)
    text = rid.decode("latin-1")
    n_tok = int(num_tokens)
    assumed = {}
    for p in peers:
        blocks = tuple((1,) * -(-n_tok // tpb) for tpb in p.info.tokens_per_block)
        assumed[p.name] = StagedRequest(p.name, text, 0, p.info.arena[1], n_tok, blocks, order or staging.order,
                                        tp_rank=p.info.tp_rank, generation=p.info.generation)
    req = staging._request(info, peers, assumed, n_tok, local_block_ids, cached, request_id)
    keys = req.peer_keys
    shape = staging.shapes.get((req.order, req.counts, req.peer_counts, keys),
                               lambda: staging._shape(info, peers, req.order, req.counts, req.peer_counts), tags=keys)
    caps = [record_capacity(p.info, n_tok, rid) for p in peers]
    staging._free_scattered()
    span = staging.arena.allocate(shape.nbytes + sum(caps))
    try:
        plan, work = staging._arena_plan(req, shape, span, {p.name: (p.info.arena[0], p.info.arena[1]) for p in peers})
        virt = staging._virtual_plan(shape, req)
        d_at = staging.base + span.offset
        rows, slots, at = {}, {}, shape.nbytes
        for p, need, cap, read in zip(peers, shape.peer_bytes, caps, work.reads):
            local = np.concatenate([read.local.astype(np.int64) - [d_at, 0, 0], [[at, cap, 0]]])
            remote = np.concatenate([read.remote.astype(np.int64) - [p.info.arena[0], 0, 0], [[need, cap, 0]]])
            local, remote = merge_rows(local, remote, 0)
            rows[p.name] = np.stack([remote[:, 0], local[:, 0], local[:, 1]], axis=1).astype(np.int64)
            rows[p.name].setflags(write=False)
            slots[p.name] = (at, cap)
            at += cap
        # the per-unit landing of a chunked push, on a CPU D and a GPU D alike (push_units)
        read_real, zero_real, _ = _real_pages(req, virt.plan)
        layout = staging.sums.layout(staging.span_copiers(req.order), req.order, req.info.tokens_per_page,
                                     "h2d") if staging.sums.on else None
        units = plan_units(staging, shape, req, peers, span.offset, rows, read_real, virt.plan.read_pages,
                           zero_real, np.asarray(work.zero_starts), np.asarray(work.zero_lens), layout)
    except Exception:
        staging.arena.free(span)
        raise
    return ReservedWork(plan, work, rows, slots, tuple(peers), req, shape, virt, units)


def read_trailer(staging: ArenaStaging, rw: ReservedWork, name: str, key) -> StagedRequest:
    """Peer ``name``'s record from its slot of D's span (``ValueError``: no record, or
    one whose frame or digest is wrong: not written, or not visible yet)."""
    at, cap = rw.slots[name]
    raw = staging.buffer[rw.work.offset + at: rw.work.offset + at + cap].numpy().tobytes()
    (length,) = LENGTH.unpack_from(raw)
    if not 0 < length <= cap - LENGTH.size:
        raise ValueError(f"{name!r}'s record slot holds no record (length {length} of {cap} bytes)")
    return StagedRequest.from_bytes(raw[LENGTH.size:LENGTH.size + length], key)


def land(staging: ArenaStaging, rw: ReservedWork, key, require_checksum: bool, done: Optional[np.ndarray] = None,
         sums: Optional[push_units.UnitSums] = None, trailers: Optional[Dict[str, StagedRequest]] = None):
    """D, once every peer's WRITE ended: check the trailers and re-plan (module
    docstring), then zero and scatter as a pull's ``complete`` does. Returns the mode's
    ``(SumCheck or None, why unchecked)``; raises ``ValueError`` with D's KV untouched
    (but for the units scattered already). ``done``/``sums``: the units of a chunked push
    scattered already (:mod:`kvcopy.nixl.modes.push_units`) and their sums: only the rest
    is scattered here, and the sums of all are compared. ``trailers``: per peer the record
    :func:`read_trailer` read from its slot already (the caller's visibility check)."""
    req = rw.request
    records, remote_ids = [], {}
    for p in rw.peers:
        rec = trailers[p.name] if trailers is not None else read_trailer(staging, rw, p.name, key)
        _, remote_ids[p.name] = check_record(p.info, rec, req.num_tokens, req.records[0].request_id)
        if rec.order != req.order:
            raise ValueError(f"{p.name!r} staged in order {rec.order!r}, D reserved {req.order!r}")
        records.append(rec)
    real = dataclasses.replace(req, remote_ids=remote_ids, records=tuple(records))
    virt = staging._virtual_plan(rw.shape, real)
    same = all(np.array_equal(a, b) for n in virt.reads for a, b in zip(virt.reads[n], rw.virtual.reads[n])) \
        and tuple(map(tuple, virt.plan.read_pages)) == tuple(map(tuple, rw.virtual.plan.read_pages))
    if not same:
        held = [int((v != NO_BLOCK).sum()) for ids in remote_ids.values() for v in ids]
        raise ValueError(f"the pushed pages are not what P holds (P holds {held} page positions per group): "
                         "the request is not loaded")
    work = rw.work
    check, unchecked = None, "checksum off on D"
    if staging.sums.on:
        layout = staging.sums.layout(staging.span_copiers(req.order), req.order, req.info.tokens_per_page, "h2d")
        check, unchecked = staging.sums.check(layout, records, real.peer_counts == (real.counts,), virt.reads,
                                              len(work.zero_lens), virt.plan.read_pages,
                                              [len(z) for z in work.zero_pages], work.read_pages)
    if require_checksum and check is None:
        raise ValueError(f"require_checksum: the pushed pages cannot be compared ({unchecked})")
    if done is None or not done.any() or rw.units is None:
        return staging.complete(work._replace(check=check, unchecked=unchecked))
    sums = push_units.UnitSums(rw.units, staging.streams) if sums is None else sums
    push_units.scatter(staging, work.offset, req.order, rw.units, np.flatnonzero(~done).tolist(), check is not None,
                       sums)
    if check is None:
        staging.sums.stats.unchecked()
        return None, unchecked
    if sums.deferred:  # compared once the read-backs are in: Completion.ready asks, never waits
        return SumCheck(sums, functools.partial(_compare, check), staging.sums.stats), None
    return SumCheck.made(_compare(check, sums.arrays()), staging.sums.stats), None


def _compare(check, values) -> Optional[str]:
    """None if the units' folded ``values`` (per group) equal P's, else the mismatch naming the pages."""
    bad = [(g, int(check.positions[g][i]), check.local_pages[g][i])
           for g in range(len(values)) for i in np.flatnonzero(values[g] != check.expected[g]).tolist()]
    return mismatch_message(bad) if bad else None
