"""A byte-oracle fuzzer for heterogeneous P/D pulls (no NIXL: CPU tensors).

    python -m kvcopy.testing.nixl.fuzz --cases 10000 --seed 0

Each case draws a geometry: layers (GQA or MLA, full or sliding-window attention), a
KV cache group plan on each side, tokens per block and per page per group on each
side, a layout per side (NHD, HND, KV-first NHD/HND, ``[pages, 2, tokens, heads,
size]``), a dtype, total KV heads and head size, TP sizes of P and D, aliasing across
groups, a KV-sharing layer, a prompt length, a sliding window, D's prefix hit, random
block ids with spare capacity, one D rank and the P ranks it is given. P's ranks hold
one *logical* KV (per layer, token and head: random bytes) in their pages; D's caches
are random poison.

The case is planned (``pair_layers`` per peer, ``build_multi_pull_plan``) and replayed
with the byte oracle onto a copy of D's caches. The expectation is computed
independently of the plan (:func:`kvcopy.testing.nixl.geometries.expected`: token and
head semantics with torch views per layout, no byte offsets). A case is **exact**
(the bytes equal the expectation), **raised** (a clear ``ValueError``, counted by
reason; "raised although feasible" counts those the expectation could serve) or
**wrong** (anything else: a bug).

``--arena``: the same cases in arena mode (:mod:`kvcopy.nixl.modes.arena`): each P rank
packs its request into its own arena with the real copier, D plans the read of P's
spans, the byte oracle applies the READ rows (:func:`~kvcopy.testing.nixl.oracle.replay_rows`)
and D's real copier scatters its span into D's caches; the result must equal the
same expectation. Cases with an odd seed whose P pages are HND (with a GQA layer) stage in head order
(``arena_order="head"``), the others in token order; the report counts both. D plans
each request twice and replays the second plan, made from D's caches (the shape's
virtual engines and plan, :class:`~kvcopy.nixl.modes.keyed_cache.KeyedCache`) at another span
of D's arena, so the cached path is what the oracle checks.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...nixl.engine.info import pair_layers
from ...nixl.planning.plan import build_multi_pull_plan
from ...nixl.modes.base import Peer
from ...nixl.wire.record import StagedRequest
from .geometries import (
    Spec, arena_order, arena_staging, build_caches, engine_info, expected,
    logical_kv, random_spec,
)
from .inject import InjectReport, homogeneous, inject, run_inject_case
from .oracle import clone_caches, first_difference, replay, replay_rows, same_bytes


def reason(exc: BaseException) -> str:
    """A short reason for a raise (the counter's key)."""
    text = str(exc)
    for pattern, short in (
        (r"P holds no page", "P holds no page for tokens D needs"),
        (r"held by none of the given peers", "a KV head on none of the given peers"),
        (r"byte runs", "layouts too fragmented"),
        (r"two sources write", "D aliases layers P keeps apart"),
        (r"layout kind|chunks per page|in-page axes", "layouts of different kinds"),
        (r"holds none of the KV heads", "a peer holding none of this rank's heads"),
    ):
        if re.search(pattern, text):
            return short
    return f"{type(exc).__name__}: {text.splitlines()[0][:80]}"


@dataclass
class Outcome:
    status: str  # "exact", "raised", "wrong"
    reason: str = ""
    feasible: bool = True
    detail: str = ""
    checked: bool = False  # arena mode: D compared its scatter's page sums with P's (and they matched)


def run_case(spec: Spec) -> Outcome:

    logical = logical_kv(spec)
    d_caches = build_caches(spec, "d", spec.d_rank)
    p_caches = {r: build_caches(spec, "p", r, logical) for r in spec.p_ranks}
    want, why = expected(spec, d_caches, logical)
    try:
        d_info = engine_info(spec, "d", spec.d_rank, d_caches, "D")
        peers = []
        for r in spec.p_ranks:
            info = engine_info(spec, "p", r, p_caches[r], f"P{r}")
            try:
                peers.append((info, pair_layers(d_info, info)))
            except ValueError as exc:
                if "holds none of the KV heads" in str(exc) and len(spec.p_ranks) > 1:
                    continue  # D was handed a rank it does not need: it would not add it
                raise
        plan = build_multi_pull_plan(d_info, peers, spec.p.block_ids, spec.num_tokens, spec.d.block_ids,
                                     spec.num_cached)
    except ValueError as exc:
        return Outcome("raised", reason(exc), feasible=want is not None, detail=str(exc))
    if want is None:
        return Outcome("wrong", f"planned although no exact pull exists ({why})")
    got = clone_caches(d_caches)
    try:
        replay(plan, got, {f"P{r}": p_caches[r] for r in spec.p_ranks if any(p.name == f"P{r}" for p, _ in peers)})
    except ValueError as exc:
        return Outcome("wrong", f"replay raised: {exc}")
    if not same_bytes(got, want):
        return Outcome("wrong", "bytes differ", detail=first_difference(got, want) or "")
    return Outcome("exact")


def reads_rank(spec: Spec, d_info, info) -> bool:
    """Whether D reads P rank ``info`` at all (False: it holds none of D's heads, one of
    several P ranks); raises what the layer pairing refuses otherwise."""
    try:
        pair_layers(d_info, info)
    except ValueError as exc:
        if "holds none of the KV heads" in str(exc) and len(spec.p_ranks) > 1:
            return False
        raise
    return True


def run_arena_case(spec: Spec, stage: Optional[Callable[..., StagedRequest]] = None) -> Outcome:
    """One case in arena mode (see the module docstring); ``stage(p_staging, info,
    block_ids, num_tokens, request_id)`` stages on P instead of ``ArenaStaging.stage``
    (the layer-wise tests stage unit by unit with it)."""
    logical = logical_kv(spec)
    d_caches = build_caches(spec, "d", spec.d_rank)
    p_caches = {r: build_caches(spec, "p", r, logical) for r in spec.p_ranks}
    want, why = expected(spec, d_caches, logical)
    made = []
    try:
        d_st, d_info = arena_staging(spec, "d", spec.d_rank, d_caches, "D")
        made.append(d_st)
        peers: List[Peer] = []
        records, buffers = {}, {}
        for r in spec.p_ranks:
            p_st, info = arena_staging(spec, "p", r, p_caches[r], f"P{r}")
            made.append(p_st)
            if not reads_rank(spec, d_info, info):
                continue
            records[info.name] = (stage(p_st, info, spec.p.block_ids, spec.num_tokens, b"req") if stage else
                                  p_st.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1))
            peers.append(Peer(len(peers), info, (), ()))
            buffers[info.name] = p_st.buffer
        _, first = d_st.plan(d_info, peers, records, spec.num_tokens, spec.d.block_ids, spec.num_cached,
                             request_id=b"req")
        # the same request again, while the first holds its span: from the caches, at another span
        _, work = d_st.plan(d_info, peers, records, spec.num_tokens, spec.d.block_ids, spec.num_cached,
                            request_id=b"req")
        d_st.free(first)
    except ValueError as exc:
        for st in made:
            st.close()
        return Outcome("raised", reason(exc), feasible=want is not None, detail=str(exc))
    try:
        if want is None:
            return Outcome("wrong", f"planned although no exact pull exists ({why})")
        try:
            replay_rows({r.peer: (r.local, r.remote) for r in d_st.reads(work)}, d_st.buffer, buffers)
        except ValueError as exc:
            return Outcome("wrong", f"replay_rows raised: {exc}")
        check, unchecked = d_st.complete(work)  # the real copier writes d_caches (its device views)
        if not same_bytes(d_caches, want):
            return Outcome("wrong", "bytes differ", detail=first_difference(d_caches, want) or "")
        mismatch = check.result() if check is not None else None
        if mismatch:
            return Outcome("wrong", "false checksum failure", detail=mismatch)
        d_st.free(work)
        if d_st.arena.bytes_in_use or d_st.stats()["spans"]:
            return Outcome("wrong", "D's span not freed")
        return Outcome("exact", checked=check is not None, reason=unchecked or "")
    finally:
        for st in made:
            st.close()


