"""The arena connector's push mode (D's ``transfer_mode: "push"``) against the real vLLM 0.33 package.

P and D are vLLM's own engines with the connector (``tests/vllm/vllm_arena_engines.py``);
D reserves a span, sends P the reservation over P's side channel, P fetches D's
handshake from D's side channel and WRITEs its staged span (record included) into D's,
then says so over NIXL. D's backing buffer is compared whole after every transfer
against the expectation built from vLLM's block tables alone; where a load fails it must
not change at all.

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

import msgspec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from test_vllm_arena import ONE_SPAN, engines, prefill_process  # noqa: E402  (the fixtures, used by name)
from test_vllm_mirror import CASES, _specs, vllm_env  # noqa: E402  (the fixture)

from kvcopy.vllm.arena.push_channel import CANCEL_MSG, RESERVE_MSG, TAKE_PUSH_MSG  # noqa: E402
from kvcopy.vllm.arena.push_recv import ArenaPushReceiver  # noqa: E402
from kvcopy.testing.engine.serve import PrefillEngine  # noqa: E402
from vllm_arena_engines import (  # noqa: E402
    ask_side_channel, assert_same, decode, expected_d, fill, fill_layerwise, land, prefill, prompts, run,
)

assert engines and prefill_process and vllm_env  # fixtures, used by name
PUSH = {"transfer_mode": "push"}


def _pair(engines, case, p_kw=None, d_kw=None):
    p = engines(case, "kv_producer", **(p_kw or {}))
    d = engines(case, "kv_consumer", **dict(PUSH, **(d_kw or {})))
    assert isinstance(d.worker.arena_worker.puller, ArenaPushReceiver)
    return p, d


def _spy_reserves(d, monkeypatch):
    out = []
    real = d.manager.reservations.reserve

    def reserve(*a, **kw):
        res = real(*a, **kw)
        out.append(res)
        return res
    monkeypatch.setattr(d.manager.reservations, "reserve", reserve)
    return out


def _push(p, d, lengths, seed, limit_s=60.0):
    tokens = prompts(len(lengths), lengths, seed)
    rids = [f"r{seed}-{i}" for i in range(len(tokens))]
    params = prefill(p, rids, tokens)
    before = d.raw_bytes()
    failed = decode(d, [p], rids, tokens, params, limit_s=limit_s)
    return rids, tokens, before, failed


def _loaded(p, d, rids, tokens, before, d_rids=None):
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(r, dr, n) for r, dr, n in zip(rids, d_rids or rids, n_load)], before)
    assert (exp != before).any(), "the expectation moves nothing: the test would not see a missed load"
    assert_same(d, exp)


def test_push_one_descriptor_per_request_and_spans_freed(engines, monkeypatch):
    p, d = _pair(engines, CASES["one_group"])
    reserves = _spy_reserves(d, monkeypatch)
    pulls = []
    monkeypatch.setattr(d.manager, "pull", lambda *a, **kw: pulls.append(a))
    fill(p, d, 1)
    rids, tokens, before, failed = _push(p, d, [40, 17, 64], seed=1)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert pulls == []  # nothing was READ: P WRITEs
    assert [r.num_descriptors for r in reserves] == [1, 1, 1]  # equal geometry: one WRITE descriptor, record included
    run([p, d], lambda: p.stats()["staged_requests"] == 0)  # P's span lives pack + WRITE
    st = d.stats()
    assert st["bytes_in_use"] == 0 and st["push_held_spans"] == 0 and st["push_reserved"] == 0
    assert p.stats()["push_writes_in_flight"] == 0 and p.worker.arena_worker.sender.refused == 0


def _concurrent(p) -> dict:
    """D's kv_transfer_params from a concurrent proxy: P's coordinates, not P's answer."""
    host, port = p.worker.arena_worker.listener
    return PrefillEngine(p.sched.connector.connector_scheduler.engine_id, host, port).decode_params("proxy-id")


def test_concurrent_dispatch_reservation_before_p_has_the_request_matched_by_base_id(engines):
    """D gets the request first (no P answer: D names its own id); its reservation waits
    on P, which has no such request yet; P then computes the same client request under
    its own engine suffix, matches the reservation by vLLM's base id and WRITEs."""
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 9)
    tokens = prompts(2, [56, 33], seed=9)
    p_rids, d_rids = ["cc-0-1a2b3c4d", "cc-1-00c0ffee"], ["cc-0-5e6f7a8b", "cc-1-deadbeef"]
    before = d.raw_bytes()
    for rid, t in zip(d_rids, tokens):
        d.add(rid, t, _concurrent(p), max_tokens=2)
    run([d], lambda: p.stats()["push_accepted"] == 2)  # P holds both reservations, knows neither request
    for rid, t in zip(p_rids, tokens):
        p.add(rid, t, {"do_remote_decode": True})
    assert land(d, [p], d_rids) == set()
    _loaded(p, d, p_rids, tokens, before, d_rids)
    assert p.worker.arena_worker.sender.refused == 0
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)


