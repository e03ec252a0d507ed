"""The oracle fuzz for push (:mod:`kvcopy.nixl.push_reservations`), without NIXL: every random geometry of
:mod:`kvcopy.testing.nixl.geometries` (TP pairs, token and head order, MLA, overlaid and
hybrid groups, GDN state, the six layouts, page sizes) through D's reservation, P's
record slot and rows replayed in memory as P's WRITE would move them, and D's landing.
A case is ``exact`` when D's caches equal the token-position expectation byte for byte
(D poisoned first), ``raised`` when planning refused it (the pull of the same case must
refuse it too: :func:`run_push_case` is compared with :func:`~kvcopy.testing.nixl.fuzz.run_arena_case`).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from ...nixl.modes.arena_push import LENGTH, land, reserve
from ...nixl.modes.base import Peer
from ...nixl.planning.pack_order import ORDERS
from .fuzz import Outcome, reads_rank, reason
from .geometries import Spec, arena_order, arena_staging, build_caches, expected, logical_kv
from .oracle import first_difference, replay_rows, same_bytes


def run_push_case(spec: Spec) -> Outcome:
    logical = logical_kv(spec)
    d_caches = build_caches(spec, "d", spec.d_rank)
    want, _ = expected(spec, d_caches, logical)
    made: List[object] = []
    try:
        d_st, d_info = arena_staging(spec, "d", spec.d_rank, d_caches, "D")
        made.append(d_st)
        peers: List[Peer] = []
        staged, buffers = {}, {}
        for r in spec.p_ranks:
            p_st, info = arena_staging(spec, "p", r, build_caches(spec, "p", r, logical), f"P{r}")
            made.append(p_st)
            if not reads_rank(spec, d_info, info):
                continue
            peers.append(Peer(len(peers), info, (), ()))
            staged[info.name] = (p_st, p_st.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1))
            buffers[info.name] = p_st.buffer
        rw = reserve(d_st, d_info, peers, spec.num_tokens, spec.d.block_ids, spec.num_cached, b"req",
                     ORDERS[arena_order(spec)])
    except ValueError as exc:
        for st in made:
            st.close()  # type: ignore[attr-defined]
        return Outcome("raised", reason(exc), feasible=want is not None, detail=str(exc))
    try:
        if want is None:
            return Outcome("wrong", "reserved although no exact transfer exists")
        reads: Dict[str, tuple] = {}
        for name, (p_st, record) in staged.items():
            entry = p_st.begin_write(b"req")
            body = record.to_bytes()
            at = entry.span.offset + entry.payload
            p_st.buffer[at: at + LENGTH.size + len(body)] = torch.frombuffer(
                bytearray(LENGTH.pack(len(body)) + body), dtype=torch.uint8)
            rows = rw.rows[name]
            if np.any(rows[:, 0] + rows[:, 2] > entry.payload + entry.slot):  # P's own check at post
                return Outcome("wrong", "a row reads past P's staged span")
            zero = np.zeros(len(rows), np.int64)
            local = np.stack([d_st.base + rw.work.offset + rows[:, 1], rows[:, 2], zero], 1).astype(np.uint64)
            remote = np.stack([p_st.base + entry.span.offset + rows[:, 0], rows[:, 2], zero], 1).astype(np.uint64)
            reads[name] = (local, remote)
        replay_rows(reads, d_st.buffer, buffers)
        try:
            check, unchecked = land(d_st, rw, None, False)
        except ValueError as exc:
            return Outcome("wrong", f"land refused a genuine push: {exc}")
        if not same_bytes(d_caches, want):
            return Outcome("wrong", "bytes differ", detail=first_difference(d_caches, want) or "")
        mismatch = check.result() if check is not None else None
        if mismatch:
            return Outcome("wrong", "false checksum failure", detail=mismatch)
        return Outcome("exact", checked=check is not None, reason=unchecked or "")
    finally:
        for st in made:
            st.close()  # type: ignore[attr-defined]
