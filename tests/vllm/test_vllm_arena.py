"""kvcopy.vllm.KvcopyArenaConnector against the real vLLM 0.33 package, on the CPU.

P and D are each vLLM's own engine (config, cache allocation, ``Scheduler`` with the
connector's scheduler side, the connector's worker side with a real NIXL agent, UCX on
loopback), the test playing the model runner (``tests/vllm/vllm_arena_engines.py`` says how,
and how the expectation is built from vLLM's block tables alone). D's backing buffer is
compared whole after every transfer; where a load fails, it must not change at all.

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

from test_vllm_mirror import CASES, Kernel16Backend, _specs, vllm_env  # noqa: E402  (the model families, the fixture)
from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvcopy.nixl.pull import Completion  # noqa: E402
from kvcopy.testing.nixl.stopped_peer import TCP_LOOPBACK, stop_process  # noqa: E402
from vllm_arena_engines import (  # noqa: E402
    ArenaEngine, assert_same, decode, expected_d, fill, free_port, prefill, prefill_child, prompts, run,
)

assert vllm_env  # a fixture, used by name


@pytest.fixture
def engines(vllm_env, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    def no_mirror(*a, **k):
        raise AssertionError("vLLM's host mirror was allocated")
    monkeypatch.setattr(base_worker.NixlBaseConnectorWorker, "initialize_host_xfer_buffer", no_mirror)
    made = []

    def make(case, role, **kw):
        e = ArenaEngine(vllm_env, case, role, monkeypatch.setenv, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


@pytest.fixture
def prefill_process(vllm_env, tmp_path):
    import multiprocessing as mp

    procs = []

    def start(case_name, engine_id, seed, **opts):
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=prefill_child, args=(child, vllm_env.model, str(tmp_path), case_name, engine_id, seed, opts),
            daemon=True)
        proc.start()
        procs.append(proc)
        assert parent.poll(300) and parent.recv() == "ready", "the P process did not start"
        return proc, parent
    yield start
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(30)


# ------------------------------------------------------------------ tests
def _spy_pulls(d, monkeypatch):
    """D's plans, as its TransferManager posts them (the real pull runs)."""
    plans = []
    real = d.manager.pull

    def pull(plan, *a, **kw):
        plans.append(plan)
        return real(plan, *a, **kw)
    monkeypatch.setattr(d.manager, "pull", pull)
    return plans


def _transfer(p, d, lengths, seed=0, prefix=None):
    """P prefills ``lengths``-token prompts (``prefix`` in front, if any), D loads them:
    D's bytes checked whole. Returns the requests' ids."""
    tokens = [(prefix or []) + t for t in prompts(len(lengths), lengths, seed)]
    rids = [f"r{seed}-{i}" for i in range(len(tokens))]
    params = prefill(p, rids, tokens)
    before = d.raw_bytes()
    assert decode(d, [p], rids, tokens, params) == set()
    n_load = [p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(t)) for t in tokens]
    exp = expected_d(p, d, [(r, r, n) for r, n in zip(rids, n_load)], before,
                     cached_tokens=len(prefix or []) // d.block_size * d.block_size)
    assert (exp != before).any(), "the expectation moves nothing: the test would not see a missed load"
    assert_same(d, exp)
    return rids


def test_several_requests_in_one_step_one_descriptor_each(engines, monkeypatch):
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    plans = _spy_pulls(d, monkeypatch)
    for e in (p, d):  # no host mirror: the arena is the only memory NIXL registers
        ((_, nbytes, _, mem),) = e.manager.arena.registrations()
        assert mem == "DRAM" and nbytes == e.stats()["arena_bytes"] + e.manager.arena.arena.granule
    fill(p, d, 1)
    tokens = prompts(3, [40, 17, 64])
    rids = ["a", "b", "c"]
    params = prefill(p, rids, tokens)
    # P's KV blocks go back to its pool once staged, before D has read anything: the arena holds the KV
    run([p], lambda: not any(r in p.sched.requests for r in rids))
    assert p.stats()["staged_requests"] == 3
    before = d.raw_bytes()
    assert decode(d, [p], rids, tokens, params) == set()
    assert_same(d, expected_d(p, d, [(r, r, len(t)) for r, t in zip(rids, tokens)], before))
    assert [pl.num_descriptors for pl in plans] == [1, 1, 1]  # equal geometry: one READ descriptor per request
    run([p], lambda: p.stats()["staged_requests"] == 0)  # D's notifications freed P's spans
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["live_transfer_handles"] == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_family_moves_every_group_exactly(engines, name):
    """Several groups overlaid from byte 0, KV-sharing layers, kernel-page splits, MLA,
    padded pages, unified block sizes, packed rows, attention + GDN state."""
    case = CASES[name]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 2)
    _transfer(p, d, [70, 33], seed=2)


