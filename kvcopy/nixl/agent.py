"""The NIXL agent, wrapped: import by either wheel name, and errors as values.

``nixl-cu12`` installs the module ``nixl_cu12`` (``nixl-cu13``: ``nixl_cu13``); the
``nixl`` meta package exposes ``nixl`` (its API in ``nixl._api``). :func:`load_nixl`
takes the first module, in that order, that has ``nixl_agent``.

NIXL reports failures by raising its own exception classes from the bindings
(``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...), from ``check_xfer_state``
too, not only by returning ``"ERR"``. :class:`Agent` funnels them into two shapes:

* set-up calls (register, add a peer, prepare descriptor lists) raise
  :class:`NixlError`, a ``RuntimeError`` naming the call and NIXL's status;
* transfer calls (post, state, release) return a state string and a reason, so a
  failed transfer is a value the manager reports per request, never an exception
  that escapes ``poll``.

Descriptor lists are numpy ``[N, 3]`` uint64 arrays of (address, bytes, device id).

Peers' agents are *parked*, not unloaded, when the manager stops using them
(:meth:`Agent.release_remote`): with NIXL 1.5 over UCX, unloading the agent of a peer
that is still alive (``remove_remote_agent``) leaves its UCX endpoint, and one TCP
socket on each side, open until the peer dies (UCX closes an endpoint with error
handling only when the connection breaks; NIXL issue #2025), so every add/remove cycle
of a live peer leaked two loopback sockets. A parked agent is no peer: nothing reads
from it, and it is taken up again only by byte-identical metadata (then re-validated
in full by ``add_peer``); different metadata under its name unloads it first (a
restarted peer). At most :data:`MAX_PARKED` are kept (the oldest is unloaded); all go
with the agent.

A peer whose connection NIXL reported failed is unloaded, not parked. NIXL's UCX plugin
reports an endpoint UCX failed (reset, not connected, endpoint timeout: TCP's user
timeout or keepalive gave up) as ``NIXL_ERR_REMOTE_DISCONNECT`` (:data:`DISCONNECTED`),
from a READ's state, from posting a READ on that endpoint and from sending a
notification on it, and never reconnects: a parked agent taken up again would fail
every READ at once, also once the peer is reachable again. So the wrapper charges such
a status to the peer it came from (each posted READ is a :class:`Transfer` that knows
its peer and which load of that peer's metadata it went through; a status from an
earlier load, now unloaded, is charged to nothing), and :meth:`Agent.release_remote`
then unloads the agent (nothing leaks: the endpoint is already closed), so the next
``add_remote`` of the same metadata builds a new connection. A peer that fails after it
was parked (a READ given up on ends later) is unloaded when it is taken up again.

Progress thread: NIXL's Python wrapper starts every agent's progress thread with a
poll delay of 0, so each idle agent busy-polls one CPU. The thread already wakes on
UCX's event fd when there is work, so :class:`Agent` gives it a delay
(``progress_delay_us``, default :data:`PROGRESS_DELAY_US`): idle agents then use no
CPU, and transfers and copies beside them keep the cores (the figures, from
``bench/nixl_progress_delay.py``: ``docs/nixl.md``, "Progress thread").
The delay is also the longest the thread sleeps between
unprompted progress calls (UCX keepalive, failure detection). ``0`` restores NIXL's
busy polling. NIXL's wrapper has no knob for it: the delay is set on the binding's
agent config while the wrapper builds the agent (:func:`make_agent`).

Thread priority (``nixl_thread_nice``, default 0: unchanged): the threads NIXL and UCX
start while an agent is built (the progress thread and UCX's ``async`` thread) get that
nice value. Woken by a WRITE, the progress thread takes the CPU from the thread that
posted it where the two share one (a push's first WRITE after P's prefill: 1-5 ms more,
docs/vllm.md, "The first WRITE after the prefill end stalls"); at nice 19 it runs only
where the CPU has time to spare, which is also when a P serves a READ over TCP (a
software GET its progress thread sends): 3-31x slower pulls from a busy P, hence the
default (docs/nixl.md, "Progress thread").

Logging: NIXL's Python logger prints an ``INFO`` line to stdout for every agent and
backend it creates. kvcopy sets that logger to ``WARNING`` when it loads NIXL, unless
``NIXL_LOG_LEVEL`` (NIXL's own knob, which then applies) or ``KVCOPY_VERBOSE=1`` is set.
"""
from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from types import ModuleType
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

