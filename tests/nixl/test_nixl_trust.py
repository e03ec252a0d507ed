"""Trust model of the NIXL manager (docs/nixl.md, "Trust model"): a shared key,
refusals that leave nothing behind, and add/remove cycles that leak no fd, NIXL agent
or memory. Leak runs go in a subprocess: the count of open fds and the RSS of the
pytest process depend on every test before them. NIXL traffic is on loopback."""
import gc
import json
from dataclasses import replace
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from kvcopy.nixl import nixl_available
from kvcopy.nixl.wire.handshake import decode, encode
from kvcopy.testing.nixl.handshake_fuzz import misplaced
from kvcopy.testing.nixl.engines import build_case, pull_and_complete
from kvcopy.testing.nixl.oracle import fill_random, same_bytes

pytestmark = pytest.mark.skipif(nixl_available() is not None, reason="needs NIXL")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NP = 16
KEY = b"a shared secret of 32 bytes ....."
# 70 tokens of the hybrid case: group 0 (32-token blocks, 2 pages each) and group 1
# (16-token blocks) share one tensor, so their pages are disjoint
HYBRID_P = [[1, 2, 3], [8, 9, 10, 11, 12]]
HYBRID_D = [[4, 5, 6], [0, 1, 2, 3, 14]]

# The child: P and D managers, ``warmup`` then ``cycles`` rounds of one kind, and the
# fds (/proc/self/fd), sockets, RSS, NIXL agents and peers before and after, as JSON.
LEAK_CHILD = r'''
import json, os, sys
from kvcopy.nixl.wire.handshake import decode, encode
from kvcopy.testing.nixl.handshake_fuzz import misplaced
from kvcopy.testing.nixl.engines import build_case, one_torch_thread
from kvcopy.testing.nixl.oracle import fill_random

kind, warmup, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def fds():
    out = {"fds": 0, "sockets": 0}
    for f in os.listdir("/proc/self/fd"):
        out["fds"] += 1
        try:
            out["sockets"] += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:
            pass
    return out

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

with one_torch_thread():
    pe, de = build_case("hybrid", 16), build_case("hybrid", 16)
    fill_random(pe.device_caches, 1)
    p, d = pe.manager("P-leak"), de.manager("D-leak")
    genuine = p.metadata()
    lying = encode(misplaced(decode(genuine)))
    flipped = genuine[:100] + bytes([genuine[100] ^ 1]) + genuine[101:]
    blocks = [[1, 2, 3], [8, 9, 10, 11, 12]]  # hybrid: group 0 blocks are 2 pages, sharing group 1's tensor

    def one():
        if kind == "cycle":  # add, plan (fills the route cache), remove
            name = d.add_peer(genuine)
            d.plan_pull(name, blocks, 70, blocks)
            d.remove_peer(name)
        else:  # refused after NIXL loaded the agent (lying regions), and before (a flip)
            for bad in (lying, flipped):
                try:
                    d.add_peer(bad)
                except ValueError:
                    pass
                else:
                    raise AssertionError("bad metadata accepted")

    for _ in range(warmup):
        one()
    before = dict(fds(), rss_kb=rss_kb())
    for _ in range(cycles):
        one()
    after = dict(fds(), rss_kb=rss_kb())
    name = d.add_peer(genuine)  # the same name, genuine metadata: still accepted
    d.remove_peer(name)
    report = {"before": before, "after": after, "peers": d.peers(), "parked": list(d._agent.parked),
              "nixl_holds_p": d._agent.has_remote("P-leak")}
    d.close()
    p.close()
    print(json.dumps(report), flush=True)
'''


