"""Push in arena mode over real NIXL (UCX, DRAM): D reserves, P WRITEs its staged span and
record into D's span, D lands it. Every byte of D's caches must equal the token-position
expectation (D poisoned first). Reservations are checked on P before NIXL; D's span is
never reused while a WRITE may land; a failed push writes nothing to D's KV. The last
test runs P in a child process and kills it after its WRITE was posted."""
import os
import signal
import time

import numpy as np
import pytest
import torch

from kvcopy.nixl import NO_BLOCK, push_reservations, push_writes
from kvcopy.nixl.modes import push_units
from kvcopy.nixl.wire.push_messages import (MAX_ROWS, MAX_TIMEOUT_S, NEVER, PREFIX, chunk_notice, notice,
                                            parse_chunk_notice, parse_notice)
from kvcopy.testing.nixl.engines import (
    ManagerPairs, PrefillProcess, allocate_blocks, build_case, expected_pull, one_torch_thread,
)
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes
from kvcopy.testing.streams import RecordedStreams

NP = 48
MB = 1 << 20


@pytest.fixture
def pd():
    with one_torch_thread(), ManagerPairs() as pairs:
        def make(case, p_tpb=None, d_tpb=None, **kw):
            p, d, peer, pe, de = pairs.make(case, NP, p_tpb, d_tpb, "arena", **{"arena_bytes": MB, **kw})
            target = p.add_target(d.metadata())
            return p, d, peer, pe, de, target
        yield make


def settle(p, d, token, guard_s=30.0):
    """P polls its WRITEs, D its reservation, until D's state is not PROC (hang guard only)."""
    end = time.monotonic() + guard_s
    while (state := d.reservations.state(token)) == "PROC":
        p.push_writes.poll()
        assert time.monotonic() < end, "push still in flight"
        time.sleep(0.001)
    return state


def push_once(p, d, peer, target, p_ids, d_ids, n, rid, cached=0, timeout_s=30.0):
    res = d.reservations.reserve([peer], n, d_ids, cached, rid, timeout_s)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    p.push_writes.post(tok, p.save(p_ids, num_tokens=n, request_id=rid))
    return res


@pytest.mark.parametrize("case,counts,n", [("one_group", [3], 40), ("hybrid", [3, 6], 90), ("seeds3", [3], 300)])
def test_equal_geometry_is_one_descriptor_and_byte_exact(pd, case, counts, n):
    p, d, peer, pe, de, target = pd(case)
    rng = np.random.default_rng(1)
    p_ids = allocate_blocks(rng, pe, counts, set(), NP)
    d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP)
    before = clone_caches(de.device_caches)
    res = push_once(p, d, peer, target, p_ids, d_ids, n, "req-1")
    assert res.num_descriptors == 1  # payload and record slot merged into one row
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok and done.checked, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n)
    assert not same_bytes(before, want)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0
    assert p.stats()["push_writes_in_flight"] == 0
    p.arena.release("req-1")  # the connector frees P's span once every reservation ended
    assert p.stats()["bytes_in_use"] == 0


def test_page_sizes_differ_and_prefix_hit_with_window_holes(pd):
    p, d, peer, pe, de, target = pd("seeds3", p_tpb=[128], d_tpb=[64])
    before = clone_caches(de.device_caches)
    res = push_once(p, d, peer, target, [[5, 9]], [[20, 21, 22]], 160, "s3")
    assert settle(p, d, res.token) == "DONE"
    assert d.reservations.complete(res.token).ok
    want = expected_pull(before, de, [[20, 21, 22]], pe.device_caches, pe, [[5, 9]], 160)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)

    p, d, peer, pe, de, target = pd("hybrid")
    rng = np.random.default_rng(2)
    p_ids = allocate_blocks(rng, pe, [3, 6], set(), NP)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    p_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    d_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    before = clone_caches(de.device_caches)
    res = push_once(p, d, peer, target, p_ids, d_ids, 90, "swa", cached=32)
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, 90, 32)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)


def test_a_hole_on_p_under_a_page_d_reads_fails_the_load_and_writes_nothing(pd):
    p, d, peer, pe, de, target = pd("hybrid")
    rng = np.random.default_rng(3)
    p_ids = allocate_blocks(rng, pe, [3, 6], set(), NP)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    p_ids[1][:2] = [NO_BLOCK, NO_BLOCK]  # P dropped pages D wants
    before = clone_caches(de.device_caches)
    res = push_once(p, d, peer, target, p_ids, d_ids, 90, "hole")
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert not done.ok and "P holds no page" in done.error
    assert same_bytes(de.device_caches, before)
    assert d.stats()["bytes_in_use"] == 0


def test_a_byte_flipped_in_p_span_fails_the_sums(pd):
    p, d, peer, pe, de, target = pd("one_group")
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "flip", 30.0)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    record = p.save([[0, 1, 2]], num_tokens=40, request_id="flip")
    p.arena.buffer[record.offset + 100] ^= 0x40
    p.push_writes.post(tok, record)
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert not done.ok and "sum" in done.error.lower()


