"""Chunked push (kvcopy.vllm.arena.push_chunks): a layer-wise P WRITEs a request's units into
D's reservation as its last step's copies end, D scatters each chunk as it lands; with
vLLM 0.33's real scheduler and connector worker classes, on the CPU.

Concurrent dispatch as a proxy does it: D gets the request (P's coordinates and request
id) before P computed it, reserves, and P's worker accepts the reservation before P's
last step. P's KV is poisoned and its forward writes each layer's bytes just before
``save_kv_layer``; D's is poisoned; D's buffer is compared whole with the expectation
built from vLLM's block tables alone, or, where the load fails, outside the request's
own blocks.

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_arena import engines  # noqa: E402  (the fixture)
from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the fixture)
from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402

from kvcopy.nixl.modes.partial_stage import StepCopies  # noqa: E402
from kvcopy.testing.engine.serve import PrefillEngine  # noqa: E402
from kvcopy.vllm.arena.push_chunks import tail_mask  # noqa: E402
from vllm_arena_engines import assert_same, expected_d, fill_layerwise, land, prefill, prompts, run  # noqa: E402

assert engines and vllm_env  # fixtures, used by name
PUSH = {"transfer_mode": "push"}


def _pair(engines, case, p_kw=None, d_kw=None):
    # push_chunk_bytes 0: a chunk per copy, the most WRITEs
    p = engines(case, "kv_producer", layerwise=True, **{"push_chunk_bytes": 0, **(p_kw or {})})
    d = engines(case, "kv_consumer", **PUSH, **(d_kw or {}))
    return p, d


def _template(p, d):
    """kv_transfer_params as P's finish gives them (a warm-up request: D learns P's
    handshake, P D's), to address requests D gets before P finished them."""
    tokens = prompts(1, [20], 99)
    (params,) = prefill(p, ["warm"], tokens)
    d.add("warm", tokens[0], params, max_tokens=2)
    run([d, p], lambda: "warm" in d.params or "warm" in d.tables or not d.sched.requests)
    return params


def _accepted(p, rids, readers=1):
    """Every P rank accepted ``readers`` reservations of each request (one per D rank reading it)."""
    for rank in p.ranks:
        w = rank.worker.arena_worker
        with w.lock:
            if not all(len(w.sender.tokens_for(r)) >= readers for r in rids):
                return False
    return True


def _concurrent(p, d, lengths, seed, limit_s=60.0, accepted=None, readers=1):
    """D and P get each request at once; P steps only once its workers accepted D's
    reservations (concurrent dispatch, D first; ``readers`` per P rank and request);
    then both step until D's loads ended. ``accepted()`` is called then. Returns (rids,
    tokens, D's bytes before, failed)."""
    template = _template(p, d)
    tokens = prompts(len(lengths), lengths, seed)
    rids = [f"c{seed}-{i}" for i in range(len(tokens))]
    for rid, toks in zip(rids, tokens):
        p.add(rid, toks, {"do_remote_decode": True})
        d.add(rid, toks, dict(template, remote_request_id=rid), max_tokens=2)
    before = d.raw_bytes()
    deadline = time.monotonic() + limit_s
    while not _accepted(p, rids, readers):  # P's housekeeping takes the reservations without a step
        assert time.monotonic() < deadline, "P's worker never accepted the reservations"
        d.step()
        time.sleep(0.005)
    if accepted is not None:
        accepted()
    ended, failed = set(), set()
    while not ended >= set(rids):
        assert time.monotonic() < deadline, f"D's loads did not end: {sorted(set(rids) - ended)}"
        p.step()
        out = d.step()
        for rid in out.finished_recving or ():
            if rid in d.sched.requests:
                d.tables[rid] = d.sched.kv_cache_manager.get_block_ids(rid)
            ended.add(rid)
        failed |= set(out.failed_recving or ())
        time.sleep(0.001)
    return rids, tokens, before, failed


