"""D's side-channel client in the arena connector: every question in flight at once, one thread.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. The messages
are :mod:`kvcopy.vllm.arena.channel`'s.

One thread (``kvcopy-arena-fetch``) runs a ZMQ poller over every exchange in flight, a
REQ socket each (one request, one reply; a REQ socket that timed out cannot be reused).
Nothing waits on one P or one request: a P that answers ``pending`` is asked again after
a backoff (:data:`POLL_MIN_S` doubling to :data:`POLL_MAX_S`) while other requests'
questions go out and come back, and a P that does not answer holds only its own
exchanges, each for :data:`EXCHANGE_TIMEOUT_S` at most; a fetch asks again after an
exchange that got no answer in time, until the fetch's deadline (a listener held up
past 5 s, seen once in CI under load, failed every fetch waiting on it; an error other
than the timeout, such as a malformed reply, still fails the fetches it concerns). (With a pool of threads that
each held a request while P said ``pending``, four requests P could stage only after D
read a fifth held every thread, and the fifth's fetch waited behind them until P's stage
timeout failed all four.) A fetch's deadline starts when it is submitted: its work
starts then.

* :meth:`SideChannel.fetch`: for each P rank, its handshake (cached per engine and rank,
  one question in flight per rank whoever waits for it), then, unless only the
  handshakes are wanted, the records, asked again while P says ``pending``, until the
  deadline; the requests due from one P go in one question (up to
  :data:`~kvcopy.vllm.arena.channel.MAX_BATCH`), one such question in flight per P and
  at most one per :data:`RECORDS_INTERVAL_S`, so P's listener gets at most 100 questions
  a second from a D, however many requests wait. The caller polls :attr:`Fetch.done`;
  :attr:`Fetch.metadata` fills as the handshakes arrive.
* :meth:`SideChannel.give_up`: one give-up question; its outcome is only logged.
* :meth:`SideChannel.ask`: any other question (P's worker taking its give-ups, and its
  reservations by long-poll, woken by ``on_done``; D's RESERVE, asked again after an
  exchange with no answer until the push's deadline, its copies counted on the
  :class:`Reply`).
* With a key, every question is wrapped with a challenge of P's (a pool per P, refilled
  by each keyed reply; a ``HELLO`` first when it is empty) and every reply checked.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path

from .channel import (
    CHALLENGE_TTL_S, GIVEUP_MSG, HELLO_MSG, MAX_BATCH, MAX_METADATA_REPLY, MAX_QUESTION_BYTES, MAX_RECORDS_REPLY,
    RECORDS_MSG, RecordsReply, batch_of, challenge_of, decode_bounded, metadata_of, ok_of, unwrap, wrap,
)

logger = init_logger("vllm.kvcopy")

EXCHANGE_TIMEOUT_S = 5.0  # one question to P's side channel
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05  # asking again while P says "pending"
# Per P: one records question in flight, at most one per this long (at most 100 a
# second from a D, whatever the number of requests waiting and their backoff phases).
RECORDS_INTERVAL_S = 0.01
IDLE_WAKE_S = 1.0  # the loop's longest sleep with nothing in flight (it also wakes on new work)
POOL_PER_P = 64  # challenges kept per P; kept for half their life on P
_Endpoint = Tuple[str, int]


@dataclass
class Fetch:
    """One request's fetch. Written by the client's thread; read by others once ``done``
    (``metadata`` as it fills)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    ranks: Tuple[int, ...]
    deadline: float
    records_wanted: bool = True
    metadata: Dict[int, bytes] = field(default_factory=dict)  # P rank -> handshake bytes
    reply: Optional[RecordsReply] = None  # "ready"
    asked: float = 0.0  # monotonic, before the question whose reply brought the records
    error: Optional[Exception] = None
    done: bool = False
    next_ask: float = 0.0  # the loop's own from here on
    backoff: float = POLL_MIN_S
    asking: bool = False

    @property
    def endpoint(self) -> _Endpoint:
        return (self.host, self.port)