def test_a_scatter_that_raises_fails_the_load_and_ends_the_reservation(pd, monkeypatch):
    """Whatever the landing raises (a torch or CUDA error in the scatter, not only a
    refused record) is this load's failure: complete() returns it, never raises it, so
    the connector's failure path finds the reservation ended (it would raise there)."""
    p, d, peer, pe, de, target = pd("one_group")
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "boom", 30.0)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    p.push_writes.post(tok, p.save([[0, 1, 2]], num_tokens=40, request_id="boom"))
    assert settle(p, d, res.token) == "DONE"

    def scatter_fails(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(push_reservations, "land", scatter_fails)
    done = d.reservations.complete(res.token)
    assert not done.ok and "RuntimeError: CUDA error" in done.error
    with pytest.raises(ValueError, match="unknown reservation token"):
        d.reservations.state(res.token)  # ended: nothing left for the caller to fail


def test_reservations_are_checked_before_nixl(pd):
    p, d, peer, pe, de, target = pd("one_group")
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "chk", 30.0)
    item = list(res.items[peer])
    (tok, rid, n, order, off, nbytes, rows, slot, timeout) = item
    arena = d.info.arena[1]

    def refused(match, **change):
        bad = dict(zip(["token", "rid", "n", "order", "off", "nbytes", "rows", "slot", "timeout"], item))
        bad.update(change)
        with pytest.raises(ValueError, match=match):
            p.push_writes.accept(target, d.info.generation, tuple(bad.values()))

    refused("token", token=b"short")
    refused("not inside", off=arena - 10)
    refused("not inside", nbytes=arena)
    refused("row", rows=[[0, nbytes - 8, 64]])
    refused("row", rows=[[0, 0, 0]])
    refused("1 to", rows=[[0, 0, 64]] * (MAX_ROWS + 1))
    refused("slot", slot=[nbytes - 8, 64])
    refused("cannot hold", slot=[slot[0], 64])
    refused("tokens or order", order="nope")
    refused("tokens or order", n=True)
    refused("timeout", timeout=float("nan"))
    with pytest.raises(ValueError, match="9 fields"):
        p.push_writes.accept(target, d.info.generation, tuple(item[:8]))
    with pytest.raises(ValueError, match="registration"):
        p.push_writes.accept(target, "0" * 16, tuple(item))
    with pytest.raises(ValueError, match="unknown push target"):
        p.push_writes.accept("nobody", d.info.generation, tuple(item))
    got = p.push_writes.accept(target, d.info.generation, tuple(item))
    with pytest.raises(ValueError, match="used already"):
        p.push_writes.accept(target, d.info.generation, tuple(item))
    # a staged request other than the reserved one: refused at post, D told never
    with pytest.raises(ValueError, match="reservation is for"):
        p.push_writes.post(got, p.save([[0, 1, 2]], num_tokens=41, request_id="chk"))
    assert p.push_writes.cancel(got) == "never"
    assert settle(p, d, res.token) == "ERR"
    assert not d.reservations.complete(res.token).ok
    assert d.stats()["bytes_in_use"] == 0  # "x" said nothing lands: the span is free
    assert p.stats()["push_writes_in_flight"] == 0 and p.stats()["bytes_in_use"] > 0


def test_write_after_d_gave_up_lands_in_the_held_span_only(pd):
    p, d, peer, pe, de, target = pd("one_group")
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "late", 0.05)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    time.sleep(0.1)
    assert d.reservations.state(res.token) == "ERR"  # D's deadline: the request fails ...
    done = d.reservations.complete(res.token)
    assert not done.ok and "deadline" in done.error and done.read_pending
    assert d.stats()["push_held_spans"] == 1  # ... its span stays held
    span = res.plan.span
    # twenty allocations meanwhile never overlap the held span
    others = [d.reservations.reserve([peer], 40, [[1, 2, 3]], 0, f"o{i}", 30.0) for i in range(20)]
    for o in others:
        s = o.plan.span
        assert s.offset + s.nbytes <= span.offset or s.offset >= span.offset + span.nbytes
    other_bytes = [d.arena.buffer[o.plan.span.offset: o.plan.span.offset + o.plan.span.nbytes].clone()
                   for o in others]
    p.push_writes.post(tok, p.save([[0, 1, 2]], num_tokens=40, request_id="late"))  # the late WRITE
    end = time.monotonic() + 30
    while d.stats()["push_held_spans"]:
        p.push_writes.poll()
        d.notifications()
        assert time.monotonic() < end
    assert same_bytes(de.device_caches, before)  # D's KV untouched by the late bytes
    for o, b in zip(others, other_bytes):
        assert torch.equal(d.arena.buffer[o.plan.span.offset: o.plan.span.offset + o.plan.span.nbytes], b)


def test_cancel_answers_never_ended_in_flight(pd):
    p, d, peer, pe, de, target = pd("one_group")
    r1 = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "c1", 30.0)
    t1 = p.push_writes.accept(target, d.info.generation, r1.items[peer])
    assert p.push_writes.cancel(t1) == "never" and p.push_writes.cancel(t1) == "never"
    r2 = d.reservations.reserve([peer], 40, [[10, 11, 12]], 0, "c2", 30.0)
    t2 = p.push_writes.accept(target, d.info.generation, r2.items[peer])
    p.push_writes.post(t2, p.save([[0, 1, 2]], num_tokens=40, request_id="c2"))
    first = p.push_writes.cancel(t2)
    assert first in ("in_flight", "ended")
    settle(p, d, r2.token)
    assert p.push_writes.cancel(t2) == "ended"
    assert d.reservations.complete(r2.token).ok
    assert settle(p, d, r1.token) == "ERR"
    d.reservations.complete(r1.token)
    assert d.stats()["bytes_in_use"] == 0


def test_notices_are_parsed_strictly():
    tok = bytes(range(16))
    assert parse_notice(notice(tok, NEVER)) == (tok, NEVER)
    for bad in (PREFIX, PREFIX + b"zz" * 16 + b"\0f", notice(tok, NEVER)[:-1] + b"q", notice(tok, NEVER) + b"x"):
        assert parse_notice(bad) is None


