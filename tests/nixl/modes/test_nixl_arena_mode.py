"""Arena mode (request-packed staging) end to end over real NIXL (UCX, DRAM): P packs a
request into one span, D reads it and scatters it; every byte of D's caches must equal
the token-position expectation (D poisoned first). Spans are freed on both sides; a full
arena raises ArenaFull and drops nothing; failures write nothing to the KV. Two-process
tests at the end (P in a spawned child)."""
import gc
import itertools
import json
import time
import weakref

import numpy as np
import pytest
import torch

from kvcopy.nixl import NO_BLOCK, TransferManager, remote_ranks
from kvcopy.testing.nixl import fuzz, geometries
from kvcopy.nixl.modes.spans import ArenaFull
from kvcopy.nixl.wire.record import StagedRequest
from kvcopy.nixl.modes.arena import ArenaPlan
from kvcopy.testing.nixl.engines import (
    ManagerPairs, allocate_blocks, build_case, collect_notifications, expected_pull, from_wire, one_torch_thread,
    wait,
)
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes

NP = 48
KB = 1 << 20  # test arenas: 1 MiB


@pytest.fixture
def pd():
    with one_torch_thread(), ManagerPairs() as pairs:
        yield lambda case, p_tpb=None, d_tpb=None, **kw: pairs.make(
            case, NP, p_tpb, d_tpb, "arena", **{"arena_bytes": KB, **kw})


def pull_arena(d, peer, de, d_ids, pe, p_ids, record, n, cached=0, notify=b""):
    before = clone_caches(de.device_caches)
    plan = d.plan_pull(peer, record, n, d_ids, cached, request_id=record.request_id)
    h = d.pull(plan, notify=notify or record.request_id.encode())
    assert wait(d, h) == "DONE", h.error
    done = d.complete(h)
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n, cached)
    assert done.ok, done.error
    assert not same_bytes(before, want)  # the case moves bytes: it can fail
    assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    return plan


@pytest.mark.parametrize("case,counts,n", [("one_group", [3], 40), ("hybrid", [3, 6], 90), ("seeds3", [3], 300)])
def test_equal_geometry_is_one_descriptor_and_frees_both_spans(pd, case, counts, n):
    p, d, peer, pe, de = pd(case)
    rng = np.random.default_rng(1)
    p_ids = allocate_blocks(rng, pe, counts, set(), NP)
    d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP)  # D reserved more
    record = p.save(p_ids, num_tokens=n, request_id="req-1")
    assert p.stats()["bytes_in_use"] == record.nbytes > 0
    plan = pull_arena(d, peer, de, d_ids, pe, p_ids, record, n)
    assert plan.num_descriptors == 1
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["spans"] == 0
    assert collect_notifications(p, 1, 10) == [(d.name, b"req-1")]
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["high_water"] == record.nbytes


def test_sliding_window_holes_and_prefix_hit(pd):
    p, d, peer, pe, de = pd("hybrid")
    rng = np.random.default_rng(2)
    p_ids = allocate_blocks(rng, pe, [3, 6], set(), NP)
    d_ids = allocate_blocks(rng, de, [3, 6], set(), NP)
    p_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    d_ids[1][:2] = [NO_BLOCK, NO_BLOCK]
    record = p.save(p_ids, num_tokens=90, request_id="swa")
    assert record.blocks[1][:3] == (0, 0, 1)
    plan = pull_arena(d, peer, de, d_ids, pe, p_ids, record, 90, cached=32)
    # the dropped and cached pages are small gaps: read across (not scattered), one descriptor
    assert plan.num_descriptors == 1


def test_different_page_sizes(pd):
    p, d, peer, pe, de = pd("seeds3", p_tpb=[128], d_tpb=[64])
    record = p.save([[5, 9]], num_tokens=160, request_id="s3")
    pull_arena(d, peer, de, [[20, 21, 22]], pe, [[5, 9]], record, 160)


def test_full_arena_raises_and_drops_nothing(pd):
    p, d, peer, pe, de = pd("one_group", arena_bytes=64 << 10)
    span = p.save([[0, 1, 2]], num_tokens=48, request_id="a").nbytes
    p.arena.release("a")
    records = []
    ids = [[[3 * i, 3 * i + 1, 3 * i + 2]] for i in range(16)]
    with pytest.raises(ArenaFull, match="staging arena full"):
        for i, b in enumerate(ids):
            records.append((b, p.save(b, num_tokens=48, request_id=f"r{i}")))
    full = p.stats()
    assert full["failed_allocations"] == 1 and full["spans"] == len(records) >= 2
    assert full["bytes_in_use"] == len(records) * span
    # D's arena is as small: one plan in flight more than P's spans does not fit
    plans = []
    with pytest.raises(ArenaFull):
        for k in range(len(records) + 1):
            rec = records[k % len(records)][1]
            plans.append(d.plan_pull(peer, rec, 48, [[30 + k, 20 + k, 10 + k]], request_id=rec.request_id))
    assert d.stats()["failed_allocations"] == 1 and len(plans) == len(records)
    for plan in plans:
        d.discard(plan)
    assert d.stats()["bytes_in_use"] == 0
    # every staged request is still intact: pull each in turn
    for k, (b, rec) in enumerate(records):
        pull_arena(d, peer, de, [[40, 41, 42]], pe, b, rec, 48, notify=f"r{k}".encode())
    collect_notifications(p, len(records), 10)
    assert p.stats()["bytes_in_use"] == 0
    p.save([[0, 1, 2]], num_tokens=48, request_id="again")  # room again