def test_a_post_that_raises_fails_its_own_reservation_only_and_the_step_goes_on(engines, monkeypatch):
    """Two reservations posted in one step of P (concurrent dispatch: both wait on P, whose
    prefills of the two end in one step); the second request's post raises (NIXL or UCX,
    not a ValueError), before or after the first's (the order P's listener got the two
    RESERVEs): that reservation alone is answered x at once (D recomputes it, its KV
    untouched), the first's WRITE lands byte-exact and its f comes, and P's span of each
    is freed. Before, the raise left the step (the save's: out of P's engine step; the copy
    thread's: the request it worked for was given up, whichever post had raised)."""
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 22)
    tokens = prompts(2, [56, 33], seed=22)
    p_rids, d_rids = ["pr-0-1a2b3c4d", "pr-1-00c0ffee"], ["pr-0-5e6f7a8b", "pr-1-deadbeef"]
    before = d.raw_bytes()
    sender = p.worker.arena_worker.sender
    steps, posts = [0], []
    real_step, real_post = sender.step, p.manager.push_writes.post

    def step():
        steps[0] += 1
        real_step()

    def post(token, record, **kw):
        posts.append((record.request_id, steps[0]))
        if record.request_id == p_rids[1]:
            raise RuntimeError("the WRITE's post failed")
        return real_post(token, record, **kw)
    monkeypatch.setattr(sender, "step", step)
    monkeypatch.setattr(p.manager.push_writes, "post", post)
    for rid, t in zip(d_rids, tokens):
        d.add(rid, t, _concurrent(p), max_tokens=2)
    run([d], lambda: p.stats()["push_accepted"] == 2)  # P holds both reservations, knows neither request
    for rid, t in zip(p_rids, tokens):
        p.add(rid, t, {"do_remote_decode": True})
    assert land(d, [p], d_rids, limit_s=30) == {d_rids[1]}  # x, well inside D's 60 s
    # one step posted both, in the order P's listener got D's two RESERVEs (two connections: either may be first)
    assert sorted(r for r, _ in posts) == p_rids and posts[0][1] == posts[1][1]
    _loaded(p, d, p_rids[:1], tokens[:1], before, d_rids[:1])  # the first byte-exact, the second's KV untouched
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["push_writes_in_flight"] == 0 and p.stats()["bytes_in_use"] == 0 and sender.refused == 0


def test_matching_a_reservation_that_raises_fails_it_alone(engines, monkeypatch):
    """Two reservations waiting on P (concurrent dispatch); matching the first of them to
    P's requests raises: that reservation alone is answered x at once (D recomputes it,
    its KV untouched), the second is matched, posted and lands byte-exact. Before, the
    raise left the step before the second was served, every turn (the housekeeper logged
    it), and at wait_for_save out of P's engine step."""
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 23)
    tokens = prompts(2, [56, 33], seed=23)
    p_rids, d_rids = ["mr-0-1a2b3c4d", "mr-1-00c0ffee"], ["mr-0-5e6f7a8b", "mr-1-deadbeef"]
    before = d.raw_bytes()
    sender = p.worker.arena_worker.sender
    real_match, raised = sender._match, []

    def match(token, named):
        if named == d_rids[0]:
            raised.append(named)
            raise RuntimeError("matching failed")
        return real_match(token, named)
    for rid, t in zip(d_rids, tokens):
        d.add(rid, t, _concurrent(p), max_tokens=2)
    run([d], lambda: p.stats()["push_accepted"] == 2)  # P holds both reservations, knows neither request
    monkeypatch.setattr(sender, "_match", match)
    for rid, t in zip(p_rids, tokens):
        p.add(rid, t, {"do_remote_decode": True})
    assert land(d, [p], d_rids, limit_s=30) == {d_rids[0]}  # x, well inside D's 60 s
    assert raised
    _loaded(p, d, p_rids[1:], tokens[1:], before, d_rids[1:])  # the second byte-exact, the first's KV untouched
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["push_writes_in_flight"] == 0 and p.stats()["bytes_in_use"] == 0


def test_concurrent_dispatch_refuses_a_base_id_two_of_ps_requests_share(engines):
    """Two requests on P with one base id (a client sent one X-Request-Id twice): D's
    reservation by that base is refused as ambiguous (x), so D recomputes at once, its KV
    untouched; P's two spans are not WRITten."""
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 10)
    tokens = prompts(2, [40, 40], seed=10)
    prefill(p, ["dup-0-00000001", "dup-0-00000002"], tokens)
    before = d.raw_bytes()
    d.add("dup-0-0000000d", tokens[0], _concurrent(p), max_tokens=2)
    assert land(d, [p], ["dup-0-0000000d"], limit_s=30) == {"dup-0-0000000d"}  # P's x, well inside D's 60 s
    assert_same(d, before)
    sender = p.worker.arena_worker.sender
    assert sender.ambiguous == 1 and sender.refused == 1
    assert p.stats()["push_writes_in_flight"] == 0 and p.stats()["staged_requests"] == 2
    run([d], lambda: d.stats()["push_held_spans"] == 0 and d.stats()["bytes_in_use"] == 0)