def test_two_processes_p_killed_after_posting():
    """P (a child) stages and posts its WRITE, then is SIGKILLed before it could say
    so: D's request fails at its deadline with its KV untouched, the span stays held
    until D learns P restarted; a second request D pulls meanwhile is byte-exact."""
    child = PrefillProcess()
    with one_torch_thread():
        try:
            de = build_case("one_group", NP)
            fill_random(de.device_caches, 2)
            d = de.manager("Dkill", buffer="arena", arena_bytes=MB)
            (p_md, _) = child.call("start", "one_group", NP, None, 1, "Pkill", {"buffer": "arena", "arena_bytes": MB})
            peer = d.add_peer(p_md)
            before = clone_caches(de.device_caches)
            res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "k1", 1.0)
            (pid,) = child.call("push_arena", d.metadata(), d.info.generation, res.items[peer], [[0, 1, 2]], 40, "k1")
            os.kill(pid, signal.SIGKILL)
            child.process.join(30)
            end = time.monotonic() + 30
            while d.reservations.state(res.token) == "PROC":
                assert time.monotonic() < end
                time.sleep(0.01)
            done = d.reservations.complete(res.token)
            assert not done.ok and "deadline" in done.error
            assert same_bytes(de.device_caches, before)
            assert d.stats()["push_held_spans"] == 1
            d.reservations.peer_restarted(peer, "0" * 16, grace_s=0.2)  # P's new registration, as D would learn it
            assert d.stats()["push_held_spans"] == 1  # not before the grace
            time.sleep(0.3)
            d.reservations.sweep()
            assert d.stats()["push_held_spans"] == 0 and d.stats()["bytes_in_use"] == 0
            d.close()
        finally:
            child.stop()


def test_push_oracle_fuzz_agrees_with_pull():
    """Random geometries (TP pairs, both orders, MLA, hybrid and GDN groups, layouts):
    a push is exact wherever the pull of the same case is, and refused where it is."""
    from kvcopy.testing.nixl import fuzz
    from kvcopy.testing.nixl.push_fuzz import run_push_case

    counts = {"exact": 0, "checked": 0}
    with one_torch_thread():
        for seed in range(7_000_000, 7_000_150):
            spec = fuzz.case(seed)
            pull, push = fuzz.run_arena_case(spec), run_push_case(spec)
            assert push.status != "wrong", (seed, push.reason, push.detail, spec.summary())
            assert push.status == pull.status, (seed, pull.status, push.status, push.reason, spec.summary())
            counts["exact"] += push.status == "exact"
            counts["checked"] += push.status == "exact" and push.checked
    assert counts["exact"] >= 100 and counts["checked"] >= 1, counts


def _held_after_deadline(p, d, peer, target, rid, d_ids):
    """A reservation P accepted and never posted, failed at D's deadline: its span held."""
    res = d.reservations.reserve([peer], 40, d_ids, 0, rid, 0.01)
    p.push_writes.accept(target, d.info.generation, res.items[peer])
    time.sleep(0.02)
    assert d.reservations.state(res.token) == "ERR"
    assert not d.reservations.complete(res.token).ok
    return res


def test_holds_for_one_p_beyond_half_of_d_arena_refuse_new_reservations(pd):
    """A P that never answers keeps D's spans held; past half of D's arena held for it,
    reserve() refuses (the load fails and recomputes) instead of filling the arena.
    P's answer to the cancel ends the holds, and reserving works again."""
    p, d, peer, pe, de, target = pd("one_group", arena_bytes=64 << 10)
    held = []
    while d.stats()["bytes_in_use"] <= (64 << 10) // 2:
        held.append(_held_after_deadline(p, d, peer, target, f"h{len(held)}", [[7, 8, 9]]))
    assert d.stats()["push_held_spans"] == len(held) >= 2
    with pytest.raises(ValueError, match="held for"):
        d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "more", 30.0)
    assert d.stats()["push_reserved"] == 0  # nothing kept for the refused one
    generation = p.info.generation
    for res in held:
        d.reservations.answered(res.token, peer, "in_flight", generation)  # in flight: still held
    assert d.stats()["push_held_spans"] == len(held)
    for res in held:
        assert p.push_writes.cancel(res.token, target) == "never"
        d.reservations.answered(res.token, peer, "never", generation)
    assert d.stats()["push_held_spans"] == 0 and d.stats()["bytes_in_use"] == 0
    res = push_once(p, d, peer, target, [[0, 1, 2]], [[7, 8, 9]], 40, "again")
    assert settle(p, d, res.token) == "DONE" and d.reservations.complete(res.token).ok


def test_a_cancel_answered_by_a_new_generation_of_p_ends_the_hold_after_the_grace(pd):
    p, d, peer, pe, de, target = pd("one_group")
    res = _held_after_deadline(p, d, peer, target, "g", [[7, 8, 9]])
    d.reservations.answered(res.token, peer, "pending", "")  # P's worker has not answered: nothing learned
    d.reservations.answered(res.token, peer, "never", "f" * 16)  # another registration answered: P restarted
    assert d.stats()["push_held_spans"] == 1  # not before the grace
    end = time.monotonic() + 30
    while d.stats()["push_held_spans"]:
        assert time.monotonic() < end
        time.sleep(0.05)
        d.reservations.sweep()
    assert d.stats()["bytes_in_use"] == 0


def test_p_refusing_a_reservation_answers_x_and_never(pd, monkeypatch):
    """A reservation P refuses (here: beyond the reservations P keeps) is answered ``x``
    over NIXL, so D fails at once, and ``never`` to a cancel; P keeps nothing of it."""
    p, d, peer, pe, de, target = pd("one_group")
    monkeypatch.setattr(push_writes, "MAX_ACCEPTED", 1)
    first = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "a", 30.0)
    p.push_writes.accept(target, d.info.generation, first.items[peer])
    second = d.reservations.reserve([peer], 40, [[10, 11, 12]], 0, "b", 30.0)
    with pytest.raises(ValueError, match="reservations not posted"):
        p.push_writes.accept(target, d.info.generation, second.items[peer])
    p.push_writes.refused(second.token, target)
    assert settle(p, d, second.token) == "ERR"
    assert not d.reservations.complete(second.token).ok
    assert p.push_writes.cancel(second.token, target) == "never" and p.stats()["push_accepted"] == 1
    monkeypatch.setattr(push_writes, "MAX_ACCEPTED", 2)
    with pytest.raises(ValueError, match="timeout"):  # P keeps a reservation at most MAX_TIMEOUT_S
        p.push_writes.accept(target, d.info.generation, (bytes(16),) + first.items[peer][1:8] + (MAX_TIMEOUT_S * 2,))