def test_save_waits_for_space_until_a_notification_or_its_deadline(pd):
    p, d, peer, pe, de = pd("one_group", arena_bytes=64 << 10)
    records = []
    with pytest.raises(ArenaFull):
        for i in range(16):
            b = [[3 * i, 3 * i + 1, 3 * i + 2]]
            records.append((b, p.save(b, num_tokens=48, request_id=f"w{i}")))
    assert p.stats()["failed_allocations"] == 1
    with pytest.raises(ValueError, match="space_timeout_s"):
        p.save([[0, 1, 2]], num_tokens=48, request_id="x", space_timeout_s=-1)
    t0 = time.monotonic()
    with pytest.raises(ArenaFull):  # nothing frees a span: it waited, then raised
        p.save([[0, 1, 2]], num_tokens=48, request_id="late", space_timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert p.stats()["failed_allocations"] == 2  # one per refused save, not per retry
    # D reads one staged request; its notification frees that span while save waits
    b, rec = records[0]
    pull_arena(d, peer, de, [[40, 41, 42]], pe, b, rec, 48)
    got = p.save([[45, 46, 47]], num_tokens=48, request_id="waited", space_timeout_s=30)
    assert got.offset == rec.offset and p.stats()["failed_allocations"] == 2
    assert "w0" not in p.arena.staged and "waited" in p.arena.staged
    assert p.notifications() == {d.name: [b"w0"]}  # what save read is kept for the caller


def test_save_larger_than_the_arena_does_not_wait(pd):
    p, d, peer, pe, de = pd("one_group", arena_bytes=64 << 10)
    t0 = time.monotonic()
    with pytest.raises(ArenaFull, match="more than the whole arena") as info:
        p.save([list(range(NP))], num_tokens=16 * NP, request_id="huge", space_timeout_s=20)
    assert info.value.ever_fits is False
    assert time.monotonic() - t0 < 10  # no retry can help: raised without waiting
    assert p.stats()["failed_allocations"] == 1 and p.stats()["spans"] == 0


def test_ttl_frees_p_spans(pd):
    p, d, peer, pe, de = pd("one_group", arena_ttl_s=0.5)  # the shortest TTL a manager takes
    p.save([[1, 2]], num_tokens=20, request_id="old")
    p.notifications()
    assert p.arena.staged == ["old"]
    time.sleep(0.55)
    p.notifications()
    assert p.stats()["bytes_in_use"] == 0 and p.arena.staged == []


def test_readers_are_distinct_d_agents(pd):
    """readers=2: P frees the span once two different D agents reported; the same D
    reporting twice (a retried pull) counts once."""
    p, d, peer, pe, de = pd("one_group")
    de2 = build_case("one_group", NP)
    fill_random(de2.device_caches, 33)
    d2 = de2.manager(f"{d.name}-second", buffer="arena", arena_bytes=KB)
    try:
        peer2 = d2.add_peer(p.metadata())
        record = p.save([[1, 2]], num_tokens=20, request_id="two", readers=2)
        pull_arena(d, peer, de, [[7, 8]], pe, [[1, 2]], record, 20)
        assert collect_notifications(p, 1, 10) == [(d.name, b"two")]
        pull_arena(d, peer, de, [[9, 10]], pe, [[1, 2]], record, 20)  # the same reader again
        assert collect_notifications(p, 1, 10) == [(d.name, b"two")]
        assert p.stats()["spans"] == 1 and p.arena.staged == ["two"]  # still one reader to come
        pull_arena(d2, peer2, de2, [[3, 4]], pe, [[1, 2]], record, 20)
        assert collect_notifications(p, 1, 10) == [(d2.name, b"two")]
        assert p.stats()["spans"] == 0
    finally:
        d2.close()


def test_failed_pull_writes_nothing_and_frees_d_span(pd):
    p, d, peer, pe, de = pd("one_group")
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="gone")
    plan = d.plan_pull(peer, record, 40, [[10, 11, 12]], request_id="gone")
    before = clone_caches(de.device_caches)
    p.close()  # P goes away before the READ
    d.remove_peer(peer)
    with pytest.raises(ValueError, match="removed or re-added|unknown peer"):
        d.pull(plan)
    d.discard(plan)
    assert d.stats()["bytes_in_use"] == 0
    assert same_bytes(de.device_caches, before)


