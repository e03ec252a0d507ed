"""The arena connector against hostile and mistaken peers: P and D are vLLM 0.33 engines
with the connector (tests/vllm/vllm_arena_engines.py), real NIXL over UCX on loopback, the
hostile clients real ZMQ sockets and a bare NIXL agent. After every attack the same P
serves a genuine D, whose buffer is compared whole (D poisoned first).

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os
import random
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

import msgspec  # noqa: E402
import zmq  # noqa: E402
from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the model families, the fixture)
from test_vllm_arena import _failed_load, _transfer, engines  # noqa: E402  (a load that must fail, one that must not)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG  # noqa: E402

from kvcopy.nixl.agent import Agent  # noqa: E402
from kvcopy.testing.nixl.hostile import nixl_part  # noqa: E402
from kvcopy.vllm.arena.channel import GIVEUP_MSG, HELLO_MSG, RECORDS_MSG  # noqa: E402
from kvcopy.vllm.arena.push_channel import CANCEL_MSG, RESERVE_MSG, TAKE_PUSH_MSG  # noqa: E402
from kvcopy.vllm.arena.meta import GAVE_UP, notify_bytes  # noqa: E402
from vllm_arena_engines import (  # noqa: E402
    ArenaEngine, ask_side_channel, assert_same, decode, expected_d, fill, prefill, prompts, run,
)

assert vllm_env and engines  # fixtures, used by name

enc = msgspec.msgpack.encode
KEY_ENV = "KVCOPY_TRUST_TEST_KEY"
KEY = "6b76636f70792d74727573742d746573742d6b65792d3031"  # hex, 24 bytes


def _port(p) -> int:
    return int(p.sched.connector.connector_scheduler.side_channel_port)


def _answered_malformed(port, question) -> bool:
    parts = ask_side_channel(port, question)
    return len(parts) == 1 and msgspec.msgpack.decode(parts[0]).get("error") == "malformed question"


# 1-2 KB questions nested 1,000 deep: each made msgspec raise RecursionError, which ended
# P's listener thread (vLLM does not restart it); every later handshake and records
# question then timed out.
DEEP = b"\x91" * 1000 + b"\xc0"
KILLERS = {
    "deep arrays": DEEP,
    "deep maps": b"\x81\x00" * 1000 + b"\xc0",
    "deep in the request-id slot": b"\x93\xc4\x0ekvcopy_records" + DEEP + b"\x91\x00",
    "deep in the ranks slot": b"\x93\xc4\x0ekvcopy_records\xa1r" + DEEP,
    "deep in the TP-rank slot of a handshake question": b"\x93\xc4\x0cget_meta_msg\x00" + DEEP,
}


def test_questions_that_killed_the_listener_leave_it_answering(engines):
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 21)
    for name, question in KILLERS.items():
        assert len(question) <= 2100
        assert _answered_malformed(_port(p), question), name
    assert p.sched.connector.connector_scheduler._nixl_handshake_listener_t.is_alive()
    _transfer(p, d, [40, 23], seed=21)  # the handshake and records questions of a genuine D: answered


def _fuzz_questions(rng: random.Random, n: int):
    """(class, question) for ``n`` malformed questions, five classes in turn: random
    bytes, a bit flipped in a genuine question, a genuine question truncated, random
    msgpack values (any type, nesting up to 60; half of them shaped as a question of a
    known kind with wrong arguments), and nesting 100 to 3,000 deep (arrays, maps or
    both, alone or in a slot of a genuine question)."""
    reservation = [0, b"t" * 16, "req", 10, "token", 0, 4096, b"\0" * 24, 0, 100, 1.0]
    genuine = [enc((GET_META_MSG, 0, 0)), enc((RECORDS_MSG, "req", [0])), enc((GIVEUP_MSG, "req", [0], "D", 1)),
               enc((HELLO_MSG,)), enc((RESERVE_MSG, "D", 0, 1, "127.0.0.1", 9, "gen", [reservation])),
               enc((CANCEL_MSG, "D", 0, [[0, b"t" * 16]])), enc((TAKE_PUSH_MSG, 0))]
    kinds = [GET_META_MSG, RECORDS_MSG, GIVEUP_MSG, HELLO_MSG, b"kvcopy_take_giveups", RESERVE_MSG, CANCEL_MSG,
             TAKE_PUSH_MSG]

    def value(depth):
        kind = rng.randrange(9 if depth < 60 else 6)
        return [lambda: rng.randrange(-2**63, 2**64), lambda: rng.random() * 1e300, lambda: None,
                lambda: rng.randbytes(rng.randrange(40)), lambda: "x" * rng.randrange(2000), lambda: True,
                lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
                lambda: {str(i): value(depth + 1) for i in range(rng.randrange(4))},
                lambda: [value(depth + 1)]][kind]()

    def deep():
        levels = rng.randrange(100, 3000)
        body = b"".join(rng.choice([b"\x91", b"\x81\x00"]) for _ in range(levels)) + b"\xc0"
        if rng.random() < 0.5:
            return body
        head = rng.choice([b"\x93\xc4\x0ekvcopy_records", b"\x93\xc4\x0cget_meta_msg\x00"])
        return head + body + (b"\x91\x00" if head.endswith(b"records") else b"")
    classes = ["random bytes", "bit flip", "truncation", "random value", "deep nesting"]
    for i in range(n):
        cls = classes[i % len(classes)]
        if cls == "random bytes":
            q = rng.randbytes(rng.randrange(1, 600))
        elif cls == "bit flip":
            g = bytearray(rng.choice(genuine))
            at = rng.randrange(len(g))
            g[at] ^= 1 << rng.randrange(8)
            q = bytes(g)
        elif cls == "truncation":
            g = rng.choice(genuine)
            q = g[:rng.randrange(len(g))] or b"\xc1"
        elif cls == "random value":
            q = enc(value(0) if i % 2 else (rng.choice(kinds),) + tuple(value(50) for _ in range(rng.randrange(5))))
        else:
            q = deep()
        yield cls, q


def test_a_malformed_question_fuzz_leaves_the_listener_answering(engines, caplog):
    """2,000 malformed questions (five classes, 400 each) at one P: each is answered (an
    error, or for a well-formed stray question its proper answer), the listener never
    stops, and every 100 questions a genuine records question is answered; then a
    genuine D loads two requests exactly."""
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 22)
    port = _port(p)
    counts: dict = {}
    rng = random.Random(0)
    for i, (cls, q) in enumerate(_fuzz_questions(rng, 2000)):
        try:
            parts = ask_side_channel(port, q, timeout_ms=30_000)  # a hang guard: answers take milliseconds
        except zmq.Again:
            pytest.fail(f"question {i} ({cls}, {len(q)} bytes, {q[:40]!r}...) got no answer")
        kind = "error" if len(parts) == 1 and "error" in msgspec.msgpack.decode(parts[0]) else "answered"
        counts[(cls, kind)] = counts.get((cls, kind), 0) + 1
        if i % 100 == 99:
            (reply,) = ask_side_channel(port, enc((RECORDS_MSG, "not-staged", [0])))
            assert msgspec.msgpack.decode(reply)["state"] == "pending"
    assert sum(counts.values()) == 2000
    print("side-channel fuzz, per class and outcome:", dict(sorted(counts.items())))
    assert not [r for r in caplog.records if "starting it again" in r.getMessage()]  # nothing escaped a handler
    assert p.sched.connector.connector_scheduler._nixl_handshake_listener_t.is_alive()
    _transfer(p, d, [40, 23], seed=22)


def test_a_genuine_record_of_another_request_fails_the_load(engines, monkeypatch):
    """D asks P's side channel for B and is answered with A's genuine, keyed record (a
    P that mixes requests up, or a man in the middle replaying A's reply): before
    records were bound, B finished as loaded holding A's KV, and D's notification freed
    B's span unread. Now D refuses the record (B takes the load-error path, D's buffer
    unchanged), gives B up (P frees B's span: D will not read it), and A loads exactly."""
    monkeypatch.setenv(KEY_ENV, KEY)
    case = CASES["one_group"]
    p = engines(case, "kv_producer", key_env=KEY_ENV)
    d = engines(case, "kv_consumer", key_env=KEY_ENV)
    fill(p, d, 23)
    tok_a, tok_b = prompts(2, [40, 40], seed=23)
    params_a, params_b = prefill(p, ["A", "B"], [tok_a, tok_b])
    run([p], lambda: p.staged() == ["A", "B"])
    store = p.sched.connector.connector_scheduler.store
    real = store.lookup
    monkeypatch.setattr(store, "lookup", lambda rid, ranks, now=None: real("A" if rid == "B" else rid, ranks, now))
    _failed_load(d, "B", tok_b, params_b, [p])
    end = time.monotonic() + 10  # hang guard: P frees B's span when D gives it up, not at its TTL
    while p.staged() != ["A"]:
        assert time.monotonic() < end, p.staged()
        time.sleep(0.01)
    monkeypatch.setattr(store, "lookup", real)
    before = d.raw_bytes()
    assert decode(d, [p], ["A"], [tok_a], [params_a]) == set()
    assert_same(d, expected_d(p, d, [("A", "A", 40)], before))


@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "key"])
def test_with_a_key_p_serves_and_frees_for_nobody_else(engines, monkeypatch, keyed):
    """A client on the network without the key: P's side channel gives it no handshake,
    no record and takes no give-up (without a key it gets all three: documented); a bare
    NIXL agent loaded with P's NIXL metadata (as an eavesdropper could cut it out of a
    handshake) sends the notification that frees a span: P ignores it with the key
    (untagged), frees the span without one. A genuine D with the key loads exactly."""
    kw = {}
    if keyed:
        monkeypatch.setenv(KEY_ENV, KEY)
        kw = {"key_env": KEY_ENV}
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer", **kw), engines(case, "kv_consumer", **kw)
    fill(p, d, 24)
    (params,) = prefill(p, ["S"], prompts(1, [40], seed=24))
    run([p], lambda: p.staged() == ["S"])
    port = _port(p)
    meta = ask_side_channel(port, enc((GET_META_MSG, 0, 0)))
    records = msgspec.msgpack.decode(ask_side_channel(port, enc((RECORDS_MSG, "S", [0])))[0])
    assert (len(meta) == 2 and bool(meta[0])) is not keyed  # the handshake, or a refusal
    assert (records["state"] == "ready") is not keyed
    ask_side_channel(port, enc((GIVEUP_MSG, "nothing-staged", [0], "intruder", 1)))
    intruder = Agent(f"intruder-{keyed}")
    try:
        name = intruder.add_remote(nixl_part(p.manager.metadata()))
        assert intruder.send_notification(name, notify_bytes("S", 1, GAVE_UP)) is None
        end = time.monotonic() + 10  # hang guard: the notification arrives, and is taken or refused
        while p.staged() == ["S"] and not p.stats().get("notifications_refused"):
            assert time.monotonic() < end
            time.sleep(0.01)
    finally:
        intruder.close()
    if not keyed:
        assert p.staged() == []  # freed by anyone who reaches P's NIXL agent
        return
    assert p.staged() == ["S"] and p.stats()["notifications_refused"] == 1
    _transfer(p, d, [40, 23], seed=25)


