"""Layer-wise staging's GPU path (a side stream: kvcopy.nixl.modes.side_stream) with vLLM 0.33's
real scheduler and connector worker classes, on the CPU.

P's worker is given recorded streams and events (``KvcopyArenaWorker.stream_ops``:
kvcopy.testing.streams.RecordedStreams), which select the path a CUDA arena takes:
``save_kv_layer`` marks an event on the forward's stream, the copy thread runs the
layer's copies on the side stream after waiting for it, capped at ``layerwise_ctas``,
``wait_for_save`` joins the side stream before the sweep, records wait for an event,
and a chunked push WRITEs a unit only once the event after its copy completed. The
copies run on the CPU at once; the log says what a GPU would have been told, and the
test checks its order (``check_layerwise_order``) and that the forward's thread never
waits on the host. D's bytes are compared whole with the expectation from vLLM's block
tables, P's KV poisoned before its forward writes each layer. One test gives D recorded
streams too (``ArenaStaging.streams``): a GPU D landing pushed chunks at their ``c``.

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_arena import engines  # noqa: E402  (the fixture)
from test_vllm_arena_layerwise import _transfer  # noqa: E402
from test_vllm_arena_push_chunks import _chunk_stats, _concurrent, _loaded  # noqa: E402
from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the fixture)

import torch  # noqa: E402

from kvcopy.nixl import push_reservations  # noqa: E402
from kvcopy.nixl.modes import partial_stage  # noqa: E402
from kvcopy.nixl.modes.partial_stage import StepCopies  # noqa: E402
from kvcopy.testing.streams import RecordedStreams, check_layerwise_order, noting_copies  # noqa: E402
from kvcopy.vllm.arena.connector import KvcopyArenaWorker  # noqa: E402
from kvcopy.vllm.arena.push_recv import ArenaPushReceiver  # noqa: E402
from vllm_arena_engines import fill_layerwise, run  # noqa: E402

assert engines and vllm_env  # fixtures, used by name
FORWARD = threading.current_thread().name  # the engine's thread: the test steps the engines
CTAS = 3


@pytest.fixture
def streams(monkeypatch):
    """Recorded streams for every arena worker made in the test, copies noted."""
    ops = RecordedStreams()
    monkeypatch.setattr(KvcopyArenaWorker, "stream_ops", ops)
    monkeypatch.setattr(StepCopies, "run", noting_copies(ops))
    return ops


def _side(p):
    layers = p.worker.arena_worker.stager.layers
    assert layers.side is not None and layers.side.max_ctas == CTAS
    return layers


def _forward_waits_for_the_waiter(layers, monkeypatch):
    """The test's engine waits, before ``wait_for_save``'s close, until P's waiter thread
    handed on what it was given (a real one does not: units handed on after the close go
    in the final WRITE), so that the counts of chunks and early records are fixed."""
    real = layers.wait_copies

    def wait():
        real()
        for f in list(layers._handing):
            f.result()
    monkeypatch.setattr(layers, "wait_copies", wait)


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing", "mla", "gdn_exact"])
def test_layers_copied_on_the_side_stream_load_exactly(engines, streams, monkeypatch, name):
    case = CASES[name]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS)
    d = engines(case, "kv_consumer")
    layers = _side(p)
    _forward_waits_for_the_waiter(layers, monkeypatch)
    at_layer, swept = _transfer(p, d, [40, 17])
    assert at_layer > 0
    side_copies = check_layerwise_order(streams.log, layers.side.stream.name, FORWARD, CTAS)
    assert side_copies > 0
    # kvcopy's threads that touch the GPU made the KV's device theirs (a new thread's is 0)
    for prefix in ("kvcopy-arena-layers-", "kvcopy-arena-waits-", "kvcopy-arena-house-"):
        assert any(t.startswith(prefix) for t in streams.entered), (prefix, streams.entered)
    assert [e for e in streams.log if e[1] == "wait_stream"]  # the forward's stream joined the side stream
    # records: made on the copy thread once the last unit's event completed, or, with state
    # units left to the sweep (GDN), at the close once an event after the sweep completed
    state = any(u.state for u in p.manager.arena.units)
    assert layers.early == (0 if state else 2)
    assert swept > 0 if state else swept == 0
    assert p.stats()["partial_requests"] == 0


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_one_event_and_one_hand_off_per_layer_for_every_final_request(engines, streams, monkeypatch, name):
    """Two requests whose prefill ends in one step: each layer's copies of both are
    followed by one event on the side stream and one waiter hand-off covering both (not
    one per request); each request's units of the layer handed on once, after that
    event. Page sums the GPU's way (read back into a poisoned host buffer, folded at the
    record): one host buffer per request and step, D byte-exact (its sums compared).
    P's side stream is destroyed once at shutdown."""
    case = CASES[name]
    allocated = []

    def host(n):
        allocated.append(n)
        return torch.full((n,), -0x5A5A5A5A5A5A5A5B, dtype=torch.int64)
    monkeypatch.setattr(partial_stage, "deferred_sums", lambda device: True)
    monkeypatch.setattr(partial_stage, "host_sums", host)
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS)
    d = engines(case, "kv_consumer")
    layers = _side(p)
    assert p.worker.arena_worker.manager.arena.sums.on  # the records carry page sums, D compares them
    _forward_waits_for_the_waiter(layers, monkeypatch)
    hand_offs = []
    real_hand_on = layers._hand_on

    def hand_on(*args):
        streams.note("hand_on", args)
        hand_offs.append(args)
        return real_hand_on(*args)
    monkeypatch.setattr(layers, "_hand_on", hand_on)
    handed = []
    real_copied = layers.on_copied

    def copied(rid, units):
        streams.note("copied", rid, tuple(units))
        handed.append(rid)
        return real_copied(rid, units)
    layers.on_copied = copied
    at_layer, _ = _transfer(p, d, [40, 17])
    assert at_layer > 0
    check_layerwise_order(streams.log, layers.side.stream.name, FORWARD, CTAS)
    side = layers.side.stream.name
    records = [e for e in streams.entries("record") if e[3] == side]
    waits = [e for e in streams.entries("wait_event") if e[2] == side]  # one per layer copied at its layer
    assert records and len(records) <= len(waits)  # at most one event per layer
    assert len(hand_offs) == len(records)  # one waiter job per event
    both = [h for h in hand_offs if len(h[0]) == 2]
    assert both, hand_offs  # a layer of both final requests: one event, one hand-off
    for h, rec in zip(hand_offs, records):
        assert h[1].name == rec[2] and len({rid for rid, _ in h[0]}) == len(h[0])
    assert len(handed) == sum(len(h[0]) for h in hand_offs)  # each request's units once per layer
    done = set()
    for entry in streams.log:  # a request's units handed on only after the event of their layer
        if entry[1] == "synchronize":
            done.add(entry[2])
        elif entry[1] == "hand_on":
            event = entry[2][1].name
        elif entry[1] == "copied":
            assert event in done, entry
    assert allocated and len(allocated) <= 2 * len([e for e in streams.log if e[1] == "wait_stream"])
    pw = p.worker.arena_worker
    pw.shutdown()
    assert [e[1:] for e in streams.entries("destroy")] == [("destroy", side)]