@pytest.mark.parametrize("name", ["hybrid_kv_sharing", "mla", "kernel_split_32_to_16", "gdn_padded",
                                  "heads_packed_blhnc"])
def test_push_model_families(engines, name):
    p, d = _pair(engines, CASES[name])
    fill(p, d, 2)
    rids, tokens, before, failed = _push(p, d, [70, 33], seed=2)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)


def test_push_with_a_key(engines, monkeypatch):
    monkeypatch.setenv("KVCOPY_TEST_PUSH_KEY", "ab" * 32)
    kw = {"key_env": "KVCOPY_TEST_PUSH_KEY"}
    p, d = _pair(engines, CASES["one_group"], kw, kw)
    fill(p, d, 3)
    rids, tokens, before, failed = _push(p, d, [50], seed=3)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    # without the key the listener takes no reservation
    q = msgspec.msgpack.encode((TAKE_PUSH_MSG, 0))
    (reply,) = ask_side_channel(_port(p), q)
    assert "authentication" in msgspec.msgpack.decode(reply)["error"]


def _port(e) -> int:
    return e.worker.arena_worker.listener[1]


def test_d_arena_full_recomputes_at_the_push_deadline_and_p_frees_its_span(engines):
    """D's arena holds one span; a second request waits for space until push_timeout_s, then fails."""
    case = CASES["one_group"]
    p, d = _pair(engines, case, d_kw={"arena_bytes": ONE_SPAN, "push_timeout_s": 1.5})
    fill(p, d, 4)
    d.worker.arena_worker.lock.acquire()  # hold D's worker: the first request's span is not freed in time
    try:
        pr = d.worker.arena_worker.puller
        held = pr.m.arena.arena.allocate(8 << 10)  # what is left cannot hold a 64-token span
    finally:
        d.worker.arena_worker.lock.release()
    rids, tokens, before, failed = _push(p, d, [64], seed=4)
    assert failed == set(rids)  # recomputed
    assert_same(d, before)  # D's KV untouched
    run([p], lambda: p.stats()["staged_requests"] == 0)  # D's give-up freed P's span
    with d.worker.arena_worker.lock:
        pr.m.arena.arena.free(held)


def test_d_arena_full_then_space_frees_in_time(engines):
    case = CASES["one_group"]
    p, d = _pair(engines, case, d_kw={"arena_bytes": ONE_SPAN})
    fill(p, d, 5)
    rids, tokens, before, failed = _push(p, d, [64, 64], seed=5)  # one span at a time on D
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert d.stats()["failed_allocations"] >= 1  # the second waited


def test_a_write_landing_after_d_gave_up_touches_only_the_held_span(engines, monkeypatch):
    """P's post is held back past D's deadline: D recomputes with its KV untouched, its
    span stays held (never handed out) until P's WRITE ended and said so."""
    case = CASES["one_group"]
    p, d = _pair(engines, case, d_kw={"push_timeout_s": 1.0})
    fill(p, d, 6)
    sender = p.worker.arena_worker.sender
    real = sender.m.push_writes.post
    gate = {"open": False, "posted": 0}

    def post(token, record):
        while not gate["open"]:
            time.sleep(0.01)  # P's transfer thread holds the token (a slow or stopped P)
        gate["posted"] += 1
        return real(token, record)
    monkeypatch.setattr(sender.m.push_writes, "post", post)
    tokens = prompts(1, [48], 6)
    params = prefill(p, ["late"], tokens)
    before = d.raw_bytes()
    d.add("late", tokens[0], params[0], max_tokens=2)
    deadline = time.monotonic() + 30
    failed = set()
    while "late" not in failed:  # step D only: P's worker is stuck in post (its lock held)
        assert time.monotonic() < deadline
        failed |= set(d.step().failed_recving or ())
        time.sleep(0.01)
    assert_same(d, before)
    assert d.stats()["push_held_spans"] == 1  # a WRITE may still land
    span = d.manager.reservations._held[next(iter(d.manager.reservations._held))].rw.work
    others = []
    with d.worker.arena_worker.lock:
        for _ in range(20):  # allocations meanwhile never overlap the held span
            s = d.manager.arena.arena.allocate(4096)
            assert s.offset + s.nbytes <= span.offset or s.offset >= span.offset + span.nbytes
            others.append(s)
        for s in others:
            d.manager.arena.arena.free(s)
    gate["open"] = True  # the late WRITE lands, in the held span only; P's f frees it
    run([p, d], lambda: d.stats()["push_held_spans"] == 0 and gate["posted"] == 1)
    assert d.stats()["bytes_in_use"] == 0