@dataclass
class Report:
    cases: int = 0
    exact: int = 0
    wrong: int = 0
    raised: Counter = field(default_factory=Counter)
    raised_feasible: int = 0
    wrong_cases: List[Tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0
    orders: Counter = field(default_factory=Counter)  # arena mode: cases per staging order
    checked: int = 0  # arena mode: exact cases whose page sums D compared (and found equal)
    unchecked: Counter = field(default_factory=Counter)  # arena mode: exact cases not compared, by why

    @property
    def num_raised(self) -> int:
        return sum(self.raised.values())

    def __str__(self) -> str:
        lines = [f"cases {self.cases}, exact {self.exact}, raised {self.num_raised} "
                 f"({100.0 * self.num_raised / max(self.cases, 1):.2f}%), wrong {self.wrong}  "
                 f"[{self.seconds:.1f} s]"]
        if self.orders:
            lines.append("  arena staging order: " + ", ".join(f"{k} {v}" for k, v in sorted(self.orders.items())))
            lines.append(f"  page sums: {self.checked} exact cases compared (0 false failures: a mismatch "
                         f"counts as wrong), {sum(self.unchecked.values())} not compared")
            for why, k in self.unchecked.most_common():
                lines.append(f"    not compared {k:6d}  {why}")
        for r, k in self.raised.most_common():
            lines.append(f"  raised {k:6d}  {r}")
        if self.raised_feasible:
            lines.append(f"  of the raised, {self.raised_feasible} had an exact pull by the expectation")
        for seed, text in self.wrong_cases[:20]:
            lines.append(f"  WRONG seed {seed}: {text}")
        return "\n".join(lines)


def fuzz(cases: int, seed: int = 0, verbose: bool = False, stop_on_wrong: bool = False,
         arena: bool = False, progress: Optional[Callable[[int, Report], None]] = None) -> Report:
    """``cases`` cases from ``seed``; ``progress(cases done, report so far)`` after each."""
    report = Report()
    start = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(cases):
            case_seed = seed * 1_000_003 + i
            spec = random_spec(np.random.default_rng(case_seed), case_seed)
            try:
                out = run_arena_case(spec) if arena else run_case(spec)
            except Exception as exc:  # anything but a clear ValueError is a bug
                out = Outcome("wrong", f"{type(exc).__name__}: {exc}")
            report.cases += 1
            if arena:
                report.orders[arena_order(spec)] += 1
            if out.status == "exact":
                report.exact += 1
                if arena and out.checked:
                    report.checked += 1
                elif arena:
                    report.unchecked[out.reason] += 1
            elif out.status == "raised":
                report.raised[out.reason] += 1
                report.raised_feasible += out.feasible
            else:
                report.wrong += 1
                report.wrong_cases.append((case_seed, f"{out.reason} {out.detail} | {spec.summary()}"))
            if verbose:
                print(f"{case_seed}: {out.status} {out.reason} | {spec.summary()}", flush=True)
            if progress is not None:
                progress(i + 1, report)
            if stop_on_wrong and report.wrong:
                break
    finally:
        torch.set_num_threads(before)
        report.seconds = time.perf_counter() - start
    return report


def case(seed: int) -> Spec:
    """The spec of one fuzz case by its seed (for replaying a reported case)."""
    return random_spec(np.random.default_rng(seed), seed)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", type=int, default=None, help="run one case by its seed and print it")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--stop-on-wrong", action="store_true")
    ap.add_argument("--arena", action="store_true", help="arena mode: pack, READ rows, scatter")
    ap.add_argument("--inject", action="store_true",
                    help="arena mode with P's geometry on D: a clean pull, then five faults per case (bit flips in "
                         "P's and D's spans, swapped pages, an earlier request's page, a truncated READ), each of "
                         "which D's page sums must catch (kvcopy.testing.nixl.inject)")