def test_a_chunk_is_written_only_after_its_units_event(engines, streams, monkeypatch):
    """Concurrent dispatch, push in chunks: each chunk WRITE (on the copy thread) carries
    only units whose side-stream event the copy thread waited for; the record is made on
    the copy thread after the last one (finish_early, as on the CPU); D byte-exact."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS, push_chunk_bytes=0)
    d = engines(case, "kv_consumer", transfer_mode="push")
    layers = _side(p)
    _forward_waits_for_the_waiter(layers, monkeypatch)
    pw = p.worker.arena_worker
    writes = pw.manager.push_writes
    real = writes.post_units

    def post_units(token, part, lo, hi, staged_as=None):
        streams.note("post", lo, hi)
        return real(token, part, lo, hi, staged_as=staged_as)
    monkeypatch.setattr(writes, "post_units", post_units)
    real_staged = pw.stager.staged_early

    def staged_early(rid, record):
        streams.note("staged_early", rid)
        return real_staged(rid, record)
    monkeypatch.setattr(pw.stager, "staged_early", staged_early)
    fill_layerwise(p, d, 31)
    rids, tokens, before, failed = _concurrent(p, d, [40], seed=31, accepted=streams.log.clear)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    check_layerwise_order(streams.log, layers.side.stream.name, FORWARD, CTAS)
    copied, event_units, done = [], {}, set()
    posts = 0
    for entry in streams.log:
        if entry[1] == "copy" and entry[0] != FORWARD:
            copied.append(entry[2])
        elif entry[1] == "record" and entry[3] == layers.side.stream.name:
            event_units[entry[2]], copied = copied, []
        elif entry[1] == "synchronize":
            done.update(event_units[entry[2]])
        elif entry[1] == "post":
            assert entry[0] != FORWARD
            assert set(range(entry[2], entry[3])) <= done, (entry, sorted(done))
            posts += 1
        elif entry[1] == "staged_early":  # the record (and the final WRITE) after every unit's event
            assert set(u for units in event_units.values() for u in units) <= done and not copied, entry
    assert posts >= 1 and _chunk_stats(p, d)[1] == posts
    assert layers.early == len(rids) + 1  # the warm-up's record too: made on the copy thread


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_a_gpu_d_lands_chunks_at_c_and_reports_after_their_events(engines, streams, monkeypatch, name):
    """Both sides on the GPU path: P's copies on its side stream; D (its own recorded
    streams: ArenaStaging.streams) scatters chunks at their c on the engine thread's
    current stream, its sums folded only once their event completed (late once): each
    load is reported at a later step than the one that read its f, D never waits on the
    host, D's bytes are exact and its spans freed. D's worker is stepped from P's
    ``wait_for_save`` until a chunk was scattered (D's engine stepping while P's forward
    ends), and P's record is made there (not right after the last copy), so the f comes
    after those chunks."""
    case = CASES[name]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS, push_chunk_bytes=0)
    d = engines(case, "kv_consumer", transfer_mode="push")
    d_ops = RecordedStreams()
    dw = d.worker.arena_worker
    dw.manager.arena.streams = d_ops
    pw = p.worker.arena_worker
    _forward_waits_for_the_waiter(_side(p), monkeypatch)
    monkeypatch.setattr(pw.stager.layers, "finish_early", lambda rid: None)
    held = dw.manager.reservations._recv
    real_save = pw.save

    def save(meta):
        end = time.monotonic() + 30
        while held and not any(j.scattered is not None and j.scattered.any() for j in held.values()):
            assert time.monotonic() < end, "D scattered no chunk while P's forward ended"
            with dw.lock:
                dw.puller.step()
            time.sleep(0.001)
        real_save(meta)
    monkeypatch.setattr(pw, "save", save)
    at_f: Dict[str, int] = {}
    real_complete = push_reservations.Reservations.complete

    def complete(self, token):
        job = self._recv[token]
        at_f[job.rw.request.records[0].request_id] = 0 if job.scattered is None else int(job.scattered.sum())
        return real_complete(self, token)
    monkeypatch.setattr(push_reservations.Reservations, "complete", complete)
    lands: Dict[str, int] = {}
    real_land = ArenaPushReceiver._land

    def land(self, job, what):
        lands[job.rid] = lands.get(job.rid, 0) + 1
        return real_land(self, job, what)
    monkeypatch.setattr(ArenaPushReceiver, "_land", land)
    fill_layerwise(p, d, 41)
    rids, tokens, before, failed = _concurrent(p, d, [40, 17], seed=41)
    assert failed == set()
    _loaded(p, d, rids, tokens, before)
    assert any(at_f[r] > 0 for r in rids), at_f  # units scattered at their c, before the f
    scatters = [e for e in d_ops.log if e[1] == "record"]
    assert all(e[0] == FORWARD and e[3] == "current" for e in scatters)
    chunked = [r for r in rids if at_f[r] > 0]
    assert all(lands[r] >= 2 for r in chunked), lands  # the verdict waited for the tail's event, a step at least
    assert d_ops.entries("synchronize") == []
    run([p, d], lambda: d.stats()["bytes_in_use"] == 0 and d.stats()["push_held_spans"] == 0)


def test_the_engine_never_waits_for_the_side_streams_events(engines, streams):
    """Every host wait held (a GPU far behind): P's steps still end, the records are made
    at the close once their events complete (polled), D loads exactly; the copy thread's
    waiter, still waiting, hands on nothing early."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS)
    d = engines(case, "kv_consumer")
    layers = _side(p)
    streams.gate = threading.Event()
    try:
        at_layer, swept = _transfer(p, d, [40, 17])
        assert at_layer > 0 and swept == 0
        held = [e for e in streams.log if e[1] == "synchronize"]
        assert held and all(e[0] != FORWARD for e in held)  # the waiter is in its waits
        assert layers.early == 0 and any(not f.done() for f in layers._handing)
    finally:
        streams.gate.set()
    for f in list(layers._handing):
        f.result()
    assert layers.early == 0  # the close made the records; the waiter's late turn changes nothing