def test_listener_keeps_answering_malformed_push_questions(engines):
    p, d = _pair(engines, CASES["one_group"])
    port = _port(p)
    bad = [(RESERVE_MSG,), (RESERVE_MSG, "d", 0, 1, "h", 1, "g", [[0, b"x" * 16]]), (CANCEL_MSG, "d", 0, [[0, b"1"]]),
           (TAKE_PUSH_MSG, -1), (RESERVE_MSG, "d", 5, 1, "h", 1, "g", [])]
    for q in bad:
        (reply,) = ask_side_channel(port, msgspec.msgpack.encode(q))
        assert msgspec.msgpack.decode(reply)["state"] == "failed"
    (reply,) = ask_side_channel(port, msgspec.msgpack.encode((TAKE_PUSH_MSG, 0)))
    assert msgspec.msgpack.decode(reply) == {"reserve": [], "cancel": []}


def test_p_unable_to_stage_answers_x_and_d_fails_before_its_deadline(engines):
    """P's arena cannot hold the request: P refuses the reservation with ``x``, D's load
    fails at once (not at its 60 s push deadline), its KV untouched, its span freed."""
    p, d = _pair(engines, CASES["one_group"], p_kw={"arena_bytes": ONE_SPAN})
    fill(p, d, 7)
    tokens = prompts(1, [200], seed=7)
    params = prefill(p, ["big"], tokens)
    before = d.raw_bytes()
    assert decode(d, [p], ["big"], tokens, params, limit_s=30) == {"big"}  # a guard well inside D's 60 s
    assert_same(d, before)
    run([d], lambda: d.stats()["push_held_spans"] == 0 and d.stats()["bytes_in_use"] == 0)


def test_ds_cancel_at_its_deadline_is_answered_never_and_frees_the_span(engines, monkeypatch):
    """D reserves a request P does not have (P keeps the reservation, never posts): at D's
    deadline D fails the load and sends CANCEL; P answers ``never`` (x over NIXL) and D's
    held span goes."""
    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 1.0})
    fill(p, d, 8)
    answers = []
    push = p.worker.arena_worker.sender.m.push_writes
    real = push.cancel
    monkeypatch.setattr(push, "cancel", lambda token, target=None: answers.append(real(token, target)) or answers[-1])
    tokens = prompts(1, [48], 8)
    (params,) = prefill(p, ["real"], tokens)
    ghost = dict(params, remote_request_id="ghost")
    before = d.raw_bytes()
    assert decode(d, [p], ["ghost"], tokens, [ghost]) == {"ghost"}
    assert_same(d, before)
    run([p, d], lambda: answers and d.stats()["push_held_spans"] == 0)
    assert answers[0] == "never"  # not posted, and now never (or P's own 1 s timeout said so first)
    assert d.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("p_tp,d_tp,order", [(2, 1, "token"), (1, 2, "head"), (2, 2, "token")])
def test_push_between_other_tp_sizes(engines, p_tp, d_tp, order):
    """Each D rank reserves from the P ranks holding its KV heads; each P rank WRITEs its
    share and frees its span once every D rank reading it was pushed."""
    case = CASES["hybrid_kv_sharing"]  # 2 KV heads per layer
    p = engines(case, "kv_producer", tp=p_tp, arena_order=order)
    d = engines(case, "kv_consumer", tp=d_tp, arena_order=order, **PUSH)
    fill(p, d, 19)
    tokens = prompts(2, [40, 57], seed=19)
    rids = ["t0", "t1"]
    params = prefill(p, rids, tokens)
    before = [x.raw.clone() for x in d.ranks]
    assert decode(d, [p], rids, tokens, params) == set()
    assert_same(d, expected_d(p, d, [(r, r, len(t)) for r, t in zip(rids, tokens)], before))
    run([p, d], lambda: not any(p.stats(r)["staged_requests"] for r in range(len(p.ranks))))
    assert all(d.stats(r)["bytes_in_use"] == 0 and d.stats(r)["push_landed"] == 2 for r in range(len(d.ranks)))


@pytest.mark.parametrize("name", ["hybrid_kv_sharing", "gdn_padded"])
def test_a_layerwise_p_pushes_what_it_staged_layer_by_layer(engines, name):
    """P stages layer by layer (its forward's bytes written per layer over poison, each
    layer's pages copied from save_kv_layer, GDN state by the sweep) and WRITEs the span,
    record slot included, into a push D's reservation: D's bytes equal the reference."""
    case = CASES[name]
    p, d = _pair(engines, case, p_kw={"layerwise": True})
    fill_layerwise(p, d, 8)
    rids, tokens, before, failed = _push(p, d, [40, 17], seed=8)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    layers = p.worker.arena_worker.stager.layers
    assert layers.at_layer > 0 and p.stats()["partial_requests"] == 0


def _failures(d, monkeypatch):
    """D's load failures, with their reasons, as D's worker reports them."""
    puller = d.worker.arena_worker.puller
    reasons = {}
    real = puller._fail

    def fail(job, reason):
        reasons[job.rid] = reason
        return real(job, reason)
    monkeypatch.setattr(puller, "_fail", fail)
    return reasons