def run(args: argparse.Namespace, progress: Optional[Callable[[int, Report], None]] = None) -> int:
    """Run the fuzzer (or one case); exit code 1 if any case is wrong. ``progress``: see :func:`fuzz`."""
    if getattr(args, "inject", False):
        return run_inject(args, progress)
    if args.case is not None:
        spec = case(args.case)
        print(spec.summary())
        out = run_arena_case(spec) if args.arena else run_case(spec)
        print(out.status, out.reason, out.detail)
        return 1 if out.status == "wrong" else 0
    print(f"python -m kvcopy.testing.nixl.fuzz --cases {args.cases} --seed {args.seed}"
          + (" --arena" if args.arena else ""))
    report = fuzz(args.cases, args.seed, args.verbose, args.stop_on_wrong, args.arena, progress)
    print(report)
    return 1 if report.wrong else 0


def run_inject(args: argparse.Namespace, progress=None) -> int:
    """``--inject`` (one case with ``--case SEED``); exit code 1 if a fault was missed or
    a clean pull failed its comparison or its bytes."""
    if args.case is not None:
        report = InjectReport()
        rng = np.random.default_rng(args.case)
        spec = homogeneous(rng, args.case)
        print(spec.summary())
        run_inject_case(spec, rng, report)
        report.cases = 1
    else:
        print(f"python -m kvcopy.testing.nixl.fuzz --inject --cases {args.cases} --seed {args.seed}")
        report = inject(args.cases, args.seed, progress)
    print(report)
    return 1 if report.failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcopy.testing.nixl.fuzz", description=__doc__.split("\n\n")[0])
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