_MODULE_NAMES = ("nixl", "nixl_cu12", "nixl_cu13")
PROGRESS_DELAY_US = 100_000  # the progress thread's poll timeout (module docstring)
MAX_NICE = 19  # the lowest priority; below 0 would need privileges and take CPU from the engine
_build_lock = threading.Lock()
MAX_PARKED = 64  # peers' agents kept loaded after their last use (see the module docstring)
DISCONNECTED = "NIXL_ERR_REMOTE_DISCONNECT"  # NIXL's status for a connection UCX failed (module docstring)
_module: Optional[ModuleType] = None
_import_error: Optional[str] = None


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the call and NIXL's status."""


class BackendUnavailable(NixlError, ValueError):
    """A backend name no plugin here serves: bad input (a ``ValueError``) as well."""


def load_nixl() -> ModuleType:
    """The NIXL Python module (``nixl``, ``nixl_cu12`` or ``nixl_cu13``)."""
    global _module, _import_error
    if _module is not None:
        return _module
    errors = []
    for name in _MODULE_NAMES:
        for candidate in (name, f"{name}._api"):  # the meta package keeps the API in nixl._api
            try:
                mod = importlib.import_module(candidate)
            except ImportError as exc:
                errors.append(f"{candidate}: {exc}")
                break
            if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
                _quiet_nixl_logging()
                _module = mod
                return mod
            errors.append(f"{candidate}: has no nixl_agent")
    _import_error = "; ".join(errors)
    raise ImportError(
        "kvcopy.nixl needs NIXL: pip install nixl-cu12 (or nixl-cu13, or nixl). " + _import_error
    )


def _quiet_nixl_logging() -> None:
    """NIXL's INFO lines off by default, on request loud (see the module doc)."""
    if os.environ.get("NIXL_LOG_LEVEL") or os.environ.get("KVCOPY_VERBOSE", "") not in ("", "0"):
        return
    logging.getLogger("nixl").setLevel(logging.WARNING)


def nixl_available() -> Optional[str]:
    """None when NIXL imports, else why not."""
    try:
        load_nixl()
    except ImportError as exc:
        return str(exc)
    return None


_MD_PREFIX = b"nixlSerDes|Agent"


def metadata_name(blob: bytes) -> Optional[str]:
    """The agent name NIXL agent metadata starts with (NIXL 1.5's serialization:
    ``nixlSerDes|Agent`` then a u64 length and the name), or None where the bytes are
    not in that form: the manager then checks the name NIXL reports after loading."""
    if not blob.startswith(_MD_PREFIX) or len(blob) < len(_MD_PREFIX) + 8:
        return None
    n = int.from_bytes(blob[len(_MD_PREFIX):len(_MD_PREFIX) + 8], "little")
    start = len(_MD_PREFIX) + 8
    if n > 4096 or len(blob) < start + n:
        return None
    try:
        return blob[start:start + n].decode()
    except UnicodeDecodeError:
        return None