@pytest.mark.parametrize("layout", [x.name for x in KVCacheLayout])
def test_the_six_layouts(engines, layout):
    case = dict(CASES["hybrid_kv_sharing"], layout=layout)
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 3)
    _transfer(p, d, [50], seed=3)


def test_prefix_hit_on_d_is_not_written(engines):
    """D computed a 32-token prefix before (its cached blocks keep D's own bytes); the
    request reads only the tokens after it."""
    case = CASES["hybrid_kv_sharing"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 4)
    prefix = prompts(1, [32], seed=40)[0]
    d.add("local", prefix + [9], max_tokens=1)
    run([d], lambda: "local" in d.params)
    plans = []
    real = d.manager.plan_pull
    d.manager.plan_pull = lambda *a, **kw: plans.append(a) or real(*a, **kw)
    _transfer(p, d, [30], seed=4, prefix=prefix)
    assert [list(a[4]) for a in plans] == [[32, 32]]  # D's prefix hit, per group, handed to kvcopy


@pytest.mark.parametrize("p_bs,d_bs", [(32, 16), (16, 32)])
def test_different_block_sizes_on_p_and_d(engines, p_bs, d_bs):
    """vLLM's own host-buffer path asserts on this; kvcopy plans by token position."""
    p = engines(dict(block_size=p_bs, specs=_specs(4, block_size=p_bs, sliding=64)), "kv_producer")
    d = engines(dict(block_size=d_bs, specs=_specs(4, block_size=d_bs, sliding=64)), "kv_consumer")
    fill(p, d, 5)
    _transfer(p, d, [70, 41], seed=5)


def test_kernel_page_split_on_p_only(engines):
    """P's 32-token blocks split into 16-token kernel pages, D's 16-token blocks: equal pages."""
    p = engines(dict(block_size=32, specs=_specs(4, block_size=32), backend=Kernel16Backend), "kv_producer")
    d = engines(dict(block_size=16, specs=_specs(4, block_size=16)), "kv_consumer")
    assert {t.shape[2] for t in p.caches.values()} == {16}  # [B, H, N, C]: 16-token kernel pages
    fill(p, d, 6)
    _transfer(p, d, [45], seed=6)


# ------------------------------------------------------------------ back-pressure
# one_group: 4 layers, 2 KiB pages (2 heads x 16 tokens x 32 fp16 values); a 64-token
# prompt is a 32 KiB span. 40 KiB of arena (4 KiB granules, the first kept zero) holds one.
ONE_SPAN = 40 << 10


def test_p_arena_too_small_for_two_requests_the_second_waits_then_completes(engines):
    case = CASES["one_group"]
    p = engines(case, "kv_producer", arena_bytes=ONE_SPAN)
    d = engines(case, "kv_consumer")
    fill(p, d, 7)
    tokens = prompts(2, [64, 64], seed=7)
    params = prefill(p, ["x", "y"], tokens)  # both prefills end in one step
    st = p.stats()
    assert st["staged_requests"] == 1 and st["failed_allocations"] >= 1  # the second is held back, not dropped
    assert {"x", "y"} <= set(p.sched.requests)  # and its KV blocks with it, until it is staged
    before = d.raw_bytes()
    assert decode(d, [p], ["x", "y"], tokens, params) == set()
    assert_same(d, expected_d(p, d, [("x", "x", 64), ("y", "y", 64)], before))
    assert p.stats()["high_water"] <= ONE_SPAN


