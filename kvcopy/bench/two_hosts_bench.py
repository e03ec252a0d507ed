"""``kvcopy-bench nixl --two-hosts``: the pull over a real link, against a bulk READ of the same bytes.

P's and D's processes run in two network namespaces joined by a veth pair capped at
``--rate`` (:mod:`kvcopy.bench.two_hosts`; UCX on TCP over the veth). The scenario is
the ``nixl`` subcommand's (``--preset``, ``--num-groups``, ...; the preset's largest
group count by default). In D's process, round-robin (:func:`kvcopy.bench.timing.measure`):

``bulk READ``
    one READ of one descriptor of the plan's bytes between two raw agents (one in each
    namespace): the floor, and what the link gives one transfer.
``arena pull``, ``arena pull+complete``
    both managers in ``buffer="arena"`` mode: one READ of P's span into a span of D's
    (a fresh plan per timed pull; ``pull`` frees D's span, ``pull+complete`` scatters
    it into D's KV first).
``host pull``
    host-buffer mode: ``pull`` + ``poll`` until DONE, one descriptor per (region, chunk,
    page).

A busy P (``--p-cpus``, ``--p-load``, ``--nixl-thread-nice``;
:mod:`kvcopy.bench.two_hosts_load`): P's process pinned to ``--p-cpus`` (its NIXL and
UCX threads with it), ``--p-load`` busy threads at nice 0 on those cores while D times
its rows (P's forward), and P's managers' agents built with ``nixl_thread_nice``. The
``bulk READ`` stays the reference, its P agent at nice 0; with ``--nixl-thread-nice``
a row ``bulk READ at P's nice`` reads the same bytes from a P agent at that nice (the
async thread UCX starts once per process has the nice of P's first agent, a manager's).
``--d-cpus`` pins D's process. ``--write-rows`` adds ``bulk WRITE`` rows timed in P's
process while its load runs: P's raw agents (nice 0, and at ``--nixl-thread-nice``)
WRITE the same bytes into a buffer of D's, P's thread checking each WRITE's state every
``--write-poll-ms`` (1 ms: the arena connector's housekeeper while a push's WRITEs are
in flight): the push's direction, where P's bytes go as P's threads progress them.

Each row: median time, ``x bulk`` (time / the bulk READ's in the same run, lower is
better) and ``% rate`` (the row's throughput as a share of the configured cap; the
first 1 ms of the cap's bucket passes at line rate after an idle gap). Afterwards D's
KV is compared with P's at every group's blocks (D rebuilds P's bytes from the
scenario's seed).

``--faults`` instead measures how long D takes to notice each fault of
:data:`kvcopy.bench.two_hosts_faults.FAULTS`, in host and arena mode, with no deadline
(``--fault-guard`` bounds the wait) and with ``--fault-deadline``, at ``--fault-rate``
(a slow cap keeps a 1 MiB request in flight for about a second).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import List

import numpy as np

from .nixl.request import check_kv, d_block_ids, padded
from . import two_hosts_load as load
from .two_hosts import TwoHosts, parse_rate, unavailable
from .two_hosts_load import parse_cpus

SIDE_P, SIDE_D = "kvcopy-2h-P", "kvcopy-2h-D"
ROWS = ("bulk READ", "arena pull", "arena pull+complete", "host pull")
NICED_BULK = "bulk READ at P's nice"  # a row only with --nixl-thread-nice
WRITE_ROWS = ("bulk WRITE", "bulk WRITE at P's nice")  # --write-rows; the second with --nixl-thread-nice


def add_args(p) -> None:
    t = p.add_argument_group("two hosts (P and D in two network namespaces over a rate-capped veth link; root)")
    t.add_argument("--two-hosts", action="store_true",
                   help="time bulk READ, arena pull, arena pull+complete and host pull over the link")
    t.add_argument("--rate", default="10gbit", help="the link's cap (tc rate: 10gbit, 1gbit, 500mbit)")
    t.add_argument("--nixl-thread-nice", type=int, default=None, metavar="N",
                   help="P's managers' agents (and a second bulk READ's P agent) at nice N (0-19)")
    t.add_argument("--p-cpus", metavar="LIST", help="pin P's process to these CPUs (1, 0,1, 0-3)")
    t.add_argument("--p-load", type=int, default=0, metavar="N",
                   help="N busy threads in P's process (nice 0, pinned with it) while D times its rows")
    t.add_argument("--d-cpus", metavar="LIST", help="pin D's process to these CPUs")
    t.add_argument("--write-rows", action="store_true",
                   help="also time bulk WRITEs from P's raw agents (nice 0, and at --nixl-thread-nice) into D, "
                        "timed in P's process while its load runs")
    t.add_argument("--write-poll-ms", type=float, default=1.0,
                   help="P checks a WRITE's state every this many ms (default 1: the arena connector's "
                        "housekeeper while a push's WRITEs are in flight)")
    t.add_argument("--faults", action="store_true",
                   help="with --two-hosts: how long D takes to notice each fault, instead of the timing")
    t.add_argument("--fault-rate", default="8mbit", help="the cap during --faults (default 8mbit)")
    t.add_argument("--fault-deadline", type=float, default=2.5, help="pull deadline of the deadline rows (s)")
    t.add_argument("--fault-guard", type=float, default=60.0,
                   help="longest wait for a pull without a deadline (s): 'not noticed' past it")


# ---------------------------------------------------------------------- P's process
def p_setup(server, sc, arena_bytes: int, delay_us: int, nice: int = 0) -> dict:
    """P: the scenario's KV, a host-mode and an arena-mode manager, the request saved in
    both; returns their handshakes and the arena record."""
    from ..nixl import TransferManager

    P = sc.build("cpu")
    counts = sc.blocks_per_group()
    tokens = max(counts) * sc.block_size
    kw = dict(block_dim=sc.block_dim(), kv_layout=sc.kv_layout(), progress_delay_us=delay_us,
              nixl_thread_nice=nice)
    host = TransferManager(SIDE_P, P.dev, P.layer_groups, sc.block_size, sc.block_size, **kw)
    arena = TransferManager(SIDE_P + "-arena", P.dev, P.layer_groups, sc.block_size, sc.block_size,
                            buffer="arena", arena_bytes=arena_bytes, arena_ttl_s=3600.0, **kw)
    server.managers.update({"host": host, "arena": arena})
    server.scratch["point"] = P
    host.save(P.ids)
    record = arena.save(padded(P.ids, counts), num_tokens=tokens, request_id="bench", readers=1 << 62)
    return {"host": host.metadata(), "arena": arena.metadata(), "record": record.to_bytes()}


def p_raw(server, nbytes: int, delay_us: int, tag: str, nice: int = 0) -> dict:
    """P: a raw agent at ``nice`` with one registered buffer of ``nbytes`` (a bulk
    READ's source)."""
    agent, buf = _raw_agent(server, f"{SIDE_P}-raw-{tag}", nbytes, delay_us, nice)
    return {"metadata": agent.get_agent_metadata(), "address": buf.data_ptr()}


def _raw_agent(server, name: str, nbytes: int, delay_us: int, nice: int = 0):
    import torch

    from ..nixl.agent import load_nixl
    from ..nixl.agent import make_agent

    agent = make_agent(load_nixl(), name, ["UCX"], delay_us, nice)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    server.scratch[name] = (agent, buf, agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM"))
    return agent, buf


# ---------------------------------------------------------------------- D's process
def d_setup(server, sc, p_info: dict, rounds: int, delay_us: int) -> int:
    """D: the scenario's KV, both managers with P as a peer, the plans; returns the
    plan's bytes (the bulk READ's size)."""
    from ..nixl import StagedRequest, TransferManager

    D = sc.build("cpu")
    counts = sc.blocks_per_group()
    tokens = max(counts) * sc.block_size
    num_blocks, p_ids = sc.block_ids()
    d_ids = d_block_ids(sc, num_blocks, sc.seed)
    record = StagedRequest.from_bytes(p_info["record"])
    kw = dict(block_dim=sc.block_dim(), kv_layout=sc.kv_layout(), progress_delay_us=delay_us)
    host = TransferManager(SIDE_D, D.dev, D.layer_groups, sc.block_size, sc.block_size, **kw)
    arena = TransferManager(SIDE_D + "-arena", D.dev, D.layer_groups, sc.block_size, sc.block_size,
                            buffer="arena", arena_bytes=(2 * rounds + 4) * (record.nbytes + (4 << 20)), **kw)
    server.managers.update({"host": host, "arena": arena})
    peer = host.add_peer(p_info["host"])
    arena_peer = arena.add_peer(p_info["arena"])
    def host_plan():  # one pull per plan: each host pull gets its own, made untimed
        return host.plan_pull(peer, padded(p_ids, counts), tokens, padded(d_ids, counts))

    plan = host_plan()
    pools = {k: [arena.plan_pull(arena_peer, record, tokens, padded(d_ids, counts), request_id=record.request_id)
                 for _ in range(rounds)]
             for k in ("pull", "pc")}
    server.scratch.update(point=D, d_ids=d_ids, plan=plan, host_plan=host_plan, pools=pools)
    return int(plan.num_bytes)


def d_measure(server, sc, raw_info: dict, iters: int, warmup: int, budget: float, delay_us: int,
              niced_raw_info=None):
    """D: a host-mode pull+complete checked against P's bytes, the timed rows
    (round-robin; ``niced_raw_info``: P's niced raw agent, the extra bulk row), then
    the KV checked again (the arena rows wrote it last)."""
    from .timing import measure
    from ..core.layout import as_words

    s = server.scratch
    n = int(s["plan"].num_bytes)
    P, D = sc.build("cpu"), s["point"]  # P's bytes, from the scenario's seed
    host = server.managers["host"]
    if not host.complete(_pull(host, s["plan"])).ok:
        raise RuntimeError("host-mode complete failed")
    verify = {"host": check_kv(P, D, s["d_ids"], sc.block_dim(), as_words)}
    _poison(D, s["d_ids"], sc.block_dim(), as_words)
    pending: list = []  # the plan the next host pull pulls, made untimed before it

    def host_pull():
        _pull(host, pending.pop())  # the handle dropped here is finished without writing the KV

    methods = {"bulk READ": _bulk_read(server, n, raw_info, delay_us, "ref")}
    if niced_raw_info is not None:
        methods[NICED_BULK] = _bulk_read(server, n, niced_raw_info, delay_us, "niced")
    methods |= {"arena pull": lambda: _arena_pull(server, False),
                "arena pull+complete": lambda: _arena_pull(server, True),
                "host pull": host_pull}
    before = {"host pull": lambda: pending.append(s["host_plan"]()) if not pending else None}
    timings = measure(methods, "cpu", iters, warmup, budget_s=budget, before=before)
    verify["arena"] = check_kv(P, D, s["d_ids"], sc.block_dim(), as_words)
    arena_descs = s["pools"]["pull"][0].num_descriptors
    descs = {"bulk READ": 1, NICED_BULK: 1, "arena pull": arena_descs, "arena pull+complete": arena_descs,
             "host pull": sum(len(p.local_pages) * p.local.num_chunks for p in s["plan"].pairs)}
    return {name: timings[name].stats() for name in methods}, descs, n, verify


def _poison(D, d_ids, block_dim: int, as_words) -> None:
    """Zero D's destination blocks: the next check passes only if a pull wrote them."""
    import torch

    for g, names in enumerate(D.layer_groups):
        ids = torch.tensor(d_ids[g], dtype=torch.int64)
        for name in names:
            as_words(D.dev[name]).index_fill_(block_dim, ids, 0)


def _bulk_read(server, nbytes: int, raw_info: dict, delay_us: int, tag: str):
    agent, buf = _raw_agent(server, f"{SIDE_D}-raw-{tag}", nbytes, delay_us)
    return _bulk(server, agent, buf, nbytes, raw_info, "READ", tag)


def _bulk(server, agent, buf, nbytes: int, remote_info: dict, op: str, tag: str, poll_s: float = 0.0):
    """One ``op`` (READ or WRITE) of ``buf`` against the peer's buffer, its state
    checked until it ends (every ``poll_s``; 0: back to back)."""
    peer = agent.add_remote_agent(remote_info["metadata"])
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buf.data_ptr(), nbytes, 0]], np.uint64), "DRAM")
    remote = agent.prep_xfer_dlist(peer, np.array([[remote_info["address"], nbytes, 0]], np.uint64), "DRAM")
    server.scratch[f"dlists-{tag}"] = (local, remote)
    idx = np.arange(1, dtype=np.int32)

    def run():
        h = agent.make_prepped_xfer(op, local, idx, remote, idx, b"")
        state = agent.transfer(h)
        while state == "PROC":
            if poll_s:
                time.sleep(poll_s)
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"bulk {op} ended {state}")

    return run