def test_a_post_raising_inside_nixl_answers_x_and_gives_the_span_back(pd, monkeypatch):
    """Something other than a refusal raising in P's post (here NIXL's post itself)
    gives the span's WRITE mark back and answers ``x`` at once: D fails long before the
    reservation's deadline, writes nothing, and P's span is freed when released (before:
    the mark stayed, so the span was never freed, and D waited for its deadline)."""
    p, d, peer, pe, de, target = pd("one_group")
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "boom", 600.0)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    record = p.save([[0, 1, 2]], num_tokens=40, request_id="boom")

    def post_read_descs(*a, **kw):
        raise RuntimeError("transport gone")
    monkeypatch.setattr(p.push_writes._agent, "post_read_descs", post_read_descs)
    with pytest.raises(RuntimeError, match="transport gone"):
        p.push_writes.post(tok, record)
    assert settle(p, d, res.token, guard_s=10.0) == "ERR"
    assert not d.reservations.complete(res.token).ok
    assert same_bytes(de.device_caches, before)
    assert d.stats()["bytes_in_use"] == 0 and p.stats()["push_writes_in_flight"] == 0
    p.arena.release("boom")
    assert p.stats()["bytes_in_use"] == 0


def _hold_then_fail(p, monkeypatch, bad, raises=1):
    """P's status checks answer PROC while ``hold`` (both WRITEs in flight in P's view,
    whatever NIXL did meanwhile), then raise ``raises`` times for each handle in ``bad``
    (kvcopy's wrapper failing: ``Agent.state`` answers NIXL's own raise ``ERR``) before
    asking NIXL, as for the others. ``mode["raised"]`` counts the raises."""
    real = p.push_writes._agent.state
    mode = {"hold": True, "raised": 0}

    def state(xfer):
        if mode["hold"]:
            return "PROC", None
        if any(xfer is b for b in bad) and mode["raised"] < raises * len(bad):
            mode["raised"] += 1
            raise RuntimeError("a bug in the status check's wrapper")
        return real(xfer)
    monkeypatch.setattr(p.push_writes._agent, "state", state)
    return mode


@pytest.mark.parametrize("how", ["status_check", "span_mark"])
@pytest.mark.parametrize("guilty", [0, 1])
def test_a_status_check_raising_for_one_write_fails_its_reservation_only(pd, monkeypatch, guilty, how):
    """Two reservations' WRITEs in flight; the status check of one handle raises (past
    ``Agent.state``: the WRITE's state unknown, so it counts in flight until a later check
    sees it end), or (``span_mark``) giving back its span's WRITE mark raises after the
    WRITE ended: that reservation alone is answered ``x`` (D fails it long before its
    deadline, its pages untouched), its span's WRITE mark is given back,
    and the other's WRITE is reaped and lands byte-exact, whichever of the two the poll
    meets first. Before, the raise left ``poll``: the reservations after it were never
    reaped (no ``f``) and the caller (P's copy thread) blamed its own request."""
    p, d, peer, pe, de, target = pd("one_group")
    before = clone_caches(de.device_caches)
    p_ids, d_ids, rids = [[[0, 1, 2]], [[3, 4, 5]]], [[[7, 8, 9]], [[10, 11, 12]]], ["first", "second"]
    bad: list = []
    mode = _hold_then_fail(p, monkeypatch, bad)
    res, toks = [], []
    for pi, di, rid in zip(p_ids, d_ids, rids):
        r = d.reservations.reserve([peer], 40, di, 0, rid, 600.0)
        tok = p.push_writes.accept(target, d.info.generation, r.items[peer])
        p.push_writes.post(tok, p.save(pi, num_tokens=40, request_id=rid))
        res.append(r)
        toks.append(tok)
    assert p.stats()["push_writes_in_flight"] == 2
    if how == "status_check":
        bad.append(p.push_writes._send[toks[guilty]].xfer)
    else:
        real_end = p.push_writes._mode.end_write

        def end_write(request_id):
            real_end(request_id)  # the mark is given back; what follows it raises
            if request_id == rids[guilty].encode():
                raise RuntimeError("bookkeeping after the mark")
        monkeypatch.setattr(p.push_writes._mode, "end_write", end_write)
    mode["hold"] = False
    ok = 1 - guilty
    assert settle(p, d, res[guilty].token, guard_s=10.0) == "ERR"  # x from P, not D's 600 s deadline
    assert settle(p, d, res[ok].token) == "DONE"
    assert not d.reservations.complete(res[guilty].token).ok
    done = d.reservations.complete(res[ok].token)
    assert done.ok and done.checked, done.error
    want = expected_pull(before, de, d_ids[ok], pe.device_caches, pe, p_ids[ok], 40)
    assert not same_bytes(before, want)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)  # the guilty's untouched
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0
    assert p.stats()["push_writes_in_flight"] == 0
    assert sorted(t for t, _, _ in p.push_writes.take_closed()) == sorted(toks)
    for rid in rids:
        p.arena.release(rid)
    assert p.stats()["bytes_in_use"] == 0  # both WRITE marks given back