def test_d_arena_too_small_for_two_requests_the_second_waits_then_completes(engines):
    case = CASES["one_group"]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", arena_bytes=ONE_SPAN)
    fill(p, d, 8)
    tokens = prompts(2, [64, 64], seed=8)
    params = prefill(p, ["x", "y"], tokens)
    before = d.raw_bytes()
    assert decode(d, [p], ["x", "y"], tokens, params) == set()
    assert_same(d, expected_d(p, d, [("x", "x", 64), ("y", "y", 64)], before))
    assert d.stats()["failed_allocations"] >= 1 and d.stats()["bytes_in_use"] == 0


# ------------------------------------------------------------------ failures
def _failed_load(d, rid, tokens, params, p_engines=(), **kw):
    """D loads one request that must fail: vLLM's scheduler gets it in failed_recving (and
    its blocks as load errors for one-group models), D's bytes do not change, and the
    next step schedules the whole prompt for recompute."""
    before = d.raw_bytes()
    errors = set()
    real_step = d.step

    def step():
        out = real_step()
        errors.update(out.invalid_block_ids)
        return out
    d.step = step
    try:
        assert decode(d, list(p_engines), [rid], [tokens], [params], **kw) == {rid}
    finally:
        d.step = real_step
    assert_same(d, before)
    if len(d.kcc.kv_cache_groups) == 1:
        assert errors and errors == {b for g in d.tables[rid] for b in g if b}
    else:
        assert not errors  # vLLM takes block ids only from one-group models
    d.step()
    assert d.sched.requests[rid].num_computed_tokens == len(tokens)  # recomputed here, whole
    return errors


def test_p_cannot_stage_a_request_larger_than_its_arena_and_d_recomputes_it(engines):
    case = CASES["one_group"]
    p = engines(case, "kv_producer", arena_bytes=ONE_SPAN)
    d = engines(case, "kv_consumer")
    fill(p, d, 9)
    tokens = prompts(1, [200], seed=9)[0]
    (params,) = prefill(p, ["big"], [tokens])
    _failed_load(d, "big", tokens, params, [p])
    run([p], lambda: "big" not in p.sched.requests)  # P's blocks freed too
    assert p.stats()["staged_requests"] == 0


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_p_unreachable_fails_the_load_at_its_deadline(engines, name):
    case = CASES[name]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", fetch_timeout_s=1.0)
    fill(p, d, 10)
    tokens = prompts(1, [40], seed=10)[0]
    (params,) = prefill(p, ["lost"], [tokens])
    _failed_load(d, "lost", tokens, dict(params, remote_port=free_port()))  # nothing listens there