def test_a_reservation_p_never_took_is_cancelled_and_its_span_freed(engines, monkeypatch):
    """P cannot reach D's side channel (so it cannot add D, take the reservation or send
    D anything over NIXL): D fails the load at its deadline, then its CANCEL, asked again
    every second, is answered ``never`` through P's listener and the held span goes."""
    from kvcopy.vllm.arena import push_send
    from vllm_arena_engines import free_port

    monkeypatch.setattr(push_send, "FETCH_TIMEOUT_S", 1.0)
    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 1.5})
    d.worker.arena_worker.puller.own = ("127.0.0.1", free_port())  # nothing listens there
    fill(p, d, 9)
    rids, tokens, before, failed = _push(p, d, [48], seed=9)
    assert failed == set(rids)
    assert_same(d, before)
    run([p, d], lambda: d.stats()["push_held_spans"] == 0, limit_s=30)
    assert d.stats()["bytes_in_use"] == 0 and p.worker.arena_worker.sender.refused == 1


def test_the_listener_bounds_what_it_keeps_and_refuses_beyond_with_an_answer(engines):
    """No key: anyone can ask. Reservations for P ranks P does not have, beyond
    MAX_QUEUED per rank, or waiting longer than P keeps one are refused with an answer;
    a genuine push still works after."""
    from kvcopy.vllm.arena import push_channel
    from kvcopy.nixl.wire.push_messages import MAX_TIMEOUT_S

    p, d = _pair(engines, CASES["one_group"])
    port = _port(p)

    def entry(p_rank, timeout=10.0):
        return [p_rank, os.urandom(16), "x", 16, "token", 0, 4096, bytes(24), 64, 512, timeout]

    def ask(q):
        (reply,) = ask_side_channel(port, msgspec.msgpack.encode(q))
        return msgspec.msgpack.decode(reply)

    d_fields = ["D", 0, 1, "127.0.0.1", 9, "g" * 16]
    assert "TP ranks" in ask((RESERVE_MSG, *d_fields, [entry(1)]))["error"]  # P has one rank
    assert "TP ranks" in ask((CANCEL_MSG, "D", 0, [[1, b"t" * 16]]))["error"]
    assert ask((RESERVE_MSG, *d_fields, [entry(0, MAX_TIMEOUT_S + 1)]))["state"] == "failed"
    assert ask((TAKE_PUSH_MSG, 1))["state"] == "failed"
    box = p.sched.connector.connector_scheduler.store.pushes
    w = p.worker.arena_worker
    with w.lock:  # P's worker takes nothing meanwhile (a TAKE already in flight takes at most 64)
        replies = [box.answer(RESERVE_MSG, d_fields + [[entry(0)]]) for _ in range(push_channel.MAX_QUEUED + 65)]
        assert sum(r["state"] == "ok" for r in replies) <= push_channel.MAX_QUEUED + push_channel.TAKE_RESERVATIONS
        assert replies[-1] == {"state": "failed", "error": f"P's ranks [0] hold {push_channel.MAX_QUEUED} "
                                                          "reservations not taken"}
        box._reserve[0].clear()  # (what P's worker would take and refuse: D's side channel is not there)
    fill(p, d, 10)
    rids, tokens, before, failed = _push(p, d, [40], seed=10)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)


def test_a_stale_reservation_is_refused_and_the_live_ones_stay(engines, monkeypatch):
    """A RESERVE naming a registration of D other than the one P added (sent before D
    re-registered, or replayed) makes P look at D's handshake again; it did not change,
    so that reservation is refused, and D's live reservation is pushed byte-exact."""
    from kvcopy.vllm.arena.push_channel import reserve_question

    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 11)
    reserves = _spy_reserves(d, monkeypatch)
    sender = p.worker.arena_worker.sender
    gate = {"open": False}
    real_step = sender.step
    monkeypatch.setattr(sender, "step", lambda: real_step() if gate["open"] else None)  # P posts nothing yet
    tokens = prompts(1, [56], 11)
    params = prefill(p, ["live"], tokens)
    before = d.raw_bytes()
    d.add("live", tokens[0], params[0], max_tokens=2)
    run([p, d], lambda: sender._waiting)  # P accepted the live reservation
    (res,) = reserves
    item = list(res.items[next(iter(res.items))])
    item[0] = os.urandom(16)
    pr = d.worker.arena_worker.puller
    stale = reserve_question(pr.engine_id, 0, 1, pr.own[0], pr.own[1], "0" * 16, {0: tuple(item)})
    (reply,) = ask_side_channel(_port(p), msgspec.msgpack.encode(stale))
    assert msgspec.msgpack.decode(reply)["state"] == "ok"
    run([p, d], lambda: sender.refused == 1)
    assert sender._waiting and p.stats()["push_accepted"] == 1  # the live one stays
    gate["open"] = True
    failed = set()
    run([p, d], lambda: "live" in d.tables or failed.update(d.step().failed_recving or ()) or failed)
    assert failed == set()
    _loaded(p, d, ["live"], tokens, before)


