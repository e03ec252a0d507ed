"""Notifications that free P's spans (kvcopy/nixl/wire/notices.py) over real NIXL: without a
key anyone who reaches P's agent frees a staged span by naming its request; with the
managers' key only a tagged notification from a key holder does, for this registration
of this P."""
import time

import pytest

from kvcopy.nixl.wire import notices
from kvcopy.nixl.agent import Agent
from kvcopy.testing.nixl.engines import ManagerPairs, collect_notifications, one_torch_thread, wait
from kvcopy.testing.nixl.hostile import nixl_part

KEY = b"kvcopy-notices-test-key-01234567"
_names = iter(range(10**6))


def _intruder(p, message: bytes) -> Agent:
    """A bare NIXL agent that never passed any handshake sends ``message`` to P (close
    it once P has looked: a send is asynchronous)."""
    intruder = Agent(f"intruder-{next(_names)}")
    name = intruder.add_remote(nixl_part(p.metadata()))
    assert intruder.send_notification(name, message) is None
    return intruder


@pytest.mark.parametrize("key", [None, KEY], ids=["no key", "key"])
def test_a_bare_agent_frees_a_staged_span_only_without_a_key(key):
    with one_torch_thread(), ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", 48, buffer="arena", arena_bytes=1 << 20, key=key)
        p.save([[1, 2, 3]], num_tokens=40, request_id="A")
        intruder = _intruder(p, b"A")
        got = []
        try:
            deadline = time.monotonic() + 60  # hang guard: the message arrives, kept or refused
            while not got and not p.stats().get("notifications_refused") and time.monotonic() < deadline:
                got += [m for msgs in p.notifications().values() for m in msgs]
                time.sleep(0.001)
        finally:
            intruder.close()
        if key is None:  # documented: the key is what protects staged spans from this
            assert got == [b"A"] and p.arena.staged == []
            return
        assert got == [] and p.arena.staged == ["A"] and p.stats()["notifications_refused"] == 1
        record = p.save([[4, 5, 6]], num_tokens=40, request_id="B")
        h = d.pull(d.plan_pull(peer, record.to_bytes(key), 40, [[10, 11, 12]], request_id="B"), notify=b"B")
        assert wait(d, h) == "DONE" and d.complete(h).ok
        assert collect_notifications(p, 1) == [(d.name, b"B")]  # tagged by D, checked and stripped by P
        assert p.arena.staged == ["A"]
        d.notify(peer, b"A")  # D gives A up without reading it: P frees it at once
        assert collect_notifications(p, 1) == [(d.name, b"A")] and p.arena.staged == []


def test_tags_bind_sender_receiver_registration_and_message():
    good = notices.tagged(KEY, "D", "P", "0123456789abcdef", b"A")
    assert good[:1] == b"A" and len(good) == 1 + notices.TAG_BYTES
    assert notices.untag(KEY, "P", "0123456789abcdef", {"D": [good]}) == ({"D": [b"A"]}, 0)
    for receiver, gen, sender, msg in [("P2", "0123456789abcdef", "D", good),  # another P
                                       ("P", "fedcba9876543210", "D", good),  # P re-registered
                                       ("P", "0123456789abcdef", "X", good),  # another sender's name
                                       ("P", "0123456789abcdef", "D", b"B" + good[1:]),  # another request
                                       ("P", "0123456789abcdef", "D", b"A"),  # untagged
                                       ("P", "0123456789abcdef", "D", good[:-1])]:  # cut
        assert notices.untag(KEY, receiver, gen, {sender: [msg]}) == ({}, 1)
    assert notices.untag(None, "P", "0", {"D": [b"A"]}) == ({"D": [b"A"]}, 0)
    assert notices.tagged(None, "D", "P", "0", b"A") == b"A"