def test_records_from_the_peer_are_checked(pd):
    """Records are parsed through the schema (tests/nixl/wire/test_nixl_record.py has the wire
    form's mutations); here, the checks D makes against the peer's handshake."""
    p, d, peer, pe, de = pd("one_group")
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="x")
    assert StagedRequest.from_bytes(record.to_bytes()) == record
    bad = [
        (dict(record.to_dict(), order="other"), "order: 'other' is not one of"),
        (dict(record.to_dict(), offset=-1), r"offset: -1 out of range"),
        (dict(record.to_dict(), blocks=[[1, 2, 1]]), r"blocks\[0\]\[1\]: 2 out of range \[0, 1\]"),
        ({"engine": "P"}, "malformed"),
    ]
    for d_, words in bad:
        with pytest.raises(ValueError, match=words):
            StagedRequest.from_dict(d_)
    with pytest.raises(ValueError, match="bad magic"):
        StagedRequest.from_bytes(b"\xff")
    with pytest.raises(TypeError, match="must be bytes"):
        StagedRequest.from_bytes(record.to_dict())
    d.discard(d.plan_pull(peer, record.to_bytes(), 40, [[10, 11, 12]], request_id="x"))  # the wire form is accepted
    for rec, words in [
        (StagedRequest(**{**record.__dict__, "offset": p.info.arena[1]}), "inside the peer's"),
        (StagedRequest(**{**record.__dict__, "engine": "someone"}), "given for peer"),
        (StagedRequest(**{**record.__dict__, "num_tokens": 20}), "staged 20 tokens"),
        (StagedRequest(**{**record.__dict__, "blocks": ((1, 1),)}), "blocks staged"),
    ]:
        with pytest.raises(ValueError, match=words):
            d.plan_pull(peer, rec, rec.num_tokens if "staged" not in words else 40, [[10, 11, 12]], request_id="x")
        with pytest.raises(ValueError, match=words):  # the same record in wire form
            d.plan_pull(peer, rec.to_bytes(), rec.num_tokens if "staged" not in words else 40, [[10, 11, 12]],
                        request_id="x")
    assert d.stats()["bytes_in_use"] == 0  # nothing allocated by the refused plans
    with pytest.raises(ValueError, match="already staged"):
        p.save([[4]], num_tokens=10, request_id="x")
    with pytest.raises(ValueError, match="num_tokens and request_id"):
        p.save([[4]])
    with pytest.raises(ValueError, match="out of range"):
        p.save([[NP + 5]], num_tokens=10, request_id="y")
    assert p.stats()["spans"] == 1  # only "x"


KEY = b"kvcopy-arena-test-key-0123456789"


def test_a_genuine_record_of_another_request_is_refused():
    """D asks for request B and is handed A's genuine, keyed record of the same length:
    before records were bound, B completed as loaded holding A's KV (the key and the
    page sums both pass: A's bytes match A's sums). plan_pull names the request it
    pulls and refuses A's record, in wire form and as an object; B's own record pulls
    B exactly."""
    with one_torch_thread(), ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", NP, buffer="arena", arena_bytes=KB, key=KEY)
        rec_a = p.save([[1, 2, 3]], num_tokens=40, request_id="A")
        rec_b = p.save([[4, 5, 6]], num_tokens=40, request_id="B")
        assert rec_a.nbytes == rec_b.nbytes  # the same size: nothing but the binding tells them apart
        before = clone_caches(de.device_caches)
        for given in (rec_a.to_bytes(KEY), rec_a):
            with pytest.raises(ValueError, match="record of request 'A' given for request 'B'"):
                d.plan_pull(peer, given, 40, [[10, 11, 12]], request_id="B")
        with pytest.raises(ValueError, match="needs request_id"):
            d.plan_pull(peer, rec_b.to_bytes(KEY), 40, [[10, 11, 12]])
        assert d.stats()["bytes_in_use"] == 0 and same_bytes(de.device_caches, before)
        h = d.pull(d.plan_pull(peer, rec_b.to_bytes(KEY), 40, [[10, 11, 12]], request_id="B"), notify=b"B")
        assert wait(d, h) == "DONE" and d.complete(h).ok
        want = expected_pull(before, de, [[10, 11, 12]], pe.device_caches, pe, [[4, 5, 6]], 40)
        assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)