def test_a_reservation_p_could_not_take_fails_at_reserve_when_too_large(engines, monkeypatch):
    """TP sizes that differ in token order: a row per page per layer and P rank (here
    2 x 12 x 188); a long request's reservation outgrows what P's side channel takes
    (64 KiB). D fails the load at once with a clear error, keeps no span, and gives
    the request up to P."""
    case = dict(block_size=16, specs=_specs(12))
    p = engines(case, "kv_producer", tp=2, arena_order="token", num_blocks=220, arena_bytes=16 << 20)
    d = engines(case, "kv_consumer", tp=1, arena_order="token", num_blocks=220, arena_bytes=16 << 20, **PUSH)
    reasons = _failures(d, monkeypatch)
    fill(p, d, 12)
    tokens = prompts(1, [3000], seed=12)
    params = prefill(p, ["long"], tokens)
    before = d.raw_bytes()
    assert decode(d, [p], ["long"], tokens, params, limit_s=30) == {"long"}
    assert "more than P's side channel takes" in reasons["long"], reasons
    assert_same(d, before)
    st = d.stats()
    assert st["push_held_spans"] == 0 and st["bytes_in_use"] == 0
    run([p], lambda: not any(p.stats(r)["staged_requests"] for r in range(2)))  # D's give-up freed P's spans


def test_p_killed_mid_write_fails_its_request_and_the_span_waits_for_ps_new_generation(engines, monkeypatch,
                                                                                         prefill_process):
    """P2 (another process) posts its WRITE into D's span and is SIGKILLed at once (a
    test hook), before it could say the WRITE ended: D fails that load at its deadline
    (vLLM recomputes), D's two requests from P1 are byte-exact, and the span stays held
    while P2 is gone; a new P2 process on the same side channel answers D's cancel
    from a new registration, and the hold ends only after the grace."""
    from kvcopy.nixl.push_reservations import RESTART_GRACE_S
    from test_vllm_arena import p2_and_p1
    from vllm_arena_engines import free_port

    port = free_port()
    (p2, _pipe), p1, d, tokens, params = p2_and_p1(engines, prefill_process, monkeypatch,
                                                   dict(PUSH, push_timeout_s=3.0), port=port, kill_after_post=True)
    before = d.raw_bytes()
    failed = decode(d, [p1], ["x", "y", "z"], tokens, params)
    p2.join(30)
    assert p2.exitcode == -signal.SIGKILL  # the hook fired: P2 posted, then died
    assert failed == {"x"}
    assert_same(d, expected_d(p1, d, [("y", "y", 40), ("z", "z", 56)], before))
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # D's cancels reach nobody: the span stays held
        d.step()
        time.sleep(0.01)
    assert d.stats()["push_held_spans"] == 1
    restarted = []
    real = d.manager.reservations.peer_restarted

    def peer_restarted(*a, **kw):
        restarted.append(time.monotonic())
        return real(*a, **kw)
    monkeypatch.setattr(d.manager.reservations, "peer_restarted", peer_restarted)
    _, pipe2 = prefill_process("one_group", "P2", 17, port=port)  # P2 again: a new registration, the same port
    run([d], lambda: d.stats()["push_held_spans"] == 0)
    assert restarted and time.monotonic() >= restarted[0] + RESTART_GRACE_S
    assert d.stats()["bytes_in_use"] == 0
    pipe2.send(("stop", None))  # (the pipe kept open until here: the child ends when it closes)


def test_an_idle_p_takes_a_reservation_and_writes_without_its_housekeeping_turn(engines, monkeypatch):
    """P's engine does not step (it is idle, as vLLM's engines are without requests) and
    its housekeeper's period is far beyond the test: D's RESERVE must reach P's worker by
    the long-poll (the parked TAKE_PUSH's reply wakes the housekeeper), P must fetch D's
    handshake, WRITE, see the WRITE end and notify, all from those wakes."""
    import kvcopy.vllm.arena.connector as connector

    monkeypatch.setattr(connector, "HOUSEKEEPING_S", 600.0)
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 11)
    tokens = prompts(2, [70, 33], 11)
    rids = ["idle-0", "idle-1"]
    params = prefill(p, rids, tokens)
    before = d.raw_bytes()
    for rid, toks, prm in zip(rids, tokens, params):
        d.add(rid, toks, prm, max_tokens=2)
    assert land(d, [], rids, limit_s=60) == set()  # only D steps
    _loaded(p, d, rids, tokens, before)