def _status(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if text.startswith("NIXL") else f"{type(exc).__name__}: {text}"


def make_agent(nixl: ModuleType, name: str, backends: List[str], delay_us: int, nice: int = 0):
    """``nixl.nixl_agent(name, config)`` with the progress thread's poll delay set to
    ``delay_us``: the wrapper hard-codes 0, so its binding constructor is wrapped for
    the duration of this one call (under a lock, so kvcopy builds its agents one at a
    time; another thread building a NIXL agent directly inside that window gets the same
    delay, which does it no harm). A wrapper that builds its agent some other way (a
    later NIXL) gets NIXL's own delay, with a warning: the agent works, its idle
    progress thread busy-polls. ``nice`` (0-19): the priority of the threads that
    appeared while it was built (Linux; under the same lock, so another library's thread
    started in that window would get it too)."""
    wrapper = sys.modules.get(getattr(nixl.nixl_agent, "__module__", ""), nixl)  # nixl_cu12._api
    binding = getattr(wrapper, "nixlBind", None)
    real = getattr(binding, "nixlAgent", None)
    if binding is None or real is None:
        raise NixlError(f"{wrapper.__name__} builds its agents without a binding module (nixlBind) "
                        "in reach: this kvcopy cannot set the progress-thread delay on this NIXL")
    applied = []

    def with_delay(agent_name, config, *args, **kwargs):
        config.pthrDelay = delay_us
        applied.append(True)
        return real(agent_name, config, *args, **kwargs)

    with _build_lock:
        binding.nixlAgent = with_delay
        before = _thread_ids() if nice else set()
        try:
            agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=backends))
        finally:
            binding.nixlAgent = real
        for tid in (_thread_ids() - before) if nice else ():
            try:  # never above the priority it inherited (raising one needs privileges)
                os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
            except ProcessLookupError:  # it ended already
                pass
    if not applied and delay_us:
        logging.getLogger("kvcopy.nixl").warning(
            "%s built NIXL agent %r without %s.nixlAgent: its progress thread keeps NIXL's own poll "
            "delay (0: busy polling), not progress_delay_us=%d", wrapper.__name__, name,
            getattr(binding, "__name__", "nixlBind"), delay_us)
    return agent


def _thread_ids() -> Set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class Transfer:
    """A posted READ: NIXL's transfer handle, the peer it reads from, and which load of
    that peer's metadata (``Agent``'s count) its connection belongs to."""

    __slots__ = ("handle", "peer", "load")

    def __init__(self, handle, peer: Optional[str], load: Optional[int]):
        self.handle, self.peer, self.load = handle, peer, load

    def release(self) -> None:
        self.handle.release()


class RemoteList:
    """A peer's prepared descriptor list (``prep_xfer_dlist``), with the peer and load
    it was prepared for, so a READ posted from it is charged to that peer."""

    __slots__ = ("dlist", "peer", "load")

    def __init__(self, dlist, peer: str, load: Optional[int]):
        self.dlist, self.peer, self.load = dlist, peer, load

    def release(self) -> None:
        self.dlist.release()