def test_a_record_of_another_rank_or_an_earlier_registration_is_refused():
    """A record names P's TP rank and registration generation: P re-registered under
    the same name (restarted) makes every record of the old registration stale, even
    one whose span offset and size the new P also uses."""
    with one_torch_thread(), ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", NP, buffer="arena", arena_bytes=KB)
        old = p.save([[1, 2, 3]], num_tokens=40, request_id="A")
        with pytest.raises(ValueError, match="record of TP rank 1 given for peer"):
            d.plan_pull(peer, StagedRequest(**{**old.__dict__, "tp_rank": 1}).to_bytes(), 40, [[10, 11, 12]],
                        request_id="A")
        name = p.name
        p.close()
        d.remove_peer(peer)
        p2 = pe.manager(name, buffer="arena", arena_bytes=KB)
        pairs.made.append(p2)
        peer = d.add_peer(p2.metadata())
        new = p2.save([[1, 2, 3]], num_tokens=40, request_id="A")
        assert (new.offset, new.nbytes) == (old.offset, old.nbytes) and new.generation != old.generation
        with pytest.raises(ValueError, match="re-registered"):
            d.plan_pull(peer, old.to_bytes(), 40, [[10, 11, 12]], request_id="A")
        d.discard(d.plan_pull(peer, new.to_bytes(), 40, [[10, 11, 12]], request_id="A"))
        assert d.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("field,value", [
    ("offset", -1),  # posted a READ below P's arena
    ("offset", True),  # read as 1
    ("num_tokens", 40.0),
    ("nbytes", 8192.5),
    ("blocks", ((True, True, True),)),
    ("blocks", "abc"),
    ("request_id", b"A"),
    ("sums", {"layout": "0" * 32, "pages": ["0" * 48]}),
])
def test_record_objects_are_checked_exactly_as_wire_records(field, value):
    """A StagedRequest handed to plan_pull in-process goes through the wire form's field
    checker: each of these was accepted (and some completed ok) before; each is refused
    now as its wire form is, with nothing allocated and D's KV untouched."""
    with one_torch_thread(), ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", NP, buffer="arena", arena_bytes=KB)
        record = p.save([[1, 2, 3]], num_tokens=40, request_id="A")
        bad = StagedRequest(**{**record.__dict__, field: value})
        before = clone_caches(de.device_caches)
        with pytest.raises((ValueError, TypeError)):
            d.plan_pull(peer, bad, 40, [[10, 11, 12]], request_id="A")
        if field != "sums":  # the same fields in wire form (a PageSums dict cannot be framed)
            with pytest.raises((ValueError, TypeError)):
                d.plan_pull(peer, bad.to_bytes(), 40, [[10, 11, 12]], request_id="A")
        assert d.stats()["bytes_in_use"] == 0 and same_bytes(de.device_caches, before)
        d.discard(d.plan_pull(peer, record, 40, [[10, 11, 12]], request_id="A"))  # the genuine one is taken


def test_corrupted_records_are_refused_by_plan_pull_and_keyed_managers_authenticate_them():
    """Bit flips in the offset's digits, the order, the block flags of a record in wire
    form (which completed ok=True with foreign bytes before records carried a digest),
    and records made without the managers' shared key: plan_pull refuses each before
    allocating D's span."""
    key = KEY
    with one_torch_thread(), ManagerPairs() as pairs:
        p, d, peer, pe, de = pairs.make("one_group", NP, buffer="arena", arena_bytes=KB, key=key)
        record = p.save([[1, 2, 3]], num_tokens=40, request_id="flip")
        wire = record.to_bytes(key)
        body = json.dumps(record.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        start = len(wire) - 64 - len(body)
        refused = 0
        for field in (b'"offset":', b'"order":', b'"blocks":'):
            at = start + body.index(field) + len(field)
            for i in range(at, at + 6):
                for bit in range(8):
                    flipped = wire[:i] + bytes([wire[i] ^ (1 << bit)]) + wire[i + 1:]
                    with pytest.raises(ValueError):
                        d.plan_pull(peer, flipped, 40, [[10, 11, 12]], request_id="flip")
                    refused += 1
        for unkeyed in (record.to_bytes(), record.to_bytes(b"not-the-managers-key-0123456789")):
            with pytest.raises(ValueError, match="authenticated|HMAC"):
                d.plan_pull(peer, unkeyed, 40, [[10, 11, 12]], request_id="flip")
        assert refused == 3 * 6 * 8 and d.stats()["bytes_in_use"] == 0
        before = clone_caches(de.device_caches)
        plan = d.plan_pull(peer, wire, 40, [[10, 11, 12]], request_id="flip")
        h = d.pull(plan, notify=b"flip")
        assert wait(d, h) == "DONE" and d.complete(h).ok
        want = expected_pull(before, de, [[10, 11, 12]], pe.device_caches, pe, [[1, 2, 3]], 40)
        assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)


def test_plan_is_pulled_once(pd):
    p, d, peer, pe, de = pd("one_group")
    record = p.save([[1]], num_tokens=16, request_id="once")
    plan = d.plan_pull(peer, record, 16, [[3]], request_id="once")
    assert isinstance(plan, ArenaPlan)
    h = d.pull(plan, notify=b"once")
    with pytest.raises(ValueError, match="the plan is pulled: only a planned plan can be pulled"):
        d.pull(plan)
    wait(d, h)
    assert d.complete(h).ok