def test_concurrent_dispatch_a_d_abort_before_scheduling_frees_ps_span(engines):
    """D (concurrent dispatch: it names its own id, P's differs by the engine's suffix)
    aborts a request before scheduling it, so it never reserves; its give-up names D's
    id, and P frees the span of the one request with that base id, long before P's TTL
    (before: the give-up matched nothing and the span waited for the TTL)."""
    p, d = _pair(engines, CASES["one_group"])
    fill(p, d, 21)
    tokens = prompts(1, [40], seed=21)
    prefill(p, ["ab-0-1a2b3c4d"], tokens)
    run([p], lambda: "ab-0-1a2b3c4d" not in p.sched.requests)
    assert p.stats()["staged_requests"] == 1
    before = d.raw_bytes()
    d.add("ab-0-5e6f7a8b", tokens[0], _concurrent(p), max_tokens=2)
    d.sched.finish_requests("ab-0-5e6f7a8b", RequestStatus.FINISHED_ABORTED)
    run([d, p], lambda: p.stats()["staged_requests"] == 0, limit_s=30)  # P's TTL: 60 s
    assert_same(d, before)
    assert d.stats()["bytes_in_use"] == 0 and not d.worker.arena_worker.puller.jobs


def test_a_cancel_answered_while_the_take_is_parked_reaches_the_listener_at_the_next_turn(engines, monkeypatch):
    """A cancel answer P's worker makes while its TAKE_PUSH is parked (as ``_targets_in``
    does once D's handshake came) goes at its next housekeeping turn, in a take of wait 0
    the listener answers at once (before: only with the take after the parked one's reply,
    up to TAKE_WAIT_MS, and a turn, later). P's turns are taken by hand: its housekeeper's
    period is beyond the test and the long-poll's replies wake nobody."""
    import kvcopy.vllm.arena.connector as connector
    from kvcopy.vllm.arena import push_send

    monkeypatch.setattr(connector, "HOUSEKEEPING_S", 3600.0)
    monkeypatch.setattr(push_send, "TAKE_WAIT_MS", 4000)  # the longest park: the turns below fall inside it
    p, _ = _pair(engines, CASES["one_group"])
    pw = p.worker.arena_worker
    pw.sender.wake = None

    def turn():
        with pw.lock:
            pw._tick()
    first = pw.sender._asking
    run([], lambda: first is None or first.done)  # the take the worker asked at start is answered
    turn()  # a new take, parked
    token = b"c" * 16
    with pw.lock:
        assert pw.sender._asking is not None and not pw.sender._asking.done
        pw.sender._cancel("D-0", token)  # a token never seen: answered "never" now
    turn()
    question = msgspec.msgpack.encode((CANCEL_MSG, "D", 0, [[0, token]]))

    def answered():  # D's CANCEL through P's listener: "pending" (queued for P's worker) until the answer came
        reply = msgspec.msgpack.decode(ask_side_channel(_port(p), question)[0])
        return [a[2] for a in reply.get("answers", [])] == ["never"]  # (a full queue: "failed", no answers)
    run([], answered, limit_s=10)


def _until(what, missed, limit_s=30.0):
    """Wait in P's listener thread (the test's thread steps the engines meanwhile); a
    wait that runs out is put in ``missed`` for the test to assert on (a raise here
    would be the listener's, answered as an error, and fail the test later and
    elsewhere)."""
    end = time.monotonic() + limit_s
    while not what():
        if time.monotonic() > end:
            missed.append(what)
            return
        time.sleep(0.01)


def _stall_first_reserve(p, d, monkeypatch, then=None):
    """P's listener holds D's first RESERVE until D asked again (its exchange timed out),
    then takes it, as a listener starved of its CPU does; ``then(kind, args)`` answers
    the copies after it (None: the listener's own answer). Returns the RESERVE questions
    seen; a wait that ran out appends None to them."""
    box = p.sched.connector.connector_scheduler.store.pushes
    real, seen = box.answer, []
    puller = d.worker.arena_worker.puller

    def answer(kind, args):
        if kind == RESERVE_MSG:
            seen.append(args)
            if len(seen) == 1:
                missed = []
                _until(lambda: puller.channel.asked_again >= 1, missed)
                if missed:
                    seen.append(None)
            elif then is not None:
                return then(kind, args)
        return real(kind, args)
    monkeypatch.setattr(box, "answer", answer)
    return seen


def _accepted(p, monkeypatch):
    """The tokens P's worker checked (``push_writes.accept``), in order."""
    took, writes = [], p.manager.push_writes
    real = writes.accept
    monkeypatch.setattr(writes, "accept", lambda *a: took.append(a[2][0]) or real(*a))
    return took