def test_a_status_check_that_keeps_raising_holds_the_reservation_in_flight(pd, monkeypatch):
    """A WRITE whose status check raises (past ``Agent.state``) may still land: while the
    check raises, P neither answers D nor gives back its span's WRITE mark, and D's span
    stays reserved; once a check sees the WRITE ended, the reservation is answered ``x``
    (not ``f``: it failed), D's pages untouched and both spans freed."""
    p, d, peer, pe, de, target = pd("one_group")
    before = clone_caches(de.device_caches)
    r = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "stuck", 600.0)
    tok = p.push_writes.accept(target, d.info.generation, r.items[peer])
    bad: list = []
    mode = _hold_then_fail(p, monkeypatch, bad, raises=50)
    p.push_writes.post(tok, p.save([[0, 1, 2]], num_tokens=40, request_id="stuck"))
    bad.append(p.push_writes._send[tok].xfer)
    mode["hold"] = False
    for _ in range(40):
        p.push_writes.poll()
        assert d.reservations.state(r.token) == "PROC"
    assert p.stats()["push_writes_in_flight"] == 1 and not p.push_writes.take_closed()
    p.arena.release("stuck")  # the WRITE mark is kept: the span stays until the WRITE is seen ended
    assert p.stats()["bytes_in_use"] > 0 and d.stats()["bytes_in_use"] > 0
    assert settle(p, d, r.token, guard_s=10.0) == "ERR" and mode["raised"] == 50
    assert not d.reservations.complete(r.token).ok
    assert same_bytes(de.device_caches, before)
    assert p.stats()["push_writes_in_flight"] == 0 and d.stats()["bytes_in_use"] == 0
    assert p.stats()["bytes_in_use"] == 0  # freed at the mark's end


def test_a_chunks_status_check_raising_fails_its_reservation_only(pd, monkeypatch):
    """A chunk WRITE's status check raises while another reservation's final WRITE is in
    flight: the chunked reservation is answered ``x`` once its WRITEs ended (its partial
    stage's hold dropped), D's KV of it untouched; the other lands byte-exact."""
    p, d, pe, de, before, res, part, step, tok = _reserved_final_step(pd, "chunky")
    peer, target = next(iter(res.items)), p.push_writes.targets()
    (target,) = target
    bad: list = []
    mode = _hold_then_fail(p, monkeypatch, bad)
    step.run(step.units[0])
    p.push_writes.post_units(tok, part, step.units[0], step.units[0] + 1)
    other = d.reservations.reserve([peer], 40, [[10, 11, 12]], 0, "other", 600.0)
    tok2 = p.push_writes.accept(target, d.info.generation, other.items[peer])
    p.push_writes.post(tok2, p.save([[3, 4, 5]], num_tokens=40, request_id="other"))
    bad.append(p.push_writes._send[tok].chunks[0][0])
    mode["hold"] = False
    assert settle(p, d, res.token, guard_s=10.0) == "ERR"
    assert not d.reservations.complete(res.token).ok
    assert settle(p, d, other.token) == "DONE"
    assert d.reservations.complete(other.token).ok
    want = expected_pull(before, de, [[10, 11, 12]], pe.device_caches, pe, [[3, 4, 5]], 40)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert sorted(t for t, _, _ in p.push_writes.take_closed()) == sorted([tok, tok2])  # answered, both
    assert p.stats()["push_writes_in_flight"] == 0 and d.stats()["bytes_in_use"] == 0
    p.arena.abandon(part)  # its span goes: the chunk's hold was dropped
    p.arena.release("other")
    assert p.stats()["bytes_in_use"] == 0


def test_reservations_needing_more_rows_than_p_takes_are_refused_at_reserve(pd, monkeypatch):
    """A plan of more WRITE rows per P rank than P takes (TP sizes that differ, token
    order, long requests) fails at reserve, before anything is sent, with nothing held."""
    p, d, peer, pe, de, target = pd("hybrid")
    rng = np.random.default_rng(5)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    d_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    probe = d.reservations.reserve([peer], 90, d_ids, 32, "probe", 30.0)
    rows = len(probe.items[peer][6])
    d.reservations.fail(probe.token, "probe")
    d.reservations.release(probe.token)
    d.reservations.complete(probe.token)
    monkeypatch.setattr(push_reservations, "MAX_ROWS", rows - 1)
    with pytest.raises(ValueError, match=f"needs {rows} WRITE rows"):
        d.reservations.reserve([peer], 90, d_ids, 32, "many", 30.0)
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_reserved"] == 0


# ------------------------------------------------------------------ chunked push (layer-wise P)
def _stage_final_step(p, p_ids, n, rid):
    """P stages ``rid`` unit by unit, its last step planned (nothing copied yet)."""
    part = p.arena.begin(p.info, n, rid, 1)
    return part, p.arena.settle(part, p_ids, n)


def _chunked(p, d, target, res, peer, part, step, per_chunk=1, after_chunk=None):
    """Copy the units in span order; after every ``per_chunk`` units WRITE them as one
    chunk and let D read its notices (it scatters what landed). Returns the D units
    scattered before P's final WRITE."""
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    units = step.units
    for k in range(0, len(units), per_chunk):
        run = units[k:k + per_chunk]
        for u in run:
            step.run(u)
        if after_chunk is not None:
            after_chunk(run)
        p.push_writes.post_units(tok, part, run[0], run[-1] + 1)
        job = d.reservations._recv[res.token]
        end = time.monotonic() + 30
        while job.scattered is None or not job.scattered[run].all():  # D scatters a chunk once its c came
            p.push_writes.poll()
            assert d.reservations.state(res.token) == "PROC"
            assert time.monotonic() < end, "chunk not landed"
            time.sleep(0.001)
    before_final = int(job.scattered.sum()) if job.scattered is not None else 0
    p.push_writes.post(tok, p.arena.finish(part))
    return tok, before_final