@dataclass
class Reply:
    """One question's outcome: ``parts`` or ``error``, once ``done``. Asked with ``until``
    (:meth:`SideChannel.ask`), ``copies`` counts the copies asked (at least those that
    reached the wire: a keyed copy whose ``HELLO`` timed out counts too; final once ``done``)."""

    done: bool = False
    parts: Optional[List[bytes]] = None
    error: Optional[Exception] = None
    copies: int = 1
    until: float = 0.0  # ask again after an unanswered exchange while before this (monotonic)

    def stop_asking(self) -> None:
        """No more copies after the exchange in flight (the asker no longer wants the answer)."""
        self.until = 0.0


@dataclass
class _Exchange:
    endpoint: _Endpoint
    question: bytes  # the unkeyed question
    on_reply: Callable[[List[bytes]], None]
    on_error: Callable[[Exception], None]
    deadline: float
    max_bytes: int
    nonce: Optional[bytes] = None  # keyed: D's nonce of the wrapped question
    hello: bool = False  # keyed: this is the HELLO before the question
    retried: bool = False  # keyed: asked again with a fresh challenge (P dropped the pooled one)


class SideChannel:
    """D's client of P's side channels (see the module docstring)."""

    def __init__(self, key: Optional[bytes], compat: str):
        self.key, self.compat = key, compat
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._inbox: Deque[Callable[[], None]] = deque()
        self._stop = threading.Event()
        self._closed = False
        self._wake_addr = f"inproc://kvcopy-arena-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._metadata: Dict[Tuple[str, int], bytes] = {}  # (engine, P rank) -> handshake bytes (lock)
        # the loop's own
        self._fetches: List[Fetch] = []
        self._exchanges: Dict[zmq.Socket, _Exchange] = {}
        self._poller = zmq.Poller()
        self._meta_asking: Dict[Tuple[str, int], Set[int]] = {}  # (engine, rank) -> fetches waiting (by id)
        self._pool: Dict[_Endpoint, Deque[Tuple[bytes, float]]] = {}
        self._records_asked: Dict[_Endpoint, float] = {}  # when the last records question went
        self._records_busy: Set[_Endpoint] = set()  # a records question in flight
        self.asked_again = 0  # copies :meth:`ask` sent after an exchange got no answer in time
        self._thread = threading.Thread(target=self._run, name="kvcopy-arena-fetch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread
    def fetch(self, engine_id: str, host: str, port: int, request_id: str, ranks: Sequence[int], timeout_s: float,
              records: bool = True) -> Fetch:
        f = Fetch(engine_id, host, port, request_id, tuple(ranks), time.monotonic() + timeout_s, records)
        self._post(lambda: self._fetches.append(f))
        return f

    def give_up(self, host: str, port: int, request_id: str, ranks: Sequence[int], reader: str, d_tp: int) -> None:
        question = msgspec.msgpack.encode((GIVEUP_MSG, request_id, list(ranks), reader, d_tp))
        where = f"{host}:{port}"

        def done(parts):
            ok_of(parts, where)

        def failed(exc):
            logger.info("kvcopy arena: telling P at %s that request %s is given up failed: %s", where, request_id, exc)
        self._post(lambda: self._ask((host, port), question, _checked(done, failed), failed,
                                     time.monotonic() + EXCHANGE_TIMEOUT_S, 4096))

    def ask(self, host: str, port: int, question: bytes, max_bytes: int,
            on_done: Optional[Callable[[], None]] = None, until: float = 0.0, what: str = "a question") -> Reply:
        """One question; its :class:`Reply` fills on the client's thread, which then calls
        ``on_done`` (it must be quick and never raise: P's worker wakes a thread with it).
        An exchange that got no answer in time is asked again, the same question, while
        ``time.monotonic()`` is before ``until`` and :meth:`Reply.stop_asking` was not
        called; the peer must take a copy it gets twice as one question (D's RESERVE:
        :mod:`kvcopy.vllm.arena.push_recv`). ``what``: the question, in the log."""
        out = Reply(until=until)
        endpoint = (host, port)

        def done(parts):
            out.parts = parts
            out.done = True
            if on_done is not None:
                on_done()

        def failed(exc):
            # ``until`` may be cleared by another thread just after this read: one more
            # copy then, counted before ``done``, which the asker's rule for copies covers
            if isinstance(exc, TimeoutError) and time.monotonic() < out.until:
                out.copies += 1
                self.asked_again += 1
                logger.info("kvcopy arena: P at %s:%d did not answer %s (%s): asking again", host, port, what, exc)
                self._ask(endpoint, question, done, failed, time.monotonic() + EXCHANGE_TIMEOUT_S, max_bytes)
                return
            out.error = exc
            out.done = True
            if on_done is not None:
                on_done()
        self._post(lambda: self._ask(endpoint, question, done, failed, time.monotonic() + EXCHANGE_TIMEOUT_S,
                                     max_bytes))
        return out

    def forget(self, engine_id: str, ranks: Sequence[int]) -> None:
        """Ask these P ranks for their handshake again next time (P may have restarted)."""
        with self._lock:
            for r in ranks:
                self._metadata.pop((engine_id, r), None)

    def cached(self, engine_id: str, rank: int) -> Optional[bytes]:
        with self._lock:
            return self._metadata.get((engine_id, rank))

    def close(self) -> None:
        """Stop the thread (exchanges in flight are dropped), then the sockets."""
        self._stop.set()
        self._post(lambda: None)
        self._thread.join(30)
        with self._lock:
            self._closed = True
            self._wake_tx.close(linger=0)
        self._ctx.destroy(linger=0)

    def _post(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            self._inbox.append(work)
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # the loop is behind: it reads the inbox anyway
                pass

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        self._poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception:  # noqa: BLE001 -- a bug must not stop every fetch: fail what is in flight
                    logger.exception("kvcopy arena: D's side-channel client failed; failing its fetches")
                    self._drop_all(RuntimeError("D's side-channel client failed (see the log)"))
        finally:
            self._drop_all(RuntimeError("the connector is shutting down"))
            self._wake_rx.close(linger=0)

    def _turn(self) -> None:
        with self._lock:
            work, self._inbox = list(self._inbox), deque()
        for w in work:
            w()
        now = time.monotonic()
        due: Dict[_Endpoint, List[Fetch]] = {}
        for f in list(self._fetches):
            if self._advance(f, now):
                due.setdefault(f.endpoint, []).append(f)
        wake = [x.deadline for x in self._exchanges.values()] + [f.deadline for f in self._fetches]
        for endpoint, fetches in due.items():
            allowed = self._records_asked.get(endpoint, 0.0) + RECORDS_INTERVAL_S
            if endpoint in self._records_busy:
                continue  # asked when it comes back
            if now < allowed:
                wake.append(allowed)
                continue
            self._ask_records(endpoint, fetches)
        wake += [f.next_ask for f in self._fetches if not f.asking and f.next_ask > now]
        timeout = min([IDLE_WAKE_S] + [max(0.0, t - now) for t in wake])
        for sock, _ in self._poller.poll(int(timeout * 1000) + 1):
            if sock is self._wake_rx:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
                continue
            self._reply(sock)
        now = time.monotonic()
        for sock, x in list(self._exchanges.items()):
            if now >= x.deadline:
                self._end(sock)
                x.on_error(TimeoutError(f"P's side channel {x.endpoint[0]}:{x.endpoint[1]} did not answer "
                                        f"within {EXCHANGE_TIMEOUT_S:g} s"))

    def _advance(self, f: Fetch, now: float) -> bool:
        """Move ``f`` on; whether its records are due to be asked for now."""
        if f.done:
            self._fetches.remove(f)
            return False
        if now >= f.deadline:
            what = "records" if f.metadata.keys() >= set(f.ranks) else "handshake"
            self._finish(f, TimeoutError(f"no {what} from P within the fetch timeout"))
            return False
        missing = [r for r in f.ranks if r not in f.metadata]
        for r in missing:
            md = self.cached(f.engine_id, r)
            if md is not None:
                f.metadata[r] = md
            elif (f.engine_id, r) not in self._meta_asking:
                self._meta_asking[(f.engine_id, r)] = {id(f)}
                self._ask_metadata(f, r)
            else:
                self._meta_asking[(f.engine_id, r)].add(id(f))
        if any(r not in f.metadata for r in f.ranks):
            return False
        if not f.records_wanted:
            self._finish(f, None)
            return False
        return not f.asking and now >= f.next_ask

    def _ask_metadata(self, f: Fetch, rank: int) -> None:
        key = (f.engine_id, rank)
        where = f"{f.host}:{f.port}"

        def done(parts):
            md = metadata_of(parts, where, self.compat)
            with self._lock:
                self._metadata[key] = md
            self._meta_asking.pop(key, None)

        def failed(exc):
            waiting = self._meta_asking.pop(key, set())
            if isinstance(exc, TimeoutError):  # no answer in time: the fetches waiting ask again until their deadline
                if any(id(g) in waiting for g in self._fetches):  # (a fetch past its deadline has left the list)
                    logger.info("kvcopy arena: P at %s did not answer the handshake question of rank %d (%s): "
                                "asking again", where, rank, exc)
                return
            for g in self._fetches:
                if id(g) in waiting:
                    self._finish(g, exc)
        self._ask(f.endpoint, msgspec.msgpack.encode((GET_META_MSG, 0, rank)), _checked(done, failed), failed,
                  time.monotonic() + EXCHANGE_TIMEOUT_S, MAX_METADATA_REPLY)

    def _ask_records(self, endpoint: _Endpoint, fetches: List[Fetch]) -> None:
        """One question for up to :data:`MAX_BATCH` requests due from one P (at most
        half of P's question limit in request ids); the rest go in the next."""
        batch: List[Fetch] = []
        size = 0
        for f in fetches:
            cost = len(f.request_id) + 8 * len(f.ranks) + 16
            if batch and (len(batch) == MAX_BATCH or size + cost > MAX_QUESTION_BYTES // 2):
                break
            batch.append(f)
            size += cost
        self._ask_batch(endpoint, batch)

    def _ask_batch(self, endpoint: _Endpoint, batch: List[Fetch]) -> None:
        asked = time.monotonic()
        where = f"{endpoint[0]}:{endpoint[1]}"
        self._records_asked[endpoint] = asked
        self._records_busy.add(endpoint)
        for f in batch:
            f.asking = True

        def done(parts):
            self._records_busy.discard(endpoint)
            replies = batch_of(parts, [f.ranks for f in batch], where)
            for f, reply in zip(batch, replies):
                f.asking = False
                if f.done:  # its deadline passed meanwhile
                    continue
                if isinstance(reply, Exception):
                    self._finish(f, reply)
                elif reply.state == "ready":
                    f.reply, f.asked = reply, asked
                    self._finish(f, None)
                elif reply.state != "pending":
                    self._finish(f, RuntimeError(f"P {reply.state}: {reply.error}"))
                else:
                    f.next_ask = time.monotonic() + f.backoff
                    f.backoff = min(2 * f.backoff, POLL_MAX_S)

        def failed(exc):
            self._records_busy.discard(endpoint)
            if isinstance(exc, TimeoutError) and not all(f.done for f in batch):
                logger.info("kvcopy arena: P at %s did not answer the records question of %d request(s) (%s): "
                            "asking again", where, len(batch), exc)
            for f in batch:
                f.asking = False
                if not isinstance(exc, TimeoutError):  # else asked again at the next turn, until its deadline
                    self._finish(f, exc)
        question = msgspec.msgpack.encode((RECORDS_MSG, [[f.request_id, list(f.ranks)] for f in batch]))
        self._ask(endpoint, question, _checked(done, failed), failed, asked + EXCHANGE_TIMEOUT_S, MAX_RECORDS_REPLY)

    def _finish(self, f: Fetch, error: Optional[Exception]) -> None:
        if f.done:
            return
        f.error = error
        f.done = True
        if f in self._fetches:
            self._fetches.remove(f)

    def _drop_all(self, error: Exception) -> None:
        """End every exchange and fetch with ``error`` (not a timeout: nothing is asked
        again), so that no :class:`Reply` stays not ``done`` (D's CANCEL waits for its
        RESERVE's)."""
        for sock in list(self._exchanges):
            x = self._end(sock)
            if x is not None:
                try:
                    x.on_error(error)
                except Exception:  # noqa: BLE001 -- the others must still end
                    logger.exception("kvcopy arena: ending a side-channel question failed")
        for f in list(self._fetches):
            self._finish(f, error)
        self._meta_asking.clear()
        self._records_busy.clear()

    # ------------------------------------------------------------ exchanges
    def _ask(self, endpoint: _Endpoint, question: bytes, on_reply, on_error, deadline: float, max_bytes: int) -> None:
        x = _Exchange(endpoint, question, on_reply, on_error, deadline, max_bytes)
        try:
            if self.key is None:
                self._send(x, question)
                return
            challenge = self._challenge(endpoint)
            if challenge is None:
                x.hello = True
                self._send(x, msgspec.msgpack.encode((HELLO_MSG,)), 1024)
            else:
                self._send_wrapped(x, challenge)
        except Exception as exc:  # noqa: BLE001 -- an address ZMQ refuses (from a request's params): this question fails
            on_error(exc)

    def _send_wrapped(self, x: _Exchange, challenge: bytes) -> None:
        assert self.key is not None
        data, x.nonce = wrap(self.key, challenge, x.question)
        x.hello = False
        self._send(x, data)

    def _send(self, x: _Exchange, data: bytes, max_bytes: Optional[int] = None) -> None:
        sock = self._ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_bytes or x.max_bytes + 4096)
            sock.connect(make_zmq_path("tcp", *x.endpoint))
            sock.send(data)
        except BaseException:
            sock.close(linger=0)
            raise
        self._exchanges[sock] = x
        self._poller.register(sock, zmq.POLLIN)

    def _end(self, sock) -> Optional[_Exchange]:
        x = self._exchanges.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)
        return x

    def _reply(self, sock) -> None:
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            x = self._end(sock)
            if x is not None:
                x.on_error(exc)
            return
        x = self._end(sock)
        if x is None:
            return
        if self.key is None:
            x.on_reply(parts)
            return
        where = f"P at {x.endpoint[0]}:{x.endpoint[1]}"
        try:
            if x.hello:
                self._send_wrapped(x, challenge_of(parts))
                return
            assert x.nonce is not None
            inner, nxt = unwrap(self.key, x.nonce, parts, f"reply from {where}")
        except Exception as exc:  # noqa: BLE001 -- a peer's reply: whatever it makes the checks raise fails it
            if not x.retried and _stale_challenge(parts):  # P restarted, or dropped it: once more, fresh
                x.retried = x.hello = True
                self._send(x, msgspec.msgpack.encode((HELLO_MSG,)), 1024)
                return
            x.on_error(exc)
            return
        self._keep(x.endpoint, nxt)
        x.on_reply(inner)

    def _challenge(self, endpoint: _Endpoint) -> Optional[bytes]:
        pool = self._pool.get(endpoint)
        now = time.monotonic()
        while pool:
            c, got = pool.popleft()
            if now - got < CHALLENGE_TTL_S / 2:
                return c
        return None

    def _keep(self, endpoint: _Endpoint, challenge: bytes) -> None:
        pool = self._pool.setdefault(endpoint, deque())
        pool.append((challenge, time.monotonic()))
        while len(pool) > POOL_PER_P:
            pool.popleft()


def _stale_challenge(parts: List[bytes]) -> bool:
    """P's plain refusal of a challenge it no longer knows."""
    try:
        (d,) = [decode_bounded(p, 4096, "reply") for p in parts]
    except ValueError:
        return False
    return isinstance(d, dict) and "challenge" in str(d.get("error", ""))


def _checked(on_reply: Callable[[List[bytes]], None], on_error: Callable[[Exception], None]
             ) -> Callable[[List[bytes]], None]:
    """``on_reply``, with whatever it raises on a peer's reply passed to ``on_error``."""
    def run(parts: List[bytes]) -> None:
        try:
            on_reply(parts)
        except Exception as exc:  # noqa: BLE001 -- a peer's reply: any check failing fails the request
            on_error(exc)
    return run
