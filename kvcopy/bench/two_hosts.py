"""Two hosts on one machine: P and D in their own network namespaces, joined by a veth link.

    with TwoHosts(rate="1gbit") as net:      # namespaces, veth pair, addresses, tbf caps
        p, d = net.spawn("p"), net.spawn("d")  # a child process in each namespace
        p.call("engine", "one_group", 64, 1)   # commands over a pipe (two_hosts_server)
        net.link_down("p"); net.link_up("p")   # faults: link, rate, MTU, P frozen or killed

Layout of one instance (names are unique per run; addresses only ever exist inside the
two namespaces it made, from the benchmarking range 198.18.0.0/15)::

    netns kvc2h-<pid>-<n>-p                       netns kvc2h-<pid>-<n>-d
    P's processes   kvp 198.18.0.1/30  <-- veth -->  kvd 198.18.0.2/30   D's processes
                    egress: tbf rate R                 egress: tbf rate R

The veth pair is created directly inside the two namespaces, so its interface names
(``kvp``, ``kvd``) never meet another run's. Each side's egress has a token-bucket
filter (``tc qdisc ... tbf``) at ``rate``; P's egress carries the READ data.

UCX over the link: every child runs with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<its
veth>``. ``UCX_TLS`` is UCX's allow-list of transports (``ucp_context.c``: "tcp: sockets
over TCP/IP"); without it two processes on one machine would pick UCX's shared-memory
transports (``cma``, ``posix``/``sysv`` mappers), which move bytes through memory and
never touch the link. ``UCX_NET_DEVICES`` is the allow-list of network devices: with
only the veth, the worker address a peer advertises holds the veth address and nothing
else (no loopback address that would mean another namespace on the far side).

Faults (:class:`TwoHosts`): ``link_down``/``link_up`` (one end set down: the other end
loses carrier; TCP keeps its connections and retransmits; ``link_up`` returns once a new
connection can cross), ``set_rate`` (the cap changed in place, e.g. collapsed to
``1mbit`` mid-transfer), ``set_mtu`` (both ends: the sender's own route shrinks and
TCP follows the smaller MTU), and P's process frozen (``SIGSTOP``), continued, killed
(``SIGKILL``) or restarted.

One end's MTU only (``set_mtu(1280, "d")``): a veth drops a frame larger than the
receiving end's MTU, silently (no ICMP error reaches the sender), unless the frame is a
GSO frame (``is_skb_forwardable`` in the kernel's ``net/core/dev.c``: a GSO frame is
forwarded whatever its length, as it could have been forwarded unsegmented). P's TCP
sends most of a READ's bytes as GSO frames (tbf's bucket, :func:`_burst_bytes`, keeps
them whole), but now and then a lone full-size segment (a window update from D's small
receive buffer opens room for one, a retransmission after a timeout is one): that one
is dropped, and so is every retransmission of it. Linux's TCP finds such a black hole
only with ``net.ipv4.tcp_mtu_probing`` >= 1 (:meth:`TwoHosts.set_mtu_probing`, per
namespace; the default 0 is off): after a few retransmission timeouts it falls back to
``tcp_base_mss`` (1024-byte) segments, which fit. Without it the connection stalls
until the MTU is back. ``TwoHosts(gso=False)`` (``gso_max_segs 1`` on both ends) makes
every segment its own frame, so the black hole catches every full-size segment: a
deterministic version of the stall.

Clean-up: :meth:`TwoHosts.close` (also the context manager's exit and an ``atexit``
hook) stops the children (continued first if frozen, killed if they do not exit) and
deletes both namespaces, which deletes the veth pair and its qdiscs. A run that died
without cleaning up leaves namespaces named after its dead pid: :func:`sweep_stale`
(called by every new instance) kills what still runs in them and deletes them.

Handshake bytes, records and results travel over a pipe between the parent and each
child (a socketpair: :class:`Host`), never over the link under test.

Where namespaces cannot be made (not root, no ``ip``/``tc``, a kernel or container that
refuses them), :func:`unavailable` says why, and callers skip with that reason.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Dict, Iterator, List, Optional

PREFIX = "kvc2h"  # namespace names: kvc2h-<creator pid>-<serial>-<p|d>
IFACES = {"p": "kvp", "d": "kvd"}
ADDRESSES = {"p": "198.18.0.1", "d": "198.18.0.2"}  # RFC 2544 benchmarking range, inside our namespaces
_live: List["TwoHosts"] = []
_serial = 0
_probe: Optional[List[Optional[str]]] = None
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class NetError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message has the command and its stderr."""