def test_a_failed_side_copy_stages_the_request_whole(engines, streams, monkeypatch):
    """A copy the side stream refuses (raised at launch) fails the request's layer-wise
    staging: its span goes and it is staged whole at its last step; D byte-exact."""
    case = CASES["hybrid_kv_sharing"]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS)
    d = engines(case, "kv_consumer")
    _side(p)
    noted = StepCopies.run
    calls = []

    def failing(self, unit, max_ctas=None):
        calls.append(max_ctas)
        if max_ctas is not None and calls.count(CTAS) == 2:  # the second copy on the side stream
            self.done.add(unit)
            raise RuntimeError("injected launch failure")
        return noted(self, unit, max_ctas)
    monkeypatch.setattr(StepCopies, "run", failing)
    saves = []
    manager = p.worker.arena_worker.manager
    real_save = manager.save
    monkeypatch.setattr(manager, "save", lambda *a, **k: (saves.append(k.get("request_id")), real_save(*a, **k))[1])
    _transfer(p, d, [40, 17])
    assert len(saves) == 1  # one request staged whole, after its layer-wise copy failed
    assert p.stats()["partial_requests"] == 0


def test_while_a_graph_is_captured_nothing_is_queued_and_the_sweep_copies(engines, streams):
    case = CASES["one_group"]
    p = engines(case, "kv_producer", layerwise=True, layerwise_ctas=CTAS)
    d = engines(case, "kv_consumer")
    layers = _side(p)
    streams.capture = True
    at_layer, swept = _transfer(p, d, [40, 17])
    assert at_layer == 0 and swept > 0
    assert not any(e[1] == "copy" and e[0] != FORWARD for e in streams.log)
    check_layerwise_order(streams.log, layers.side.stream.name, FORWARD, CTAS)
