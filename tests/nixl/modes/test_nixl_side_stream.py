"""Layer-wise copies on a side stream (kvcopy.nixl.modes.side_stream).

CPU: the GPU path's order of operations with recorded streams and events
(kvcopy.testing.streams): each layer's copies run on the side stream after it waited for
that layer's event (recorded on the forward's stream by the forward's thread), with the
grid cap; each job's event follows its copies; the forward's stream waits for the side
stream before the sweep; only a third thread (the waiter) waits on the host, and the
threads that use the streams made the device theirs first. The span and record
equal the whole-request staging's byte for byte, arenas poisoned first. One event per
layer whatever the number of jobs (a failed job's request alone without it). Page sums
the GPU's way (read back and folded at finish) run on the CPU too: one pinned
allocation per planned step, poisoned, one read-back per job, the same record bytes.
The side stream is released at close; kvcopy's library exports the stream calls.

GPU (``@pytest.mark.gpu``, real ``torch.cuda`` streams and events; prepared, not run on
a machine without a device): the same bytes; a layer's KV written on the current stream
behind a long kernel reaches the span (the side stream waited for it); the side copies'
grid is the cap, the sweep's the copier's.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvcopy import native
from kvcopy.nixl.modes import partial_stage
from kvcopy.nixl.modes.partial_stage import StepCopies
from kvcopy.nixl.modes.side_stream import LAYERWISE_CTAS, MAX_LAYERWISE_CTAS, CudaStreams, Job, SideStream
from kvcopy.nixl.planning.pack_order import natural_key
from kvcopy.testing.nixl.engines import one_torch_thread
from kvcopy.testing.nixl.geometries import arena_staging, build_caches, logical_kv, random_spec
from kvcopy.testing.streams import RecordedStreams, check_layerwise_order, noting_copies

POISON = 0xA5
SEEDS = range(12)
FORWARD = threading.current_thread().name  # the test's thread plays the forward's


def _layers(st):
    """The span's units grouped by their last layer, in forward order (save_kv_layer's)."""
    by_last = {}
    for u, unit in enumerate(st.span_copiers(st.order).units):
        by_last.setdefault(max(unit.layers, key=natural_key), []).append(u)
    return [by_last[k] for k in sorted(by_last, key=natural_key)]


def _pair(spec, caches, pin=False):
    """(whole-request staging of ``caches["cpu"]``, its record, staging unit by unit of
    ``caches["parts"]``, its record): arenas poisoned. The records differ in their
    regions' addresses only when the two are different tensors (GPU tests)."""
    whole, info = arena_staging(spec, "p", spec.p_ranks[0], caches["cpu"], "P")
    parts, parts_info = arena_staging(spec, "p", spec.p_ranks[0], caches["parts"], "P", pin=pin)
    for st in (whole, parts):
        st.buffer[st.arena.granule:].fill_(POISON)
    return whole, info, parts, parts_info