class ChildError(RuntimeError):
    """A command failed in a child process; ``kind`` is the exception's type name there."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
    return out


def parse_rate(text: str) -> float:
    """A tc rate (``10gbit``, ``500mbit``, ``1mbit``) in bits per second."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?bit)\s*", str(text).lower())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"rate must be a positive tc rate such as 10gbit, 500mbit or 1mbit, got {text!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def unavailable() -> Optional[str]:
    """None when this process can make network namespaces, a veth pair and a tbf qdisc;
    else why not (probed once: a namespace made and deleted)."""
    global _probe
    if _probe is not None:
        return _probe[0]
    why = None
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if not sys.platform.startswith("linux"):
        why = "network namespaces need Linux"
    elif os.geteuid() != 0:
        why = "making network namespaces needs root (ip netns add)"
    elif missing:
        why = f"{' and '.join(missing)} not found (iproute2)"
    else:
        why = _probe_namespaces()
    _probe = [why]
    return why


def _probe_namespaces() -> Optional[str]:
    name = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", name)
    except (NetError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a network namespace: {exc}"
    try:
        _run("ip", "-n", name, "link", "add", "kvp", "type", "veth", "peer", "name", "kvd")
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "kvp", "root", "tbf", "rate", "1gbit",
             "burst", "256kb", "latency", "50ms")
    except (NetError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a veth pair with a tbf qdisc in a namespace: {exc}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> List[str]:
    """Delete namespaces left by runs that died (their creator pid is gone), killing the
    processes still in them first; returns the names deleted."""
    out = _run("ip", "netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-[\w-]+", name)
        if m is None or _alive(int(m.group(1))):
            continue
        _kill_inside(name)
        _run("ip", "netns", "del", name, check=False)
        gone.append(name)
    return gone


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (ours by its name), by pid."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGCONT)
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _burst_bytes(rate_bps: float) -> int:
    """tbf's bucket: 1 ms of the rate, at least 128 KiB (a 64 KiB GSO frame must fit, or
    tbf splits every frame). A transfer after an idle gap gets this much at line rate:
    a 36 MiB request at 10 Gbit/s gains ~3%."""
    return max(128 << 10, int(rate_bps / 8 * 0.001))


class Host:
    """A child process in a namespace serving :mod:`kvcopy.bench.two_hosts_server`
    commands over a socketpair."""

    def __init__(self, ns: str, side: str, env: Dict[str, str]):
        parent, child = socket.socketpair()
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvcopy.bench.two_hosts_server",
               str(child.fileno())]
        try:
            # ip netns exec execs the command: the pid is the Python child's
            self.process = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.side = side
        self.frozen = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, *msg, timeout: float = 300.0):
        """Send one command; return its result. ``timeout`` is a hang guard only."""
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.side} process did not answer {msg[0]!r} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise ChildError(f"{self.side} process, {msg[0]!r}: {value}", value.split(":", 1)[0])
        return value

    def alive(self) -> bool:
        return self.process.poll() is None

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait(30)
        self.frozen = False

    def proc_stats(self) -> Dict[str, int]:
        """Open file descriptors, threads and resident memory (bytes) of the child."""
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        threads = len(os.listdir(f"/proc/{self.pid}/task"))
        rss = 0
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return {"fds": fds, "threads": threads, "rss": rss}

    def stop(self) -> None:
        """Ask the child to exit; continue it first if frozen, kill it if it does not go."""
        if self.alive():
            if self.frozen:
                self.thaw()
            try:
                self.conn.send(("exit",))
                self.process.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self.kill()
        self.conn.close()