def _outside_untouched(de, before, d_ids):
    """Every page of D outside the request's pages equals ``before``."""
    mine = {b for g in d_ids for b in g}
    for name, t in de.device_caches.items():
        others = [i for i in range(t.shape[0]) if i not in mine]
        assert torch.equal(t[others].view(torch.uint8), before[name][others].view(torch.uint8)), name  # bytes: NaNs


@pytest.mark.parametrize("case,counts,n", [("one_group", [3], 40), ("hybrid", [3, 6], 90), ("seeds3", [3], 300)])
def test_chunked_push_scatters_as_chunks_land_and_is_byte_exact(pd, case, counts, n):
    p, d, peer, pe, de, target = pd(case)
    rng = np.random.default_rng(11)
    p_ids = allocate_blocks(rng, pe, counts, set(), NP)
    d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP)
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], n, d_ids, 0, "ch", 30.0)
    part, step = _stage_final_step(p, p_ids, n, "ch")
    assert len(step.units) > 1
    tok, early = _chunked(p, d, target, res, peer, part, step)
    assert early == len(step.units)  # every unit scattered as its chunk landed, before P's final WRITE
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok and done.checked, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n)
    assert not same_bytes(before, want)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0
    assert p.stats()["push_writes_in_flight"] == 0
    p.arena.release("ch")
    assert p.stats()["bytes_in_use"] == 0


def test_chunked_push_with_holes_and_a_prefix_hit(pd):
    p, d, peer, pe, de, target = pd("hybrid")
    rng = np.random.default_rng(12)
    p_ids = allocate_blocks(rng, pe, [3, 6], set(), NP)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    p_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    d_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 90, d_ids, 32, "swa", 30.0)
    part, step = _stage_final_step(p, p_ids, 90, "swa")
    _chunked(p, d, target, res, peer, part, step, per_chunk=2)
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, 90, 32)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)


def test_a_byte_flipped_in_one_chunk_fails_the_load_and_writes_only_its_pages(pd):
    p, d, peer, pe, de, target = pd("one_group")
    d_ids = [[7, 8, 9]]
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 40, d_ids, 0, "flipc", 30.0)
    part, step = _stage_final_step(p, [[0, 1, 2]], 40, "flipc")
    flipped = []

    def flip(run):
        if not flipped:  # the first chunk's bytes change after their copy, before their WRITE
            p.arena.buffer[part.span.offset + 100] ^= 0x40
            flipped.append(run)
    _, early = _chunked(p, d, target, res, peer, part, step, after_chunk=flip)
    assert early == len(step.units)
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert not done.ok and "checksum mismatch" in done.error
    assert done.written_in == "device caches"  # the chunks wrote the request's own pages: vLLM recomputes
    _outside_untouched(de, before, d_ids)
    assert d.stats()["bytes_in_use"] == 0


def _reserved_final_step(pd, rid):
    """one_group: D reserved pages 7-9 for 40 tokens, P accepted and planned its last step."""
    p, d, peer, pe, de, target = pd("one_group")
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, rid, 30.0)
    part, step = _stage_final_step(p, [[0, 1, 2]], 40, rid)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    return p, d, pe, de, before, res, part, step, tok


def test_p_failing_mid_chunks_answers_x_after_its_writes_ended(pd):
    p, d, pe, de, before, res, part, step, tok = _reserved_final_step(pd, "midx")
    d_ids = [[7, 8, 9]]
    step.run(step.units[0])
    p.push_writes.post_units(tok, part, step.units[0], step.units[0] + 1)
    p.push_writes.refuse(tok)  # P could not finish it (a later copy failed, an abort)
    p.arena.abandon(part)  # its span goes once no WRITE reads it
    assert settle(p, d, res.token) == "ERR"
    done = d.reservations.complete(res.token)
    assert not done.ok and "will not push" in done.error
    _outside_untouched(de, before, d_ids)
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["push_writes_in_flight"] == 0
    with pytest.raises(ValueError):
        p.push_writes.post_units(tok, part, 1, 2)  # answered: nothing more is posted


def test_post_units_is_checked(pd):
    p, d, peer, pe, de, target = pd("one_group")
    res = d.reservations.reserve([peer], 40, [[7, 8, 9]], 0, "chk2", 30.0)
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    part = p.arena.begin(p.info, 40, "chk2", 1)
    p.arena.settle(part, [[0, 1, 2]], 16)
    with pytest.raises(ValueError, match="last step"):
        p.push_writes.post_units(tok, part, 0, 1)  # not the last step yet: units are not final
    step = p.arena.settle(part, [[0, 1, 2]], 40)
    for u in step.units:
        step.run(u)
    with pytest.raises(ValueError, match="out of range"):
        p.push_writes.post_units(tok, part, 0, 99)
    p.push_writes.post_units(tok, part, 0, 1)
    with pytest.raises(ValueError, match="sent already"):
        p.push_writes.post_units(tok, part, 0, 2)
    other = p.arena.begin(p.info, 40, "other", 1)
    p.arena.settle(other, [[3, 4, 5]], 40)
    with pytest.raises(ValueError, match="reservation is for"):
        p.push_writes.post_units(tok, other, 1, 2)


def test_chunk_notices_are_parsed_strictly():
    tok = bytes(range(16))
    assert parse_chunk_notice(chunk_notice(tok, 2, 5)) == (tok, 2, 5)
    good = chunk_notice(tok, 2, 5)
    for bad in (good[:-1] + b"q", chunk_notice(tok, 5, 5), good.replace(b"\x002\x00", b"\x00-2\x00"),
                good.replace(b"\x002\x00", b"\x001234567\x00"), PREFIX + b"zz" * 16 + b"\x001\x002\x00c"):
        assert parse_chunk_notice(bad) is None
    assert parse_notice(good) is None


