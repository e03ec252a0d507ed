"""A stand-in for CUDA streams and events on the CPU that writes down what each did.

:class:`RecordedStreams` is a :class:`~kvcopy.nixl.modes.side_stream.StreamOps`: tests
give it to a :class:`~kvcopy.nixl.modes.side_stream.SideStream` (and through
``KvcopyArenaWorker.stream_ops`` to the arena connector) to run the GPU path of
layer-wise staging on CPU tensors and check its order of operations. The copies
themselves run at once on the CPU; what the log records is what a GPU would be told:

* ``("record", event, stream)``, ``("wait_event", stream, event)``,
  ``("wait_stream", stream, other)``, ``("use", stream)`` (made current on a thread),
  ``("synchronize", event)`` (a host wait), ``("enter_thread",)``, ``("destroy",
  stream)`` (:meth:`RecordedStreams.close_stream`), and what a test adds with
  :meth:`note`;
* each entry starts with the name of the thread that made it.

A thread that makes a stream current or waits for an event on the host without having
called :meth:`RecordedStreams.enter_thread` first raises ``AssertionError`` there (on a
GPU it would run on device 0, whatever the KV's device).

Streams are named ``"current"`` (every thread's until one is made current with
:meth:`use`) and ``"side1"``, ``"side2"`` ...; events ``"e1"``, ``"e2"`` ... in creation order.
A stream closed with :meth:`RecordedStreams.close_stream` refuses (``AssertionError``)
to be waited on, to wait, to be made current or to be closed again (on a GPU: a
destroyed stream's handle).
An event is a GPU that is late once: its first :meth:`_Event.query` after it was
recorded says not yet, the next says done; :meth:`_Event.synchronize` (a host wait)
completes it (and raises for an event made without ``blocking``: a real wait for it
would spin a core). ``capture`` True plays a CUDA graph being captured; a ``gate``
(a ``threading.Event``) holds every host wait until it is set: a GPU far behind.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple


class _Stream:
    def __init__(self, ops: "RecordedStreams", name: str):
        self.ops, self.name = ops, name
        self.destroyed = False

    def live(self) -> "_Stream":
        if self.destroyed:
            raise AssertionError(f"{self.name} used after it was destroyed")
        return self

    def wait_event(self, event: "_Event") -> None:
        self.live().ops.note("wait_event", self.name, event.name)

    def wait_stream(self, other: "_Stream") -> None:
        self.live().ops.note("wait_stream", self.name, other.live().name)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class _Event:
    def __init__(self, ops: "RecordedStreams", name: str, blocking: bool):
        self.ops, self.name, self.blocking = ops, name, blocking
        self.recorded = False
        self.done = False
        self._asked = False

    def record(self, stream: _Stream) -> None:
        self.ops.note("record", self.name, stream.live().name)
        self.recorded, self.done, self._asked = True, False, False

    def query(self) -> bool:
        if not self.recorded:
            raise AssertionError(f"{self.name} queried before it was recorded")
        if not self.done and self._asked:
            self.done = True
        self._asked = True
        return self.done

    def synchronize(self) -> None:
        if not self.recorded:
            raise AssertionError(f"{self.name} waited for before it was recorded")
        if not self.blocking:
            raise AssertionError(f"a host wait for {self.name}, made without blocking: it would spin a core")
        self.ops.entered_or_raise(f"a host wait for {self.name}")
        self.ops.note("synchronize", self.name)
        if self.ops.gate is not None:
            self.ops.gate.wait()
        self.done = True

    def __repr__(self) -> str:
        return f"<event {self.name}>"


class RecordedStreams:
    """Streams and events that log what they are told (module docstring)."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, ...]] = []
        self.capture = False
        self.gate: Optional[threading.Event] = None  # set: a host wait blocks until it is (a GPU behind)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._current = _Stream(self, "current")
        self._streams = 0
        self._events = 0
        self.entered: set = set()  # names of the threads that called enter_thread (kept when the log is cleared)

    def note(self, *entry) -> None:
        """Append ``(this thread's name, *entry)`` to the log."""
        with self._lock:
            self.log.append((threading.current_thread().name, *entry))

    def current(self) -> _Stream:
        return getattr(self._local, "stream", self._current)

    def stream(self) -> _Stream:
        with self._lock:
            self._streams += 1
            return _Stream(self, f"side{self._streams}")

    def close_stream(self, stream: _Stream) -> None:
        stream.live().destroyed = True
        self.note("destroy", stream.name)

    def event(self, blocking: bool = False) -> _Event:
        with self._lock:
            self._events += 1
            return _Event(self, f"e{self._events}", blocking)

    def enter_thread(self) -> None:
        name = threading.current_thread().name
        with self._lock:
            self.entered.add(name)
        self.note("enter_thread")

    def entered_or_raise(self, what: str) -> None:
        name = threading.current_thread().name
        with self._lock:
            if name not in self.entered:
                raise AssertionError(f"{what} on {name}, which never called enter_thread (a GPU: device 0)")

    @contextmanager
    def use(self, stream: _Stream) -> Iterator[None]:
        self.entered_or_raise(f"{stream.live().name} made current")
        before = self.current()
        self._local.stream = stream
        self.note("use", stream.name)
        try:
            yield
        finally:
            self._local.stream = before

    def capturing(self) -> bool:
        return self.capture

    def entries(self, kind: str) -> List[Tuple[str, ...]]:
        """The log's entries of one kind (``"record"``, ``"synchronize"`` ...), in order."""
        with self._lock:
            return [e for e in self.log if e[1] == kind]