class TwoHosts:
    """Two namespaces joined by a veth pair with a rate cap, their child processes, and
    the fault controls (see the module docstring)."""

    def __init__(self, rate: str = "10gbit", mtu: int = 1500, env: Optional[Dict[str, str]] = None,
                 gso: bool = True):
        global _serial
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        if not isinstance(mtu, int) or isinstance(mtu, bool) or not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be an int in [576, 65535], got {mtu!r}")
        if not isinstance(gso, bool):
            raise TypeError(f"gso must be a bool, got {gso!r}")
        self.mtu = mtu
        self.gso = gso  # False: every TCP segment its own frame (module docstring)
        self.extra_env = dict(env or {})
        _serial += 1
        base = f"{PREFIX}-{os.getpid()}-{_serial}"
        self.ns = {"p": f"{base}-p", "d": f"{base}-d"}
        self.hosts: Dict[str, List[Host]] = {"p": [], "d": []}
        self._made: List[str] = []
        self._started = False

    # ------------------------------------------------------------ set-up
    def start(self) -> "TwoHosts":
        why = unavailable()
        if why:
            raise NetError(why)
        sweep_stale()
        _live.append(self)
        try:
            for side in ("p", "d"):
                _run("ip", "netns", "add", self.ns[side])
                self._made.append(self.ns[side])
            _run("ip", "-n", self.ns["p"], "link", "add", IFACES["p"], "type", "veth", "peer", "name",
                 IFACES["d"], "netns", self.ns["d"])
            for side in ("p", "d"):
                ns, dev = self.ns[side], IFACES[side]
                _run("ip", "-n", ns, "addr", "add", f"{ADDRESSES[side]}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(self.mtu), "up")
                if not self.gso:
                    _run("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1")
                _run("ip", "-n", ns, "link", "set", "dev", "lo", "up")
                self._tbf(side, "add", self.rate)
        except BaseException:
            self.close()
            raise
        self._started = True
        return self

    def _tbf(self, side: str, verb: str, rate: str) -> None:
        burst = _burst_bytes(parse_rate(rate))
        _run("ip", "netns", "exec", self.ns[side], "tc", "qdisc", verb, "dev", IFACES[side], "root", "tbf",
             "rate", rate, "burst", str(burst), "latency", "100ms")

    def env(self, side: str) -> Dict[str, str]:
        """The environment of a child on ``side``: UCX on TCP over that side's veth only."""
        import kvcopy

        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvcopy.__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.link_env(side))
        return env

    def link_env(self, side: str) -> Dict[str, str]:
        """The variables that put a process on ``side``'s end of the link: UCX on TCP over
        that side's veth only (the module docstring), and the instance's ``env``."""
        self._sides(side)
        return dict(UCX_TLS="tcp", UCX_NET_DEVICES=IFACES[side], UCX_WARN_UNUSED_ENV_VARS="n", **self.extra_env)

    def address(self, side: str) -> str:
        """``side``'s veth address (reachable from the other namespace over the link)."""
        self._sides(side)
        return ADDRESSES[side]

    def exec_prefix(self, side: str) -> List[str]:
        """The command prefix that runs a program in ``side``'s namespace (``ip netns exec``
        execs it: the pid is the program's, its session and signals are its own)."""
        self._sides(side)
        if not self._started:
            raise ValueError("TwoHosts.start() first (or use it as a context manager)")
        return [shutil.which("ip") or "ip", "netns", "exec", self.ns[side]]

    @contextlib.contextmanager
    def inside(self, side: str) -> Iterator[None]:
        """The calling thread in ``side``'s namespace for the block, back in its own after.

        A network namespace is per thread (``setns(2)`` moves the caller only), and a
        thread starts in its creator's: threads this one starts inside the block (a
        thread pool, a proxy's legs) live there for good, sockets made there stay there.
        Other threads of the process are not moved. Lets a client or proxy in this
        process reach the engines it started in that namespace without an address
        outside the namespaces this instance made."""
        self._sides(side)
        if not self._started:
            raise ValueError("TwoHosts.start() first (or use it as a context manager)")
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            there = os.open(f"/run/netns/{self.ns[side]}", os.O_RDONLY)
            try:
                _setns(there)
            finally:
                os.close(there)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    def spawn(self, side: str) -> Host:
        """A new child process in ``side``'s namespace (``"p"`` or ``"d"``)."""
        if side not in self.ns:
            raise ValueError(f"side must be 'p' or 'd', got {side!r}")
        if not self._started:
            raise ValueError("TwoHosts.start() first (or use it as a context manager)")
        host = Host(self.ns[side], side, self.env(side))
        self.hosts[side].append(host)
        return host

    # ------------------------------------------------------------ faults
    def link_down(self, side: str = "p") -> None:
        """Set one end of the link down (the other end loses carrier)."""
        _run("ip", "-n", self.ns[side], "link", "set", "dev", IFACES[side], "down")

    def link_up(self, side: str = "p", guard_s: float = 30.0) -> None:
        """Set that end up again; return once the link carries a new connection: both
        ends operationally up (the kernel applies a carrier change in deferred work), and
        no ARP resolution begun while the link was down still pending. Such an entry
        (``INCOMPLETE``: D's TCP sent while P was unreachable) used up its probes in the
        dark and turns ``FAILED`` up to a few seconds after the link is back, failing
        what was queued on it with ``EHOSTUNREACH``: a connection begun in that window
        (a new handshake's) failed with ``No route to host``. A ``FAILED`` entry is
        probed afresh by the next packet."""
        _run("ip", "-n", self.ns[side], "link", "set", "dev", IFACES[side], "up")
        wait_for(lambda: all(self._operstate(s) == "UP" and not self._resolving(s) for s in ("p", "d")),
                 guard_s, "both ends of the link up, no ARP resolution from while it was down", step=0.01)

    def _operstate(self, side: str) -> str:
        out = _run("ip", "-n", self.ns[side], "-o", "link", "show", "dev", IFACES[side]).stdout
        m = re.search(r" state (\S+)", out)
        return m.group(1) if m else ""

    def _resolving(self, side: str) -> bool:
        """Whether ``side`` has a neighbour entry still being resolved (``INCOMPLETE``)."""
        return bool(_run("ip", "-n", self.ns[side], "neigh", "show", "dev", IFACES[side], "nud",
                         "incomplete").stdout.strip())

    def set_rate(self, rate: str, side: str = "both") -> None:
        """Change the cap in place (mid-transfer: packets already queued stay queued)."""
        parse_rate(rate)
        for s in self._sides(side):
            self._tbf(s, "change", rate)

    def set_mtu(self, mtu: int, side: str = "both") -> None:
        for s in self._sides(side):
            _run("ip", "-n", self.ns[s], "link", "set", "dev", IFACES[s], "mtu", str(int(mtu)))

    def set_mtu_probing(self, value: int) -> None:
        """``net.ipv4.tcp_mtu_probing`` in both namespaces (0: off, the kernel's default;
        1: on once a black hole is suspected; 2: always). TCP reads it at each
        retransmission timeout, so it applies to connections already open."""
        if value not in (0, 1, 2) or isinstance(value, bool):
            raise ValueError(f"tcp_mtu_probing must be 0, 1 or 2, got {value!r}")
        for side in ("p", "d"):
            _run("ip", "netns", "exec", self.ns[side], "sh", "-c",
                 f"echo {value} > /proc/sys/net/ipv4/tcp_mtu_probing")

    def _sides(self, side: str) -> List[str]:
        if side == "both":
            return ["p", "d"]
        if side not in self.ns:
            raise ValueError(f"side must be 'p', 'd' or 'both', got {side!r}")
        return [side]

    def sent_bytes(self, side: str = "p") -> int:
        """Bytes that left ``side``'s veth through its tbf so far (tc statistics)."""
        out = _run("ip", "netns", "exec", self.ns[side], "tc", "-s", "qdisc", "show", "dev", IFACES[side]).stdout
        m = re.search(r"Sent (\d+) bytes", out)
        return int(m.group(1)) if m else 0

    # ------------------------------------------------------------ clean-up
    def close(self) -> None:
        for hosts in self.hosts.values():
            for h in hosts:
                try:
                    h.stop()
                except Exception:
                    pass
        self.hosts = {"p": [], "d": []}
        for ns in self._made:
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
        self._made = []
        self._started = False
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> "TwoHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for net in list(_live):
        net.close()


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    """``setns(fd, CLONE_NEWNET)`` for the calling thread."""
    from .. import native

    native.setns(fd, _CLONE_NEWNET)


def wait_for(predicate, timeout: float, what: str, step: float = 0.002) -> None:
    """Poll ``predicate`` until true; ``timeout`` is a hang guard (raises TimeoutError)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(step)
