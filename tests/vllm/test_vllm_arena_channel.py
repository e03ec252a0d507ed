"""kvcopy.vllm.arena.channel and vllm_arena_fetch: P's record store and listener, D's client
and its checks of P's replies, with and without a key (vLLM env; the listener inside real
engines, hostile clients included: tests/vllm/test_vllm_arena_trust.py)."""
from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG, NixlHandshakePayload  # noqa: E402

from kvcopy.vllm.arena.channel import (  # noqa: E402
    AUTH_MSG, GIVEUP_MSG, HELLO_MSG, RECORDS_MSG, TAKE_GIVEUPS_MSG, RecordStore, answer, give_ups_of, question_mac,
    records_of, serve,
)
from kvcopy.vllm.arena.record_client import SideChannel  # noqa: E402
from kvcopy.vllm.arena.meta import KvcopyArenaWorkerMeta  # noqa: E402
from vllm_arena_engines import ask_side_channel, free_port  # noqa: E402

enc = msgspec.msgpack.encode
KEY = b"kvcopy-side-channel-key-01234567"
MALFORMED = {"state": "failed", "records": [], "ttl_left": 0.0, "error": "malformed question"}


def test_record_store_answers():
    s = RecordStore(ttl_s=60, margin_s=5)
    assert s.lookup("r", [0, 1], now=0)["state"] == "pending"  # not reported yet
    s.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"a"}}), now=10)
    assert s.lookup("r", [0, 1], now=11)["state"] == "pending"  # rank 1 still staging
    s.update(KvcopyArenaWorkerMeta(staged={"r": {1: b"b"}}), now=12)
    got = s.lookup("r", [0, 1], now=20)
    assert got["state"] == "ready" and got["records"] == [[0, b"a"], [1, b"b"]] and got["ttl_left"] == 60 - 10 - 5
    assert s.lookup("r", [0, 1], now=66)["state"] == "expired"  # within the margin of P's TTL
    s.update(KvcopyArenaWorkerMeta(released={"r": {1}}), now=21)  # freed: never served again
    assert s.lookup("r", [0, 1], now=22)["state"] == "failed" and s.lookup("r", [0], now=22)["state"] == "ready"
    s.update(KvcopyArenaWorkerMeta(failed={"f": {0: "arena full"}}), now=22)
    assert "arena full" in s.lookup("f", [0], now=23)["error"]
    s.fail("g", "aborted on P")
    assert s.lookup("g", [0])["error"] == "aborted on P"
    s.purge(now=100)
    assert len(s) == 1  # only "g" (reported now) is younger than the TTL
    s.give_up("r", [0, 1], "D-tp0", 2)
    s.give_up("r", [1], "D-tp1", 2)
    s.give_up("q", [1], "D-tp1", 2)
    assert s.take_give_ups(1) == [("r", "D-tp0", 2), ("r", "D-tp1", 2), ("q", "D-tp1", 2)]
    assert s.take_give_ups(0) == [("r", "D-tp0", 2)] and s.take_give_ups(0) == s.take_give_ups(1) == []


def test_side_channel_answers_malformed_questions_without_raising():
    store = RecordStore(60)
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    (ok,) = answer(enc((RECORDS_MSG, "r", [0])), {}, store)
    assert msgspec.msgpack.decode(ok)["records"] == [[0, b"rec"]]
    for q in [b"\xc1", enc(1), enc((RECORDS_MSG, "r")), enc((RECORDS_MSG, "", [0])), enc((RECORDS_MSG, "r", [])),
              enc((RECORDS_MSG, "r", [-1])), enc((RECORDS_MSG, "r", [True])), enc((RECORDS_MSG, "r", [1 << 20])),
              enc((RECORDS_MSG, "x" * 2000, [0])), enc((b"other", "r", [0])), enc((GIVEUP_MSG, "r", [0], "", 1)),
              enc((GIVEUP_MSG, "r", [0], "D", 0)), enc((GIVEUP_MSG, "r", [0], "D")), enc([]),
              b"\x91" * 1000 + b"\xc0", b"\x93\xc4\x0ekvcopy_records\x91" + b"\x91" * 1000 + b"\xc0\x91\x00"]:
        (reply,) = answer(q, {}, store)
        assert msgspec.msgpack.decode(reply) == MALFORMED, q
    (ok,) = answer(enc((GIVEUP_MSG, "r", [0], "D-tp0", 1)), {}, store)
    assert msgspec.msgpack.decode(ok)["state"] == "ok"
    (taken,) = answer(enc((TAKE_GIVEUPS_MSG, 0)), {}, store)
    assert give_ups_of([taken]) == [("r", "D-tp0", 1)] and store.take_give_ups(0) == []