def _loaded(p, d, rids, tokens, before):
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(r, r, n) for r, n in zip(rids, n_load)], before)
    for e, b in zip(*((exp, before) if isinstance(exp, list) else ([exp], [before]))):  # every D rank's
        assert (e != b).any(), "the expectation moves nothing: the test would not see a missed load"
    assert_same(d, exp)


def _outside_blocks_untouched(d, rids, before):
    """D's bytes outside the blocks of ``rids`` equal ``before`` (a failed load wrote only its own pages)."""
    rank = d.ranks[0]
    mine = {b for r in rids for g in d.tables[r] for b in g}
    changed = (rank.raw != before).nonzero().flatten()
    for name, t in rank.caches.items():
        start = t.storage_offset() * t.element_size()
        block = t.stride(0) * t.element_size()
        inside = changed[(changed >= start) & (changed < start + t.shape[0] * block)]
        blocks = set(((inside - start) // block).tolist())
        assert blocks <= mine, (name, sorted(blocks - mine))


def _chunk_stats(p, d):
    """Chunk WRITEs every P rank posted, and chunks every D rank scattered."""
    return (sum(p.stats(r)["push_chunks_posted"] for r in range(len(p.ranks))),
            sum(d.stats(r)["push_chunks_landed"] for r in range(len(d.ranks))))


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing", "mla", "gdn_padded", "kernel_split_32_to_16"])
def test_a_request_reserved_before_ps_last_step_is_pushed_in_chunks(engines, name):
    case = CASES[name]
    p, d = _pair(engines, case)
    fill_layerwise(p, d, 21)
    rids, tokens, before, failed = _concurrent(p, d, [40, 17], seed=21)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    posted, landed = _chunk_stats(p, d)
    assert posted >= len(rids) and landed == posted  # a chunk or more per request, each scattered on its c
    pw = p.worker.arena_worker  # the tail (the last attention layer's units) rides in the final WRITE
    tail = tail_mask(pw.manager.arena.units)
    assert tail.any() and not any(tail[lo:hi].any() for _, _, _, lo, hi, _ in pw.sender.chunks.events)
    # the copy thread made each record (the warm-up's too) and posted its final WRITE right
    # after the last layer's copy, unless state units were left for wait_for_save's sweep (GDN)
    swept = any(u.state for u in pw.manager.arena.units)
    assert pw.stager.layers.early == (0 if swept else len(rids) + 1), (name, pw.stager.layers.early)
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["push_writes_in_flight"] == 0 and d.stats()["push_held_spans"] == 0


@pytest.mark.parametrize("layout", [x.name for x in KVCacheLayout])
def test_chunked_push_in_the_six_layouts(engines, layout):
    case = dict(CASES["hybrid_kv_sharing"], layout=layout)
    p, d = _pair(engines, case)
    fill_layerwise(p, d, 22)
    rids, tokens, before, failed = _concurrent(p, d, [33], seed=22)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert _chunk_stats(p, d)[1] > 1


@pytest.mark.parametrize("p_tp,d_tp,order", [(2, 1, "token"), (2, 1, "head"), (1, 2, "token"), (1, 2, "head"),
                                             (2, 2, "token")])
def test_chunked_push_between_other_tp_sizes(engines, p_tp, d_tp, order):
    """Each D rank reserves from the P ranks holding its KV heads (TP sizes that differ:
    a row per page and layer in token order, a row per unit in head order); every P
    rank WRITEs its share of each unit as its copies end, and every D rank's buffer is
    byte-exact over poison."""
    case = CASES["hybrid_kv_sharing"]  # 2 KV heads per layer
    p, d = _pair(engines, case, dict(tp=p_tp, arena_order=order), dict(tp=d_tp, arena_order=order))
    fill_layerwise(p, d, 27)
    readers = max(1, d_tp // p_tp)  # reservations per P rank and request
    rids, tokens, before, failed = _concurrent(p, d, [40, 57], seed=27, readers=readers)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    for r in range(p_tp):  # every P rank chunked each of its reservations
        assert p.stats(r)["push_chunks_posted"] >= len(rids) * readers, (r, p.stats(r))
    posted, landed = _chunk_stats(p, d)
    assert landed == posted
    run([p, d], lambda: not any(p.stats(r)["staged_requests"] for r in range(p_tp))
        and not any(d.stats(r)["bytes_in_use"] or d.stats(r)["push_held_spans"] for r in range(d_tp)))
    assert not any(p.stats(r)["push_writes_in_flight"] for r in range(p_tp))


def test_push_chunk_bytes_sets_the_least_chunk(engines):
    """``push_chunk_bytes`` above one unit's bytes (a 40-token request: 6 KiB per layer):
    P WRITEs no chunk smaller, so each chunk carries two layers or more; D byte-exact."""
    p, d = _pair(engines, CASES["one_group"], dict(push_chunk_bytes=8192))
    chunks = p.worker.arena_worker.sender.chunks
    assert chunks.min_bytes == 8192
    fill_layerwise(p, d, 28)
    rids, tokens, before, failed = _concurrent(p, d, [40], seed=28)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert chunks.events and _chunk_stats(p, d) == (len(chunks.events), len(chunks.events))
    for _, _, _, lo, hi, nbytes in chunks.events:
        assert nbytes >= 8192 and hi - lo >= 2, chunks.events


def test_chunked_prefill_pushes_chunks_in_the_last_step(engines):
    case = CASES["hybrid_kv_sharing"]
    p, d = _pair(engines, case)
    p.sched.max_num_scheduled_tokens = 24  # 70 tokens: three steps
    fill_layerwise(p, d, 23)
    rids, tokens, before, failed = _concurrent(p, d, [70], seed=23)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert _chunk_stats(p, d)[1] > 1


def test_a_flipped_byte_in_one_chunk_fails_the_load(engines, monkeypatch):
    """A byte of P's span changes after its unit's copy, before its chunk's WRITE: D
    scattered that chunk, its sums do not match at P's f, the load fails (vLLM
    recomputes) and nothing outside the request's blocks changed."""
    case = CASES["one_group"]
    p, d = _pair(engines, case)
    fill_layerwise(p, d, 24)
    chunks = p.worker.arena_worker.sender.chunks
    real = chunks.copied

    def flip(rid, units):
        if rid.startswith("c") and not getattr(chunks, "flipped", False):
            part = chunks.parts[rid][0]
            chunks.m.arena.buffer[part.span.offset + 64] ^= 0x10
            chunks.flipped = True
        real(rid, units)
    monkeypatch.setattr(chunks, "copied", flip)
    rids, tokens, before, failed = _concurrent(p, d, [40], seed=24)
    assert failed == set(rids)
    assert _chunk_stats(p, d)[1] > 1
    _outside_blocks_untouched(d, rids, before)
    run([p, d], lambda: d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0)


def test_p_failing_mid_chunks_answers_x_and_d_recomputes(engines, monkeypatch):
    """A copy of the request's last step fails after chunks were sent: P stages it again
    whole, cannot finish the chunked push from another span, and answers x; D fails
    the load at once (vLLM recomputes), writing nothing outside the request's blocks."""
    case = CASES["hybrid_kv_sharing"]
    p, d = _pair(engines, case)
    fill_layerwise(p, d, 25)
    real = StepCopies.run
    seen = []

    def run_unit(self, unit):
        seen.append(unit)
        if len(seen) == 3:  # the third unit copied in the request's forward fails
            self.done.add(unit)
            raise RuntimeError("injected copy failure")
        return real(self, unit)
    rids, tokens, before, failed = _concurrent(p, d, [40], seed=25, limit_s=30,  # well inside D's 60 s
                                               accepted=lambda: monkeypatch.setattr(StepCopies, "run", run_unit))
    assert failed == set(rids)
    assert _chunk_stats(p, d)[0] >= 2
    _outside_blocks_untouched(d, rids, before)
    run([p, d], lambda: d.stats()["push_held_spans"] == 0 and p.stats()["push_writes_in_flight"] == 0)


def test_a_reservation_after_staging_is_still_one_write(engines, monkeypatch):
    """Sequential dispatch (D after P finished): the span is staged layer by layer, then
    pushed in one WRITE of one descriptor, record included."""
    from test_vllm_arena_push import _push, _spy_reserves

    case = CASES["one_group"]
    p, d = _pair(engines, case)
    reserves = _spy_reserves(d, monkeypatch)
    fill_layerwise(p, d, 26)
    rids, tokens, before, failed = _push(p, d, [40, 17], seed=26)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert _chunk_stats(p, d) == (0, 0)
    assert [r.num_descriptors for r in reserves] == [1, 1]


def test_a_chunked_push_reserved_under_ds_own_id_is_matched_by_base_id(engines):
    """Concurrent dispatch as a real proxy does it: D has P's coordinates only and names
    its own request id (the engine's random suffix differs from P's); P gets the requests
    after it accepted the reservations, matches them by vLLM's base id at its last step's
    bind, and still WRITEs them in chunks."""
    p, d = _pair(engines, CASES["one_group"])
    fill_layerwise(p, d, 25)
    tokens = prompts(2, [40, 17], 25)
    p_rids, d_rids = ["cb-0-1a2b3c4d", "cb-1-00c0ffee"], ["cb-0-5e6f7a8b", "cb-1-deadbeef"]
    host, port = p.worker.arena_worker.listener
    params = PrefillEngine(p.sched.connector.connector_scheduler.engine_id, host, port).decode_params("proxy-id")
    before = d.raw_bytes()
    for rid, t in zip(d_rids, tokens):
        d.add(rid, t, dict(params), max_tokens=2)
    run([d], lambda: p.stats()["push_accepted"] == 2)  # P holds both reservations, knows neither request
    for rid, t in zip(p_rids, tokens):
        p.add(rid, t, {"do_remote_decode": True})
    assert land(d, [p], d_rids) == set()
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(pr, dr, n) for pr, dr, n in zip(p_rids, d_rids, n_load)], before)
    assert (exp != before).any(), "the expectation moves nothing: the test would not see a missed load"
    assert_same(d, exp)
    posted, landed = _chunk_stats(p, d)
    assert posted >= 2 and landed == posted  # chunked (a chunk per request at least), not one WRITE after staging
    assert p.worker.arena_worker.sender.refused == 0



def test_f_goes_once_the_writes_end_without_another_turn(engines, monkeypatch):
    """P's last step ends with its WRITEs in flight; P's engine does not step again (its
    request is done) and its housekeeping turn is an hour away: P's worker still polls
    them until they ended and sends ``f``, so D's load ends while only D steps.

    NIXL's UCX WRITE ends with a flush of the endpoint, a round trip to D over tcp on
    loopback. D's NIXL agent runs here without its progress thread, so D's UCX moves
    only when D steps (its notifications read): P's step, with D not stepping, ends with
    every WRITE of the request in flight, whatever the machine's timing. (With D's
    progress thread a WRITE posted right after a notice to D, the tail's ``c``, is in
    flight past its post for 0.1-0.8 ms: ``bench/push_chunks_serve.py``,
    ``chunked-unit-own-tail``.)"""
    from kvcopy.nixl import agent as nixl_agent
    from kvcopy.vllm.arena import connector

    monkeypatch.setattr(connector, "HOUSEKEEPING_S", 3600.0)  # no housekeeping turn in this test
    real_make = nixl_agent.make_agent

    def without_progress_thread(nixl, *args):
        real_config = nixl.nixl_agent_config
        nixl.nixl_agent_config = lambda **kw: real_config(enable_prog_thread=False, **kw)
        try:
            return real_make(nixl, *args)
        finally:
            nixl.nixl_agent_config = real_config
    monkeypatch.setattr(nixl_agent, "make_agent", without_progress_thread)
    d = engines(CASES["one_group"], "kv_consumer", **PUSH)
    monkeypatch.setattr(nixl_agent, "make_agent", real_make)
    p = engines(CASES["one_group"], "kv_producer", layerwise=True, push_chunk_bytes=0)
    pw = p.worker.arena_worker

    def turn():  # P's housekeeping turn, taken by hand (it takes D's reservations)
        with pw.lock:
            pw._tick()
    fill_layerwise(p, d, 29)
    tokens = prompts(2, [20, 40], 29)
    (template,) = prefill(p, ["warm"], tokens[:1])
    d.add("warm", tokens[0], template, max_tokens=2)
    run([d], lambda: (turn(), "warm" in d.params or not d.sched.requests)[1])
    p.add("last", tokens[1], {"do_remote_decode": True})
    d.add("last", tokens[1], dict(template, remote_request_id="last"), max_tokens=2)
    before = d.raw_bytes()
    run([d], lambda: (turn(), _accepted(p, ["last"]))[1])
    # from here only a post wakes P's housekeeper: its long-poll's replies (an empty one
    # every TAKE_WAIT_MS) would turn it within a second anyway
    pw.sender.wake = None
    run([p], lambda: "last" in p.params)  # P's last step, D not stepping
    with pw.lock:
        assert pw.manager.push_writes.writing, "P's step ended with no WRITE in flight"
    assert land(d, [], ["last"]) == set()  # only D steps
    _loaded(p, d, ["last"], tokens[1:], before)
    assert _chunk_stats(p, d)[1] >= 1


def _warnings():
    """The connector's warnings from now on (vLLM's loggers do not propagate to pytest's)."""
    import logging

    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    logger = logging.getLogger("vllm.kvcopy")
    logger.addHandler(handler)
    return seen, lambda: logger.removeHandler(handler)


def test_a_reservation_accepted_after_the_early_record_is_one_write(engines, monkeypatch):
    """P's worker takes D's reservation after its copy thread made the request's record
    (finish_early) and before wait_for_save ends the step: the reservation is one final
    WRITE of one descriptor, no chunk tried (before: the chunk poster still named the
    finished part, its chunk was refused with a warning, and the final WRITE took the
    chunked path). P's housekeeping turns are taken by hand (its period is beyond the
    test, the long-poll's replies wake nobody), the one that takes it in that window."""
    import kvcopy.vllm.arena.connector as connector

    monkeypatch.setattr(connector, "HOUSEKEEPING_S", 3600.0)
    p, d = _pair(engines, CASES["one_group"])
    pw = p.worker.arena_worker
    pw.sender.wake = None

    def turn():
        with pw.lock:
            pw._tick()
    fill_layerwise(p, d, 33)
    (tokens,) = prompts(1, [40], 33)
    (template,) = prefill(p, ["warm"], [tokens])
    d.add("warm", tokens, template, max_tokens=2)
    run([d], lambda: (turn(), "warm" in d.params or not d.sched.requests)[1])
    early = pw.stager.layers.early
    posts, real_post = [], pw.manager.push_writes.post
    monkeypatch.setattr(pw.manager.push_writes, "post", lambda *a, **kw: posts.append(real_post(*a, **kw))
                        or posts[-1])
    real_save, window = pw.save, []

    def save(meta):  # wait_for_save: the copy thread ended; P's worker takes the reservation now
        pw.stager.layers.wait_copies()
        if pw.stager.layers.early > early and not window:
            window.append(1)
            run([], lambda: (turn(), bool(posts))[1])  # taken and posted by the turn
        real_save(meta)
    monkeypatch.setattr(pw, "save", save)
    reserved = d.stats()["push_reserved"]
    p.add("win", tokens, {"do_remote_decode": True})
    d.add("win", tokens, dict(template, remote_request_id="win"), max_tokens=2)
    run([d], lambda: d.stats()["push_reserved"] > reserved)  # D reserved; P takes it only at a turn
    before = d.raw_bytes()
    warned, stop = _warnings()
    try:
        run([p], lambda: "win" in p.params)
        assert window, "P's copy thread made no record early"
        ended, failed = set(), set()

        def d_step():  # land(), with P's turns
            turn()
            out = d.step()
            for rid in out.finished_recving or ():
                d.tables[rid] = d.sched.kv_cache_manager.get_block_ids(rid)
                ended.add(rid)
            failed.update(out.failed_recving or ())
            return "win" in ended
        run([], d_step)
    finally:
        stop()
    assert failed == set()
    _loaded(p, d, ["win"], [tokens], before)
    assert [desc for _, desc in posts] == [1] and _chunk_stats(p, d) == (0, 0)
    assert not [r for r in warned if "pushing units" in r.getMessage()], [r.getMessage() for r in warned]


def test_a_record_the_copy_thread_cannot_report_fails_the_request_at_once(engines, monkeypatch):
    """staged_early raising after the copy thread made the record: P fails the request
    (its span freed) and D's reservation is answered x, its load failing with D's own
    pages only touched (before: never reported; D waited for its deadline, P's span for
    its TTL)."""
    p, d = _pair(engines, CASES["one_group"])
    pw = p.worker.arena_worker
    fill_layerwise(p, d, 34)

    early = []

    def staged_early(rid, record):
        raise RuntimeError("report lost")

    def accepted():  # after the warm-up
        early.append(pw.stager.layers.early)
        monkeypatch.setattr(pw.stager, "staged_early", staged_early)
    rids, tokens, before, failed = _concurrent(p, d, [40], seed=34, limit_s=30, accepted=accepted)  # D's: 60 s
    assert pw.stager.layers.early > early[0]  # the copy thread made the record
    assert failed == set(rids)
    assert "report lost" in pw.stager.failures[rids[0]]
    _outside_blocks_untouched(d, rids, before)
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["bytes_in_use"] == 0


def test_a_post_raising_on_the_copy_thread_fails_its_own_reservation_not_the_copy_threads_request(engines,
                                                                                                    monkeypatch):
    """The copy thread's step for request ``a`` also posts ``g``'s reservation, waiting
    since before (``g`` staged earlier, its reservation taken while only the copy thread
    may post), and ``g``'s post raises: ``g``'s reservation alone is answered x, ``a`` is
    pushed and lands byte-exact, ``g``'s KV on D untouched, P's spans freed. Before, the
    raise reached the copy thread, which gave up ``a`` (x: D recomputed an innocent
    request) and freed its span."""
    import threading

    def on_copy_thread():
        return threading.current_thread().name.startswith("kvcopy-arena-layers-")
    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 60.0})
    pw = p.worker.arena_worker
    fill_layerwise(p, d, 36)
    template = _template(p, d)
    before = d.raw_bytes()
    gate = {"open": False}
    real_step, real_post = pw.sender.step, pw.manager.push_writes.post
    raised = []

    def step():  # the engine's and housekeeper's steps post nothing: only the copy thread's
        if gate["open"] or on_copy_thread():
            real_step()

    def post(token, record, **kw):
        if record.request_id == "g":
            raised.append(on_copy_thread())
            raise RuntimeError("the WRITE's post failed")
        return real_post(token, record, **kw)
    monkeypatch.setattr(pw.sender, "step", step)
    monkeypatch.setattr(pw.manager.push_writes, "post", post)
    tokens = prompts(2, [40, 56], seed=36)
    (params,) = prefill(p, ["g"], tokens[:1])
    d.add("g", tokens[0], params, max_tokens=2)
    run([d], lambda: _accepted(p, ["g"]))  # g waits, staged, not posted
    p.add("a", tokens[1], {"do_remote_decode": True})
    d.add("a", tokens[1], dict(template, remote_request_id="a"), max_tokens=2)
    run([d], lambda: _accepted(p, ["g", "a"]))
    assert land(d, [p], ["g", "a"], limit_s=30) == {"g"}  # x at once (D's deadline: 60 s)
    assert raised == [True]  # g's post raised on the copy thread, in its step for a
    _loaded(p, d, ["a"], tokens[1:], before)  # a byte-exact, g's KV untouched
    gate["open"] = True
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["push_writes_in_flight"] == 0
    assert "a" not in pw.stager.failures and pw.sender.refused == 0