def test_post_units_of_a_finished_part_leaves_the_final_write_whole(pd):
    """A chunk asked for after the request's record was made (its partial stage finished:
    hold_part refuses it) changes nothing: the final WRITE is still the one descriptor of
    a whole-request push (before: the refused chunk had marked the reservation chunked,
    and the final WRITE took the chunked path, 2 descriptors)."""
    p, d, pe, de, before, res, part, step, tok = _reserved_final_step(pd, "late")
    d_ids = [[7, 8, 9]]
    for u in step.units:
        step.run(u)
    record = p.arena.finish(part)
    with pytest.raises(ValueError, match="not being staged unit by unit"):
        p.push_writes.post_units(tok, part, 0, 1)
    assert p.push_writes.sent_units(tok) is None
    assert p.push_writes.post(tok, record)[1] == 1
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, [[0, 1, 2]], 40)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert p.stats()["push_chunks_posted"] == 0


def test_a_chunk_post_that_raises_leaves_its_units_to_the_final_write(pd, monkeypatch):
    """``post_units`` raising after it marked the units sent and held the partial stage
    (the post itself raising here) undoes both: the units are not counted as sent (the
    final WRITE carries them: D's KV whole, not with holes) and the hold is dropped (the
    span can go). Before, the units stayed marked and the final WRITE left them out."""
    p, d, pe, de, before, res, part, step, tok = _reserved_final_step(pd, "undo")
    for u in step.units:
        step.run(u)
    real = p.push_writes._agent.post_read_descs

    def boom(*args, **kwargs):
        raise RuntimeError("a bug past NIXL's post")
    monkeypatch.setattr(p.push_writes._agent, "post_read_descs", boom)
    with pytest.raises(RuntimeError, match="past NIXL"):
        p.push_writes.post_units(tok, part, 0, 1)
    assert p.push_writes.sent_units(tok) is None and part.writing == 0
    monkeypatch.setattr(p.push_writes._agent, "post_read_descs", real)
    assert p.push_writes.post(tok, p.arena.finish(part))[1] == 1  # the whole request, one descriptor
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert done.ok, done.error
    want = expected_pull(before, de, [[7, 8, 9]], pe.device_caches, pe, [[0, 1, 2]], 40)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)


# ------------------------------------------------------------------ chunked push landing on a GPU D
# The GPU path (ArenaStaging.streams set) driven on the CPU by recorded streams
# (kvcopy.testing.streams): its events are late once, so a verdict or a free that does
# not ask again before acting is caught.
def _gpu_path(d, monkeypatch):
    """D takes the GPU path with recorded streams; every fold is checked to come after its
    event completed; ``.cpu()`` of any tensor fails (on a GPU: a host wait)."""
    ops = RecordedStreams()
    d.arena.streams = ops
    real = push_units.UnitSums._fold_host

    def fold_host(self, entry):
        assert entry[2].done, f"sums folded before {entry[2].name} completed"
        real(self, entry)
    monkeypatch.setattr(push_units.UnitSums, "_fold_host", fold_host)

    def no_cpu(self, *a, **k):
        raise AssertionError(".cpu() on the engine thread: a host wait on a GPU")
    monkeypatch.setattr(torch.Tensor, "cpu", no_cpu)
    return ops


def _chunks_but_the_tail(p, d, target, res, peer, part, step, after_copy=None):
    """Every unit but the last WRITten as its own chunk and scattered by D at its ``c``;
    the last one copied, left to P's final WRITE. Returns P's token."""
    tok = p.push_writes.accept(target, d.info.generation, res.items[peer])
    job = d.reservations._recv[res.token]
    for u in step.units[:-1]:
        step.run(u)
        if after_copy is not None:
            after_copy(u)
        p.push_writes.post_units(tok, part, u, u + 1)
        end = time.monotonic() + 30
        while job.scattered is None or not job.scattered[u]:
            p.push_writes.poll()
            assert d.reservations.state(res.token) == "PROC"
            assert time.monotonic() < end, "chunk not landed"
            time.sleep(0.001)
    step.run(step.units[-1])
    return tok


@pytest.mark.parametrize("case,counts,n", [("one_group", [3], 40), ("hybrid", [3, 6], 90), ("seeds3", [3], 300)])
def test_a_gpu_d_scatters_chunks_at_c_and_reports_after_the_events(pd, monkeypatch, case, counts, n):
    p, d, peer, pe, de, target = pd(case)
    ops = _gpu_path(d, monkeypatch)
    rng = np.random.default_rng(21)
    p_ids = allocate_blocks(rng, pe, counts, set(), NP)
    d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP)
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], n, d_ids, 0, "g", 30.0)
    assert d.reservations._recv[res.token].rw.units is not None  # a GPU D plans its units too
    part, step = _stage_final_step(p, p_ids, n, "g")
    assert len(step.units) > 1
    tok = _chunks_but_the_tail(p, d, target, res, peer, part, step)
    job = d.reservations._recv[res.token]
    assert int(job.scattered.sum()) == len(step.units) - 1  # scattered at their c, before P's f
    chunk_events = [e for _, kind, e, stream in ops.entries("record")]
    assert len(chunk_events) == len(step.units) - 1 and {e[3] for e in ops.entries("record")} == {"current"}
    p.push_writes.post(tok, p.arena.finish(part))
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert len(ops.entries("record")) == len(step.units)  # the tail's scatter, at f
    assert not done.ready  # the tail's sums are on their way: the verdict is pending
    assert done.ready and done.ok and done.checked, done.error
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n)
    assert not same_bytes(before, want)
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0  # the events asked again: freed
    assert ops.entries("synchronize") == []  # no host wait on the engine thread
    p.arena.release("g")