def test_the_shape_bound_takes_what_msgspec_takes_and_refuses_what_kills_it():
    """Every message the two sides send passes the bound; what msgspec cannot decode
    (deep nesting: RecursionError) is refused by it, never handed to msgspec."""
    from kvcopy.msgpack_shape import check_shape
    from kvcopy.vllm.arena.channel import MAX_DEPTH, MAX_ITEMS

    sent = [enc((GET_META_MSG, 0, 3)), enc((RECORDS_MSG, "req", list(range(8)))), enc((HELLO_MSG,)),
            enc((GIVEUP_MSG, "r", [0, 1], "kvcopy-arena-D-tp0", 2)),
            enc({"state": "ready", "records": [[r, b"x" * 300] for r in range(8)], "ttl_left": 1.5, "error": ""}),
            enc({"parts": [b"a", b"b"], "challenge": b"c" * 16, "mac": b"m" * 32}),
            enc((AUTH_MSG, b"c" * 16, b"n" * 16, enc((RECORDS_MSG, "r", [0])), b"m" * 32)),
            enc(NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"md" * 1000))]
    for m in sent:
        check_shape(m, 1 << 20, MAX_DEPTH, MAX_ITEMS)
        msgspec.msgpack.decode(m)
    for depth in (MAX_DEPTH + 1, 1000):
        deep = b"\x91" * depth + b"\xc0"
        with pytest.raises(ValueError, match="deeper"):
            check_shape(deep, 1 << 20, MAX_DEPTH, MAX_ITEMS)
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(b"\x91" * 1000 + b"\xc0")


# ---------------------------------------------------------------- a P of our own making
class FakeP:
    """A ROUTER on loopback answering each question with ``handler(question) -> parts``."""

    def __init__(self, handler):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.handler, self.questions = handler, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, empty, q = self.sock.recv_multipart()
            self.questions.append(q)
            parts = self.handler(q)
            if parts is not None:
                self.sock.send_multipart([ident, empty] + parts)

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fake_p():
    made = []

    def make(handler):
        made.append(FakeP(handler))
        return made[-1]
    yield make
    for p in made:
        p.close()


def _wait(f, limit=30.0):
    end = time.monotonic() + limit  # hang guard only
    while not f.done:
        assert time.monotonic() < end, "the fetch never ended"
        time.sleep(0.005)
    return f


def _handshake(q):
    if msgspec.msgpack.decode(q)[0] == GET_META_MSG:
        return [enc(NixlHandshakePayload(compatibility_hash="compat", agent_metadata_bytes=b"md")), enc(0.0)]
    return None


@pytest.mark.parametrize("reply", [
    [b"\xc1"], [b"a", b"b"], {"state": "done", "records": [], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [], "ttl_left": 1.0, "error": ""},  # no record for rank 0
    {"state": "ready", "records": [[1, b"r"]], "ttl_left": 1.0, "error": ""},  # a rank not asked for
    {"state": "ready", "records": [[0, "r"]], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": float("inf"), "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": -1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": 1.0},
    {"state": "ready", "records": [[True, b"r"]], "ttl_left": 1.0, "error": ""},
    [b"\x91" * 5000 + b"\xc0"],  # would kill a decoder without the bound
], ids=range(11))
def test_d_checks_p_s_records_reply(reply):
    parts = reply if isinstance(reply, list) else [enc(reply)]
    with pytest.raises(ValueError, match="malformed|records of ranks"):
        records_of(parts, [0], "test")


