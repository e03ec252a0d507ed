"""kvcopy.vllm.affinity: the arena connector's transfer threads start on the cores vLLM's
CPU platform reserves for KV transfer, not on the model's cores its worker is bound to.

Before this, every thread the arena worker started inherited the worker's binding, and
with P's and D's workers bound to the same core (2 cores: CPU 0 for both), P's UCX async
and NIXL progress threads got no CPU while D's worker stepped, and D's first READ passed
its deadline (docs/vllm.md, "With a real engine"). The engine-level check is
``tests/engine/``; this one is deterministic: it binds the test thread as vLLM's CPU
worker does, builds the real connector on vLLM-built caches, and reads each new thread's
CPU set back from the kernel.

Run in the vLLM environment; skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the model families, the fixture)
from vllm.platforms import current_platform  # noqa: E402

from kvcopy.vllm.affinity import threads_on, transfer_cpus  # noqa: E402
from kvcopy.vllm.arena.connector import KvcopyArenaWorker  # noqa: E402
from vllm_arena_engines import ArenaEngine, decode, prefill, prompts  # noqa: E402

assert vllm_env  # a fixture, used by name


def _tasks():
    return {int(t) for t in os.listdir("/proc/self/task")}


def _comm(tid):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


@pytest.fixture
def cores():
    """(vLLM's KV-transfer cores, the model's cores): the test thread bound to the latter,
    as vLLM's CPU worker binds itself, and restored after."""
    every = os.sched_getaffinity(0)
    reserved = {max(node) for node in current_platform.discover_numa_topology() if node} & every
    model = every - reserved
    if not reserved or not model:
        pytest.skip(f"needs at least 2 CPUs with one reserved by vLLM (CPUs {sorted(every)})")
    os.sched_setaffinity(0, model)
    yield frozenset(reserved), frozenset(model)
    os.sched_setaffinity(0, every)


def test_transfer_cpus_are_vllms_kv_cores(cores):
    reserved, _ = cores
    assert transfer_cpus() == reserved


def test_transfer_cpus_named_by_the_environment(cores, monkeypatch):
    """An engine confined to some of the host's cores names its own (``--bind split``):
    vLLM's reserved core may be another engine's."""
    reserved, model = cores
    monkeypatch.setenv("KVCOPY_TRANSFER_CPUS", ",".join(map(str, sorted(model))))
    assert transfer_cpus() == model != reserved
    monkeypatch.setenv("KVCOPY_TRANSFER_CPUS", "0-2,5")
    assert transfer_cpus() == {0, 1, 2, 5}
    for bad in ("x", "3-1", "-1", "1,,2"):
        monkeypatch.setenv("KVCOPY_TRANSFER_CPUS", bad)
        with pytest.raises(ValueError, match="KVCOPY_TRANSFER_CPUS"):
            transfer_cpus()
    # CPU numbers far beyond the machine's: refused before a set of that size is built
    for bad in ("0-4000000000", f"0,{8 * os.cpu_count()}"):
        monkeypatch.setenv("KVCOPY_TRANSFER_CPUS", bad)
        with pytest.raises(ValueError, match=r"KVCOPY_TRANSFER_CPUS: CPU \d+ is beyond this machine's"):
            transfer_cpus()


def test_threads_on_moves_the_caller_and_restores_it(cores):
    reserved, model = cores
    seen = {}

    def child():
        seen["child"] = os.sched_getaffinity(0)
    with threads_on(reserved):
        seen["body"] = os.sched_getaffinity(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()
    assert seen == {"body": reserved, "child": reserved}
    assert os.sched_getaffinity(0) == model
    with threads_on(None):  # nothing to do
        assert os.sched_getaffinity(0) == model


def test_threads_on_keeps_the_binding_where_the_kernel_refuses_the_cpus(cores):
    _, model = cores
    with threads_on(frozenset({os.cpu_count() + 64})):  # no such CPU: EINVAL
        assert os.sched_getaffinity(0) == model
    assert os.sched_getaffinity(0) == model


def test_the_arena_workers_threads_start_on_vllms_kv_cores(vllm_env, monkeypatch, cores):
    reserved, model = cores
    started = {}
    real = KvcopyArenaWorker.register_kv_caches

    def register(self, kv_caches):
        before = _tasks()
        real(self, kv_caches)
        started.update({tid: (_comm(tid), os.sched_getaffinity(tid)) for tid in _tasks() - before})
    monkeypatch.setattr(KvcopyArenaWorker, "register_kv_caches", register)
    case = CASES["one_group"]
    p = ArenaEngine(vllm_env, case, "kv_producer", monkeypatch.setenv)
    d = ArenaEngine(vllm_env, case, "kv_consumer", monkeypatch.setenv)
    try:
        assert os.sched_getaffinity(0) == model, "the worker's own thread must keep vLLM's binding"
        # a NIXL progress thread per engine, UCX's async thread (one per process)
        assert any(comm == "async" for comm, _ in started.values()), started
        assert len(started) >= 3, started
        assert {tid: cpus for tid, (_, cpus) in started.items()} == {tid: reserved for tid in started}
        tokens = prompts(2, [40, 70], seed=3)
        rids = ["a0", "a1"]
        params = prefill(p, rids, tokens)
        assert decode(d, [p], rids, tokens, params) == set()
        fetch = [t for t in threading.enumerate() if t.name.startswith("kvcopy-arena-fetch")]
        assert fetch, "D's pull ran no fetch thread"
        assert {t.name: os.sched_getaffinity(t.native_id) for t in fetch} == {t.name: reserved for t in fetch}
    finally:
        d.close()
        p.close()