def test_with_vllms_fail_policy_a_failed_load_ends_the_request_with_an_error(engines):
    """vLLM's default kv_load_failure_policy ("fail"): the same report ends the request."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", fetch_timeout_s=1.0, policy="fail")
    fill(p, d, 12)
    tokens = prompts(1, [40], seed=12)[0]
    (params,) = prefill(p, ["lost"], [tokens])
    before = d.raw_bytes()
    assert decode(d, [], ["lost"], [tokens], [dict(params, remote_port=free_port())]) == {"lost"}
    assert "lost" not in d.sched.requests and d.params["lost"] is None  # finished (with an error)
    assert_same(d, before)


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_a_completion_not_ok_of_any_cause_reaches_the_load_error_path(engines, monkeypatch, name):
    """kvcopy may report a pull as failed at ``complete`` (a checksum mismatch, for one):
    whatever the cause, D reports the request as a failed load and vLLM recomputes it."""
    case = CASES[name]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 11)
    tokens = prompts(1, [40], seed=11)[0]
    (params,) = prefill(p, ["bad"], [tokens])
    real = d.manager.complete

    real_ok = []

    def complete(h):
        done = real(h)  # the real one, so every span and handle is released as usual
        real_ok.append(done.ok)
        d.raw.copy_(before)  # undo this one's writes: the load must fail without changing D
        return Completion(False, h.plan.local_block_ids, "a failure kvcopy found at complete (injected)")
    before = d.raw_bytes()
    monkeypatch.setattr(d.manager, "complete", complete)
    _failed_load(d, "bad", tokens, params, [p])
    assert real_ok == [True]  # the injected Completion, not another failure, failed the load


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_a_byte_changed_in_ps_span_fails_the_load_by_its_checksum(engines, name):
    """A bit of P's staged span flipped after the pack: D's scatter sums the bytes it
    copies, they differ from the record's, and the request takes vLLM's load-error path
    (recomputed). D's buffer differs from a correct load in that one byte only, inside
    the request's own pages."""
    case = CASES[name]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 13)
    tokens = prompts(1, [40], seed=13)[0]
    (params,) = prefill(p, ["bad"], [tokens])
    arena = p.manager.arena
    with p.worker.arena_worker.lock:  # its housekeeping thread reads notifications and TTLs meanwhile
        (entry,) = arena._staged.values()  # the one staged span
        arena.buffer[entry.span.offset + 5] ^= 0x10
    before = d.raw_bytes()
    errors = set()
    real_step = d.step

    def step():
        out = real_step()
        errors.update(out.invalid_block_ids)
        return out
    d.step = step
    try:
        assert decode(d, [p], ["bad"], [tokens], [params]) == {"bad"}
    finally:
        d.step = real_step
    n_load = p.sched.connector.connector_scheduler._get_remote_prefill_token_count(len(tokens))
    exp = expected_d(p, d, [("bad", "bad", n_load)], before)
    assert (exp != before).any()
    assert int((d.raw != exp).sum()) == 1  # the flipped byte, copied into the request's own page
    stats = d.stats()
    assert (stats["checksum_failed"], stats["checksum_checked"]) == (1, 0)
    if len(d.kcc.kv_cache_groups) == 1:
        assert errors == {b for g in d.tables["bad"] for b in g if b}
    d.step()  # recomputed


# ------------------------------------------------------------------ P in another process


def p2_and_p1(engines, prefill_process, monkeypatch, d_opts, **p2_opts):
    """D and P1 in this process, P2 in another (UCX over TCP loopback; ``p2_opts`` its
    options and hooks): P2 prefilled ``x`` (48 tokens), P1 ``y`` and ``z`` (40, 56).
    Returns (P2's process and pipe (P2 ends when the pipe closes), P1, D, the three
    prompts, their kv_transfer_params)."""
    for k, v in TCP_LOOPBACK.items():
        monkeypatch.setenv(k, v)
    case = CASES["one_group"]
    p2, pipe = prefill_process("one_group", "P2", 13, **p2_opts)
    p1 = engines(case, "kv_producer", engine_id="P1")
    d = engines(case, "kv_consumer", engine_id="D", **d_opts)
    fill(p1, d, 14)
    (t_x,), (t_y, t_z) = prompts(1, [48], seed=15), prompts(2, [40, 56], seed=16)
    pipe.send(("prefill", (["x"], [t_x])))
    assert pipe.poll(120), "P2 did not prefill"
    (x_params,) = pipe.recv()
    return (p2, pipe), p1, d, (t_x, t_y, t_z), (x_params, *prefill(p1, ["y", "z"], [t_y, t_z]))