def test_a_gpu_d_keeps_its_span_while_a_chunk_scatter_may_read_it(pd, monkeypatch):
    p, d, pe, de, before, res, part, step, tok = _reserved_final_step(pd, "gx")
    ops = _gpu_path(d, monkeypatch)
    step.run(step.units[0])
    p.push_writes.post_units(tok, part, step.units[0], step.units[0] + 1)
    job = d.reservations._recv[res.token]
    end = time.monotonic() + 30
    while job.scattered is None or not job.scattered[step.units[0]]:
        p.push_writes.poll()
        d.reservations.state(res.token)
        assert time.monotonic() < end, "chunk not landed"
        time.sleep(0.001)
    (event,) = d.arena._scattering[job.rw.work.offset]
    event.query = lambda: False  # the GPU has not run that scatter yet
    p.push_writes.refuse(tok)
    p.arena.abandon(part)
    assert settle(p, d, res.token) == "ERR"
    done = d.reservations.complete(res.token)
    assert not done.ok and done.written_in == "device caches"  # the chunk wrote the request's own pages
    _outside_untouched(de, before, [[7, 8, 9]])
    for _ in range(3):
        assert d.stats()["bytes_in_use"] == job.rw.work.nbytes  # not freed: the scatter may still read it
    del event.query  # the scatter ran (late once: the next ask says done)
    assert d.stats()["bytes_in_use"] == job.rw.work.nbytes
    assert d.stats()["bytes_in_use"] == 0
    assert ops.entries("synchronize") == []


def test_a_gpu_d_failing_the_sums_after_chunks_reports_device_caches(pd, monkeypatch):
    p, d, peer, pe, de, target = pd("one_group")
    ops = _gpu_path(d, monkeypatch)
    d_ids = [[7, 8, 9]]
    before = clone_caches(de.device_caches)
    res = d.reservations.reserve([peer], 40, d_ids, 0, "gflip", 30.0)
    part, step = _stage_final_step(p, [[0, 1, 2]], 40, "gflip")

    def flip(u):
        if u == step.units[0]:  # the first chunk's bytes change after their copy (summed), before their WRITE
            p.arena.buffer[part.span.offset + 100] ^= 0x40
    tok = _chunks_but_the_tail(p, d, target, res, peer, part, step, flip)
    p.push_writes.post(tok, p.arena.finish(part))
    assert settle(p, d, res.token) == "DONE"
    done = d.reservations.complete(res.token)
    assert not done.ready
    assert done.ready and not done.ok and "checksum mismatch" in done.error
    assert done.written_in == "device caches"  # the chunks and the tail wrote the request's own pages
    _outside_untouched(de, before, d_ids)
    assert d.stats()["bytes_in_use"] == 0
    assert ops.entries("synchronize") == []


def _cuda_caches(caches):
    made = {}
    return {n: made.setdefault(id(t), t.cuda()) for n, t in caches.items()}


def _no_host_wait(m):
    """``torch.cuda.synchronize``, an event's ``synchronize`` and ``.cpu()`` of a CUDA tensor raise."""
    def refuse(*a, **k):
        raise AssertionError("a host wait on the engine thread")
    m.setattr(torch.cuda, "synchronize", refuse)
    m.setattr(torch.cuda.Event, "synchronize", refuse)
    real_cpu = torch.Tensor.cpu
    m.setattr(torch.Tensor, "cpu", lambda self, *a, **k: refuse() if self.is_cuda else real_cpu(self, *a, **k))


@pytest.mark.gpu
@pytest.mark.parametrize("case,counts,n", [("one_group", [3], 40), ("hybrid", [3, 6], 90)])
def test_gpu_d_on_cuda_lands_chunks_at_c_byte_exact(monkeypatch, case, counts, n):
    """Real CUDA: D's KV on the GPU, its chunk scatters enqueued at each c with their sums
    read back behind them; no host wait while it lands, the verdict polled, bytes
    compared with the rule."""
    with one_torch_thread():
        pe, de = build_case(case, NP), build_case(case, NP)
        fill_random(pe.device_caches, 1)
        fill_random(de.device_caches, 2)
        rng = np.random.default_rng(31)
        p_ids = allocate_blocks(rng, pe, counts, set(), NP)
        d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP)
        want = expected_pull(clone_caches(de.device_caches), de, d_ids, pe.device_caches, pe, p_ids, n)
        de.device_caches = _cuda_caches(de.device_caches)
        p = pe.manager("Pg", buffer="arena", arena_bytes=MB)
        d = de.manager("Dg", buffer="arena", arena_bytes=MB)
        try:
            assert d.arena.streams is not None
            peer = d.add_peer(p.metadata())
            target = p.add_target(d.metadata())
            res = d.reservations.reserve([peer], n, d_ids, 0, "cg", 30.0)
            part, step = _stage_final_step(p, p_ids, n, "cg")
            with monkeypatch.context() as m:
                _no_host_wait(m)
                tok = _chunks_but_the_tail(p, d, target, res, peer, part, step)
                assert int(d.reservations._recv[res.token].scattered.sum()) == len(step.units) - 1
                p.push_writes.post(tok, p.arena.finish(part))
                assert settle(p, d, res.token) == "DONE"
                done = d.reservations.complete(res.token)
                end = time.monotonic() + 30
                while not done.ready:
                    assert time.monotonic() < end
                    time.sleep(0.001)
                assert done.ok and done.checked, done.error
            got = {name: t.cpu() for name, t in de.device_caches.items()}
            assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
            assert d.stats()["bytes_in_use"] == 0
        finally:
            p.close()
            d.close()