def _splits(n, steps):
    return sorted({max(1, n * (k + 1) // steps) for k in range(steps)})


def stage_on_side(parts, info, spec, side, pool, waiter, steps=1, before_layer=None):
    """Stage ``req`` over ``steps`` steps as layer-wise P does on a GPU: per layer, the
    forward's thread marks, the copy thread (``pool``) enqueues that layer's units on the
    side stream, the waiter thread (``waiter``) waits for their event; every third layer
    is left to the sweep; at the close the forward's stream joins the side stream and
    sweeps; the record once an event after that completed (polled, as the stager does)."""
    for thread in (pool, waiter):
        thread.submit(side.enter_thread).result()
    part = parts.begin(info, spec.num_tokens, b"req", 1)
    for done in _splits(spec.num_tokens, steps):
        step = parts.settle(part, spec.p.block_ids, done)
        futures = []
        for i, units in enumerate(_layers(parts)):
            if before_layer is not None:
                before_layer(units)
            units = [u for u in units if step.has(u)]
            if not units or i % 3 == 2:
                continue
            after = side.mark()
            futures.append(pool.submit(side.copy, after, [Job("req", step, units, True)]))
        waits = []
        for f in futures:
            for q in f.result():
                assert q.error is None, q.error
                waits.append(waiter.submit(side.wait, q.event))
        for w in waits:
            w.result()
        side.join()
        left = step.left()
        for u in left:
            step.run(u)
        step.read_back(left)
    event = side.mark()
    while not event.query():
        pass
    return parts.finish(part)


def _threads():
    """The copy thread and the waiter thread."""
    return ThreadPoolExecutor(1, thread_name_prefix="copy"), ThreadPoolExecutor(1, thread_name_prefix="waits")


def _cpu_caches(spec):
    c = build_caches(spec, "p", spec.p_ranks[0], logical_kv(spec))
    return {"cpu": c, "parts": c}


@pytest.mark.parametrize("steps", [1, 3])
def test_the_order_of_operations_and_the_bytes(monkeypatch, steps):
    pool, waiter = _threads()
    with one_torch_thread(), pool, waiter:
        checked = 0
        for seed in SEEDS:
            spec = random_spec(np.random.default_rng(seed), seed)
            whole, info, parts, parts_info = _pair(spec, _cpu_caches(spec))
            ops = RecordedStreams()
            monkeypatch.setattr(StepCopies, "run", noting_copies(ops))
            side = SideStream(ops, 3)
            try:
                want = whole.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
                ops.log.clear()
                got = stage_on_side(parts, parts_info, spec, side, pool, waiter, steps)
                assert want.to_bytes() == got.to_bytes(), seed
                assert torch.equal(whole.buffer, parts.buffer), seed
            finally:
                whole.close()
                parts.close()
            checked += check_layerwise_order(ops.log, side.stream.name, FORWARD, 3) > 0
        assert checked >= len(SEEDS) // 2  # most draws have layers copied on the side stream


def test_a_job_that_fails_is_reported_and_the_others_run(monkeypatch):
    spec = random_spec(np.random.default_rng(3), 3)
    with one_torch_thread():
        whole, _, parts, info = _pair(spec, _cpu_caches(spec))
        try:
            ops = RecordedStreams()
            side = SideStream(ops)
            side.enter_thread()  # the test's thread copies here
            assert side.max_ctas == LAYERWISE_CTAS
            part = parts.begin(info, spec.num_tokens, b"req", 1)
            step = parts.settle(part, spec.p.block_ids, spec.num_tokens)
            u = step.units[0]
            step.run(u)  # run once already: a second run raises
            rest = [x for x in step.units if x != u]
            out = side.copy(side.mark(), [Job("a", step, [u], True), Job("b", step, rest, True)])
            assert [q.key for q in out] == ["a", "b"]
            assert isinstance(out[0].error, RuntimeError) and out[0].event is None
            assert out[1].error is None and out[1].event is not None and not step.left()
        finally:
            whole.close()
            parts.close()


def test_a_job_without_a_signal_gets_no_event_and_capture_is_seen():
    ops = RecordedStreams()
    side = SideStream(ops, 2)
    side.enter_thread()
    assert not side.capturing()
    ops.capture = True
    assert side.capturing()

    class Step:
        ran = []

        def run(self, unit, max_ctas=None):
            self.ran.append((unit, max_ctas))
    out = side.copy(side.mark(), [Job("a", Step(), [4, 5], False)])
    assert out[0].event is None and Step.ran == [(4, 2), (5, 2)]
    assert not ops.entries("record")[1:]  # the mark's record only


class _Step:
    """A stand-in step: notes its runs and read-backs; ``fail``: the unit whose run raises."""

    def __init__(self, ops, fail=None):
        self.ops, self.fail = ops, fail

    def run(self, unit, max_ctas=None):
        self.ops.note("copy", unit, self.ops.current().name, max_ctas)
        if unit == self.fail:
            raise RuntimeError("refused at launch")

    def read_back(self, units):
        self.ops.note("read_back", tuple(units), self.ops.current().name)


def test_one_event_after_every_job_of_a_layer_and_none_for_a_failed_one():
    """Four requests' units of one layer, the third refused at launch: one blocking event,
    recorded on the side stream after the last job's copies and read-back, is every
    signalled job's that did not fail; the failed one has its error and no event; a job
    that did not ask shares it not."""
    ops = RecordedStreams()
    side = SideStream(ops, 2)
    side.enter_thread()
    jobs = [Job("a", _Step(ops), [1, 2], True), Job("b", _Step(ops), [1], False),
            Job("c", _Step(ops, fail=4), [3, 4, 5], True), Job("d", _Step(ops), [6], True)]
    out = side.copy(side.mark(), jobs)
    assert [q.key for q in out] == ["a", "b", "c", "d"]
    side_records = [e for e in ops.entries("record") if e[3] == side.stream.name]
    assert len(side_records) == 1  # one per layer, not one per job
    event = out[0].event
    assert event is not None and event.blocking and event.name == side_records[0][2]
    assert out[3].event is event and out[1].event is None
    assert out[2].event is None and isinstance(out[2].error, RuntimeError) and out[2].units == [3, 4, 5]
    kinds = [e[1:3] for e in ops.log if e[1] in ("copy", "read_back", "record")]
    assert kinds[-3:] == [("copy", 6), ("read_back", (6,)), ("record", event.name)]  # the event after them all
    assert ("read_back", (3, 4, 5)) not in kinds  # the failed job's sums are never read back
    side.wait(event)
    assert ops.entries("synchronize") == [(threading.current_thread().name, "synchronize", event.name)]


def test_no_event_when_every_signalled_job_failed():
    ops = RecordedStreams()
    side = SideStream(ops)
    side.enter_thread()
    out = side.copy(side.mark(), [Job("a", _Step(ops, fail=1), [1], True), Job("b", _Step(ops), [2], False)])
    assert out[0].error is not None and out[0].event is None and out[1].event is None
    assert not [e for e in ops.entries("record") if e[3] == side.stream.name]


def _deferred(monkeypatch, poison=-0x5A5A5A5A5A5A5A5B):
    """Page sums the GPU's way on the CPU: read back into a host buffer and folded at
    finish; each host buffer (counted) poisoned, so that a slice folded without its
    read-back changes the record."""
    allocated = []

    def host(n):
        allocated.append(n)
        return torch.full((n,), poison, dtype=torch.int64)
    monkeypatch.setattr(partial_stage, "deferred_sums", lambda device: True)
    monkeypatch.setattr(partial_stage, "host_sums", host)
    return allocated


@pytest.mark.parametrize("steps", [1, 3])
def test_sums_read_back_the_gpus_way_one_buffer_per_step_one_copy_per_job(monkeypatch, steps):
    """The record (its page sums included) is the whole-request staging's byte for byte
    with sums read back to a poisoned host buffer and folded at finish; one host buffer
    per planned step (not one per unit call); one read-back copy per layer's job."""
    allocated = _deferred(monkeypatch)
    copies = []
    real = StepCopies.read_back

    def read_back(self, units):
        n = real(self, units)
        copies.append((threading.current_thread().name, len(units), n))
        return n
    monkeypatch.setattr(StepCopies, "read_back", read_back)
    pool, waiter = _threads()
    checked = 0
    with one_torch_thread(), pool, waiter:
        for seed in SEEDS:
            spec = random_spec(np.random.default_rng(seed), seed)
            whole, info, parts, parts_info = _pair(spec, _cpu_caches(spec))
            if not parts.sums.on:
                whole.close()
                parts.close()
                continue
            side = SideStream(RecordedStreams(), 3)
            allocated.clear()
            copies.clear()
            try:
                want = whole.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
                got = stage_on_side(parts, parts_info, spec, side, pool, waiter, steps)
                assert want.to_bytes() == got.to_bytes(), seed
                assert torch.equal(whole.buffer, parts.buffer), seed
            finally:
                whole.close()
                parts.close()
            planned = len(_splits(spec.num_tokens, steps))
            assert 1 <= len(allocated) <= planned, (seed, allocated)  # a step with no call allocates none
            jobs = [(k, n) for thread, k, n in copies if thread != FORWARD]
            assert jobs and all(n <= 1 for _, n in jobs), copies  # a layer's job: one copy (none: no sums)
            assert all(n <= k for thread, k, n in copies if thread == FORWARD)  # the sweep: one per run
            checked += 1
    assert checked >= len(SEEDS) // 2


def test_a_unit_whose_sums_were_not_read_back_is_refused_at_finish(monkeypatch):
    _deferred(monkeypatch)
    spec = random_spec(np.random.default_rng(0), 0)
    with one_torch_thread():
        whole, _, parts, info = _pair(spec, _cpu_caches(spec))
        try:
            assert parts.sums.on
            part = parts.begin(info, spec.num_tokens, b"req", 1)
            step = parts.settle(part, spec.p.block_ids, spec.num_tokens)
            for u in step.units:
                step.run(u)
            step.read_back(step.units[1:])
            with pytest.raises(RuntimeError, match="never read back"):
                parts.finish(part)
            parts.abandon(part)
            two = parts.settle(parts.begin(info, spec.num_tokens, b"two", 1), spec.p.block_ids, spec.num_tokens)
            with pytest.raises(RuntimeError, match="before it was copied"):
                two.read_back(two.units[:1])
            for u in two.units:
                two.run(u)
            assert len(two.units) > 1 and two.read_back(two.units) == 1  # adjacent slices: one copy
            assert two.read_back(two.units) == 0  # read once
        finally:
            whole.close()
            parts.close()


def test_the_side_stream_is_released_once_at_close():
    ops = RecordedStreams()
    side = SideStream(ops)
    name = side.stream.name
    side.close()
    side.close()
    assert [e[1:] for e in ops.entries("destroy")] == [("destroy", name)]


def test_kvcopys_library_exports_the_stream_calls():
    """libkvcopy_cuda (built here with nvcc) declares kvcopy_cuda_stream_create/destroy
    and refuses null arguments without touching a device; on a machine without a GPU
    the create fails and hands out no stream."""
    lib, why = native.load("kvcopy_cuda")
    if lib is None:
        pytest.skip(f"no libkvcopy_cuda: {why}")
    handle, priority = ctypes.c_void_p(), ctypes.c_int()
    assert lib.kvcopy_cuda_stream_create(0, None, ctypes.byref(priority)) == 1  # cudaErrorInvalidValue
    assert lib.kvcopy_cuda_stream_destroy(None) == 1
    if not torch.cuda.is_available():
        code = lib.kvcopy_cuda_stream_create(0, ctypes.byref(handle), ctypes.byref(priority))
        assert code != 0 and handle.value is None
        with pytest.raises(native.CudaError, match="kvcopy_cuda_stream_create"):
            native.check(code, "kvcopy_cuda_stream_create")


def test_cuda_streams_makes_its_own_stream_and_destroys_it_once(monkeypatch, caplog):
    """CudaStreams' wiring, the CUDA calls played: the stream is created by kvcopy's
    library on the KV's device (made current around the call), wrapped as an external
    stream of that device, and destroyed with the same handle at close, once, on that
    device; a destroy that fails (a shutdown after a sticky CUDA error) is logged, never
    raised: it would skip the rest of the worker's shutdown (NIXL's close)."""
    calls, current = [], []
    fail = {"code": 0}

    class Lib:
        def kvcopy_cuda_stream_create(self, device, handle, priority):
            calls.append(("create", device, list(current)))
            handle._obj.value, priority._obj.value = 0x5100, 0
            return 0

        def kvcopy_cuda_stream_destroy(self, handle):
            calls.append(("destroy", handle, list(current)))
            return fail["code"]

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    class External:
        def __init__(self, handle, device):
            self.cuda_stream, self.device = handle, device
    monkeypatch.setattr(native, "load", lambda stem: (Lib(), None))
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "ExternalStream", External)
    dev = torch.device("cuda", 1)
    side = SideStream(CudaStreams(dev))
    assert isinstance(side.stream, External) and side.stream.cuda_stream == 0x5100 and side.stream.device == dev
    assert calls == [("create", 1, [dev])] and current == []
    side.close()
    side.close()
    assert calls[1:] == [("destroy", 0x5100, [dev])] and current == []
    fail["code"] = 700  # cudaErrorIllegalAddress: sticky
    side = SideStream(CudaStreams(dev))
    with caplog.at_level("ERROR"):
        side.close()
    assert calls[-1] == ("destroy", 0x5100, [dev]) and "destroying the layer-wise side stream failed" in caplog.text


def test_without_kvcopys_library_a_pooled_stream_at_the_lowest_priority(monkeypatch, caplog):
    made = []
    monkeypatch.setattr(native, "load", lambda stem: (None, "not built"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority=0: made.append((device, priority)) or "pooled")
    ops = CudaStreams(torch.device("cuda", 0))
    with caplog.at_level("WARNING"):
        assert ops.stream() == "pooled"
    assert made == [(torch.device("cuda", 0), 1)] and "pooled" in caplog.text
    ops.close_stream("pooled")  # the pool's: nothing to destroy


@pytest.mark.parametrize("bad,error", [(0, ValueError), (MAX_LAYERWISE_CTAS + 1, ValueError), (2.0, TypeError),
                                       (True, TypeError), ("4", TypeError)])
def test_the_cap_is_checked(bad, error):
    with pytest.raises(error, match="layerwise_ctas"):
        SideStream(RecordedStreams(), bad)


# ------------------------------------------------------------------ GPU
def _per_tensor(caches, make):
    """``make(t)`` for each distinct tensor of ``caches``, aliases kept (one result per tensor)."""
    made, out = {}, {}
    for name, t in caches.items():
        if id(t) not in made:
            made[id(t)] = make(t)
        out[name] = made[id(t)]
    return out


def _on_cuda(caches):
    return _per_tensor(caches, lambda t: t.cuda())


def _spy_grids(monkeypatch):
    """(current stream, cap handed to the grid rule) of every kernel launch."""
    import importlib

    seen = []
    for name in ("kvcopy.copy_backends.cuda", "kvcopy.kernels.triton_copy"):
        try:
            mod = importlib.import_module(name)
        except ImportError:  # no triton: auto's summing kernel is cuda's
            continue
        real = mod.grid_size

        def rule(total, shape, cap, _real=real):
            seen.append((torch.cuda.current_stream().cuda_stream, cap))
            return _real(total, shape, cap)
        monkeypatch.setattr(mod, "grid_size", rule)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 3])
def test_gpu_side_stream_stages_bit_exactly_with_the_cap(monkeypatch, steps):
    grids = _spy_grids(monkeypatch)
    allocated = []
    real_host = partial_stage.host_sums

    def host(n):
        allocated.append(real_host(n))
        allocated[-1].fill_(-0x5A5A5A5A5A5A5A5B)  # poisoned: a slice folded unread changes the record
        return allocated[-1]
    monkeypatch.setattr(partial_stage, "host_sums", host)
    pool, waiter = _threads()
    with pool, waiter:
        for seed in range(6):
            spec = random_spec(np.random.default_rng(seed), seed)
            cpu = build_caches(spec, "p", spec.p_ranks[0], logical_kv(spec))
            whole, info, parts, parts_info = _pair(spec, {"cpu": cpu, "parts": _on_cuda(cpu)}, pin=True)
            side = SideStream(CudaStreams(torch.device("cuda")), 2)
            try:
                want = whole.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
                grids.clear()
                allocated.clear()
                got = stage_on_side(parts, parts_info, spec, side, pool, waiter, steps)
                assert want.to_bytes() == got.to_bytes(), seed  # the GPU's page sums are the CPU's
                assert torch.equal(whole.buffer, parts.buffer), seed
                on_side = [cap for s, cap in grids if s == side.stream.cuda_stream]
                assert on_side and set(on_side) == {2}, grids
                assert all(cap != 2 for s, cap in grids if s != side.stream.cuda_stream)  # the sweep: full grid
                if parts.sums.on:  # one pinned buffer per planned step, not one per unit call
                    assert 1 <= len(allocated) <= len(_splits(spec.num_tokens, steps)), allocated
                    assert all(t.is_pinned() for t in allocated)
            finally:
                side.close()
                whole.close()
                parts.close()


@pytest.mark.gpu
def test_gpu_a_layers_copy_waits_for_its_compute():
    """Each layer's KV is written on the current stream behind a ~1 ms kernel, after the
    caches were poisoned; the copy on the side stream must see the written bytes."""
    pool, waiter = _threads()
    with pool, waiter:
        for seed in range(4):
            spec = random_spec(np.random.default_rng(seed), seed)
            cpu = build_caches(spec, "p", spec.p_ranks[0], logical_kv(spec))
            truth = _on_cuda(cpu)
            dev = _per_tensor(truth, lambda t: torch.full_like(t.view(torch.uint8), 0xC3).view(t.dtype))
            whole, info, parts, parts_info = _pair(spec, {"cpu": cpu, "parts": dev}, pin=True)
            side = SideStream(CudaStreams(torch.device("cuda")), 4)
            units = parts.span_copiers(parts.order).units
            torch.cuda.synchronize()

            def write(layer_units, units=units, dev=dev, truth=truth):
                torch.cuda._sleep(2_000_000)  # the layer's compute, long enough to be overtaken
                for u in layer_units:
                    for name in units[u].layers:
                        dev[name].copy_(truth[name])
            try:
                want = whole.stage(info, spec.p.block_ids, spec.num_tokens, b"req", 1)
                got = stage_on_side(parts, parts_info, spec, side, pool, waiter, 1, before_layer=write)
                assert want.to_bytes() == got.to_bytes(), seed
                assert torch.equal(whole.buffer, parts.buffer), seed
            finally:
                side.close()
                whole.close()
                parts.close()


@pytest.mark.gpu
def test_gpu_the_side_stream_is_kvcopys_own():
    """Not one of torch's pooled streams (64 handed out per priority: twice the pool),
    at the device's lowest priority, usable (a copy on it lands), destroyed at close."""
    ops = CudaStreams(torch.device("cuda"))
    side = SideStream(ops)
    s = side.stream
    pooled = [torch.cuda.Stream() for _ in range(64)] + [torch.cuda.Stream(priority=-1) for _ in range(64)]
    assert s.cuda_stream not in {p.cuda_stream for p in pooled}
    assert s.priority >= max(p.priority for p in pooled)  # none lower than ours
    src = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
    dst = torch.full_like(src, -1)
    done = torch.cuda.Event()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dst.copy_(src)
        done.record(s)
    done.synchronize()
    assert torch.equal(dst, src)
    handle = s.cuda_stream
    assert handle in ops._own
    side.close()
    assert handle not in ops._own and side.stream is None