def test_plans_of_one_shape_share_cached_virtual_engines(pd):
    """Requests of one shape (page counts per group, peer, order) plan over the same
    address-free virtual engines and routes, keyed by those values and the peer's key,
    and reuse the virtual plan; each plan's rows are its own spans'; bytes stay exact.
    Another shape or a re-added peer misses; a removed peer's entries are dropped and
    it is freed."""
    p, d, peer, pe, de = pd("hybrid")
    rng = np.random.default_rng(5)
    shapes = d.arena.shapes

    def request(counts, n, rid):
        p_ids = allocate_blocks(rng, pe, counts, set(), NP)
        d_ids = allocate_blocks(rng, de, counts, set(), NP)
        return p_ids, d_ids, p.save(p_ids, num_tokens=n, request_id=rid)

    (pa, da, ra), (pb, db, rb) = request([3, 6], 90, "a"), request([3, 6], 90, "b")
    plan_a = pull_arena(d, peer, de, da, pe, pa, ra, 90)
    assert (shapes.hits, shapes.misses, len(shapes)) == (0, 1, 1)
    (shape,) = shapes.values()
    assert shape.routes.local is shape.local  # the routes of the shape's own virtual engines
    plan_b = pull_arena(d, peer, de, db, pe, pb, rb, 90)
    assert (shapes.hits, shapes.misses, len(shapes)) == (1, 1, 1)
    assert len(shape.plans) == 1  # the same virtual plan ...
    # ... with each request's own rows: P's spans differ, D's rows lie in D's span
    (_, rra), (lb, rrb) = plan_a.reads[peer], plan_b.reads[peer]
    assert int(rra[0, 0]) - int(rrb[0, 0]) == ra.offset - rb.offset != 0
    assert int(lb[0, 0]) == d.arena.base + plan_b.span.offset
    assert plan_a.local_block_ids != plan_b.local_block_ids
    for arr in (lb, plan_b.zero_runs[0]):  # handed out read-only, over bytes: no one can write them
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.setflags(write=True)
    # another shape: its own engines
    pc, dc, rc = request([2, 4], 60, "c")
    plan_c = pull_arena(d, peer, de, dc, pe, pc, rc, 60)
    assert (shapes.misses, len(shapes)) == (2, 2)
    shape_c = next(v for v in shapes.values() if v is not shape)
    assert shape_c.local is not shape.local and len(shape_c.plans) == 1
    del shape_c
    # a removed peer: its entries go, nothing keeps its record alive; re-added, it misses
    key = d._peers[peer].peer.key
    info_ref = weakref.ref(d._peers[peer].peer.info)
    shape_ref = weakref.ref(shape)
    assert shapes.holds(key) == 2 and d.arena.pairings.holds(key) == 1
    del shape, plan_a, plan_b, plan_c  # (a live plan holds its peer's record: the manager binds them)
    d.remove_peer(peer)
    gc.collect()
    assert len(shapes) == 0 and info_ref() is None and shape_ref() is None
    assert len(d.arena.pairings) == 0
    assert d.add_peer(p.metadata()) == peer
    pd_, dd, rd = request([3, 6], 90, "d")
    pull_arena(d, peer, de, dd, pe, pd_, rd, 90)
    assert (shapes.misses, len(shapes)) == (3, 1) and shapes.holds(key) == 0


# ---------------------------------------------------------------- head order (HND)
_hnd = itertools.count()


def hnd_pull(p_tp, d_tp, order, cached=0, p_tpp=16, d_tpp=16, n=71, heads=4):
    """P TP ``p_tp`` -> D TP ``d_tp`` in this process over real NIXL, HND pages, P
    staging in ``order``; every D rank's caches are checked bit-exact against the
    fuzzer's expectation. Returns the descriptors per D rank and peer."""
    layers = [f"model.layers.{i}.attn" for i in range(3)]
    p = geometries.side(p_tp, "kvf_hnd", [layers], [32], [p_tpp], n, seed=41)
    dside = geometries.side(d_tp, "kvf_hnd", [layers], [max(16, d_tpp)], [d_tpp], n, seed=42)
    spec = geometries.Spec(seed=43, dtype="bfloat16", total_kv_heads=heads, head_size=8, latent=16,
                           layers=[(name, "gqa", "full") for name in layers], num_tokens=n, num_cached=cached,
                           p=p, d=dside, d_rank=0, p_ranks=list(range(p_tp)))
    logical = geometries.logical_kv(spec)
    tag = next(_hnd)
    made, counts = [], []
    try:
        pms, records = [], []
        for r in range(p_tp):
            pm = TransferManager(f"Phnd{tag}.{r}", geometries.build_caches(spec, "p", r, logical),
                                 **geometries.manager_kwargs(spec, "p", r), buffer="arena", arena_bytes=KB,
                                 arena_order=order)
            made.append(pm)
            pms.append(pm)
            records.append(pm.save(p.block_ids, num_tokens=n, request_id="hnd"))
            assert records[-1].order == ("unit/head/chunk/page:v2" if order == "head" else "unit/chunk/page:v2")
        for dr in range(d_tp):
            ranks = remote_ranks(dr, d_tp, p_tp, heads)
            s = geometries.Spec(**{**spec.__dict__, "d_rank": dr, "p_ranks": ranks})
            d_caches = geometries.build_caches(s, "d", dr)
            dm = TransferManager(f"Dhnd{tag}.{dr}", d_caches, **geometries.manager_kwargs(s, "d", dr),
                                 buffer="arena", arena_bytes=KB)
            made.append(dm)
            peers = [dm.add_peer(pms[r].metadata()) for r in ranks]
            before = clone_caches(d_caches)
            plan = dm.plan_pull(peers, {peers[i]: records[r] for i, r in enumerate(ranks)}, n,
                                dside.block_ids, cached, request_id="hnd")
            h = dm.pull(plan, notify=b"hnd")
            assert wait(dm, h) == "DONE", h.error
            assert dm.complete(h).ok
            want, why = geometries.expected(s, before, logical)
            assert want is not None, why
            assert not same_bytes(want, before)
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
            assert dm.stats()["bytes_in_use"] == 0
            counts.append([len(rows[0]) for rows in plan.reads.values()])
        return counts, len(layers)
    finally:
        for m in made:
            m.close()