def test_a_hostile_reply_fails_its_fetch_and_nothing_else(fake_p):
    """D's client thread survives every reply: a deep reply fails that fetch; a second
    P's fetch, in flight at the same time, completes."""
    bad = fake_p(lambda q: _handshake(q) or [b"\x91" * 5000 + b"\xc0"])
    good = fake_p(lambda q: _handshake(q) or [enc([{"state": "ready", "records": [[0, b"rec"]], "ttl_left": 5.0,
                                                    "error": ""}])])
    ch = SideChannel(None, "compat")
    try:
        f_bad = ch.fetch("E1", "127.0.0.1", bad.port, "r", [0], 10.0)
        f_good = ch.fetch("E2", "127.0.0.1", good.port, "r", [0], 10.0)
        assert "malformed" in str(_wait(f_bad).error)
        assert _wait(f_good).error is None and f_good.reply.records == {0: b"rec"} and f_good.metadata == {0: b"md"}
        again = _wait(ch.fetch("E2", "127.0.0.1", good.port, "s", [0], 10.0))
        assert again.error is None and sum(msgspec.msgpack.decode(q)[0] == GET_META_MSG for q in good.questions) == 1
    finally:
        ch.close()


def test_a_question_p_does_not_answer_in_time_is_asked_again_until_the_deadline(fake_p, monkeypatch):
    """P leaves the first handshake question and the first records question unanswered
    (a listener held up past D's exchange timeout): the fetch asks each again and
    completes (before: the first timeout failed it, and D recomputed); a P that never
    answers fails the fetch at its deadline, not at the first timeout."""
    from kvcopy.vllm.arena import record_client

    monkeypatch.setattr(record_client, "EXCHANGE_TIMEOUT_S", 1.0)
    seen = {GET_META_MSG: 0, RECORDS_MSG: 0}

    def first_lost(q):
        kind = msgspec.msgpack.decode(q)[0]
        seen[kind] += 1
        if seen[kind] == 1:
            return None  # this question is never answered
        return _handshake(q) or [enc([{"state": "ready", "records": [[0, b"rec"]], "ttl_left": 5.0, "error": ""}])]
    slow = fake_p(first_lost)
    silent = fake_p(lambda q: None)
    ch = SideChannel(None, "compat")
    try:
        t0 = time.monotonic()
        never = ch.fetch("N", "127.0.0.1", silent.port, "n", [0], 3.5)
        f = _wait(ch.fetch("S", "127.0.0.1", slow.port, "r", [0], 30.0))
        assert f.error is None and f.reply.records == {0: b"rec"}
        assert seen[GET_META_MSG] >= 2 and seen[RECORDS_MSG] >= 2  # each answered only when asked again
        assert "within the fetch timeout" in str(_wait(never).error) and time.monotonic() - t0 >= 3.5
        assert len(silent.questions) >= 2  # asked again after the 1 s exchange timeout, not failed by it
    finally:
        ch.close()


def _until_true(what, limit=30.0):
    end = time.monotonic() + limit  # hang guard only
    while not what():
        assert time.monotonic() < end, "never happened"
        time.sleep(0.005)


def test_a_question_asked_with_until_is_sent_again_after_no_answer_and_its_copies_counted(fake_p, monkeypatch):
    """``SideChannel.ask(until=...)`` (D's RESERVE): P leaves the first copy unanswered and
    answers the next; the reply is the last copy's, ``copies`` counts them, ``on_done``
    runs once. Without ``until`` the first timeout ends the question; ``stop_asking``
    while a copy is in flight makes it the last (it times out, nothing more is sent)."""
    from kvcopy.vllm.arena import record_client

    monkeypatch.setattr(record_client, "EXCHANGE_TIMEOUT_S", 2.0)  # the test's thread acts within it
    seen = []

    def first_lost(q):
        seen.append(q)
        return None if len(seen) == 1 else [enc({"ok": len(seen)})]
    slow = fake_p(first_lost)
    silent = fake_p(lambda q: None)
    ch = SideChannel(None, "compat")
    try:
        woken = []
        r = _wait(ch.ask("127.0.0.1", slow.port, b"same", 4096, on_done=lambda: woken.append(1),
                         until=time.monotonic() + 30))
        assert r.error is None and r.copies >= 2 and msgspec.msgpack.decode(r.parts[0]) == {"ok": r.copies}
        assert seen == [b"same"] * r.copies and ch.asked_again == r.copies - 1 and woken == [1]
        again = ch.asked_again
        once = _wait(ch.ask("127.0.0.1", silent.port, b"q", 4096))
        assert isinstance(once.error, TimeoutError) and once.copies == 1 and ch.asked_again == again
        stopped = ch.ask("127.0.0.1", silent.port, b"q", 4096, until=time.monotonic() + 30)
        _until_true(lambda: len(silent.questions) == 3)  # its second copy is in flight
        stopped.stop_asking()
        assert isinstance(_wait(stopped).error, TimeoutError) and stopped.copies == 2
        time.sleep(2.5)  # past one more exchange timeout: nothing more was sent
        assert len(silent.questions) == 3 and ch.asked_again == again + 1
    finally:
        ch.close()