def d_write_target(server, nbytes: int, delay_us: int) -> dict:
    """D: a raw agent with one registered buffer of ``nbytes`` (the bulk WRITEs' target)."""
    agent, buf = _raw_agent(server, f"{SIDE_D}-target", nbytes, delay_us)
    return {"metadata": agent.get_agent_metadata(), "address": buf.data_ptr()}


def p_write_measure(server, target: dict, nbytes: int, rows: dict, iters: int, warmup: int, budget: float,
                    poll_s: float) -> dict:
    """P: the bulk WRITE rows (``rows``: row name -> the tag of P's raw agent that
    WRITEs), round-robin in P's main thread, each WRITE's state checked every
    ``poll_s`` as the arena connector's housekeeper checks a push's WRITEs."""
    from .timing import measure

    methods = {}
    for row, tag in rows.items():
        agent, buf = server.scratch[f"{SIDE_P}-raw-{tag}"][:2]
        methods[row] = _bulk(server, agent, buf, nbytes, target, "WRITE", f"write-{tag}", poll_s)
    timings = measure(methods, "cpu", iters, warmup, budget_s=budget)
    return {name: timings[name].stats() for name in methods}


def _pull(m, plan):
    h = m.pull(plan)
    while m.poll(h) == "PROC":
        pass
    if h.state != "DONE":
        raise RuntimeError(f"pull failed: {h.error}")
    return h


