"""kvcopy.vllm_arena_channel: P's record store and listener, D's checks of P's replies (vLLM env)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)


def test_record_store_answers():
    from kvcopy.vllm_arena_channel import RecordStore
    from kvcopy.vllm_arena_meta import KvcopyArenaWorkerMeta

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


def test_side_channel_answers_malformed_questions_without_raising():
    import msgspec

    from kvcopy.vllm_arena_channel import RECORDS_MSG, RecordStore, answer
    from kvcopy.vllm_arena_meta import KvcopyArenaWorkerMeta

    store = RecordStore(60)
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    enc = msgspec.msgpack.encode
    (ok,) = answer(enc((RECORDS_MSG, "r", [0])), {}, store)
    assert msgspec.msgpack.decode(ok)["records"] == [[0, b"rec"]]
    for q in [b"\xc1", enc(1), enc((RECORDS_MSG, "r")), enc((RECORDS_MSG, "", [0])), enc((RECORDS_MSG, "r", [])),
              enc((RECORDS_MSG, "r", [-1])), enc((RECORDS_MSG, "r", [True])), enc((RECORDS_MSG, "r", [1 << 20])),
              enc((RECORDS_MSG, "x" * 2000, [0])), enc((b"other", "r", [0]))]:
        (reply,) = answer(q, {}, store)
        assert msgspec.msgpack.decode(reply) == {"state": "failed", "records": [], "ttl_left": 0.0,
                                                 "error": "malformed question"}, q


def _one_reply_server(reply_parts):
    """A ROUTER on loopback that answers one question with ``reply_parts``."""
    import threading

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve_once():
        ident, empty, _ = sock.recv_multipart()
        sock.send_multipart([ident, empty] + reply_parts)
        sock.close(linger=1000)
        ctx.term()
    threading.Thread(target=serve_once, daemon=True).start()
    return port


@pytest.mark.parametrize("reply", [
    [b"\xc1"], [b"a", b"b"], {"state": "done", "records": [], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [], "ttl_left": 1.0, "error": ""},  # no record for rank 0
    {"state": "ready", "records": [[1, b"r"]], "ttl_left": 1.0, "error": ""},  # a rank not asked for
    {"state": "ready", "records": [[0, "r"]], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": float("inf"), "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": -1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": 1.0},
], ids=range(9))
def test_d_checks_p_s_records_reply(reply):
    import msgspec
    import zmq

    from kvcopy.vllm_arena_channel import fetch_records

    parts = reply if isinstance(reply, list) else [msgspec.msgpack.encode(reply)]
    port = _one_reply_server(parts)
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="malformed|records of ranks"):
            fetch_records(ctx, "127.0.0.1", port, "r", [0], 5.0)
    finally:
        ctx.destroy(linger=0)


def test_a_listener_that_cannot_bind_does_not_hang_the_scheduler():
    """vLLM's scheduler waits for the listener's ready event; a port in use must end that
    wait (the thread's error is raised there), never block the engine's start forever."""
    import threading

    import zmq

    from kvcopy.vllm_arena_channel import RecordStore, serve

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