def test_a_question_in_flight_when_the_client_closes_is_answered_with_an_error(fake_p):
    """Closing D's client ends every question in flight with an error (not a timeout:
    not asked again), so no :class:`Reply` stays not done (D's CANCEL of a push waits
    for its RESERVE's Reply)."""
    silent = fake_p(lambda q: None)
    ch = SideChannel(None, "compat")
    r = ch.ask("127.0.0.1", silent.port, b"q", 4096, until=time.monotonic() + 30)
    _until_true(lambda: len(silent.questions) == 1)
    ch.close()
    assert r.done and "shutting down" in str(r.error) and r.copies == 1


def test_a_p_that_says_pending_holds_no_other_fetch(fake_p):
    """Eight fetches to a P that stays ``pending`` and one to a P that is ready: the
    ninth completes at once (with a pool of four threads each holding a pending fetch
    it waited behind them until their deadline)."""
    def pending(q):
        batch = msgspec.msgpack.decode(q)[1]
        return [enc([{"state": "pending", "records": [], "ttl_left": 0.0, "error": ""} for _ in batch])]
    slow = fake_p(lambda q: _handshake(q) or pending(q))
    ready = fake_p(lambda q: _handshake(q) or [enc([{"state": "ready", "records": [[0, b"rec"]], "ttl_left": 5.0,
                                                     "error": ""}])])
    ch = SideChannel(None, "compat")
    try:
        waiting = [ch.fetch("S", "127.0.0.1", slow.port, f"w{i}", [0], 20.0) for i in range(8)]
        t0 = time.monotonic()
        f = _wait(ch.fetch("R", "127.0.0.1", ready.port, "go", [0], 20.0), limit=10)
        assert f.error is None and not any(w.done for w in waiting)
        assert time.monotonic() - t0 < 5  # a hang guard, far above the milliseconds it takes
        end = time.monotonic() + 10  # hang guard
        while len(records := [a[1] for a in map(msgspec.msgpack.decode, list(slow.questions))
                              if a[0] == RECORDS_MSG]) < 3:
            assert time.monotonic() < end
            time.sleep(0.005)
        assert all(sorted(rid for rid, _ in batch) == [f"w{i}" for i in range(8)] for batch in records[1:])
        assert not any(w.done for w in waiting)  # asked again and again, all eight in one question
    finally:
        ch.close()


def test_a_listener_that_cannot_bind_does_not_hang_the_scheduler():
    """vLLM's scheduler waits for the listener's ready event; a port in use must end that
    wait (the thread's error is raised there), never block the engine's start forever."""
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    ready, stop, errors = threading.Event(), threading.Event(), []

    def run():
        try:
            serve({}, ready, stop, "127.0.0.1", port, RecordStore(60))
        except zmq.ZMQError as exc:
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(30) and (t.join(30) or not t.is_alive())
        assert errors and errors[0].errno == zmq.EADDRINUSE
    finally:
        stop.set()
        taken.close(linger=0)
        ctx.term()


@pytest.fixture
def listener(monkeypatch):
    """A real listener thread (``serve``) on a free port: (port, store, stop)."""
    started = []

    def start(key=None, data=None):
        port, store = free_port(), RecordStore(60)
        ready, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=serve, args=(data or {}, ready, stop, "127.0.0.1", port, store, key), daemon=True)
        t.start()
        assert ready.wait(30)
        started.append((t, stop))
        return port, store
    yield start
    for t, stop in started:
        stop.set()
        t.join(10)