class Agent:
    """One NIXL agent with the backends it was asked for."""

    def __init__(self, name: str, backends: Tuple[str, ...] = ("UCX",),
                 progress_delay_us: int = PROGRESS_DELAY_US, nixl_thread_nice: int = 0):
        nixl = load_nixl()
        if not name:
            raise ValueError("a NIXL agent needs a non-empty name")
        if isinstance(progress_delay_us, bool) or not isinstance(progress_delay_us, int) \
                or not 0 <= progress_delay_us <= 10_000_000:
            raise ValueError(f"progress_delay_us must be an int in [0, 10 s], got {progress_delay_us!r}")
        if isinstance(nixl_thread_nice, bool) or not isinstance(nixl_thread_nice, int) \
                or not 0 <= nixl_thread_nice <= MAX_NICE:
            raise ValueError(f"nixl_thread_nice must be an int in [0, {MAX_NICE}], got {nixl_thread_nice!r}")
        self.name = name
        try:
            self._agent = make_agent(nixl, name, list(backends), progress_delay_us, nixl_thread_nice)
        except Exception as exc:
            raise NixlError(f"creating NIXL agent {name!r}: {_status(exc)}") from exc
        self._loaded: Dict[str, bytes] = {}  # peers' agents this wrapper loaded: name -> metadata
        self._parked: "OrderedDict[str, None]" = OrderedDict()  # loaded, in use by no peer; oldest first
        self._failed: set = set()  # agent names whose metadata NIXL failed to load
        self._loads = itertools.count()
        self._load_of: Dict[str, int] = {}  # loaded peer -> which load its connection came from
        self._disconnected: Set[str] = set()  # loaded peers whose connection NIXL reported failed
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise BackendUnavailable(
                f"NIXL agent {name!r}: backend(s) {missing} unavailable; plugins here: "
                f"{self._agent.get_plugin_list()}"
            )

    # ---------------------------------------------------------------- set-up
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def register(self, ranges: List[Tuple[int, int, int]], mem_type: str):
        """Register (address, bytes, device id) ranges; returns the registration."""
        try:
            return self._agent.register_memory([(a, n, d, "") for a, n, d in ranges], mem_type)
        except Exception as exc:
            raise NixlError(f"registering {len(ranges)} {mem_type} range(s): {_status(exc)}") from exc

    def deregister(self, registration) -> None:
        self._agent.deregister_memory(registration)

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (or take up its parked agent); returns its name."""
        wanted = metadata_name(metadata)
        if wanted is not None and wanted in self._parked:
            if self._loaded.get(wanted) == metadata and self.has_remote(wanted) \
                    and wanted not in self._disconnected:
                del self._parked[wanted]
                return wanted
            self.unload_remote(wanted)  # a restarted peer, a failed connection, or unloaded behind our back
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            # NIXL 1.5 keeps the UCX connection of metadata whose memory sections fail
            # to load, and no API call removes it: the name stays refused.
            hint = (f"; earlier metadata for agent {wanted!r} failed to load, and NIXL may keep a "
                    "half-loaded connection under that name that only a new agent clears"
                    if wanted in self._failed else "")
            if wanted is not None:
                self._failed.add(wanted)
            raise NixlError(f"loading the peer's NIXL agent metadata: {_status(exc)}{hint}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._failed.discard(name)
        self._loaded[name] = bytes(metadata)
        self._load_of[name] = next(self._loads)
        self._disconnected.discard(name)
        self._parked.pop(name, None)
        return name

    def release_remote(self, name: str) -> None:
        """The manager no longer uses this peer's agent: park it (module docstring);
        an agent this wrapper did not load (a failed load), or whose connection NIXL
        reported failed, is unloaded."""
        if name not in self._loaded or name in self._disconnected:
            self.unload_remote(name)
            return
        self._parked[name] = None
        self._parked.move_to_end(name)
        while len(self._parked) > MAX_PARKED:
            self.unload_remote(next(iter(self._parked)))

    def unload_remote(self, name: str) -> None:
        """Unload a peer's agent from NIXL (``remove_remote_agent``)."""
        self._parked.pop(name, None)
        self._loaded.pop(name, None)
        self._load_of.pop(name, None)
        self._disconnected.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already gone: nothing left to remove
            pass

    @property
    def parked(self) -> Tuple[str, ...]:
        return tuple(self._parked)

    def connection_failed(self, name: str) -> bool:
        """Whether NIXL reported the connection to loaded peer ``name`` failed
        (:data:`DISCONNECTED`): releasing it unloads it (module docstring)."""
        return name in self._disconnected

    def _charge(self, peer: Optional[str], load: Optional[int], reason: Optional[str]) -> None:
        """Note a failed connection of ``peer`` when ``reason`` says so and came through
        the peer's current load (a READ of an unloaded load says nothing of the new one)."""
        if reason is not None and DISCONNECTED in reason and peer is not None \
                and peer in self._loaded and self._load_of.get(peer) == load:
            self._disconnected.add(peer)

    def has_remote(self, name: str) -> bool:
        """Whether NIXL holds metadata of agent ``name`` (leak checks)."""
        try:
            return bool(self._agent.check_remote_metadata(name))
        except Exception:
            return False

    def prep_local(self, descs: np.ndarray, mem_type: str):
        return self._prep("NIXL_INIT_AGENT", descs, mem_type)

    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: str) -> RemoteList:
        return RemoteList(self._prep(peer, descs, mem_type), peer, self._load_of.get(peer))

    def _prep(self, who: str, descs: np.ndarray, mem_type: str):
        try:
            return self._agent.prep_xfer_dlist(who, np.ascontiguousarray(descs, dtype=np.uint64), mem_type)
        except Exception as exc:
            side = "local" if who == "NIXL_INIT_AGENT" else f"peer {who!r}'s"
            raise NixlError(
                f"NIXL rejected {len(descs)} {side} {mem_type} descriptors: {_status(exc)}"
            ) from exc

    @staticmethod
    def release_dlist(dlist) -> None:
        try:
            dlist.release()
        except Exception:
            pass

    # ---------------------------------------------------------------- transfers
    def post_read(self, local_dlist, local_idx: np.ndarray, remote_dlist, remote_idx: np.ndarray,
                  notify: bytes):
        """Create and post a READ from a :meth:`prep_remote` list (or a local one: a
        loopback READ, charged to no peer); returns (:class:`Transfer` or None, state,
        reason)."""
        remote = remote_dlist if isinstance(remote_dlist, RemoteList) else RemoteList(remote_dlist, "", None)
        return self._post(remote.peer or None, remote.load, lambda: self._agent.make_prepped_xfer(
            "READ", local_dlist, local_idx, remote.dlist, remote_idx, notify))

    def post_read_descs(self, local_descs: np.ndarray, local_mem: str, peer: str, remote_descs: np.ndarray,
                        remote_mem: str, notify: bytes, op: str = "READ"):
        """Create and post a READ (or, ``op="WRITE"``, a WRITE of the local rows into the
        remote ones) from explicit (address, bytes, device) rows on both sides (sub-page
        pieces); returns (:class:`Transfer` or None, state, reason)."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, got {op!r}")

        def make():
            local = self._agent.get_xfer_descs(np.ascontiguousarray(local_descs, dtype=np.uint64), local_mem)
            remote = self._agent.get_xfer_descs(np.ascontiguousarray(remote_descs, dtype=np.uint64), remote_mem)
            return self._agent.initialize_xfer(op, local, remote, peer, notify)
        return self._post(peer, self._load_of.get(peer), make)

    def _post(self, peer: Optional[str], load: Optional[int], make):
        try:
            xfer = Transfer(make(), peer, load)
        except Exception as exc:
            reason = f"NIXL rejected the transfer: {_status(exc)}"
            self._charge(peer, load, reason)
            return None, "ERR", reason
        try:
            state = self._agent.transfer(xfer.handle)
        except Exception as exc:
            reason = f"posting the transfer: {_status(exc)}"
            self._charge(peer, load, reason)
            return xfer, "ERR", reason
        return xfer, state, None if state != "ERR" else "NIXL returned ERR when posting"

    def state(self, xfer) -> Tuple[str, Optional[str]]:
        """A posted :class:`Transfer`'s state (``DONE``, ``PROC``, ``ERR``) and why it failed."""
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except Exception as exc:
            reason = f"transfer failed: {_status(exc)}"
            self._charge(xfer.peer, xfer.load, reason)
            return "ERR", reason
        return state, None if state != "ERR" else "transfer state ERR"

    @staticmethod
    def release(handle) -> Optional[str]:
        """Release a transfer handle; None or why it failed. NIXL asks UCX to cancel a
        handle still in flight, which does not stop an RMA read: it may still land
        (docs/nixl.md, "Late READs"); kvcopy releases only handles whose READ ended,
        or at close, just before the agent goes."""
        try:
            handle.release()
        except Exception as exc:
            return _status(exc)
        return None

    def notifications(self) -> Dict[str, List[bytes]]:
        notifs = self._agent.get_new_notifs()
        # a sender's name is the peer's to choose: bytes that are not UTF-8 must not raise here
        return {(k.decode(errors="replace") if isinstance(k, bytes) else k): list(v) for k, v in notifs.items()}

    def send_notification(self, peer: str, message: bytes) -> Optional[str]:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            reason = _status(exc)
            self._charge(peer, self._load_of.get(peer), reason)
            return reason
        return None

    def close(self) -> "weakref.ref":
        """Drop this wrapper's NIXL agent; returns a weak reference to its binding object
        (dead once the C++ agent, with its UCX worker, is destroyed: every transfer
        handle and descriptor list of it must be gone too, as they hold it)."""
        agent, self._agent = self._agent, None
        if agent is None:
            return weakref.ref(_Gone())
        binding = getattr(agent, "agent", None)
        try:
            ref = weakref.ref(binding if binding is not None else agent)
        except TypeError:  # not weak-referenceable: it cannot be shown gone
            keep = agent
            return lambda: keep  # type: ignore[return-value]
        del agent, binding
        return ref


class _Gone:
    """A weak-referenceable object nothing keeps (a closed wrapper's agent)."""