def test_require_checksum_sends_an_uncheckable_load_to_the_error_path(engines):
    """P runs without page sums: D with ``checksum`` alone loads the request unchecked;
    D with ``require_checksum`` refuses it before reading (vLLM's load-error path:
    recomputed, D's buffer unchanged) and gives it up, so P frees the span at once."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer", checksum=False)
    d = engines(case, "kv_consumer", require_checksum=True)
    fill(p, d, 26)
    (tok,) = prompts(1, [40], seed=26)
    (params,) = prefill(p, ["U"], [tok])
    _failed_load(d, "U", tok, params, [p])
    assert d.stats()["checksum_unchecked"] == 0
    end = time.monotonic() + 10  # hang guard
    while p.staged():
        assert time.monotonic() < end
        time.sleep(0.01)
    lenient = engines(case, "kv_consumer")
    fill(p, lenient, 27)
    _transfer(p, lenient, [40], seed=27)
    assert lenient.stats()["checksum_unchecked"] == 1


def test_a_p_restarted_under_the_same_name_and_port_is_asked_again(engines, monkeypatch, vllm_env):
    """D cached P's handshake; P restarts (same engine id, same side-channel port, a new
    registration): P's records name the new registration, D fetches P's handshake again
    (once) and loads exactly. Before, D read with the old handshake and failed the load."""
    case = CASES["one_group"]
    d = engines(case, "kv_consumer")
    made = []

    def start_p():
        port = os.environ.get("KVCOPY_TEST_P_PORT")

        def setenv(k, v):
            monkeypatch.setenv(k, port if k == "VLLM_NIXL_SIDE_CHANNEL_PORT" and port else v)
        p = ArenaEngine(vllm_env, case, "kv_producer", setenv, engine_id="restarted")
        made.append(p)
        monkeypatch.setenv("KVCOPY_TEST_P_PORT", str(_port(p)))
        return p
    try:
        p1 = start_p()
        fill(p1, d, 28)
        _transfer(p1, d, [40], seed=28)
        p1.close()
        p2 = start_p()
        assert _port(p2) == _port(p1)
        fill(p2, d, 29)
        _transfer(p2, d, [40, 30], seed=29)
    finally:
        for p in made:
            p.close()