def test_a_listener_that_dies_anyway_is_restarted_and_logged(listener, monkeypatch, caplog):
    """Nothing a peer sends ends it; if a ZMQ error (or a bug) does, it is started again
    and logged, and answers as before."""
    import kvcopy.vllm.arena.channel as channel

    real = channel.answer
    broke = []

    def answer_once_broken(*a, **k):
        if not broke:
            broke.append(1)
            raise zmq.ZMQError(zmq.EFSM, "injected")  # escapes the handler: the loop dies
        return real(*a, **k)
    monkeypatch.setattr(channel, "answer", answer_once_broken)
    port, store = listener()
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    with pytest.raises(zmq.Again):
        ask_side_channel(port, enc((RECORDS_MSG, "r", [0])), timeout_ms=1500)  # the one that broke it: no answer
    (reply,) = ask_side_channel(port, enc((RECORDS_MSG, "r", [0])))
    assert msgspec.msgpack.decode(reply)["records"] == [[0, b"rec"]]
    assert any("starting it again" in r.getMessage() for r in caplog.records)


def test_a_keyed_listener_answers_only_authenticated_questions_once(listener):
    """With a key: the handshake, records and give-ups only for a question carrying a MAC
    under a challenge P issued; a recorded question replayed, a wrong key, a forged or
    made-up challenge are refused; D checks P's reply MAC over its own nonce."""
    from kvcopy.vllm.arena.channel import challenge_of, unwrap, wrap

    payload = enc(NixlHandshakePayload(compatibility_hash="compat", agent_metadata_bytes=b"md"))
    port, store = listener(KEY, {(0, 0): payload})
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    for plain in [enc((GET_META_MSG, 0, 0)), enc((RECORDS_MSG, "r", [0])), enc((GIVEUP_MSG, "r", [0], "D", 1))]:
        (reply,) = ask_side_channel(port, plain)  # one part: no handshake, a refusal
        assert "requires authentication" in msgspec.msgpack.decode(reply)["error"]
    assert store.take_give_ups(0) == []
    question = enc((RECORDS_MSG, "r", [0]))
    c = challenge_of(ask_side_channel(port, enc((HELLO_MSG,))))
    data, nonce = wrap(KEY, c, question)
    parts, c2 = unwrap(KEY, nonce, ask_side_channel(port, data), "reply")
    assert msgspec.msgpack.decode(parts[0])["records"] == [[0, b"rec"]] and c2 != c
    (replayed,) = ask_side_channel(port, data)  # the same question again: its challenge is used up
    assert "used or expired challenge" in msgspec.msgpack.decode(replayed)["error"]
    wrong, _ = wrap(b"another-key-of-enough-length-012", c2, question)
    assert "MAC does not match" in msgspec.msgpack.decode(ask_side_channel(port, wrong)[0])["error"]
    made_up = b"x" * 16
    forged = enc((AUTH_MSG, made_up, b"n" * 16, question, question_mac(KEY, made_up, b"n" * 16, question)))
    assert "challenge" in msgspec.msgpack.decode(ask_side_channel(port, forged)[0])["error"]
    data, nonce = wrap(KEY, c2, question)
    reply = ask_side_channel(port, data)
    with pytest.raises(ValueError, match="not authenticated"):
        unwrap(KEY, b"another nonce!!!", reply, "reply")  # a reply to another question
    with pytest.raises(ValueError, match="not authenticated"):
        unwrap(b"another-key-of-enough-length-012", nonce, reply, "reply")


def test_keyed_client_and_listener_fetch_handshakes_records_and_give_ups(listener):
    """D's client with the key: one HELLO for the first question, then each reply's
    challenge for the next; a client without the key, or with another, gets nothing."""
    payload = enc(NixlHandshakePayload(compatibility_hash="compat", agent_metadata_bytes=b"md"))
    port, store = listener(KEY, {(0, 0): payload})
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    for key, words in [(None, "requires authentication"), (b"another-key-of-enough-length-012", "MAC")]:
        ch = SideChannel(key, "compat")
        try:
            f = _wait(ch.fetch("E", "127.0.0.1", port, "r", [0], 10.0))
            assert f.reply is None and words in str(f.error), f.error
        finally:
            ch.close()
    ch = SideChannel(KEY, "compat")
    try:
        f = _wait(ch.fetch("E", "127.0.0.1", port, "r", [0], 10.0))
        assert f.error is None and f.reply.records == {0: b"rec"} and f.metadata == {0: b"md"}
        ch.give_up("127.0.0.1", port, "r", [0], "kvcopy-arena-D-tp0", 1)
        end = time.monotonic() + 10
        while not (taken := store.take_give_ups(0)):
            assert time.monotonic() < end
            time.sleep(0.005)
        assert taken == [("r", "kvcopy-arena-D-tp0", 1)]
    finally:
        ch.close()