def test_p_killed_mid_pull_fails_its_request_and_the_others_complete(engines, prefill_process, monkeypatch):
    """D loads one request from P2 (another process) and two from P1. P2 is stopped just
    before D posts its READ and killed right after: that request ends as a load error
    (its blocks reported, nothing written), D's other requests complete exactly. UCX on
    TCP over loopback: with shared memory D could read a stopped P2 once its endpoint
    is wired up (tests/nixl/test_nixl_failures.py, stopped_prefill)."""
    (p2, _pipe), p1, d, (t_x, t_y, t_z), (x_params, y_params, z_params) = p2_and_p1(
        engines, prefill_process, monkeypatch, {"pull_timeout_s": 3.0})
    real = d.manager.pull
    killed = []

    def pull(plan, *a, **kw):
        if any(name.startswith("kvcopy-arena-P2-") for name in plan.all_peers):
            stop_process(p2.pid)  # every thread of P2 stopped: it cannot serve the READ ...
            h = real(plan, *a, **kw)
            os.kill(p2.pid, signal.SIGKILL)  # ... and dies with it in flight
            killed.append(h)
            return h
        return real(plan, *a, **kw)
    monkeypatch.setattr(d.manager, "pull", pull)
    before = d.raw_bytes()
    errors = set()
    real_step = d.step

    def step():
        out = real_step()
        errors.update(out.invalid_block_ids)
        return out
    monkeypatch.setattr(d, "step", step)
    failed = decode(d, [p1], ["x", "y", "z"], [t_x, t_y, t_z], [x_params, y_params, z_params])
    assert killed and failed == {"x"}
    assert errors == {b for g in d.tables["x"] for b in g if b}
    assert_same(d, expected_d(p1, d, [("y", "y", 40), ("z", "z", 56)], before))
    st = d.stats()
    assert st["in_flight"] == 0 and st["live_transfer_handles"] == 0


def test_a_span_near_the_end_of_its_ttl_is_never_read(engines):
    """P's span lives ``arena_ttl_s``; a READ must end before P may hand the span to
    another request. P's side channel stops serving a record a margin before that
    (1 s here, of a 2 s TTL), and D fails the load instead of reading."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer", arena_ttl_s=2.0)
    d = engines(case, "kv_consumer", fetch_timeout_s=3.0)
    fill(p, d, 17)
    tokens = prompts(1, [40], seed=17)[0]
    (params,) = prefill(p, ["old"], [tokens])
    time.sleep(1.2)  # the record is past its serving time, not yet past P's TTL
    _failed_load(d, "old", tokens, params, [p])


def test_a_request_d_aborts_before_loading_frees_ps_span(engines):
    """vLLM's D scheduler hands an aborted remote-prefill request to the worker with no
    blocks, so P can free its KV: here D pulls nothing (a plan of holes) and its READ's
    notification frees P's span long before P's TTL."""
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    fill(p, d, 18)
    tokens = prompts(1, [40], seed=18)[0]
    (params,) = prefill(p, ["gone"], [tokens])
    run([p], lambda: "gone" not in p.sched.requests)
    assert p.stats()["staged_requests"] == 1
    before = d.raw_bytes()
    d.add("gone", tokens, params, max_tokens=2)
    d.sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    run([d, p], lambda: p.stats()["staged_requests"] == 0)
    assert_same(d, before)
    assert d.stats()["bytes_in_use"] == 0 and not d.worker.arena_worker.puller.jobs


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2)])
def test_p_and_d_of_other_tp_sizes(engines, p_tp, d_tp):
    """Each D rank reads its KV heads from the P ranks holding them (one READ per P rank),
    and each P rank frees its span once every D rank that reads it has said so."""
    case = CASES["hybrid_kv_sharing"]  # 2 KV heads per layer
    p = engines(case, "kv_producer", tp=p_tp)
    d = engines(case, "kv_consumer", tp=d_tp)
    fill(p, d, 19)
    tokens = prompts(2, [40, 57], seed=19)
    rids = ["t0", "t1"]
    params = prefill(p, rids, tokens)
    before = [x.raw.clone() for x in d.ranks]
    assert decode(d, [p], rids, tokens, params) == set()
    assert_same(d, expected_d(p, d, [(r, r, len(t)) for r, t in zip(rids, tokens)], before))
    run([p], lambda: not any(p.stats(r)["staged_requests"] for r in range(len(p.ranks))))
    assert all(d.stats(r)["bytes_in_use"] == 0 for r in range(len(d.ranks)))
