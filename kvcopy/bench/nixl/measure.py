"""``kvcopy-bench nixl``: a P/D pull over NIXL (UCX) against one bulk READ of the same bytes.

Two engines live in this process, P (prefill) and D (decode), each with its own KV
caches built from a scenario (:mod:`kvcopy.bench.scenarios`) and its own
:class:`kvcopy.nixl.TransferManager` in host-buffer mode. D plans a pull of P's blocks
by token position into blocks of its own; then, round-robin with the other rows:

``bulk READ``
    one READ of one descriptor of ``plan.num_bytes`` between two raw agents: the floor.
``bulk READ+copy``
    the same READ, then one contiguous copy of as many bytes into the KV's device
    (on the CPU the bytes just read; on CUDA from a pinned buffer): the floor of
    ``pull+complete``, which reads and then scatters. On CUDA every row is timed to the
    end of the GPU work it enqueued.
``per-page``
    raw agents, one descriptor per (region, chunk, page) as the plan lists them, with
    NIXL's own descriptor merging off (``skip_desc_merge``).
``per-page+nixl-merge``
    the same descriptors with NIXL's merging on (its default).
``merged runs``
    the plan's pages merged into runs first (adjacent on both sides), fewer descriptors.
``pull``
    ``TransferManager.pull`` + ``poll`` until DONE (what D does per request).
``pull+complete``
    the same and ``complete`` (zero unread pages, one masked h2d into D's KV).
``save``
    P's ``TransferManager.save`` (one masked d2h into P's host buffers).
``arena save``, ``arena pull``, ``arena pull+complete``
    the same with both managers in ``buffer="arena"`` mode (:mod:`kvcopy.nixl.modes.arena`):
    P packs the request into one span of its arena (and frees it), D reads P's span
    into a span of its own (plans made before the timing: each timed pull uses a fresh
    one; ``pull`` frees D's span, ``pull+complete`` scatters it into D's KV first).
    Their ``descriptors`` are the READ's, per request; ``facts`` adds how many such
    requests one 1 GiB arena holds at once. These rows run with ``checksum=False``.
``arena save+sum``, ``arena pull+sum``, ``arena pull+complete+sum``
    the arena rows with ``checksum=True`` (a second pair of managers): P's pack sums
    every page into the record, D's scatter sums what it copies and compares
    (:mod:`kvcopy.nixl.modes.span_sums`); ``facts["arena_checksums"]`` counts the pulls
    compared (all must be ``checked``). ``--no-checksum`` skips them and the host
    ``+sum`` rows below.
``save+sum``, ``pull+complete+sum``
    host mode's ``save`` and ``pull+complete`` with ``checksum=True`` (a second pair of
    managers; the plain host rows run with ``checksum=False``): P's save writes each
    page's sum into its page-sums region, D's READ brings the sums of the pages it reads
    (one more descriptor per page), complete compares (:mod:`kvcopy.nixl.modes.mirror_sums`);
    ``facts["host_checksums"]`` counts the pulls compared.

The raw rows use buffers laid out as the plan's regions (same page geometry), so the
descriptors are the plan's. After the runs, D's KV is compared with P's at every
group's blocks (``verify``). Descriptor counts per request: per page, and after run
merging.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .request import check_kv, d_block_ids, padded

SIDE_P, SIDE_D = "kvcopy-bench-P", "kvcopy-bench-D"


def add_args(p) -> None:
    from ..args import add_scenario_group

    add_scenario_group(p)
    m = p.add_argument_group("measurement")
    m.add_argument("--iters", type=int, default=10, help="timed pulls per row")
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--budget", type=float, default=3.0, help="seconds per row before it leaves the rotation")
    m.add_argument("--device", help="where the KV caches live: cpu or cuda (default: cuda when available)")
    m.add_argument("--transport", default="UCX", help="NIXL transport plugin (default UCX)")
    m.add_argument("--copy-backend", default="auto", help="kvcopy backend for save/complete")
    m.add_argument("--no-verify", dest="verify", action="store_false", default=True)
    m.add_argument("--progress-delay-us", type=int, default=None,
                   help="NIXL progress-thread poll timeout of every agent (default: the manager's, "
                        "100000; 0 is NIXL's own busy polling)")
    m.add_argument("--arena-order", choices=("token", "head"), default="token",
                   help="P's staging order for the arena rows (head: HND layouts only)")
    m.add_argument("--no-arena", dest="arena", action="store_false", default=True,
                   help="skip the arena rows")
    m.add_argument("--no-checksum", dest="checksum", action="store_false", default=True,
                   help="skip the '+sum' rows (host save+sum and pull+complete+sum, arena save+sum, pull+sum "
                        "and pull+complete+sum: the rows again with managers whose page sums are computed "
                        "by the copies and compared; the plain rows run with checksum=False)")
    from ..two_hosts_bench import add_args as add_two_hosts_args

    add_two_hosts_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write results as JSON ('-': stdout, table to stderr)")
    o.add_argument("--quiet", action="store_true")


# ---------------------------------------------------------------------- raw agents
class RawPair:
    """Two raw NIXL agents with buffers laid out like the plan's regions."""

    def __init__(self, plan, backend: str, progress_delay_us: int):
        from ...nixl.agent import load_nixl
        from ...nixl.agent import make_agent

        nixl = load_nixl()
        # The managers' progress-thread delay: every row runs beside the same threads.
        self.src = make_agent(nixl, SIDE_P + "-raw", [backend], progress_delay_us)
        self.dst = make_agent(nixl, SIDE_D + "-raw", [backend], progress_delay_us)
        self.plan = plan
        self._regs: List[Tuple[Any, Any]] = []
        self._bufs: List[torch.Tensor] = []
        self.base_src = self._alloc(self.src, {p.remote.index: p.remote for p in plan.pairs})
        self.base_dst = self._alloc(self.dst, {p.local.index: p.local for p in plan.pairs})
        # One contiguous range of the plan's bytes on each side, for the bulk READ.
        n = int(plan.num_bytes)
        self.bulk = [self._buffer(self.src, n), self._buffer(self.dst, n)]
        self.bulk_dst = self._bufs[-1]
        # Registered memory travels in the metadata: exchange it only after registering.
        self.peer = self.dst.add_remote_agent(self.src.get_agent_metadata())
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        self._dlists: List[Tuple[object, object]] = []

    def _alloc(self, agent, regions) -> Dict[int, int]:
        bases = {}
        for idx, r in regions.items():
            extent = (r.num_pages - 1) * r.page_stride + (r.num_chunks - 1) * r.chunk_stride + r.chunk_bytes
            bases[idx] = self._buffer(agent, extent)
        return bases

    def _buffer(self, agent, nbytes: int) -> int:
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self._bufs.append(buf)
        self._regs.append((agent, agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")))
        return buf.data_ptr()

    def bulk_descriptors(self) -> Tuple[np.ndarray, np.ndarray]:
        n = int(self.plan.num_bytes)
        return (np.array([[self.bulk[1], n, 0]], dtype=np.uint64),
                np.array([[self.bulk[0], n, 0]], dtype=np.uint64))

    def descriptors(self, merge: bool) -> Tuple[np.ndarray, np.ndarray]:
        """(dst rows, src rows) of (address, bytes, 0): one per plan page chunk, or runs."""
        dst_rows, src_rows = [], []
        for p in self.plan.pairs:
            lp = np.asarray(p.local_pages, dtype=np.int64)
            rp = np.asarray(p.remote_pages, dtype=np.int64)
            if not lp.size:
                continue
            for c in range(p.local.num_chunks):
                d_addr = self.base_dst[p.local.index] + c * p.local.chunk_stride + lp * p.local.page_stride
                s_addr = self.base_src[p.remote.index] + c * p.remote.chunk_stride + rp * p.remote.page_stride
                size = np.full(lp.size, p.local.chunk_bytes, dtype=np.int64)
                dst_rows.append(np.stack([d_addr, size], 1))
                src_rows.append(np.stack([s_addr, size], 1))
        d = np.concatenate(dst_rows) if dst_rows else np.empty((0, 2), np.int64)
        s = np.concatenate(src_rows) if src_rows else np.empty((0, 2), np.int64)
        if merge:
            d, s = merge_descriptors(d, s)
        zeros = np.zeros((len(d), 1), np.int64)
        return np.hstack([d, zeros]).astype(np.uint64), np.hstack([s, zeros]).astype(np.uint64)

    def read(self, dst_rows: np.ndarray, src_rows: np.ndarray, skip_merge: bool = False):
        """A callable posting one READ of these descriptors and polling until DONE."""
        ld = self.dst.prep_xfer_dlist("NIXL_INIT_AGENT", dst_rows, "DRAM")
        rd = self.dst.prep_xfer_dlist(self.peer, src_rows, "DRAM")
        self._dlists.append((ld, rd))
        idx = np.arange(len(dst_rows), dtype=np.int32)
        agent = self.dst

        def run():
            h = agent.make_prepped_xfer("READ", ld, idx, rd, idx, b"", skip_desc_merge=skip_merge)
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in state {state}")

        return run

    def read_then_copy(self, device: str):
        """A callable: the bulk READ, then one contiguous copy of the bytes it read to a
        buffer on ``device`` (the floor of ``pull+complete``: a READ, then one copy)."""
        read = self.read(*self.bulk_descriptors())
        src = self.bulk_dst.pin_memory() if device != "cpu" else self.bulk_dst
        if device != "cpu":
            self._bufs.append(src)
        out = torch.empty_like(self.bulk_dst, device=device)
        out.fill_(0)  # touched once: the copies never pay first-touch faults

        def run():
            read()
            out.copy_(src, non_blocking=True)

        return run

    def close(self) -> None:
        for ld, rd in self._dlists:
            for d in (ld, rd):
                try:
                    self.dst.release_dlist_handle(d)
                except Exception:
                    pass
        try:
            self.dst.remove_remote_agent(self.peer)
        except Exception:
            pass
        for agent, reg in self._regs:
            try:
                agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
        self._bufs.clear()


def merge_descriptors(d: np.ndarray, s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Merge (address, bytes) rows that continue the previous row on both sides."""
    if len(d) < 2:
        return d, s
    cont = (d[1:, 0] == d[:-1, 0] + d[:-1, 1]) & (s[1:, 0] == s[:-1, 0] + s[:-1, 1])
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    sizes = np.add.reduceat(d[:, 1], starts)
    return np.stack([d[starts, 0], sizes], 1), np.stack([s[starts, 0], sizes], 1)


# ---------------------------------------------------------------------- the pull
def measure_nixl(sc, args, device: str) -> Tuple[List[dict], dict]:
    from ..timing import measure
    from ...nixl import TransferManager
    from ...nixl.agent import PROGRESS_DELAY_US

    P, D = sc.build(device), sc.build(device)
    counts = sc.blocks_per_group()
    num_blocks, _ = sc.block_ids()
    d_ids = d_block_ids(sc, num_blocks, sc.seed)
    delay = PROGRESS_DELAY_US if args.progress_delay_us is None else args.progress_delay_us
    kw = dict(block_dim=sc.block_dim(), kv_layout=sc.kv_layout(), copy_backend=args.copy_backend,
              transports=(args.transport,), progress_delay_us=delay)
    mp = md = raw = mpa = mda = host_sums = None
    summed: list = []  # the arena '+sum' rows' (P, D, methods, descs, facts, before)
    try:
        # host mode: the plain rows without page sums, the '+sum' rows with (a second pair)
        mp = TransferManager(SIDE_P, P.dev, P.layer_groups, sc.block_size, sc.block_size, **kw, checksum=False)
        md = TransferManager(SIDE_D, D.dev, D.layer_groups, sc.block_size, sc.block_size, **kw, checksum=False)
        peer = md.add_peer(mp.metadata())
        mp.save(P.ids)
        tokens = max(counts) * sc.block_size

        def page_plan(d=md, peer=peer):
            return _page_plan(d.plan_pull(peer, padded(P.ids, counts), tokens, padded(d_ids, counts)))

        plan = page_plan()  # the raw rows' descriptors; each pull gets a plan of its own (one pull per plan)
        raw = RawPair(plan, args.transport, delay)
        per_page, merged = raw.descriptors(merge=False), raw.descriptors(merge=True)
        bulk_n = int(plan.num_bytes)
        pulls = _HostPulls(md, page_plan)
        if args.checksum:
            host_sums = _HostSumRows(sc, P, D, kw, page_plan, len(per_page[0]) + sum(map(len, plan.read_pages)))

        arena_methods, arena_descs, arena_facts, before = {}, {}, {}, {}
        if args.arena:
            mpa, mda, arena_methods, arena_descs, arena_facts, before = _arena_rows(sc, args, P, D, d_ids, counts,
                                                                                    tokens, kw)
            if args.checksum:  # the same rows with page sums computed and compared
                summed = _summed_arena_rows(sc, args, P, D, d_ids, counts, tokens, kw,
                                            (arena_methods, arena_descs, arena_facts, before))
        methods, descs = _raw_rows(raw, per_page, merged, device)
        methods.update({"pull": pulls.pull_only, "pull+complete": pulls.pull_complete,
                        "save": lambda: mp.save(P.ids), **(host_sums.methods if host_sums else {}),
                        **arena_methods})
        descs.update({"pull": len(per_page[0]), "pull+complete": len(per_page[0]), "save": None, **arena_descs})
        verify = None
        if args.verify:
            pulls.pull_complete()
            verify = _verified(P, D, d_ids, sc.block_dim(), device)
        # On CUDA every row is timed to the end of the work it enqueued (complete's h2d
        # scatter, the floor's copy), not to the return of the call.
        before.update(pulls.before(), **(host_sums.pulls.before() if host_sums else {}))
        timings = measure(methods, device, args.iters, args.warmup, budget_s=args.budget, before=before)
        descs.update(host_sums.descs() if host_sums else {})
        rows = _rows(sc, timings, descs, bulk_n)
        facts = {"plan_bytes": bulk_n, "progress_delay_us": delay, "region_pairs": len(plan.pairs),
                 "descriptors_per_page": len(per_page[0]), "descriptors_merged": len(merged[0]),
                 "verify": verify or ("skipped" if not args.verify else "ok"),
                 "copy_backends": _copy_backends(md),
                 **arena_facts}
        if args.arena and args.verify:
            facts["arena_verify"] = _arena_verified(P, D, d_ids, sc.block_dim(), device, methods, before)
        for key, d in (("arena_checksums", summed[1] if summed else None),
                       ("host_checksums", host_sums.d if host_sums else None)):
            if d is not None:  # every +sum pull was compared, and matched
                facts[key] = {k: v for k, v in d.stats().items() if k.startswith("checksum_")}
        return rows, facts
    finally:
        # P before D (as kvcopy.testing.nixl.engines.ManagerPairs closes them): a D closed first can
        # leave P's background UCX connect-back refused and printed after the run.
        for x in (raw, mp, md, *(host_sums.managers if host_sums else ()), mpa, mda, *summed[:2]):
            if x is not None:
                try:
                    x.close()
                except Exception:
                    pass
        P.close()
        D.close()


def _verified(P, D, d_ids, block_dim: int, device: str) -> Optional[str]:
    """D's KV against P's at the request's blocks, once the work enqueued on D ended."""
    from ...core.layout import as_words

    if device != "cpu":
        torch.cuda.synchronize()
    return check_kv(P, D, d_ids, block_dim, as_words)


def _arena_verified(P, D, d_ids, block_dim: int, device: str, methods, before) -> Optional[str]:
    """One more arena pull+complete into D's KV poisoned first, then D's KV against P's:
    the arena's bytes alone (the host rows write the same blocks during the run)."""
    D.slabs["device"].fill_(0xA5)
    before["arena pull+complete"]()
    methods["arena pull+complete"]()
    return _verified(P, D, d_ids, block_dim, device)


def _raw_rows(raw, per_page, merged, device: str) -> Tuple[Dict[str, Callable[[], None]], dict]:
    """The raw agents' rows (no manager): the bulk READ floor, the READ then a copy, and
    the plan's descriptors per page and merged; their descriptor counts."""
    methods = {
        "bulk READ": raw.read(*raw.bulk_descriptors()),
        "bulk READ+copy": raw.read_then_copy(device),
        "per-page": raw.read(*per_page, skip_merge=True),
        "per-page+nixl-merge": raw.read(*per_page),
        "merged runs": raw.read(*merged),
    }
    descs = {"bulk READ": 1, "bulk READ+copy": 1, "per-page": len(per_page[0]),
             "per-page+nixl-merge": len(per_page[0]), "merged runs": len(merged[0])}
    return methods, descs


def _rows(sc, timings, descs, bulk_n: int) -> List[dict]:
    """One result row per method: its statistics, GB/s and x the bulk READ of the run."""
    ref = timings["bulk READ"].stats().get("median_us")
    rows = []
    for name, timing in timings.items():
        st = timing.stats()
        row = {"scenario": sc.name, "groups": len(sc.groups()), "method": name, "bytes": bulk_n,
               "descriptors": descs[name], **st}
        if st.get("median_us"):
            row["gbps"] = bulk_n / (st["median_us"] * 1e-6) / 1e9
            row["x_bulk"] = st["median_us"] / ref if ref else None
        rows.append(row)
    return rows


def _summed_arena_rows(sc, args, P, D, d_ids, counts, tokens, kw, into) -> list:
    """The arena rows with ``checksum=True`` managers, added to ``into`` (methods,
    descriptors, facts, before); returns what :func:`_arena_rows` did."""
    summed = list(_arena_rows(sc, args, P, D, d_ids, counts, tokens, kw, checksum=True))
    for target, more in zip(into, summed[2:]):
        target.update(more)
    return summed


def _arena_rows(sc, args, P, D, d_ids, counts, tokens, kw, checksum: bool = False):
    """Arena managers and their timed rows: (P, D, methods, descriptors, facts, before);
    with ``checksum`` the managers compute and compare page sums and the rows are named
    ``... +sum``.

    D's plans are made untimed right before each call of a pull row (``before``, which
    :func:`kvcopy.bench.timing.measure` runs), and each call frees its span, so D's arena
    holds a few spans whatever ``--iters`` is (it held one per call, 2.4 GB at 30 calls
    of 36 MiB)."""
    from ...nixl import TransferManager
    from ...nixl.modes.spans import Arena

    tag, kw = ("+sum", dict(kw, checksum=True)) if checksum else ("", dict(kw, checksum=False))
    probe_bytes = 1 << 26 if sc.call_bytes() < (1 << 24) else 4 * sc.call_bytes() + (1 << 24)
    probe = TransferManager(SIDE_P + "-probe" + tag, P.dev, P.layer_groups, sc.block_size, sc.block_size,
                            buffer="arena", arena_order=args.arena_order, arena_bytes=probe_bytes, **kw)
    try:
        span = probe.save(padded(P.ids, counts), num_tokens=tokens, request_id="probe").nbytes
        assert probe.arena is not None
        granule = probe.arena.arena.granule
    finally:
        probe.close()
    # 64 in flight: how many such spans one 1 GiB arena holds (same allocator, same granule)
    gib = Arena(1 << 30, granule, reserved=granule)
    fit = 0
    try:
        while True:
            gib.allocate(span)
            fit += 1
    except Exception:
        pass
    mpa = TransferManager(SIDE_P + "-arena" + tag, P.dev, P.layer_groups, sc.block_size, sc.block_size,
                          buffer="arena", arena_bytes=4 * span + 4 * granule, arena_ttl_s=3600.0,
                          arena_order=args.arena_order, **kw)
    mda = TransferManager(SIDE_D + "-arena" + tag, D.dev, D.layer_groups, sc.block_size, sc.block_size,
                          buffer="arena", arena_bytes=4 * span + 4 * granule, **kw)
    peer = mda.add_peer(mpa.metadata())
    record = mpa.save(padded(P.ids, counts), num_tokens=tokens, request_id="bench", readers=1 << 62)
    d_padded = padded(d_ids, counts)
    pending: Dict[str, Any] = {}  # row -> the plan its next call pulls (an ArenaPlan)

    def make_plan(row: str) -> None:
        if row not in pending:
            pending[row] = mda.plan_pull(peer, record, tokens, d_padded, request_id="bench")

    saves = iter(range(1 << 62))

    def arena_save():
        rid = f"s{next(saves)}"
        mpa.save(padded(P.ids, counts), num_tokens=tokens, request_id=rid)
        mpa.arena.release(rid)

    def arena_pull(complete: bool):
        plan = pending.pop(("arena pull+complete" if complete else "arena pull") + tag)
        h = mda.pull(plan)
        while mda.poll(h) == "PROC":
            pass
        if h.state != "DONE":
            raise RuntimeError(f"arena pull failed: {h.error}")
        if complete:
            c = mda.complete(h)
            if not c.ok:
                raise RuntimeError(f"arena complete failed: {c.error}")
        # pull only: the handle dropped here is finished without writing the KV, and its
        # span freed, at the manager's next call (the next untimed plan_pull)

    make_plan("arena pull" + tag)
    n_desc = pending["arena pull" + tag].num_descriptors
    methods = {"arena save" + tag: arena_save, "arena pull" + tag: lambda: arena_pull(False),
               "arena pull+complete" + tag: lambda: arena_pull(True)}
    descs = {"arena save" + tag: None, "arena pull" + tag: n_desc, "arena pull+complete" + tag: n_desc}
    facts = {"arena_span_bytes": span, "arena_granule": granule, "arena_requests_in_1GiB": fit,
             "arena_order": args.arena_order,
             "arena_descriptors_per_request": n_desc}
    if checksum:
        facts = {"arena_record_sums_bytes": sum(len(h) // 2 for h in record.sums.pages)}
    before = {row + tag: (lambda row=row + tag: make_plan(row)) for row in ("arena pull", "arena pull+complete")}
    return mpa, mda, methods, descs, facts, before


def run(args) -> int:
    import json

    from ..timing import env_info
    from ..args import BenchError, device as _device, scenarios as _scenarios
    from ..output import Progress, write_file as _write
    from ..units import plural
    from ...nixl import nixl_available

    if args.two_hosts or args.faults:  # P and D over a real link: kvcopy.bench.two_hosts_bench
        from ..two_hosts_bench import run as run_two_hosts

        if not args.two_hosts:
            raise BenchError("--faults is a --two-hosts measurement: pass both")
        return run_two_hosts(args)
    why = nixl_available()
    if why:
        print(f"kvcopy-bench nixl: NIXL is not installed here ({why})", file=sys.stderr)
        return 2
    device = _device(args)
    scenarios = _scenarios(args, sweep=False)
    if not args.num_groups:  # the preset's largest group count only, unless asked
        scenarios = scenarios[-1:]
    progress = Progress(len(scenarios), args.quiet or len(scenarios) < 2)
    results, facts = [], []
    for sc in scenarios:
        rows, f = measure_nixl(sc, args, device)
        results += rows
        facts.append({"groups": len(sc.groups()), **f})
        progress.step(plural(len(sc.groups()), "group"))
    out = {"tool": "kvcopy-bench", "command": "nixl", "argv": getattr(args, "argv", None),
           "env": env_info(device), "scenario": [s.to_dict() for s in scenarios],
           "description": scenarios[0].describe(), "plans": facts, "results": results}
    table = format_nixl(out)
    print(table, end="", file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        _write(args.json, json.dumps(out, indent=1, default=str) + "\n")
    if any(str(f["verify"]).startswith("FAIL") for f in facts):
        raise BenchError("D's KV differs from P's after a pull")
    return 0


def format_nixl(out: dict) -> str:
    from ..units import fmt_bytes

    lines = [f"kvcopy-bench nixl  on {out['env']['device']}, NIXL {out['env'].get('nixl')}",
             f"scenario {out['description']}"]
    hdr = f"{'groups':>6}  {'method':<24} {'bytes':>9} {'descs':>6} {'min us':>9} {'median us':>10} " \
          f"{'p90 us':>9} {'GB/s':>7} {'x bulk':>7}"
    lines.append(hdr)
    prev = None
    for r in out["results"]:
        if prev is not None and r["groups"] != prev:
            lines.append("")
        prev = r["groups"]
        d = "-" if r["descriptors"] is None else str(r["descriptors"])
        lines.append(f"{r['groups']:>6}  {r['method']:<24} {fmt_bytes(r['bytes']):>9} {d:>6} "
                     f"{r.get('min_us', 0):>9.1f} {r.get('median_us', 0):>10.1f} {r.get('p90_us', 0):>9.1f} "
                     f"{r.get('gbps', 0):>7.2f} {r.get('x_bulk') or 0:>7.2f}")
    lines.append("x bulk = time / one bulk READ of the same bytes, same run: lower is better (1.00x is the floor)")
    for f in out["plans"]:
        lines.append(f"groups {f['groups']}: {f['region_pairs']} region pairs, descriptors per request "
                     f"{f['descriptors_per_page']} per page -> {f['descriptors_merged']} after run merging; "
                     f"verify {f['verify']}")
        if "arena_span_bytes" in f:
            lines.append(f"groups {f['groups']}: arena span {fmt_bytes(f['arena_span_bytes'])}, "
                         f"{f.get('arena_order', 'token')} order, "
                         f"{f['arena_descriptors_per_request']} descriptor(s) per request, "
                         f"{f['arena_requests_in_1GiB']} requests fit one 1 GiB arena; "
                         f"arena verify {f.get('arena_verify', 'skipped')}")
    return "\n".join(lines) + "\n"


class _HostSumRows:
    """Host mode's '+sum' rows: a second pair of managers with ``checksum=True``; each
    page read brings its 8-byte sum, one more descriptor per page (``descriptors``)."""

    def __init__(self, sc, P, D, kw, page_plan, descriptors: int):
        from ...nixl import TransferManager

        self.p = TransferManager(SIDE_P + "-sum", P.dev, P.layer_groups, sc.block_size, sc.block_size, **kw,
                                  checksum=True)
        try:
            self.d = TransferManager(SIDE_D + "-sum", D.dev, D.layer_groups, sc.block_size, sc.block_size, **kw,
                                      checksum=True)
        except BaseException:
            self.p.close()
            raise
        self.managers = [self.p, self.d]  # P before D, as measure_nixl closes them
        try:
            peer = self.d.add_peer(self.p.metadata())
            self.p.save(P.ids)
        except BaseException:
            for m in self.managers:
                m.close()
            raise
        self.pulls = _HostPulls(self.d, lambda: page_plan(self.d, peer), tag="+sum")
        self.methods = {"save+sum": lambda: self.p.save(P.ids), "pull+complete+sum": self.pulls.pull_complete}
        self.descriptors = descriptors

    def descs(self) -> dict:
        """After the run: the READ's descriptors when every pull was compared (each page
        read brought its sum), unknown (``None``) when some went unchecked."""
        checked_all = not self.d.stats().get("checksum_unchecked")
        return {"save+sum": None, "pull+complete+sum": self.descriptors if checked_all else None}


class _HostPulls:
    """The host-mode pull rows: one pull per plan, each made untimed before its call."""

    def __init__(self, manager, make_plan, tag: str = ""):
        self.manager, self.make_plan, self.tag = manager, make_plan, tag
        self.pending: dict = {}  # row -> the plan its next call pulls

    def before(self) -> dict:
        return {row + self.tag: (lambda row=row: self._plan_for(row)) for row in ("pull", "pull+complete")}

    def _plan_for(self, row: str) -> None:
        if row not in self.pending:
            self.pending[row] = self.make_plan()

    def _pull(self, row: str):
        self._plan_for(row)
        h = self.manager.pull(self.pending.pop(row))
        while self.manager.poll(h) == "PROC":
            pass
        if h.state != "DONE":
            raise RuntimeError(f"pull failed: {h.error}")
        return h

    def pull_complete(self) -> None:
        c = self.manager.complete(self._pull("pull+complete"))
        if not c.ok:
            raise RuntimeError(f"complete failed: {c.error}")

    def pull_only(self) -> None:
        # read into D's host buffers; this row does not copy them to the KV (the handle
        # dropped here is finished without writing it, at the manager's next call)
        self._pull("pull")


def _page_plan(plan):
    """A host-mode plan (a PullPlan: pages, region pairs)."""
    from ...nixl.planning.plan import PullPlan

    if not isinstance(plan, PullPlan):
        raise TypeError(f"host mode planned a {type(plan).__name__}")
    return plan


def _copy_backends(manager) -> Optional[Dict[str, str]]:
    """The backends of a host-mode manager's BlockCopier (its buffer mode holds it)."""
    copier = getattr(getattr(manager, "_mode", None), "_copier", None)
    return copier.copy_backends() if copier is not None else None