def test_a_request_with_an_address_zmq_refuses_fails_alone(fake_p):
    """A request's ``remote_host`` comes from its params: one ZMQ cannot connect to fails
    that fetch, and the fetch beside it completes."""
    good = fake_p(lambda q: _handshake(q) or [enc([{"state": "ready", "records": [[0, b"rec"]], "ttl_left": 5.0,
                                                    "error": ""}])])
    ch = SideChannel(None, "compat")
    try:
        bad = ch.fetch("B", "no such host!", 1, "r", [0], 10.0)
        f = ch.fetch("G", "127.0.0.1", good.port, "r", [0], 10.0)
        assert _wait(bad).error is not None and _wait(f).error is None and f.reply.records == {0: b"rec"}
    finally:
        ch.close()


def _reservation(token: bytes) -> bytes:
    from kvcopy.vllm.arena.push_channel import reserve_question

    return enc(reserve_question("D", 0, 1, "127.0.0.1", 5555, "g1",
                                {0: (token, "r1", 64, "token", 0, 4096, [[0, 0, 4096]], (4096, 64), 10.0)}))


def _take(ch: SideChannel, port: int, wait_ms: int, rank: int = 0):
    """P's worker's long-poll question through the real client; (reply, when it came)."""
    from kvcopy.vllm.arena.push_channel import take_question

    came = threading.Event()
    reply = ch.ask("127.0.0.1", port, enc(take_question(rank, "gen", [], wait_ms)), 1 << 20, came.set)
    return reply, came


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "keyed"])
def test_a_parked_take_is_answered_when_its_reservation_arrives(listener, key):
    """P's worker's TAKE_PUSH with ``wait_ms`` waits at the listener while nothing is there
    for its rank, and is answered with the reservation D sends meanwhile (not at its next
    question: push_channel's long-poll); ``on_done`` fires with the reply."""
    from kvcopy.vllm.arena.channel import pushes_of

    port, store = listener(key)
    ch = SideChannel(key, "compat")
    try:
        reply, came = _take(ch, port, 4000)
        assert not came.wait(0.5) and not reply.done  # parked: nothing for rank 0 yet
        d = SideChannel(key, "compat")
        try:
            ok = d.ask("127.0.0.1", port, _reservation(b"t" * 16), 4096)
            assert came.wait(3.5), "the parked take was not answered when the reservation came"
            assert reply.error is None, reply.error
            (reserve,), cancel = pushes_of(reply.parts)
            assert reserve[1][0] == b"t" * 16 and reserve[1][1] == "r1" and cancel == []
            end = time.monotonic() + 10
            while not ok.done:
                assert time.monotonic() < end
                time.sleep(0.01)
            assert ok.error is None and msgspec.msgpack.decode(ok.parts[0])["state"] == "ok"
        finally:
            d.close()
        # nothing left: the next take waits its wait_ms out and is answered empty
        t0 = time.monotonic()
        reply, came = _take(ch, port, 300)
        assert came.wait(4.0) and reply.error is None
        assert time.monotonic() - t0 >= 0.3 and pushes_of(reply.parts) == ([], [])
    finally:
        ch.close()


def test_a_newer_take_of_a_rank_ends_the_parked_one_and_others_are_answered(listener):
    """One parked question per rank (a worker that asks again, e.g. restarted, ends its
    older one with an empty reply); other questions are answered while one is parked."""
    from kvcopy.vllm.arena.channel import pushes_of

    port, store = listener()
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    ch = SideChannel(None, "compat")
    try:
        first, first_came = _take(ch, port, 4000)
        assert not first_came.wait(0.3)
        (rec,) = ask_side_channel(port, enc((RECORDS_MSG, "r", [0])))  # the listener is not blocked
        assert msgspec.msgpack.decode(rec)["records"] == [[0, b"rec"]]
        second, second_came = _take(ch, port, 4000)
        assert first_came.wait(3.0) and pushes_of(first.parts) == ([], [])
        assert not second.done
        ask_side_channel(port, _reservation(b"u" * 16))
        assert second_came.wait(3.0)
        (reserve,), _ = pushes_of(second.parts)
        assert reserve[1][0] == b"u" * 16
    finally:
        ch.close()