def run_leak_child(kind: str, warmup: int, cycles: int) -> dict:
    env = dict(os.environ, UCX_NET_DEVICES="lo", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", LEAK_CHILD, kind, str(warmup), str(cycles)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_add_plan_remove_cycles_leak_no_fd_socket_agent_or_memory():
    """300 add_peer/plan_pull/remove_peer cycles of a live peer. Before: two loopback
    sockets per cycle (UCX keeps the endpoint of an unloaded live peer's agent)."""
    r = run_leak_child("cycle", 20, 300)
    assert r["after"]["sockets"] - r["before"]["sockets"] <= 2, r
    assert r["after"]["fds"] - r["before"]["fds"] <= 2, r
    assert r["after"]["rss_kb"] - r["before"]["rss_kb"] < 16 * 1024, r
    assert r["peers"] == [] and r["parked"] == ["P-leak"] and r["nixl_holds_p"], r


def test_refused_handshakes_leave_no_fd_socket_or_agent_behind():
    """200 handshakes refused after NIXL loaded the agent (advertised regions it never
    registered) and 200 refused before (a flipped bit): nothing accumulates, and the
    genuine metadata under the same name is accepted afterwards."""
    r = run_leak_child("refused", 10, 200)
    assert r["after"]["sockets"] - r["before"]["sockets"] <= 2, r
    assert r["after"]["fds"] - r["before"]["fds"] <= 2, r
    assert r["after"]["rss_kb"] - r["before"]["rss_kb"] < 16 * 1024, r
    assert r["peers"] == [] and r["parked"] == ["P-leak"], r


@pytest.fixture
def engines():
    pe, de = build_case("hybrid", NP), build_case("hybrid", NP)
    fill_random(pe.device_caches, 3)
    fill_random(de.device_caches, 4)
    return pe, de


def test_keyed_managers_pull_exact_bytes_and_refuse_anyone_else(engines):
    pe, de = engines
    p = pe.manager("P-key", key=KEY)
    d = de.manager("D-key", key=KEY)
    plain = pe.manager("P-nokey")
    other = pe.manager("P-otherkey", key=b"another secret, 32 bytes long..")
    try:
        with pytest.raises(ValueError, match="not authenticated: this manager requires a shared key"):
            d.add_peer(plain.metadata())
        with pytest.raises(ValueError, match="HMAC does not match"):
            d.add_peer(other.metadata())
        info = decode(p.metadata(), KEY)
        with pytest.raises(ValueError, match="not authenticated"):
            d.add_peer(encode(info))  # the same content, re-encoded without the key
        unkeyed = de.manager("D-nokey")
        try:
            with pytest.raises(ValueError, match="this manager has none"):
                unkeyed.add_peer(p.metadata())
        finally:
            unkeyed.close()
        assert d.peers() == []
        peer = d.add_peer(p.metadata())
        p_blocks, d_blocks = HYBRID_P, HYBRID_D
        p.save(p_blocks)
        out = pull_and_complete(d, peer, de, d_blocks, pe.device_caches, pe, p_blocks, 70)
        assert out.completion.ok, out.completion.error
        assert same_bytes(de.device_caches, out.expected) and same_bytes(de.device_caches, out.replayed)
    finally:
        for m in (d, p, plain, other):
            m.close()


def test_bad_keys_are_refused_at_construction(engines):
    pe, _ = engines
    with pytest.raises(ValueError, match="at least 16 bytes"):
        pe.manager("P-shortkey", key=b"short")
    with pytest.raises(TypeError, match="key must be bytes"):
        pe.manager("P-strkey", key="a string, not bytes, long enough")


def test_a_removed_peer_is_not_kept_alive_by_the_route_cache(engines):
    """The planner's route cache held the peer's EngineInfo (and its regions) until
    64 other plans pushed it out; now remove_peer drops it and nothing else holds it.
    Routes are keyed by the peer's key, which a re-added peer does not share."""
    pe, de = engines
    p, d = pe.manager("P-routes"), de.manager("D-routes")
    try:
        routes = d._mode._routes
        name = d.add_peer(p.metadata())
        d.plan_pull(name, HYBRID_P, 70, HYBRID_D)
        key = d._peers[name].peer.key
        info_ref = weakref.ref(d._peers[name].peer.info)
        assert routes.holds(key) == 1
        d.plan_pull(name, HYBRID_P, 70, HYBRID_D)
        assert (routes.hits, routes.misses) == (1, 1)
        d.remove_peer(name)
        gc.collect()
        assert info_ref() is None
        assert routes.holds(key) == 0 and len(routes) == 0  # its entries went
        assert d.add_peer(p.metadata()) == name  # and the name comes back with genuine metadata
        assert d._peers[name].peer.key != key
        d.plan_pull(name, HYBRID_P, 70, HYBRID_D)
        assert (routes.hits, routes.misses) == (1, 2)  # the re-added peer's own routes
    finally:
        d.close()
        p.close()


def test_a_refusal_after_nixl_loaded_the_agent_leaves_the_name_usable(engines):
    """Advertised regions NIXL rejects, a header naming another agent than its NIXL
    metadata, then the genuine metadata: accepted, and reads the right bytes."""
    pe, de = engines
    p, d = pe.manager("P-again"), de.manager("D-again")
    q = build_case("hybrid", NP).manager("Q-again")
    try:
        info = decode(p.metadata())
        with pytest.raises(ValueError, match="not what it registered"):
            d.add_peer(encode(misplaced(info)))
        with pytest.raises(ValueError, match="its NIXL agent metadata is for 'Q-again'"):
            d.add_peer(encode(replace(info, agent_metadata=decode(q.metadata()).agent_metadata)))
        assert not d._agent.has_remote("Q-again")  # refused before NIXL saw it
        peer = d.add_peer(p.metadata())
        p.save(HYBRID_P)
        out = pull_and_complete(d, peer, de, HYBRID_D, pe.device_caches, pe, HYBRID_P, 70)
        assert out.completion.ok and same_bytes(de.device_caches, out.expected)
    finally:
        for m in (d, p, q):
            m.close()


def test_negative_tokens_per_page_cannot_reach_the_planner(engines):
    """v2 accepted it and plan_pull then looped forever, memory growing."""
    pe, de = engines
    p, d = pe.manager("P-neg"), de.manager("D-neg")
    try:
        info = decode(p.metadata())
        bad = replace(info, tokens_per_page=(-16, -16), regions=tuple(
            replace(r, tokens_per_page=-16) for r in info.regions))
        with pytest.raises(ValueError, match="out of range"):
            d.add_peer(encode(bad))
        assert d.peers() == [] and np.all([not d._agent.has_remote("P-neg") or "P-neg" in d._agent.parked])
    finally:
        d.close()
        p.close()


def test_metadata_nixl_half_loads_is_named_when_the_name_is_refused_again(engines):
    """A documented NIXL 1.5 limitation, reachable only with a valid digest (a peer
    that computes it, or holds the key): agent metadata whose memory sections fail to
    load leaves a UCX connection under the name that no NIXL call removes. Both
    refusals are ValueErrors, and the second says why the genuine metadata fails."""
    pe, de = engines
    p, d = pe.manager("P-half"), de.manager("D-half")
    try:
        info = decode(p.metadata())
        with pytest.raises(ValueError, match="NIXL_ERR_NOT_FOUND"):
            d.add_peer(encode(replace(info, agent_metadata=info.agent_metadata[:-1])))
        with pytest.raises(ValueError, match="half-loaded connection"):
            d.add_peer(p.metadata())
        assert d.peers() == []
    finally:
        d.close()
        p.close()