@pytest.mark.parametrize("guilty", ["g", "a"])
def test_a_status_check_raising_fails_that_writes_reservation_only(engines, monkeypatch, guilty):
    """The copy thread's step for request ``a`` posts ``a``'s final WRITE (after its
    chunks) and ``g``'s (staged earlier, its reservation waiting); the status check
    raises past ``Agent.state`` (kvcopy's wrapper: the WRITE's state unknown) once for
    each WRITE handle of the ``guilty`` request's reservation. That reservation alone is
    answered x once its WRITEs are seen ended (D recomputes it, its KV untouched), the other lands
    byte-exact, and P fails no request: the copy thread's own (``a``) is not given up
    when ``g``'s check raised. Before, the raise left ``push_writes.poll`` and the copy
    thread's step, which gave up ``a`` whichever handle had raised."""
    import threading

    def on_copy_thread():
        return threading.current_thread().name.startswith("kvcopy-arena-layers-")
    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 60.0})
    pw = p.worker.arena_worker
    fill_layerwise(p, d, 37)
    template = _template(p, d)
    before = d.raw_bytes()
    gate = {"open": False}
    pushes = pw.manager.push_writes
    real_step, real_state = pw.sender.step, pushes._agent.state
    raised = []

    def step():  # the engine's and housekeeper's steps post nothing: only the copy thread's
        if gate["open"] or on_copy_thread():
            real_step()

    seen: list = []  # handles whose check raised once

    def state(xfer):
        for s in list(pushes._send.values()):
            if (s.xfer is xfer or any(c[0] is xfer for c in s.chunks)) and s.request_id == guilty.encode() \
                    and not any(xfer is h for h in seen):
                seen.append(xfer)
                raised.append(on_copy_thread())
                raise RuntimeError("a bug in the status check's wrapper")
        return real_state(xfer)
    monkeypatch.setattr(pw.sender, "step", step)
    monkeypatch.setattr(pushes._agent, "state", state)
    tokens = prompts(2, [40, 56], seed=37)
    (params,) = prefill(p, ["g"], tokens[:1])
    d.add("g", tokens[0], params, max_tokens=2)
    run([d], lambda: _accepted(p, ["g"]))  # g waits, staged, not posted
    p.add("a", tokens[1], {"do_remote_decode": True})
    d.add("a", tokens[1], dict(template, remote_request_id="a"), max_tokens=2)
    run([d], lambda: _accepted(p, ["g", "a"]))
    assert land(d, [p], ["g", "a"], limit_s=30) == {guilty}  # x at once (D's deadline: 60 s)
    assert raised and (guilty == "a" or raised[0])  # g's check raised first in the copy thread's step for a
    ok = "a" if guilty == "g" else "g"
    _loaded(p, d, [ok], [tokens[1] if ok == "a" else tokens[0]], before)  # byte-exact; the guilty's KV untouched
    gate["open"] = True
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["push_writes_in_flight"] == 0
    assert pw.stager.failures == {} and pw.sender.refused == 0  # P gave up no request