def test_head_order_equal_geometry_is_one_descriptor():
    with one_torch_thread():
        counts, _ = hnd_pull(1, 1, "head")
    assert counts == [[1]]


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (1, 2), (2, 1)])
def test_head_order_tp_is_one_descriptor_per_layer_and_peer(p_tp, d_tp):
    """A TP head slice is contiguous per layer in head order: one descriptor per
    (layer, peer) on every side of the TP change (3 layers here). Token order needs one
    per (layer, chunk, page): 3 x 2 x 5 = 30."""
    with one_torch_thread():
        head, layers = hnd_pull(p_tp, d_tp, "head")
        token, _ = hnd_pull(p_tp, d_tp, "token")
    peers = max(1, p_tp // d_tp)
    assert head == [[layers] * peers] * d_tp
    assert token == [[layers * 2 * 5] * peers] * d_tp


def test_head_order_prefix_hit_and_page_sizes():
    """A prefix hit in head order skips the cached pages of every (layer, head, chunk):
    gaps that small (2 pages of one head here) are read across, so still one
    descriptor; different page sizes still move exact bytes."""
    with one_torch_thread():
        counts, layers = hnd_pull(1, 1, "head", cached=32)
        assert counts == [[1]]
        hnd_pull(1, 1, "head", p_tpp=32, d_tpp=16)
        hnd_pull(2, 4, "head", p_tpp=16, d_tpp=32)


def test_head_order_shares_the_token_copiers_where_no_unit_splits():
    """D builds head-order copiers for the first head-order record; where no unit has
    head slabs (NHD pages here) they are the token-order ones, not a second set."""
    from kvcopy.nixl.planning.pack_order import HEAD_ORDER, ORDER

    layers = [f"model.layers.{i}.attn" for i in range(2)]
    for layout, shared in (("nhd", True), ("kvf_hnd", False)):
        side = geometries.side(1, layout, [layers], [16], [16], 40, seed=3)
        spec = geometries.Spec(seed=3, dtype="float16", total_kv_heads=2, head_size=8, latent=8,
                               layers=[(n, "gqa", "full") for n in layers], num_tokens=40, num_cached=0,
                               p=side, d=side, d_rank=0, p_ranks=[0])
        st, _ = geometries.arena_staging(spec, "d", 0, geometries.build_caches(spec, "d", 0), "D")
        try:
            assert (st.span_copiers(HEAD_ORDER) is st.span_copiers(ORDER)) == shared
        finally:
            st.close()


def test_arena_order_is_checked(pd):
    with pytest.raises(ValueError, match="arena_order"):
        pd("one_group", arena_order="heads")
    with pytest.raises(ValueError, match="needs HND pages"):
        pd("one_group", arena_order="head")  # NHD pages: a head slice is never contiguous


def test_fuzzer_arena_mode_a_few_hundred_cases():
    with one_torch_thread():
        report = fuzz.fuzz(200, seed=5, arena=True)
    assert report.wrong == 0, str(report)
    assert report.exact + report.num_raised == report.cases == 200
    assert report.num_raised < 0.05 * report.cases, str(report)


@pytest.mark.slow
def test_fuzzer_arena_mode_ten_thousand_cases():
    with one_torch_thread():
        report = fuzz.fuzz(10_000, seed=0, arena=True)
    assert report.wrong == 0, str(report)
    assert report.exact + report.num_raised == report.cases == 10_000


# ---------------------------------------------------------------- two processes
_names = itertools.count()


def start(prefill, case, arena_bytes=KB):
    n = next(_names)
    kw = {"buffer": "arena", "arena_bytes": arena_bytes}
    metadata, wire = prefill.call("start", case, NP, None, 300 + n, f"Pst{n}", kw)
    p_engine = build_case(case, NP)
    d_engine = build_case(case, NP)
    fill_random(d_engine.device_caches, 400 + n)
    d = d_engine.manager(f"Dst{n}", **kw)
    p_engine.device_caches = from_wire(wire)
    return d, d.add_peer(metadata), p_engine, d_engine


def test_two_processes_equal_geometry(prefill):
    d, peer, pe, de = start(prefill, "hybrid")
    try:
        p_ids = [[1, 2, 3], [NO_BLOCK, 10, 11, 12, 13, 14]]
        ((raw,),) = prefill.call("save_arena", p_ids, 90, "mp-1")
        record = StagedRequest.from_bytes(raw)
        plan = pull_arena(d, peer, de, [[20, 21, 22], [NO_BLOCK, 4, 5, 6, 7, 8]], pe, p_ids, record, 90)
        assert plan.num_descriptors == 1
        (got,) = prefill.call("notifications", 1)
        assert got == [(d.name, b"mp-1")]
        ((stats,),) = prefill.call("stats")
        assert stats["bytes_in_use"] == 0 and stats["high_water"] == record.nbytes
        assert d.stats()["bytes_in_use"] == 0
    finally:
        d.close()


def test_two_processes_full_arena(prefill):
    d, peer, pe, de = start(prefill, "one_group", arena_bytes=48 << 10)
    try:
        records = []
        with pytest.raises(RuntimeError, match="ArenaFull"):
            for i in range(8):
                b = [[3 * i, 3 * i + 1, 3 * i + 2]]
                ((raw,),) = prefill.call("save_arena", b, 48, f"f{i}")
                records.append((b, StagedRequest.from_bytes(raw)))
        assert len(records) >= 2
        ((stats,),) = prefill.call("stats")
        assert stats["failed_allocations"] == 1 and stats["spans"] == len(records)
        for b, rec in records:  # nothing was overwritten
            pull_arena(d, peer, de, [[40, 41, 42]], pe, b, rec, 48)
        prefill.call("notifications", len(records))
        ((stats,),) = prefill.call("stats")
        assert stats["bytes_in_use"] == 0
    finally:
        d.close()


def test_two_processes_p_killed_mid_flight(prefill):
    """P's process is killed with pulls in flight: each ends DONE (exact) or ERR (KV
    untouched); D's spans are all freed; pulls after the kill fail."""
    d, peer, pe, de = start(prefill, "one_group", arena_bytes=4 * KB)
    try:
        reqs = []
        for i in range(6):
            b = [[2 * i, 2 * i + 1]]
            ((raw,),) = prefill.call("save_arena", b, 32, f"k{i}")
            reqs.append((b, [[20 + 2 * i, 21 + 2 * i]], StagedRequest.from_bytes(raw)))
        before = clone_caches(de.device_caches)
        handles = [d.pull(d.plan_pull(peer, r, 32, q, request_id=r.request_id), notify=r.request_id.encode())
                   for _, q, r in reqs[:4]]
        prefill.process.kill()
        prefill.process.join(30)
        handles += [d.pull(d.plan_pull(peer, r, 32, q, request_id=r.request_id)) for _, q, r in reqs[4:]]
        expected, states = before, []
        deadline = time.monotonic() + 30
        for h, (b, q, _) in zip(handles, reqs):
            while d.poll(h) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            if h.state == "PROC":  # a dead peer's READ that never ends: D gives it up
                d.abort(h)
            states.append(h.state)
            done = d.complete(h)
            if done.ok:
                expected = expected_pull(expected, de, q, pe.device_caches, pe, b, 32)
            else:
                assert done.failed_block_ids == (tuple(q[0]),)
        assert states[4:] == ["ERR", "ERR"]
        assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
        st = d.stats()
        assert st["bytes_in_use"] == 0 and st["live_transfer_handles"] == 0 and st["in_flight"] == 0
    finally:
        d.close()


@pytest.mark.parametrize("order", ["token", "head"])
def test_two_processes_p_tp2_to_d_tp4(prefill, order):
    """P TP2 (two managers in the child) -> D TP4 (four here), different group plans and
    block sizes, HND on both sides: each D rank reads its KV heads from one P rank's span.
    Token order: one descriptor per (layer, chunk, page); head order: one per layer."""
    layers = [f"model.layers.{i}.attn" for i in range(4)]
    n = 71
    p = geometries.side(2, "kvf_hnd", [layers[:2], layers[2:]], [32, 32], [16, 16], n, seed=31)
    dside = geometries.side(4, "kvf_hnd", [[layers[3]], layers[:3]], [16, 16], [16, 16], n, seed=32)
    spec = geometries.Spec(seed=33, dtype="bfloat16", total_kv_heads=4, head_size=8, latent=16,
                           layers=[(name, "gqa", "full") for name in layers], num_tokens=n, num_cached=0,
                           p=p, d=dside, d_rank=0, p_ranks=[])
    tag = next(_names)
    p_names = [f"Pst{tag}.{r}" for r in range(2)]
    kw = {"buffer": "arena", "arena_bytes": KB, "arena_order": order}
    (metadata,) = prefill.call("start_spec", spec, [0, 1], p_names, kw)
    (raws,) = prefill.call("save_arena", p.block_ids, n, "tp")
    records = [StagedRequest.from_bytes(r) for r in raws]
    managers = []
    try:
        for dr in range(4):
            ranks = remote_ranks(dr, 4, 2, 4)
            s = geometries.Spec(**{**spec.__dict__, "d_rank": dr, "p_ranks": ranks})
            d_caches = geometries.build_caches(s, "d", dr)
            dm = TransferManager(f"Dst{tag}.{dr}", d_caches, **geometries.manager_kwargs(s, "d", dr), **kw)
            managers.append(dm)
            peers = [dm.add_peer(metadata[r]) for r in ranks]
            before = clone_caches(d_caches)
            plan = dm.plan_pull(peers, {peers[0]: records[ranks[0]]}, n, dside.block_ids, 0, request_id="tp")
            h = dm.pull(plan, notify=b"tp")
            assert wait(dm, h) == "DONE", h.error
            assert dm.complete(h).ok
            want, why = geometries.expected(s, before, geometries.logical_kv(s))
            assert want is not None, why
            assert not same_bytes(want, before)
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
            pages = -(-n // 16)
            if order == "token":  # a head slice is one run per (layer, chunk, page)
                assert len(layers) < plan.num_descriptors <= len(layers) * 2 * pages
            else:  # [head][chunk][page]: a head slice of a layer is one run
                assert plan.num_descriptors == len(layers)
            assert dm.stats()["bytes_in_use"] == 0
        (got,) = prefill.call("notifications", 2)
        assert [sorted(m for _, m in g) for g in got] == [[b"tp", b"tp"], [b"tp", b"tp"]]
    finally:
        for dm in managers:
            dm.close()


@pytest.mark.gpu
def test_arena_mode_with_cuda_kv():
    """CUDA KV, pinned arenas: save packs with the GPU copier, complete scatters with it."""
    with one_torch_thread():
        pe, de = build_case("one_group", NP), build_case("one_group", NP)
        fill_random(pe.device_caches, 5)
        fill_random(de.device_caches, 6)
        pe.device_caches = {k: v.cuda() for k, v in pe.device_caches.items()}
        de.device_caches = {k: v.cuda() for k, v in de.device_caches.items()}
        p = pe.manager("Pgpu", buffer="arena", arena_bytes=KB)
        d = de.manager("Dgpu", buffer="arena", arena_bytes=KB)
        try:
            peer = d.add_peer(p.metadata())
            record = p.save([[4, 9, 2]], num_tokens=40, request_id="g")
            before = {k: v.cpu() for k, v in de.device_caches.items()}
            h = d.pull(d.plan_pull(peer, record, 40, [[30, 31, 32, 33]], request_id="g"), notify=b"g")
            assert wait(d, h) == "DONE"
            assert d.complete(h).ok
            torch.cuda.synchronize()
            cpu_pe = build_case("one_group", NP)
            cpu_pe.device_caches = {k: v.cpu() for k, v in pe.device_caches.items()}
            cpu_de = build_case("one_group", NP)
            want = expected_pull(before, cpu_de, [[30, 31, 32, 33]], cpu_pe.device_caches, cpu_pe, [[4, 9, 2]], 40)
            got = {k: v.cpu() for k, v in de.device_caches.items()}
            assert same_bytes(got, want), first_difference(got, want)
        finally:
            d.close()
            p.close()


def _blocks_first_hnd(t: torch.Tensor) -> torch.Tensor:
    """The same logical ``[NB, 2, T, H, D]`` tensor over ``[NB, 2, H, T, D]`` storage
    (FlashInfer's HND page: K and V inside one page chunk, heads inside each)."""
    s = torch.empty((t.shape[0], 2, t.shape[3], t.shape[2], t.shape[4]), dtype=t.dtype).permute(0, 1, 3, 2, 4)
    s.copy_(t)
    return s


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 4)])
def test_head_order_on_blocks_first_hnd_pages(monkeypatch, p_tp, d_tp):
    """Block-first HND pages ``[NB, 2, H, T, D]`` stage in head order too: each head's
    K and V slabs, head-major, so a TP head slice is still one run per layer; bytes
    exact by the fuzzer's expectation."""
    from kvcopy.nixl.modes.base import Peer
    from kvcopy.nixl.planning.pack_order import HEAD_ORDER, stage_units

    build = geometries.build_caches

    def build_blocks_first(spec, which, rank, logical=None):
        return {n: _blocks_first_hnd(t) for n, t in build(spec, which, rank, logical).items()}

    monkeypatch.setattr(fuzz, "build_caches", build_blocks_first)
    monkeypatch.setattr(fuzz, "arena_order", lambda spec: "head")
    monkeypatch.setattr(geometries, "arena_order", lambda spec: "head")  # what arena_staging reads
    layers = [f"model.layers.{i}.attn" for i in range(3)]
    n = 45
    p = geometries.side(p_tp, "bf_kv", [layers[:2], layers[2:]], [16, 16], [16, 16], n, seed=5)
    d = geometries.side(d_tp, "bf_kv", [layers], [32], [16], n, seed=6)
    for d_rank in range(d_tp):
        spec = geometries.Spec(seed=7, dtype="bfloat16", total_kv_heads=4, head_size=8, latent=8,
                               layers=[(x, "gqa", "full") for x in layers], num_tokens=n, num_cached=0,
                               p=p, d=d, d_rank=d_rank, p_ranks=remote_ranks(d_rank, d_tp, p_tp, 4))
        with one_torch_thread():
            out = fuzz.run_arena_case(spec)
        assert out.status == "exact", (out.reason, out.detail)
    logical = geometries.logical_kv(spec)
    made = []
    try:
        d_caches = build_blocks_first(spec, "d", spec.d_rank)
        d_st, d_info = geometries.arena_staging(spec, "d", spec.d_rank, d_caches, "D")
        made.append(d_st)
        peers, records = [], {}
        for r in spec.p_ranks:
            st, info = geometries.arena_staging(spec, "p", r, build_blocks_first(spec, "p", r, logical), f"P{r}")
            made.append(st)
            assert {(u.heads, u.outer) for u in stage_units(info.regions, HEAD_ORDER)} == {(4 // p_tp, 2)}
            records[info.name] = st.stage(info, p.block_ids, n, b"q", 1)
            peers.append(Peer(len(peers), info, (), ()))
        plan, _ = d_st.plan(d_info, peers, records, n, d.block_ids, 0, request_id="q")
        # a head slice of each layer is one run per peer (fewer where runs line up across layers)
        assert all(len(rows[0]) <= len(layers) for rows in plan.reads.values())
    finally:
        for st in made:
            st.close()
