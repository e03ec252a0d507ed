"""Layer-wise copies on a side stream (kvcopy.nixl.modes.side_stream).

CPU: the GPU path's order of operations with recorded streams and events
(kvcopy.testing.streams): each layer's copies run on the side stream after it waited for
that layer's event (recorded on the forward's stream by the forward's thread), with the
grid cap; each job's event follows its copies; the forward's stream waits for the side
stream before the sweep; only a third thread (the waiter) waits on the host, and the
threads that use the streams made the device theirs first. The span and record
equal the whole-request staging's byte for byte, arenas poisoned first.

GPU (``@pytest.mark.gpu``, real ``torch.cuda`` streams and events; prepared, not run on
a machine without a device): the same bytes; a layer's KV written on the current stream
behind a long kernel reaches the span (the side stream waited for it); the side copies'
grid is the cap, the sweep's the copier's.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

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
        for u in step.left():
            step.run(u)
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
                got = stage_on_side(parts, parts_info, spec, side, pool, waiter, steps)
                assert want.to_bytes() == got.to_bytes(), seed  # the GPU's page sums are the CPU's
                assert torch.equal(whole.buffer, parts.buffer), seed
                on_side = [cap for s, cap in grids if s == side.stream.cuda_stream]
                assert on_side and set(on_side) == {2}, grids
                assert all(cap != 2 for s, cap in grids if s != side.stream.cuda_stream)  # the sweep: full grid
            finally:
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
                whole.close()
                parts.close()