@pytest.mark.parametrize("where", ["post", "step"])
def test_a_push_raising_on_the_copy_thread_fails_its_request_at_once(engines, monkeypatch, where):
    """The copy thread made a request's record and its push raised: a post failing other
    than by ValueError (the reservation it posted is answered x at once, the step goes
    on), or ``sender.step`` before it served any reservation (a raise of no reservation:
    logged, no request failed; the next step posts it, and it lands byte-exact). Before:
    left unposted, D waited for its 60 s deadline; and a raise of ``step`` gave up the
    copy thread's request, innocent or not. The other requests of the step are pushed
    byte-exact."""
    import threading

    p, d = _pair(engines, CASES["one_group"], d_kw={"push_timeout_s": 60.0})
    pw = p.worker.arena_worker
    fill_layerwise(p, d, 35)
    raised = []
    owner = pw.manager.push_writes if where == "post" else pw.sender
    real = getattr(owner, where)

    def broken(*a, **kw):  # the copy thread's first call raises
        if not raised and threading.current_thread().name.startswith("kvcopy-arena-layers-"):
            raised.append(a[1].request_id if where == "post" else None)  # post(token, record)
            raise RuntimeError("push lost")
        return real(*a, **kw)
    early = []

    def accepted():  # after the warm-up
        early.append(pw.stager.layers.early)
        monkeypatch.setattr(owner, where, broken)
    rids, tokens, before, failed = _concurrent(p, d, [40, 24, 56], seed=35, limit_s=30,  # D's deadline: 60 s
                                               accepted=accepted)
    assert pw.stager.layers.early > early[0] and raised  # the copy thread made records and pushed them
    assert not [r for r in rids if "push lost" in pw.stager.failures.get(r, "")]  # P gave up no request
    lost = raised if where == "post" else []  # a post's raise fails its reservation; step's, nothing (retried)
    assert len(lost) == (1 if where == "post" else 0) and failed == set(lost)
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(r, r, n) for r, n in zip(rids, n_load) if r not in lost], before)
    assert (exp != before).any(), "the expectation moves nothing: the test would not see a missed load"
    _outside_blocks_untouched(d, lost, exp)  # the others byte-exact; the failed one wrote only its own pages
    run([p, d], lambda: p.stats()["staged_requests"] == 0 and d.stats()["bytes_in_use"] == 0)
    assert p.stats()["bytes_in_use"] == 0 and p.stats()["push_writes_in_flight"] == 0


