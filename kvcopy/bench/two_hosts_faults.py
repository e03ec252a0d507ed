"""Faults across a real link: P and D managers over :mod:`kvcopy.bench.two_hosts`, one
request pulled while a fault hits it, and everything a failed request must leave.

    with TwoHosts(rate="8mbit", env=SMALL_SOCKET_BUFFERS) as net:
        rig = Rig(net).start()                 # P and D, a host-mode and an arena-mode pair each
        out = rig.fault_cycle("link_down", "arena", timeout_s=2.5)

The toy KV (both sides): ``layers`` bf16 NHD tensors ``[num_blocks, 16, heads,
head_dim]``, layer ``l`` in group ``l % groups``; a request moves ``blocks`` blocks per
group, whole blocks (tokens = ``blocks * 16``, nothing zeroed). P's KV never changes,
so every request reads the same P blocks; D's blocks rotate through disjoint slots, so a
failed request's blocks are never another request's. D's KV is random bytes unlike
P's (poisoned), so an unwritten or stray byte shows.

A cycle (:meth:`Rig.fault_cycle`): D posts the pull with a deadline; once P's veth has
sent a fifth of the request's bytes the fault is applied (the pull is in flight: the
rate cap keeps it there); D polls until the pull ends and completes it at once; then
the fault is undone, the link is left to go quiet (a READ given up on may still land),
and D's KV, D's and P's counters, the next request (posted after the link returned,
byte-exact) and D's counters once every READ given up on ended are collected. The
caller asserts; :func:`notice_times` measures.
:func:`late_read_into_reused_blocks` sets up issue 21's late READ over the link: a READ
given up on at its deadline that lands later, while another request wants its blocks.

Socket buffers: :data:`SMALL_SOCKET_BUFFERS` keeps UCX's TCP socket buffers at 64 KiB,
so what the kernels hold in flight (socket buffers and tbf's queue) stays well under a
request (the kernels keep sending what they hold while P is frozen, and a request
smaller than that would finish anyway).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .two_hosts import ChildError, Host, TwoHosts, wait_for

SMALL_SOCKET_BUFFERS = {"UCX_TCP_SNDBUF": "64k", "UCX_TCP_RCVBUF": "64k"}
MODES = ("host", "arena")
BLOCK = 16  # tokens per block (and page)


@dataclass(frozen=True)
class Fault:
    """How to apply and undo one fault; ``survivable``: a pull in flight should still end
    DONE (TCP rides it out)."""

    name: str
    apply: Callable[["Rig"], None]
    undo: Callable[["Rig"], None]
    what: str
    survivable: bool = False


def _collapse(rig: "Rig") -> None:
    rig.net.set_rate("32kbit")


FAULTS: Dict[str, Fault] = {f.name: f for f in (
    Fault("link_down", lambda r: r.net.link_down("p"), lambda r: r.net.link_up("p"),
          "P's end of the link set down (D's end loses carrier)"),
    Fault("link_down_d", lambda r: r.net.link_down("d"), lambda r: r.net.link_up("d"),
          "D's own end of the link set down"),
    Fault("rate_collapse", _collapse, lambda r: r.net.set_rate(r.net.rate),
          "the rate cap collapsed to 32 kbit/s"),
    Fault("mtu_both", lambda r: r.net.set_mtu(1280), lambda r: r.net.set_mtu(r.net.mtu),
          "both ends' MTU lowered to 1280", survivable=True),
    # survivable only where TCP detects black holes (kvcopy.bench.two_hosts, module docstring)
    Fault("mtu_one_end", lambda r: r.net.set_mtu(1280, "d"), lambda r: r.net.set_mtu(r.net.mtu, "d"),
          "D's end's MTU lowered to 1280, P's left at 1500"),
    Fault("p_frozen", lambda r: r.p.freeze(), lambda r: r.p.thaw(), "P's process stopped (SIGSTOP)"),
    Fault("p_killed", lambda r: r.p.kill(), lambda r: r.restart_p(), "P's process killed (SIGKILL)"),
)}


@dataclass
class Cycle:
    """What one fault cycle observed (times are ``time.monotonic()`` seconds)."""

    fault: str
    mode: str
    record: dict  # D's record of the pull hit by the fault (two_hosts_server)
    t_fault: float  # the fault in place (the command applying it returned)
    in_flight: bool  # the pull had not ended when the fault began to be applied
    d_ids: List[List[int]]
    kv_right: bool  # when the pull ended, D's KV as before (failed) or with P's bytes (DONE)
    kv_right_later: bool  # the same once the link went quiet again (late READs landed)
    d_stats: dict
    d_stats_before: dict
    next_record: dict  # the request posted after the fault was undone
    next_exact: bool  # D's KV after it: P's bytes at its blocks, every other byte as before
    p_stats: dict = field(default_factory=dict)
    d_settled: dict = field(default_factory=dict)  # D's counters once every READ given up on ended

    @property
    def notice_s(self) -> float:
        """From the fault to D's poll returning the pull's end."""
        return self.record["t_end"] - self.t_fault


class Rig:
    """P and D processes over a :class:`TwoHosts` link, one manager pair per mode."""

    net: TwoHosts
    p: Host  # P's process (replaced when P is restarted)
    d: Host  # D's process

    def __init__(self, net: TwoHosts, layers: int = 4, groups: int = 2, num_blocks: int = 256, heads: int = 4,
                 head_dim: int = 64, blocks: int = 32, modes=MODES, arena_ttl_s: float = 30.0):
        self.net = net
        self.engine = (layers, groups, num_blocks, BLOCK, heads, head_dim)
        self.blocks = blocks
        self.modes = tuple(modes)
        self.arena_ttl_s = arena_ttl_s
        self.request_bytes = layers * blocks * BLOCK * heads * head_dim * 2
        self.slots = num_blocks // blocks
        self.p_ids = [list(range(blocks)) for _ in range(groups)]
        self.peers: Dict[str, str] = {}
        self.p_meta: Dict[str, bytes] = {}
        self._next_slot = 1  # slot 0 holds P's blocks on P; D's slots rotate from 1
        self._serial = 0

    # ------------------------------------------------------------ set-up
    def _kwargs(self, mode: str) -> dict:
        if mode == "host":
            return {}
        arena = 4 * self.request_bytes + (8 << 20)
        return {"buffer": "arena", "arena_bytes": arena, "arena_ttl_s": self.arena_ttl_s}

    def start(self) -> "Rig":
        self.d = self.net.spawn("d")
        self.d.call("engine", *self.engine, 2)  # D's bytes differ from P's: a poisoned destination
        for mode in self.modes:
            self.d.call("manager", f"D-{mode}", self._kwargs(mode))
        self._start_p()
        return self

    def _start_p(self) -> None:
        self.p = self.net.spawn("p")
        self.p.call("engine", *self.engine, 1)
        for mode in self.modes:
            self.p_meta[mode] = self.p.call("manager", f"P-{mode}", self._kwargs(mode))
            self.peers[mode] = self.d.call("add_peer", f"D-{mode}", self.p_meta[mode])

    def restart_p(self) -> None:
        """A new P process (same names, same KV bytes, new NIXL metadata); D forgets the
        old one and takes the new handshake, as after a restart."""
        if self.p.alive():
            self.p.kill()
        for mode in self.modes:
            self.d.call("remove_peer", f"D-{mode}", self.peers.pop(mode))
        self._start_p()

    def rehandshake(self, mode: str) -> None:
        """D forgets P and takes its handshake again: a live P whose connection UCX
        declared failed, which NIXL never reconnects (docs/nixl.md, "Two hosts: faults
        on a real link")."""
        peer = self.peers.pop(mode)
        self.d.call("remove_peer", f"D-{mode}", peer)
        self.peers[mode] = self.d.call("add_peer", f"D-{mode}", self.p_meta[mode])

    # ------------------------------------------------------------ requests
    def next_d_ids(self) -> List[List[int]]:
        slot = self._next_slot
        self._next_slot = slot + 1 if slot + 1 < self.slots else 1
        return [list(range(slot * self.blocks, (slot + 1) * self.blocks)) for _ in self.p_ids]

    def post(self, mode: str, d_ids, timeout_s: Optional[float]) -> Tuple[str, float]:
        """P saves (or stages) the request, D posts its pull; returns (key, time posted)."""
        self._serial += 1
        key = f"r{self._serial}"
        tokens = self.blocks * BLOCK
        if mode == "arena":
            remote = self.p.call("stage", f"P-{mode}", self.p_ids, tokens, key, 1)
        else:
            self.p.call("save", f"P-{mode}", self.p_ids)
            remote = self.p_ids
        return key, self.d.call("post", key, f"D-{mode}", self.peers[mode], remote, tokens, d_ids,
                                key.encode(), timeout_s)

    def pull(self, mode: str, d_ids, timeout_s: float = 60.0) -> dict:
        key, _ = self.post(mode, d_ids, timeout_s)
        return self.d.call("wait", [key], timeout_s + 60)[key]

    def expected(self, before: Dict[str, np.ndarray], p_kv: Dict[str, np.ndarray], d_ids) -> Dict[str, np.ndarray]:
        """D's KV after a correct pull of P's blocks into ``d_ids``; every other byte as before."""
        layers, groups, num_blocks = self.engine[:3]
        out = {n: a.copy() for n, a in before.items()}
        for i in range(layers):
            name, g = f"layer.{i}", i % groups
            out[name].reshape(num_blocks, -1)[d_ids[g]] = p_kv[name].reshape(num_blocks, -1)[self.p_ids[g]]
        return out

    # ------------------------------------------------------------ one fault
    def fault_cycle(self, fault: str, mode: str, timeout_s: Optional[float], guard_s: float = 120.0) -> Cycle:
        """Apply ``fault`` to a pull in flight and collect what it left (module docstring)."""
        f = FAULTS[fault]
        d_ids = self.next_d_ids()
        before = self.d.call("caches")
        stats_before = self.d.call("stats", f"D-{mode}")
        start = self.net.sent_bytes("p")
        key, _ = self.post(mode, d_ids, timeout_s)
        wait_for(lambda: self.net.sent_bytes("p") - start >= self.request_bytes // 5, guard_s,
                 f"{mode} pull under way over the link")
        t_apply = time.monotonic()
        f.apply(self)
        try:
            t_fault = time.monotonic()
            record = self.d.call("wait", [key], guard_s)[key]
            kv_at_end = self.d.call("caches")
            stats = self.d.call("stats", f"D-{mode}")
        finally:
            f.undo(self)  # a killed P is restarted (D takes its new handshake)
        quiet(self.net)
        # A failed pull leaves D's KV as it was; a pull that rode the fault out is exact.
        want = self.expected(before, self.p.call("caches"), d_ids) if record["ok"] else before
        later = self.d.call("caches")
        if "NIXL_ERR_REMOTE_DISCONNECT" in str(record.get("error")) and fault != "p_killed":
            self.rehandshake(mode)
        next_ids = self.next_d_ids()
        nxt = self.pull(mode, next_ids)
        next_exact = _same(self.expected(want, self.p.call("caches"), next_ids), self.d.call("caches"))
        return Cycle(fault, mode, record, t_fault, record["t_end"] >= t_apply, d_ids, _same(want, kv_at_end),
                     _same(want, later), stats, stats_before, nxt, next_exact,
                     self._p_settled(mode) if mode == "arena" else {}, self._d_settled(mode))

    def _d_settled(self, mode: str, guard_s: float = 60.0) -> dict:
        """D's counters once NIXL reported every READ given up on ended (hang guard)."""
        end = time.monotonic() + guard_s
        while True:
            stats = self.d.call("stats", f"D-{mode}")
            if stats["abandoned_reads"] == 0 or time.monotonic() > end:
                return stats
            time.sleep(0.05)

    def _p_settled(self, mode: str, guard_s: float = 30.0) -> dict:
        """P's arena counters once D's notifications freed what they free (hang guard)."""
        end = time.monotonic() + guard_s
        while True:
            self.p.call("notifications", f"P-{mode}")
            stats = self.p.call("stats", f"P-{mode}")
            if stats["staged_requests"] == 0 or time.monotonic() > end:
                return stats
            time.sleep(0.05)


def quiet(net: TwoHosts, still_s: float = 0.3, guard_s: float = 60.0) -> None:
    """Wait until neither veth has sent a byte for ``still_s`` (a released READ has
    landed or been dropped); ``guard_s`` is a hang guard."""
    last = (net.sent_bytes("p"), net.sent_bytes("d"))
    since = time.monotonic()
    end = since + guard_s
    while time.monotonic() - since < still_s:
        if time.monotonic() > end:
            raise TimeoutError(f"the link kept moving bytes for {guard_s} s")
        time.sleep(0.05)
        now = (net.sent_bytes("p"), net.sent_bytes("d"))
        if now != last:
            last, since = now, time.monotonic()


def _same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def notice_times(net: TwoHosts, faults, modes, timeout_s: Optional[float], guard_s: float) -> List[dict]:
    """For each (fault, mode): how long after the fault D's poll saw the pull end, with
    this deadline (None: none; then ``guard_s`` bounds the wait). One row each."""
    rig = Rig(net, modes=modes).start()
    rows = []
    for fault in faults:
        for mode in modes:
            row = {"fault": fault, "what": FAULTS[fault].what, "mode": mode, "deadline_s": timeout_s}
            try:
                c = rig.fault_cycle(fault, mode, timeout_s, guard_s=guard_s)
            except ChildError as exc:
                if exc.kind != "TimeoutError":
                    raise
                rows.append({**row, "state": "PROC", "notice_s": None,
                             "error": f"still in flight {guard_s:g} s after the fault"})
                rig = _fresh_rig(net, rig, modes)
                continue
            rows.append({**row, "state": c.record["state"], "notice_s": c.notice_s, "error": c.record["error"],
                         "next_ok": c.next_record["ok"], "kv_right": c.kv_right and c.kv_right_later})
    return rows


def _fresh_rig(net: TwoHosts, rig: Rig, modes) -> Rig:
    """After a pull that never ended: undo every fault, new processes on both sides."""
    for f in FAULTS.values():
        try:
            if f.name != "p_killed":
                f.undo(rig)
        except Exception:
            pass
    for h in (rig.p, rig.d):
        h.stop()
    return Rig(net, modes=modes).start()


def late_read_into_reused_blocks(net: TwoHosts, mode: str, deadline_s: float = 1.0) -> dict:
    """A READ given up on at its deadline lands later: it must not land in blocks (host
    mode: their host pages) or a span (arena mode) another request holds.

    P1 and P2 are two P processes with different KV bytes. D pulls request A from P1,
    and P1 is frozen mid-READ: A fails at its deadline (D keeps the READ's handle). Past
    what P's TTL is, D pulls request C from P2 into A's blocks: host mode refuses it
    while A's READ may land (``PagesHeld``, the kind of error in ``c_refused``) and C is
    pulled again once it ended; arena mode gives C a span other than A's, still held.
    C's READ ends DONE, and before D completes C (a decode engine completes at its next
    step) P1 runs again: A's READ lands. Returns C's completion and, per layer, whether
    D's KV at C's blocks holds P2's bytes (``c_exact``) and how many of its blocks hold
    P1's request-A bytes (``a_blocks``), and D's counters while A's READ was held and
    after it ended (``held``, ``ended``)."""
    layers, groups, num_blocks = 4, 2, 64
    engine = (layers, groups, num_blocks, BLOCK, 4, 64)
    kw = {} if mode == "host" else {"buffer": "arena", "arena_bytes": 8 << 20, "arena_ttl_s": deadline_s}
    ids = [list(range(16)) for _ in range(groups)]
    d_ids = [list(range(16, 32)) for _ in range(groups)]
    p1, p2, d = net.spawn("p"), net.spawn("p"), net.spawn("d")
    for host, seed in ((p1, 1), (p2, 3), (d, 2)):
        host.call("engine", *engine, seed)
    handshakes = [p1.call("manager", "P1", kw), p2.call("manager", "P2", kw)]
    d.call("manager", "D", kw)
    peers = [d.call("add_peer", "D", h) for h in handshakes]
    remote = []
    for host, name, rid in ((p1, "P1", "A"), (p2, "P2", "C")):
        if mode == "arena":
            remote.append(host.call("stage", name, ids, 16 * BLOCK, rid, 1))
        else:
            host.call("save", name, ids)
            remote.append(ids)
    start = net.sent_bytes("p")
    d.call("post", "A", "D", peers[0], remote[0], 16 * BLOCK, d_ids, b"A", deadline_s)
    wait_for(lambda: net.sent_bytes("p") - start >= 100_000, 60, "request A under way")
    p1.freeze()
    a = d.call("wait", ["A"])["A"]
    time.sleep(deadline_s * 1.2)  # past P's TTL (what D's quarantine timer was)
    held = d.call("stats", "D")
    refused, key = None, "C"
    try:
        d.call("post", key, "D", peers[1], remote[1], 16 * BLOCK, d_ids, b"C", 60.0, True)
    except ChildError as exc:
        refused, key = exc.kind, "C-again"
    if refused is None:
        c = d.call("wait", [key])[key]
    p1.thaw()
    request_bytes = layers * 16 * BLOCK * 4 * 64 * 2
    # every byte of A (given up on or not) crosses P's veth before it goes quiet
    wait_for(lambda: net.sent_bytes("p") - start >= request_bytes, 60, "A's READ sent")
    quiet(net)
    if refused is not None:  # A's READ ended: its pages are free again
        d.call("post", key, "D", peers[1], remote[1], 16 * BLOCK, d_ids, b"C", 60.0, True)
        c = d.call("wait", [key])[key]
    done = d.call("complete", key)
    ended = d.call("stats", "D")
    p1_kv, p2_kv, d_kv = p1.call("caches"), p2.call("caches"), d.call("caches")
    out = {"a": a, "c": c, "c_ok": done["ok"], "c_refused": refused, "held": held, "ended": ended,
           "c_exact": {}, "a_blocks": {}}
    for i in range(layers):
        name = f"layer.{i}"
        got = d_kv[name].reshape(num_blocks, -1)[d_ids[i % groups]]
        out["c_exact"][name] = bool(np.array_equal(got, p2_kv[name].reshape(num_blocks, -1)[ids[i % groups]]))
        out["a_blocks"][name] = int((got == p1_kv[name].reshape(num_blocks, -1)[ids[i % groups]]).all(axis=1).sum())
    return out
