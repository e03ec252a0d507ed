"""Fault injection for arena mode's page sums: a fault between P's pack and D's scatter fails the request.

    python -m kvcopy.testing.nixl.fuzz --inject --cases 2000 --seed 0

Each case draws a geometry as the fuzzer does (:func:`~kvcopy.testing.nixl.geometries.random_spec`),
then gives D P's geometry (TP size, group plan, tokens per block and page, layout,
aliasing) with D's own block ids, spare capacity and prefix hit, so the staged pages
are the same bytes on both sides and D compares their sums (:mod:`kvcopy.nixl.modes.span_sums`).
P's rank stages an earlier request (its KV first overwritten with other bytes), then
the request itself; D plans it. Without NIXL: the READ is the byte oracle's
:func:`~kvcopy.testing.nixl.oracle.replay_rows`, the copies are the real copiers.

1. **clean**: the READ, D's scatter: D's caches must equal the fuzzer's expectation and
   the sums must match (a mismatch is a false failure: *wrong*).
2. one run per fault, from the same two spans (P's restored, D's zeroed before each):

   * ``p_flip``: one bit of P's span flipped after the pack, in a byte D compares;
   * ``d_flip``: one bit of D's span flipped after the READ;
   * ``swap``: two compared blocks of one size with different bytes exchanged in D's span;
   * ``replay``: one compared block of P's span replaced by the earlier request's block
     at the same place;
   * ``truncate``: the READ row holding a compared byte cut short at that byte.

   Each must fail D's comparison, naming the faulted page positions (*caught*); a fault
   that passes is *missed*, one caught naming other pages *wrong*. A fault that would
   change no byte (the earlier request's block equal to this one's, two equal blocks,
   a truncated tail equal to what D's span held) is *not injected*, and counted.

A case whose pages D does not compare (a geometry the fuzzer draws that the sums
cannot serve, e.g. KV heads replicated over ranks) or that raises counts apart; the
goal is every injected fault caught and no false failure.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ...nixl.modes.base import Peer
from ...nixl.engine.geometry import remote_ranks
from ...nixl.engine.info import pair_layers
from .geometries import Spec, allocate, arena_staging, build_caches, expected, logical_kv, random_spec
from .oracle import first_difference, replay_rows, same_bytes, unique_storages

FAULTS = ("p_flip", "d_flip", "swap", "replay", "truncate")


def homogeneous(rng: np.random.Generator, seed: int) -> Spec:
    """A fuzz case whose D has P's geometry (see the module docstring)."""
    spec = random_spec(rng, seed)
    p = spec.p
    counts = [-(-spec.num_tokens // b) + int(rng.random() < 0.4) for b in p.tokens_per_block]
    firsts = [next((i for i, x in enumerate(ids) if x >= 0), len(ids)) for ids in p.block_ids]
    firsts = [min(f + int(rng.random() < 0.2), c - 1) for f, c in zip(firsts, counts)]
    num_pages, ids = allocate(rng, p.tokens_per_block, p.tokens_per_page, counts, firsts)
    d_rank = int(rng.integers(0, p.tp_size))
    gqa = any(kind == "gqa" for _, kind, _ in spec.layers)
    ranks = remote_ranks(d_rank, p.tp_size, p.tp_size, spec.total_kv_heads if gqa else None)
    cached = int(rng.integers(0, spec.num_tokens + 1)) // p.tokens_per_block[0] * p.tokens_per_block[0] \
        if rng.random() < 0.3 else 0
    return replace(spec, d=replace(p, num_pages=num_pages, block_ids=ids), d_rank=d_rank, p_ranks=ranks,
                   num_cached=cached)


@dataclass
class InjectReport:
    cases: int = 0
    clean: Counter = field(default_factory=Counter)  # compared / not compared / raised / wrong
    faults: Dict[str, Counter] = field(default_factory=lambda: {f: Counter() for f in FAULTS})
    wrong: List[Tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def injected(self) -> int:
        return sum(c["caught"] + c["missed"] + c["wrong"] for c in self.faults.values())

    @property
    def failures(self) -> int:
        """Missed faults, wrongly named ones, false failures and wrong bytes."""
        return sum(c["missed"] + c["wrong"] for c in self.faults.values()) + self.clean["wrong"]

    def __str__(self) -> str:
        caught = sum(c["caught"] for c in self.faults.values())
        lines = [f"cases {self.cases}: clean pulls {dict(sorted(self.clean.items()))}; injected {self.injected}, "
                 f"caught {caught}, missed {sum(c['missed'] for c in self.faults.values())}  [{self.seconds:.1f} s]"]
        for f in FAULTS:
            c = self.faults[f]
            lines.append(f"  {f:9s} injected {c['caught'] + c['missed'] + c['wrong']:6d}  caught {c['caught']:6d}  "
                         f"missed {c['missed']}  wrong {c['wrong']}  not injected {c['not injected']}")
        for seed, text in self.wrong[:20]:
            lines.append(f"  WRONG seed {seed}: {text}")
        return "\n".join(lines)


class _Case:
    """One staged request and its plan, the spans kept to restore between faults."""

    def __init__(self, spec: Spec):
        self.spec = spec
        logical = logical_kv(spec)
        self.d_caches = build_caches(spec, "d", spec.d_rank)
        rank = spec.p_ranks[0]
        p_caches = build_caches(spec, "p", rank, logical)
        self.want, _ = expected(spec, self.d_caches, logical)
        self.made = []
        self.d_st, d_info = arena_staging(spec, "d", spec.d_rank, self.d_caches, "D")
        self.made.append(self.d_st)
        p_st, info = arena_staging(spec, "p", rank, p_caches, f"P{rank}", spans=2)
        self.made.append(p_st)
        pair_layers(d_info, info)
        self.old = self._stage_earlier(p_st, info, p_caches)
        self.record = p_st.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
        _, self.work = self.d_st.plan(d_info, [Peer(0, info, (), ())], {info.name: self.record}, spec.num_tokens,
                                      spec.d.block_ids, spec.num_cached, request_id=b"req")
        self.pbuf, self.dbuf = p_st.buffer, self.d_st.buffer
        self.p_span = self.pbuf[self.record.offset:self.record.offset + self.record.nbytes].clone()
        self.reads = {r.peer: (r.local, r.remote) for r in self.d_st.reads(self.work)}
        self.peers = {info.name: self.pbuf}

    def _stage_earlier(self, p_st, info, caches) -> int:
        """Stage an earlier request over other KV bytes; P's KV is restored after. Its
        span's offset in P's arena."""
        saved = {k: s.clone() for k, s in unique_storages(caches).items()}
        gen = torch.Generator().manual_seed(self.spec.seed ^ 0x5EED)
        for s in unique_storages(caches).values():
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, generator=gen))
        old = p_st.stage(info, self.spec.p.block_ids, self.spec.num_tokens, b"earlier", 1).offset
        for k, s in unique_storages(caches).items():
            s.copy_(saved[k])
        return old

    def blocks(self) -> List[Tuple[int, int, int, int]]:
        """(D arena offset, bytes, group, page position) of every block D compares."""
        check = self.work.check
        cps = self.d_st.span_copiers(self.work.order)
        out = []
        for (cb, _, group, _, _), call in zip(cps.index, self.work.scatter):
            for j, src in enumerate(call.src_ids):
                g = int(group[j])
                for i, h in enumerate(src[:len(check.positions[g])].tolist()):
                    out.append((h * cb, cb, g, int(check.positions[g][i])))
        return out

    def to_p(self, d_offset: int) -> int:
        """P's arena offset of D's span offset ``d_offset`` (the READ moves bytes in place)."""
        return self.record.offset + d_offset - self.work.offset

    def run(self, pre: Optional[Callable] = None, post: Optional[Callable] = None,
            reads=None) -> Optional[str]:
        """Restore P's span, zero D's, READ (``reads`` or the plan's), scatter: the comparison's result."""
        self.pbuf[self.record.offset:self.record.offset + self.record.nbytes] = self.p_span
        self.dbuf[self.work.offset:self.work.offset + self.work.nbytes] = 0
        if pre is not None:
            pre()
        replay_rows(reads or self.reads, self.dbuf, self.peers)
        if post is not None:
            post()
        check, _ = self.d_st.complete(self.work)
        return None if check is None else check.result()

    def close(self) -> None:
        for st in self.made:
            st.close()


def _flip(buf: torch.Tensor, at: int, bit: int) -> None:
    buf[at] = int(buf[at]) ^ (1 << bit)


def _fault(case: _Case, fault: str, rng: np.random.Generator):
    """(pre, post, reads, the (group, position) pages it changes), or None: not injectable."""
    blocks = case.blocks()
    start, n, g, k = blocks[int(rng.integers(len(blocks)))]
    at = start + int(rng.integers(n))
    if fault == "p_flip":
        p_at, bit = case.to_p(at), int(rng.integers(8))
        return (lambda: _flip(case.pbuf, p_at, bit)), None, None, {(g, k)}
    if fault == "d_flip":
        bit = int(rng.integers(8))
        return None, (lambda: _flip(case.dbuf, at, bit)), None, {(g, k)}
    if fault == "swap":
        for _ in range(16):
            s2, n2, g2, k2 = blocks[int(rng.integers(len(blocks)))]
            a, b = case.p_span[case.to_p(start) - case.record.offset:][:n], \
                case.p_span[case.to_p(s2) - case.record.offset:][:n2]
            if n2 == n and s2 != start and not torch.equal(a, b):
                def swap(s1=start, s2=s2, n=n):
                    x = case.dbuf[s1:s1 + n].clone()
                    case.dbuf[s1:s1 + n] = case.dbuf[s2:s2 + n]
                    case.dbuf[s2:s2 + n] = x
                return None, swap, None, {(g, k), (g2, k2)}
        return None
    if fault == "replay":
        src = case.old + case.to_p(start) - case.record.offset
        if torch.equal(case.pbuf[src:src + n], case.p_span[case.to_p(start) - case.record.offset:][:n]):
            return None

        dst = case.to_p(start)

        def stale(src=src, dst=dst, n=n):
            case.pbuf[dst:dst + n] = case.pbuf[src:src + n].clone()
        return stale, None, None, {(g, k)}
    return _truncate(case, blocks, at)


def _truncate(case: _Case, blocks, at: int):
    """The READ row holding D offset ``at`` ends there instead (None: the bytes it no
    longer moves are zeros, as D's span held, so nothing would change)."""
    base = case.dbuf.data_ptr()
    (peer, (lrows, rrows)), = case.reads.items()
    starts = lrows[:, 0].astype(np.int64) - base
    r = int(np.flatnonzero((starts <= at) & (at < starts + lrows[:, 1].astype(np.int64)))[0])
    end = int(starts[r] + lrows[r, 1])
    if not case.p_span[case.to_p(at) - case.record.offset:case.to_p(end) - case.record.offset].any():
        return None
    lcut, rcut = lrows.copy(), rrows.copy()
    lcut[r, 1] = rcut[r, 1] = at - int(starts[r])
    keep = lcut[:, 1] > 0
    pages = {(g, k) for s, n, g, k in blocks if s < end and s + n > at}
    return None, None, {peer: (lcut[keep], rcut[keep])}, pages


_NAMED = re.compile(r"group (\d+) page position (\d+)")


def _named(message: str) -> Set[Tuple[int, int]]:
    return {(int(g), int(k)) for g, k in _NAMED.findall(message)}


def run_inject_case(spec: Spec, rng: np.random.Generator, report: InjectReport) -> None:
    """One case: the clean pull, then every fault (see the module docstring)."""
    try:
        case = _Case(spec)
    except ValueError:
        report.clean["raised"] += 1
        return
    try:
        mismatch = case.run()
        if case.work.check is None:
            report.clean[f"not compared: {case.work.unchecked}"] += 1
            return
        if case.want is None or not same_bytes(case.d_caches, case.want) or mismatch:
            report.clean["wrong"] += 1
            why = mismatch or first_difference(case.d_caches, case.want or {}) or "no expectation"
            report.wrong.append((spec.seed, f"clean pull: {why} | {spec.summary()}"))
            return
        report.clean["compared"] += 1
        for fault in FAULTS:
            made = _fault(case, fault, rng)
            if made is None:
                report.faults[fault]["not injected"] += 1
                continue
            pre, post, reads, pages = made
            found = case.run(pre, post, reads)
            named = _named(found) if found else set()
            status = "missed" if not found else "caught" if named and (
                named <= pages if fault == "truncate" else named == pages or len(pages) > 4) else "wrong"
            report.faults[fault][status] += 1
            if status != "caught":
                report.wrong.append((spec.seed, f"{fault} {status}: pages {sorted(pages)[:4]}, got {found} | "
                                                f"{spec.summary()}"))
    finally:
        case.close()


def inject(cases: int, seed: int = 0, progress: Optional[Callable[[int, InjectReport], None]] = None) -> InjectReport:
    """``cases`` cases from ``seed`` (five injections each where they apply)."""
    import time
    report = InjectReport()
    start = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(cases):
            case_seed = seed * 1_000_003 + i
            rng = np.random.default_rng(case_seed)
            try:
                run_inject_case(homogeneous(rng, case_seed), rng, report)
            except Exception as exc:  # anything but a clear ValueError is a bug
                report.clean["wrong"] += 1
                report.wrong.append((case_seed, f"{type(exc).__name__}: {exc}"))
            report.cases += 1
            if progress is not None:
                progress(i + 1, report)
    finally:
        torch.set_num_threads(before)
        report.seconds = time.perf_counter() - start
    return report