def _arena_pull(server, complete: bool) -> None:
    m = server.managers["arena"]
    plan = server.scratch["pools"]["pc" if complete else "pull"].pop()
    h = _pull(m, plan)
    if complete and not m.complete(h).ok:
        raise RuntimeError("arena complete failed")
    # pull only: the handle dropped here is finished without writing the KV, and its
    # span freed, at the manager's next call


# ---------------------------------------------------------------------- the parent
def run(args) -> int:
    from .args import BenchError, scenarios as _scenarios
    from .output import write_file
    from .timing import env_info
    from ..nixl import nixl_available
    from ..nixl.options import ManagerOptions

    try:
        parse_rate(args.rate)
        parse_rate(args.fault_rate)
        parse_cpus(args.p_cpus), parse_cpus(args.d_cpus)
        ManagerOptions(nixl_thread_nice=args.nixl_thread_nice or 0)
        if isinstance(args.p_load, bool) or args.p_load < 0:
            raise ValueError(f"--p-load must be 0 or more threads, got {args.p_load}")
        if not 0 <= args.write_poll_ms <= 1000:
            raise ValueError(f"--write-poll-ms must be in [0, 1000], got {args.write_poll_ms}")
    except (ValueError, TypeError) as exc:
        raise BenchError(str(exc)) from None
    busy = [f for f, v in (("--nixl-thread-nice", args.nixl_thread_nice), ("--p-cpus", args.p_cpus),
                           ("--p-load", args.p_load), ("--d-cpus", args.d_cpus), ("--write-rows", args.write_rows))
            if v]
    if args.faults and busy:
        raise BenchError(f"{', '.join(busy)}: options of the timed rows, not of --faults")
    why = nixl_available() or unavailable()
    if why:
        print(f"kvcopy-bench nixl --two-hosts: cannot run here: {why}", file=sys.stderr)
        return 2
    if args.faults:
        out = {"tool": "kvcopy-bench", "command": "nixl --two-hosts --faults", "argv": getattr(args, "argv", None),
               "env": env_info("cpu"), "rate": args.fault_rate, "faults": measure_faults(args)}
        text = format_faults(out)
    else:
        sc = _scenarios(args, sweep=False)[-1]
        rows, facts = measure_two_hosts(sc, args)
        out = {"tool": "kvcopy-bench", "command": "nixl --two-hosts", "argv": getattr(args, "argv", None),
               "env": env_info("cpu"), "rate": args.rate, "scenario": sc.to_dict(), "description": sc.describe(),
               "facts": facts, "results": rows}
        text = format_two_hosts(out)
    print(text, end="", file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_file(args.json, json.dumps(out, indent=1, default=str) + "\n")
    if "FAIL" in str(out.get("facts", {}).get("verify", "ok")):
        raise BenchError("D's KV differs from P's after the pulls")
    return 0


def measure_two_hosts(sc, args):
    from ..nixl.agent import PROGRESS_DELAY_US

    delay = PROGRESS_DELAY_US if args.progress_delay_us is None else args.progress_delay_us
    rounds = args.iters + args.warmup + 1
    nice = args.nixl_thread_nice
    p_cpus, d_cpus = parse_cpus(args.p_cpus), parse_cpus(args.d_cpus)
    load_before = os.getloadavg()
    with TwoHosts(rate=args.rate) as net:
        p, d = net.spawn("p"), net.spawn("d")
        for host, cpus in ((p, p_cpus), (d, d_cpus)):
            if cpus is not None:
                host.call("call", load.pin, cpus)
        p_info = p.call("call", p_setup, sc, 4 * sc.call_bytes() + (64 << 20), delay, nice or 0)
        nbytes = d.call("call", d_setup, sc, p_info, rounds, delay)
        raw = p.call("call", p_raw, nbytes, delay, "ref")
        niced_raw = None if nice is None else p.call("call", p_raw, nbytes, delay, "niced", nice)
        p_threads = p.call("call", load.threads)
        if args.p_load:
            p.call("call", load.load_start, args.p_load)
        stats, descs, n, verify = d.call("call", d_measure, sc, raw, args.iters, args.warmup, args.budget, delay,
                                         niced_raw, timeout=3600)
        if args.write_rows:
            target = d.call("call", d_write_target, nbytes, delay)
            tags = {WRITE_ROWS[0]: "ref"} | ({} if nice is None else {WRITE_ROWS[1]: "niced"})
            stats |= p.call("call", p_write_measure, target, nbytes, tags, args.iters, args.warmup, args.budget,
                            args.write_poll_ms / 1e3, timeout=3600)
            descs |= dict.fromkeys(tags, 1)
        load_rate = p.call("call", load.load_stop) if args.p_load else None
    rate = parse_rate(args.rate)
    rows = []
    for name in (m for m in (ROWS[0], NICED_BULK) + ROWS[1:] + WRITE_ROWS if m in stats):
        st = stats[name]
        of = WRITE_ROWS[0] if name in WRITE_ROWS else ROWS[0]  # x bulk: a WRITE row's against the bulk WRITE
        ref = stats[of].get("median_us")
        row = {"method": name, "bytes": n, "descriptors": descs[name], "x_bulk_of": of, **st}
        if st.get("median_us"):
            row["gbps"] = n / (st["median_us"] * 1e-6) / 1e9
            row["pct_rate"] = 100 * row["gbps"] * 8e9 / rate
            row["x_bulk"] = st["median_us"] / ref if ref else None
        rows.append(row)
    bad = [f"{mode}: {v}" for mode, v in verify.items() if v != "ok"]
    return rows, {"verify": "; ".join(bad) if bad else "ok", "verify_by_mode": verify, "progress_delay_us": delay,
                  "ucx": "UCX_TLS=tcp, UCX_NET_DEVICES=<veth>", "nixl_thread_nice": nice, "p_cpus": p_cpus,
                  "d_cpus": d_cpus, "p_load_threads": args.p_load, "p_load_mm_per_s": load_rate,
                  "p_threads": p_threads, "load_average_before": load_before, "load_average_after": os.getloadavg()}


def measure_faults(args) -> List[dict]:
    from .two_hosts_faults import FAULTS, MODES, SMALL_SOCKET_BUFFERS, notice_times

    rows = []
    for deadline in (None, args.fault_deadline):
        with TwoHosts(rate=args.fault_rate, env=SMALL_SOCKET_BUFFERS) as net:
            rows += notice_times(net, list(FAULTS), MODES, deadline, args.fault_guard)
    return rows


def format_two_hosts(out: dict) -> str:
    from .units import fmt_bytes

    f = out["facts"]
    busy = (f"P on CPUs {f.get('p_cpus') or 'any'}, D on {f.get('d_cpus') or 'any'}, P's load "
            f"{f.get('p_load_threads', 0)} threads" + (f" ({f['p_load_mm_per_s']:.0f} multiplies/s)"
                                                        if f.get("p_load_mm_per_s") else "")
            + f", P's managers' NIXL threads at nice {f.get('nixl_thread_nice') or 0}")
    loads = " -> ".join(" ".join(f"{x:.2f}" for x in f[k]) for k in ("load_average_before", "load_average_after")
                        if f.get(k))
    lines = [f"kvcopy-bench nixl --two-hosts  link cap {out['rate']} (veth between two network namespaces, "
             f"UCX on TCP), NIXL {out['env'].get('nixl')}, load average {loads}",
             f"scenario {out['description']}", busy,
             f"{'method':<22} {'bytes':>9} {'descs':>6} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
             f"{'GB/s':>6} {'% rate':>7} {'x bulk':>7}"]
    for r in out["results"]:
        lines.append(f"{r['method']:<22} {fmt_bytes(r['bytes']):>9} {r['descriptors']:>6} "
                     f"{r.get('median_us', 0) / 1e3:>10.2f} {r.get('p10_us', 0) / 1e3:>8.2f} "
                     f"{r.get('p90_us', 0) / 1e3:>8.2f} {r.get('gbps', 0):>6.2f} {r.get('pct_rate', 0):>7.1f} "
                     f"{r.get('x_bulk') or 0:>7.2f}")
    lines.append("x bulk = time / one bulk READ (WRITE rows: bulk WRITE) of the same bytes over the same link, "
                 "same run (lower is better); % rate = throughput / the link's cap")
    lines.append(f"verify {out['facts']['verify']}")
    return "\n".join(lines) + "\n"


def format_faults(out: dict) -> str:
    lines = [f"kvcopy-bench nixl --two-hosts --faults  link cap {out['rate']}, 1 MiB requests, "
             f"load {out['env'].get('load_average')}",
             f"{'fault':<15} {'mode':<6} {'deadline':>8} {'ended':>6} {'noticed after':>14} {'next':>5} "
             f"{'KV':>9}  error"]
    for r in out["faults"]:
        dl = "none" if r["deadline_s"] is None else f"{r['deadline_s']:g} s"
        seen = "not seen" if r["notice_s"] is None else f"{r['notice_s']:.2f} s"
        kv = "-" if "kv_right" not in r else ("right" if r["kv_right"] else "WRONG")
        nxt = "-" if "next_ok" not in r else ("ok" if r["next_ok"] else "FAIL")
        lines.append(f"{r['fault']:<15} {r['mode']:<6} {dl:>8} {r['state']:>6} {seen:>14} {nxt:>5} {kv:>9}  "
                     f"{(r['error'] or '')[:60]}")
    lines.append("noticed after = from the fault in place to D's poll returning the pull's end "
                 "(DONE: the pull rode the fault out)")
    return "\n".join(lines) + "\n"