def test_p_polls_chunk_writes_every_10_ms_and_a_final_write_every_1_ms():
    """``PushSender.poll_s``, the housekeeper's period while WRITEs are in flight: a final
    WRITE not reaped yet, or a D's handshake on its way, 1 ms; only chunk WRITEs (a
    layer-wise push during P's forward) 10 ms: each poll takes P's CPU and the GIL from
    the forward (over a 1 Gbit/s link the forward was 9-21% slower polled every 1 ms);
    nothing, None. And the worker's wake after a post: a final WRITE always wakes the
    housekeeper, a chunk only when nothing was in flight before it (a wake runs a whole
    turn: one per layer otherwise)."""
    from types import SimpleNamespace

    from kvcopy.vllm.arena.connector import KvcopyArenaWorker
    from kvcopy.vllm.arena.push_send import CHUNK_POLL_S, WRITE_POLL_S, PushSender

    def sender(posted=(), fetching=(), writing=False):
        s = PushSender.__new__(PushSender)  # poll_s reads only these
        s._posted, s._fetching = dict.fromkeys(posted), dict.fromkeys(fetching)
        s.m = SimpleNamespace(push_writes=SimpleNamespace(writing=writing))
        return s
    assert sender().poll_s is None and not sender().urgent
    assert sender(writing=True).poll_s == CHUNK_POLL_S == 0.01
    assert sender(posted=[b"t"], writing=True).poll_s == WRITE_POLL_S == 0.001
    assert sender(fetching=["D-0"]).poll_s == WRITE_POLL_S and sender(fetching=["D-0"]).urgent
    assert sender(posted=[b"t"]).awaited and sender(fetching=["D-0"]).awaited and not sender(writing=True).awaited

    def wakes(s, busy_before):
        w = KvcopyArenaWorker.__new__(KvcopyArenaWorker)
        woke = []
        w.sender, w.housekeeper = s, SimpleNamespace(wake=lambda: woke.append(1))
        w._hurry(busy_before)
        return len(woke)
    assert wakes(sender(writing=True), busy_before=False) == 1  # the first chunk in flight
    assert wakes(sender(writing=True), busy_before=True) == 0  # another chunk while some are
    assert wakes(sender(posted=[b"t"], writing=True), busy_before=True) == 1  # the final WRITE
    assert wakes(sender(), busy_before=False) == 0  # nothing in flight