def test_a_reserve_p_does_not_answer_in_time_is_asked_again_and_pushed_once(engines, monkeypatch):
    """P's listener holds D's first RESERVE past D's exchange timeout, then takes it (seen
    once in CI: P's listener silent for 5 s, the push failed and D recomputed): D asks
    again with the same question, P's worker checks the reservation once (a copy it gets
    twice is dropped; one copy may instead go with a take reply the worker gave up, and
    the listener hands it out again), and the request is pushed and loaded, nothing
    refused."""
    from kvcopy.vllm.arena import push_send, record_client

    monkeypatch.setattr(record_client, "EXCHANGE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(push_send, "TAKE_WAIT_MS", 300)  # P's parked take answered well within the timeout
    p, d = _pair(engines, CASES["one_group"])
    seen = _stall_first_reserve(p, d, monkeypatch)
    took = _accepted(p, monkeypatch)
    fill(p, d, 31)
    rids, tokens, before, failed = _push(p, d, [56], seed=31)
    assert failed == set() and None not in seen and len(seen) >= 2 and seen[0] == seen[1]
    _loaded(p, d, rids, tokens, before)
    run([p, d], lambda: p.stats()["push_writes_in_flight"] == 0 and d.stats()["push_held_spans"] == 0)
    assert len(took) == 1 and p.worker.arena_worker.sender.refused == 0 and d.stats()["bytes_in_use"] == 0


def test_a_refusal_of_a_reserve_asked_again_keeps_the_span_until_p_answers_the_cancel(engines, monkeypatch):
    """D asked again after no answer and P's listener refused the second copy, while the
    first still waited there: the refusal proves nothing of the first (P's worker may
    take it after, or get it resent once D's CANCEL tombstoned its token), so D fails
    the load but keeps the span held, never released on the refusal, until P's answers
    (to its CANCEL, or the first copy's WRITE ending) end the hold; D's KV untouched, and
    nothing of the reservation left on P once the listener's resend window passed
    (before: the refusal freed the span at once)."""
    from kvcopy.vllm.arena import push_channel, push_send, record_client

    monkeypatch.setattr(record_client, "EXCHANGE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(push_send, "TAKE_WAIT_MS", 300)
    monkeypatch.setattr(push_channel, "RESEND_S", 1.0)
    p, d = _pair(engines, CASES["one_group"])
    seen = _stall_first_reserve(p, d, monkeypatch, then=lambda kind, args: {"state": "failed", "error": "injected"})
    took = _accepted(p, monkeypatch)
    released, held = [], d.manager.reservations
    real_release = held.release
    monkeypatch.setattr(held, "release", lambda token: released.append(token) or real_release(token))
    fill(p, d, 33)
    rids, tokens, before, failed = _push(p, d, [40], seed=33)
    assert failed == set(rids) and None not in seen and len(seen) >= 2
    assert_same(d, before)
    run([p, d], lambda: d.stats()["push_held_spans"] == 0 and d.stats()["push_reserved"] == 0, limit_s=30)
    assert released == []  # the hold ended by P's answer, not by the refusal
    later = time.monotonic() + 2.5  # past the listener's resend of a copy its worker may not have had
    run([p, d], lambda: time.monotonic() > later)
    st = p.stats()
    assert len(took) <= 1 and st["push_accepted"] == 0 and st["push_writes_in_flight"] == 0
    assert d.stats()["bytes_in_use"] == 0 and p.worker.arena_worker.sender.refused == 0


def test_a_take_reply_lost_to_a_worker_that_gave_up_is_handed_out_again(engines, monkeypatch):
    """P's listener answered D's RESERVE, then was held up answering its worker's parked
    take until the worker gave that take up and asked again: the reply carrying the
    reservation went to a socket that was gone. The listener hands it out again
    (RESEND_S without the worker's acknowledgement) and the request is pushed and loaded
    (before: lost, the push failed at D's deadline and D recomputed)."""
    from kvcopy.vllm.arena import push_channel, push_send, record_client

    monkeypatch.setattr(record_client, "EXCHANGE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(push_send, "TAKE_WAIT_MS", 300)
    monkeypatch.setattr(push_channel, "RESEND_S", 1.0)
    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 20.0})
    box, sender = p.sched.connector.connector_scheduler.store.pushes, p.worker.arena_worker.sender
    real, real_ask, handed, stalled, missed, parks = box.take, sender._ask, [], [], [], [0]

    def ask(wait_ms):
        parks[0] += wait_ms > 0  # counted before it is sent: the take answered below is one of these
        return real_ask(wait_ms)
    monkeypatch.setattr(sender, "_ask", ask)

    def take(rank):
        if box.ready(rank) and not stalled:
            stalled.append(parks[0])  # the latest take, the one answered now: the worker asks anew once it gave up
            _until(lambda: parks[0] > stalled[0], missed)
        out = real(rank)
        handed.extend(r[6] for r in out["reserve"])
        return out
    monkeypatch.setattr(box, "take", take)
    took = _accepted(p, monkeypatch)
    fill(p, d, 32)
    rids, tokens, before, failed = _push(p, d, [48], seed=32)
    assert failed == set() and len(stalled) == 1 and missed == []
    _loaded(p, d, rids, tokens, before)
    assert d.worker.arena_worker.puller.channel.asked_again == 0  # D had its answer: only the take's reply was lost
    assert len(handed) >= 2 and set(handed) == set(took)  # handed out again after the lost reply; checked once
    run([p, d], lambda: p.stats()["push_writes_in_flight"] == 0 and d.stats()["push_held_spans"] == 0)
    assert len(took) == 1 and p.worker.arena_worker.sender.refused == 0 and d.stats()["bytes_in_use"] == 0