def test_a_parked_take_whose_reply_fails_gets_an_error_and_others_stay_parked(listener, monkeypatch):
    """Building a parked TAKE_PUSH's reply raising (a bug) is logged and answered with an
    error; the listener keeps serving, another rank's parked question stays parked and is
    answered when its reservation comes (before: the listener restarted, dropping every
    parked question)."""
    from kvcopy.vllm.arena.channel import pushes_of

    port, store = listener()
    store.pushes.tp_size = 2
    real = store.pushes.take

    def take(rank):
        if rank == 1:
            raise RuntimeError("injected")
        return real(rank)
    monkeypatch.setattr(store.pushes, "take", take)
    ch = SideChannel(None, "compat")
    try:
        zero, zero_came = _take(ch, port, 4000, rank=0)
        one, one_came = _take(ch, port, 200, rank=1)
        assert one_came.wait(3.0) and one.error is None  # at its deadline: an error, not silence
        assert msgspec.msgpack.decode(one.parts[0])["state"] == "failed"
        assert not zero.done
        ask_side_channel(port, _reservation(b"v" * 16))  # for rank 0
        assert zero_came.wait(3.0) and zero.error is None, zero.error
        (reserve,), _ = pushes_of(zero.parts)
        assert reserve[1][0] == b"v" * 16
    finally:
        ch.close()


def test_a_reservation_handed_out_goes_again_until_its_worker_acknowledges_it(monkeypatch):
    """The listener keeps each reservation it handed to a worker's take until a later
    take lists its token, and hands it out again once RESEND_S passed without that (the
    reply may have gone to a worker that gave up waiting: push_channel, "Delivery");
    one acknowledged never comes again, and none is kept past its own timeout. The
    listener's clock is the test's."""
    import types

    from kvcopy.vllm.arena import push_channel as pc

    clock = [1000.0]
    monkeypatch.setattr(pc, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    box = pc.PushBox(1)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16

    def take(acks, wait_ms=0):
        reply = box.answer(pc.TAKE_PUSH_MSG, [0, "gen", [], wait_ms, acks])
        return reply if isinstance(reply, pc.Parked) else [r[6] for r in reply["reserve"]]

    def reserve(token):
        q = msgspec.msgpack.decode(_reservation(token))  # its timeout: 10 s
        assert box.answer(q[0], q[1:]) == {"state": "ok"}
    reserve(a)
    reserve(b)
    assert take([]) == [a, b]
    clock[0] += pc.RESEND_S - 0.1
    assert take([a]) == [] and not box.ready(0)  # a acknowledged, b not due yet
    assert isinstance(take([], wait_ms=1000), pc.Parked)  # nothing for the worker: parked
    clock[0] += 0.2
    assert box.ready(0)  # b is due again: a parked take is answered with it
    assert take([]) == [b]
    reserve(c)
    assert take([b]) == [c] and not box.ready(0)
    clock[0] += 10.5  # past c's timeout, not acknowledged: dropped, not handed out again
    assert not box.ready(0) and take([]) == []
    assert box.answer(pc.TAKE_PUSH_MSG, [0, "gen", [], 0, [b"short"]]) is None  # malformed: nothing handed out
    reserve(a)  # D asking again after the first copy was acknowledged: handed out again (the worker drops it)
    assert take([]) == [a]
    monkeypatch.setattr(pc, "MAX_QUEUED", 2)  # a rank whose worker stopped taking: full, until its rows expire
    reserve(b)
    q = msgspec.msgpack.decode(_reservation(c))
    assert box.answer(q[0], q[1:])["state"] == "failed"  # a (handed, not acknowledged) and b (queued)
    clock[0] += 10.5
    assert box.answer(q[0], q[1:]) == {"state": "ok"} and take([]) == [c]  # both past their timeout: dropped