def noting_copies(ops: RecordedStreams) -> Callable:
    """A stand-in for :meth:`~kvcopy.nixl.modes.partial_stage.StepCopies.run` (a test
    monkeypatches it in) that notes ``("copy", unit, current stream, max_ctas)``, then
    copies."""
    from ..nixl.modes.partial_stage import StepCopies

    real = StepCopies.run

    def run(self, unit: int, max_ctas: Optional[int] = None) -> None:
        ops.note("copy", unit, ops.current().name, max_ctas)
        real(self, unit, max_ctas)
    return run


def check_layerwise_order(log: List[Tuple[str, ...]], side: str, forward: str, cap: int) -> int:
    """Assert the order of a layer-wise GPU path in ``log`` (with :func:`noting_copies`):
    a copy off the forward's thread runs on the ``side`` stream with grid cap ``cap``,
    inside a ``use`` of it just after the side stream waited for an event the forward's
    thread recorded on its current stream: a new one for every ``use``, in the order the
    forward recorded them (each layer's copies wait for that layer's own event, not an
    earlier one); a copy on the forward's thread (the sweep) runs on the current
    stream with the copier's grid, after the current stream last waited for the side
    stream with no side copy since; a host wait (``synchronize``) is never on the
    forward's thread nor on a thread that copies on the side stream, and only for an
    event the copy thread recorded on the side stream right after its copies. Returns
    the count of side copies."""
    recorded: Dict[str, Tuple[str, str]] = {}  # event -> (thread, stream) of its last record
    forward_order: Dict[str, int] = {}  # event the forward's thread recorded -> its place
    previous: Dict[str, Tuple] = {}  # thread -> its entry before this one
    waited = None  # the event the side stream waited for since its last use
    last_waited = -1  # the forward's place of the event the last use waited for
    using: Dict[str, bool] = {}  # thread -> its last side use began right after a new wait
    copiers = {e[0] for e in log if e[1] == "copy" and e[0] != forward}  # threads that copy on the side stream
    side_copies = 0
    joined = False  # the forward's stream waited for the side stream, no side copy since
    for entry in log:
        thread, kind = entry[0], entry[1]
        if kind == "record":
            recorded[entry[2]] = (thread, entry[3])
            if thread == forward and entry[3] == "current":
                forward_order[entry[2]] = len(forward_order)
            if entry[3] == side:  # a layer's event: right after its (last job's) copies, on the copy thread
                before = previous.get(thread)
                assert before is not None and before[1] == "copy" and before[3] == side, (entry, before)
        elif kind == "wait_event":
            assert entry[2] == side and thread != forward, entry
            assert recorded.get(entry[3]) == (forward, "current"), (entry, recorded.get(entry[3]))
            waited = entry[3]
        elif kind == "use" and entry[2] == side:
            assert waited is not None, f"{side} made current with no new wait for a layer's event: {entry}"
            place = forward_order[waited]
            assert place > last_waited, f"{side} waited for {waited}, not after the last use's: {entry}"
            last_waited, waited, using[thread] = place, None, True
        elif kind == "copy" and thread != forward:
            assert entry[3] == side and entry[4] == cap and using.get(thread), entry
            side_copies += 1
            joined = False
        elif kind == "copy":
            assert entry[3] == "current" and entry[4] is None, entry
            assert joined, f"a sweep copy with side copies not joined: {entry}"
        elif kind == "wait_stream":
            assert entry[2:] == ("current", side) and thread == forward, entry
            joined = True
        elif kind == "synchronize":
            assert thread != forward, f"a host wait on the forward's thread: {entry}"
            assert thread not in copiers, f"a host wait on the copy thread: {entry}"
            assert recorded[entry[2]][1] == side, entry
        previous[thread] = entry
    return side_copies
