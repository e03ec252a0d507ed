"""kvcopy.vllm.offload against the real vLLM 0.33 package, on the CPU.

Each case builds vLLM's own KV cache config and device caches (the model families of
tests/vllm/test_vllm_mirror.py: hybrids with overlaid groups, kernel-page splits, MLA, padded and
packed pages, attention + GDN), vLLM's ``OffloadingConnector`` worker side
(``KvcopyOffloadingConnector``, the spec through vLLM's factory) and its
``register_kv_caches``, which canonicalizes the caches and hands them to the spec.

The reference is vLLM's own CPU spec worker (``CPUOffloadingWorker`` and its
``SingleDirectionOffloadingHandler``: descriptor building, group sizes, block indices,
sub-block skips, its host tensors) on a clone of the device storages, with its CUDA
calls replaced as :mod:`kvcopy.testing.vllm_offload` says (a memmove per descriptor
for ``cuMemcpyBatchAsync``). Every byte of every host tensor after a store, and of
every device storage after a load, must equal the reference's, the destination
poisoned first.

The scheduler tests run vLLM's real ``Scheduler`` with the connector on both sides;
the test plays the model runner (``KVConnectorModelRunnerMixin``'s order: preemptions,
bind, the forward, ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``,
worker metadata) and the model: each scheduled token's KV row of each layer gets bytes
drawn from a generator seeded by the layer, the position and the tokens up to it, so
a loaded row can be checked against what the model would have written. Every job the
scheduler sends the worker is replayed on the reference worker and compared.

Run in the vLLM environment; skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import math
import os
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_mirror import CASES, _vllm_config, vllm_env  # noqa: E402  (the model families, the fixture)
from vllm_arena_engines import _worker_step  # noqa: E402  (the model runner's connector calls)
from vllm.config import KVTransferConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheLayout, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes  # noqa: E402

import kvcopy.vllm  # noqa: E402
from kvcopy.testing.vllm_offload import VllmCpuWorker  # noqa: E402
from kvcopy.vllm.offload import (  # noqa: E402
    KvcopyOffloadingConnector, KvcopyOffloadingSpec, KvcopyOffloadingWorker, drop_chunks,
)

init_none_hash(sha256)
assert vllm_env  # a fixture, used by name

# tests/vllm/test_vllm_mirror.py's model families, and the other block-outermost layouts vLLM
# canonicalizes as whole packed rows (BHLNC takes one page size only)
OFFLOAD_CASES = {**CASES, "heads_packed_blnhc": dict(CASES["heads_packed_blhnc"], layout="BLNHC"),
                 "one_group_bhlnc": dict(CASES["one_group"], layout="BHLNC")}
FAMILIES = ["one_group", "hybrid_kv_sharing", "kernel_split_32_to_16", "mla", "hybrid_lbnhc", "heads_padded",
            "heads_unified_block_size", "heads_packed_blhnc", "heads_packed_blnhc", "one_group_bhlnc", "gdn_padded",
            "gdn_exact", "gdn_kernel_split_32_to_16", "gdn_packed_blhnc"]
SPEC = {"spec_name": "KvcopyOffloadingSpec", "spec_module_path": "kvcopy.vllm"}


# ---------------------------------------------------------------- vLLM pieces
def _offload_config(model_config, case, connector="KvcopyOffloadingConnector", cpu_bytes=1 << 22, policy="recompute",
                    **extra):
    cfg = _vllm_config(model_config, case["block_size"], "NixlConnector", "kv_both", case.get("layout", "LBHNC"))
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_load_failure_policy=policy,
        kv_connector_module_path="kvcopy.vllm" if connector.startswith("Kvcopy") else None,
        kv_connector_extra_config={**SPEC, "cpu_bytes_to_use": cpu_bytes, **extra})
    return cfg


def _caches(cfg, case, num_blocks):
    """vLLM's KV cache config and device caches (KV-sharing layers aliased as the model runner does)."""
    groups = get_kv_cache_groups(cfg, case["specs"])
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    kcc = get_kv_cache_config_from_groups(cfg, groups, page * len(case["specs"]) * num_blocks)
    attn = [[SimpleNamespace(backend=case.get("backend", _flash()), kv_cache_spec=g.kv_cache_spec)]
            for g in kcc.kv_cache_groups]
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[case.get("layout", "LBHNC")],
                               prepare_kernel_block_sizes(kcc, attn))
    for layer, target in case.get("kv_sharing", {}).items():
        caches[layer] = caches[target]
    return kcc, caches


def _flash():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend


def _raw(t: torch.Tensor) -> torch.Tensor:
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))


def _storages(tensors) -> dict:
    return {t.untyped_storage().data_ptr(): _raw(t) for t in tensors}


def _fill(raws, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for r in raws:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=g))


class VllmReference:
    """vLLM's own CPU spec worker (:class:`kvcopy.testing.vllm_offload.VllmCpuWorker`)
    on clones of the device storages, its host tensors its own."""

    def __init__(self, worker: KvcopyOffloadingWorker, blocks_per_chunk: int):
        kv = worker.kv_caches
        self.ours = _storages(ct.tensor for ct in kv.tensors)
        self.clones = {p: r.clone() for p, r in self.ours.items()}

        def view(t):
            clone = self.clones[t.untyped_storage().data_ptr()]
            return torch.empty(0, dtype=t.dtype).set_(clone.untyped_storage(), t.storage_offset(), t.shape,
                                                      t.stride())

        tensors = [CanonicalKVCacheTensor(view(ct.tensor), ct.page_size_bytes) for ct in kv.tensors]
        self.vllm = VllmCpuWorker(CanonicalKVCaches(tensors, kv.group_data_refs), blocks_per_chunk,
                                  worker.jobs.num_chunks)
        self.cpu_tensors = self.vllm.cpu_tensors
        assert [tuple(t.shape) for t in self.cpu_tensors] == [tuple(t.shape) for t in worker.cpu_tensors]

    def store(self, job, gpu, cpu):
        return self.vllm.store(job, gpu, cpu)

    def load(self, job, cpu, gpu):
        return self.vllm.load(job, cpu, gpu)

    def sync_device_from_ours(self):
        for p, r in self.ours.items():
            self.clones[p].copy_(r)

    def device_equal(self) -> bool:
        return all(torch.equal(self.clones[p], r) for p, r in self.ours.items())

    def host_equal(self, cpu_tensors) -> bool:
        return all(torch.equal(a, b) for a, b in zip(cpu_tensors, self.cpu_tensors))


class Rig:
    """One worker: vLLM's caches, the connector's worker side, and the reference."""

    def __init__(self, model_config, case, bpc=1, connector="KvcopyOffloadingConnector", num_blocks=64, **extra):
        self.cfg = _offload_config(model_config, case, connector, blocks_per_chunk=bpc, **extra)
        self.cfg.cache_config.num_gpu_blocks_override = num_blocks
        self.bpc = bpc
        with set_current_vllm_config(self.cfg):
            self.kcc, self.caches = _caches(self.cfg, case, num_blocks)
            cls = KvcopyOffloadingConnector if connector.startswith("Kvcopy") else OffloadingConnector
            self.conn = cls(self.cfg, KVConnectorRole.WORKER, self.kcc)
            self.conn.register_kv_caches(self.caches)
        self.worker: KvcopyOffloadingWorker = self.conn.connector_worker.worker
        self.ref = VllmReference(self.worker, bpc)
        self.num_blocks = num_blocks

    def close(self):
        self.conn.shutdown()


@pytest.fixture
def rigs(vllm_env):
    made = []

    def make(case, **kw):
        made.append(Rig(vllm_env, OFFLOAD_CASES[case] if isinstance(case, str) else case, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _random_jobs(rng, rig, count):
    """``count`` store jobs: per group a few blocks (a random start in its first chunk),
    GPU blocks distinct across the jobs and groups (one block pool), chunks likewise."""
    groups = len(rig.worker.kv_caches.group_data_refs)
    gpu_pool = list(rng.permutation(np.arange(1, rig.num_blocks)))
    chunk_pool = list(rng.permutation(rig.worker.jobs.num_chunks))
    jobs = []
    for _ in range(count):
        sizes = [int(rng.integers(0, 4)) for _ in range(groups)]
        sizes[int(rng.integers(groups))] += 1
        starts = [int(rng.integers(0, 7)) for _ in range(groups)]
        gpu = [int(gpu_pool.pop()) for _ in range(sum(sizes))]
        cpu = [int(chunk_pool.pop()) for n, s in zip(sizes, starts) for _ in range(_chunks(n, s, rig.bpc))]
        jobs.append((sizes, starts, gpu, cpu))
    return jobs, gpu_pool


def _chunks(n, start, bpc):
    """Chunks a group's ``n`` blocks from block index ``start`` span (vLLM skips empty groups)."""
    return -(-(n + start % bpc) // bpc) if n else 0


def _specs_of(job, gpu=None):
    sizes, starts, g, c = job
    return GPULoadStoreSpec(list(g if gpu is None else gpu), group_sizes=sizes, block_indices=starts), \
        CPULoadStoreSpec(list(c))


def _poison_hosts(rig, seed):
    """Random bytes in every host tensor, the same in ours and the reference's."""
    _fill([_raw(t) for t in rig.worker.cpu_tensors], seed)
    for a, b in zip(rig.worker.cpu_tensors, rig.ref.cpu_tensors):
        b.copy_(a)


def _store_and_compare(rig, jobs, first_id=1):
    for i, job in enumerate(jobs):
        gpu, cpu = _specs_of(job)
        rig.ref.sync_device_from_ours()
        assert rig.worker.submit_store(first_id + i, gpu, cpu)
        (mine,) = rig.worker.get_finished()
        theirs = rig.ref.store(first_id + i, gpu, cpu)
        assert mine.success and mine.transfer_size == theirs.transfer_size
        assert rig.ref.host_equal(rig.worker.cpu_tensors), f"host bytes differ from vLLM's after store job {i}"


# ---------------------------------------------------------------- bytes against vLLM's own spec
@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_store_and_load_bytes_equal_vllms_own_spec(rigs, name, bpc):
    rig = rigs(name, bpc=bpc)
    rng = np.random.default_rng(zlib.crc32(f"{name}/{bpc}".encode()))
    _fill(rig.ref.ours.values(), 1)
    _poison_hosts(rig, 2)
    jobs, free = _random_jobs(rng, rig, 3)
    _store_and_compare(rig, jobs)
    stored = {p: r.clone() for p, r in rig.ref.ours.items()}
    # Loads into other blocks of a poisoned device: the bytes stored come back.
    for r in rig.ref.ours.values():
        r.fill_(0x5A)
    rig.ref.sync_device_from_ours()
    for i, job in enumerate(jobs):
        dst = [int(free.pop()) for _ in job[2]]
        gpu, cpu = _specs_of(job, dst)
        assert rig.worker.submit_load(100 + i, cpu, gpu, expedited=bool(i % 2))
        (mine,) = rig.worker.get_finished()
        theirs = rig.ref.load(100 + i, cpu, gpu)
        assert mine.success and mine.transfer_size == theirs.transfer_size
        assert rig.ref.device_equal(), f"device bytes differ from vLLM's after load job {i}"
        assert not rig.worker.take_failed_loads()
        assert _loaded_pages_differ(rig, stored, job, dst) == []


def _loaded_pages_differ(rig, stored, job, dst):
    """The (group, layer, block) pages of a load that differ from the pages its source
    blocks held when they were stored (``stored``: the device storages then)."""
    kv = rig.worker.kv_caches
    bad, at = [], 0
    for g, n in enumerate(job[0]):
        for k, ref in enumerate(kv.group_data_refs[g]):
            t = kv.tensors[ref.tensor_idx].tensor
            then = torch.empty(0, dtype=torch.uint8).set_(stored[t.untyped_storage().data_ptr()].untyped_storage(),
                                                          t.storage_offset(), t.shape, t.stride())
            for d, s in zip(dst[at:at + n], job[2][at:at + n]):
                if not torch.equal(t[d, :ref.page_size_bytes].view(torch.uint8), then[s, :ref.page_size_bytes]):
                    bad.append((g, k, d))
        at += n
    return bad


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_checksums_off_moves_the_same_bytes(rigs, name):
    rig = rigs(name, bpc=2, kvcopy={"checksum": False})
    assert not rig.worker.options.checksum
    _fill(rig.ref.ours.values(), 3)
    jobs, _ = _random_jobs(np.random.default_rng(4), rig, 2)
    _store_and_compare(rig, jobs)


# ---------------------------------------------------------------- checksums and the failure path
def _flip_in_stored_page(rig, job, which=0):
    """Flip one bit of a byte the store wrote: group with blocks, its ``which``-th block's
    sub-block, in its first layer's page. Returns (tensor index, chunk, byte)."""
    sizes, starts, _, cpu = job
    g = next(i for i, n in enumerate(sizes) if n)
    skip = starts[g] % rig.bpc
    first_chunk = sum(_chunks(n, s, rig.bpc) for n, s in zip(sizes[:g], starts[:g]))
    pos = skip + which
    chunk, j = cpu[first_chunk + pos // rig.bpc], pos % rig.bpc
    ref = rig.worker.kv_caches.group_data_refs[g][0]
    page = rig.worker.kv_caches.tensors[ref.tensor_idx].page_size_bytes
    byte = j * page + ref.page_size_bytes // 2
    t = rig.worker.cpu_tensors[ref.tensor_idx]
    t[chunk, byte] = int(t[chunk, byte]) ^ 0x10
    return ref.tensor_idx, chunk, byte


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing", "gdn_padded"])
def test_a_flipped_host_byte_fails_the_load_through_the_connector(rigs, name):
    rig = rigs(name, bpc=2)
    _fill(rig.ref.ours.values(), 5)
    jobs, free = _random_jobs(np.random.default_rng(6), rig, 2)
    _store_and_compare(rig, jobs)
    _flip_in_stored_page(rig, jobs[0])
    for i, job in enumerate(jobs):
        gpu, cpu = _specs_of(job, [int(free.pop()) for _ in job[2]])
        rig.worker.submit_load(200 + i, cpu, gpu)
    done = rig.worker.get_finished()
    # The connector takes the failure (its failed_recving path): the job itself reports done.
    assert [r.success for r in done] == [True, True]
    assert rig.worker.take_failed_loads() == {200}
    assert rig.worker.take_failed_loads() == set()


def test_a_never_stored_sub_block_fails_its_load(rigs):
    rig = rigs("one_group", bpc=2)
    gpu = GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
    rig.worker.submit_load(1, CPULoadStoreSpec([5]), gpu)
    rig.worker.get_finished()
    assert rig.worker.take_failed_loads() == {1}


def test_under_the_stock_connector_a_failed_load_stops_vllm(rigs):
    rig = rigs("one_group", bpc=1, connector="OffloadingConnector")
    assert isinstance(rig.worker, KvcopyOffloadingWorker) and not rig.worker.reports_failures
    _fill(rig.ref.ours.values(), 7)
    jobs, free = _random_jobs(np.random.default_rng(8), rig, 1)
    _store_and_compare(rig, jobs)
    _flip_in_stored_page(rig, jobs[0])
    gpu, cpu = _specs_of(jobs[0], [int(free.pop()) for _ in jobs[0][2]])
    cw = rig.conn.connector_worker
    cw._load_jobs[300] = "req"
    rig.worker.submit_load(300, cpu, gpu)
    with pytest.raises(AssertionError):  # vLLM's "we currently do not support job failures"
        cw.get_finished(set())


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_dropped_chunks_leave_vllms_manager_as_an_eviction_would(policy):
    """drop_chunks on vLLM's own CPUOffloadingManager: a chunk another load still reads
    stays (returned, to retry once that load completes), an idle one leaves (its
    lookup misses, a removal event names it, its chunk id is free); the evictable
    count stays what the manager's own eviction then relies on."""
    m = CPUOffloadingManager(num_chunks=4, cache_policy=policy, enable_events=True)
    ctx = ReqContext("r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
    assert m.prepare_store(keys, ctx) is not None
    m.complete_store(keys, ctx)
    list(m.take_events())
    m.prepare_load([keys[1]], ctx)  # a load still reads keys[1]
    assert drop_chunks(m, {keys[0], keys[1]}) == {keys[1]}
    assert (m.lookup(keys[0], ctx), m.lookup(keys[1], ctx)) == (LookupResult.MISS, LookupResult.HIT)
    assert [(e.keys, e.removed) for e in m.take_events()] == [([keys[0]], True)]
    m.complete_load([keys[1]], ctx)
    assert drop_chunks(m, {keys[1]}) == set()
    assert m.lookup(keys[1], ctx) == LookupResult.MISS
    assert m._num_evictable_cache_chunks == 2 and m._get_num_free_chunks() == 2  # keys 2, 3; chunks 0, 1
    # Four new chunks: the two freed ids and the two idle chunks evicted, no more, no fewer.
    new = [make_offload_key(bytes([9 + i]) * 32, 0) for i in range(4)]
    out = m.prepare_store(new, ctx)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys[2:])
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2, 3]
    m.complete_store(new, ctx)
    m.prepare_load(new, ctx)  # every chunk read: nothing to evict for a fifth
    assert m._num_evictable_cache_chunks == 0
    assert m.prepare_store([make_offload_key(b"x" * 32, 0)], ctx) is None
    assert drop_chunks(m, set(new) | {keys[2]}) == set(new)  # read, or gone: nothing removed


# ---------------------------------------------------------------- configuration
def test_the_spec_loads_through_vllms_factory_from_both_module_paths():
    for path in ("kvcopy.vllm", "kvcopy.vllm.offload"):
        assert OffloadingSpecFactory.get_spec_cls({"spec_name": "KvcopyOffloadingSpec",
                                                   "spec_module_path": path}) is KvcopyOffloadingSpec
    assert kvcopy.vllm.KvcopyOffloadingConnector is KvcopyOffloadingConnector


@pytest.mark.parametrize("raw,match", [
    ({"checksum": "yes"}, "checksum must be true or false"),
    ({"max_ctas": 0}, "max_ctas must be a positive integer"),
    ({"copy_backend": ""}, "copy_backend must be a backend name"),
    ({"backend": "cpu"}, r"unknown key\(s\) \['backend'\]"),
    ({"sums": True}, r"unknown key\(s\) \['sums'\]"),
    ([1], "must be an object"),
])
def test_bad_options_are_refused(raw, match):
    from kvcopy.vllm.config import OFFLOAD_SURFACE, PREFIX, parse

    with pytest.raises(ValueError, match=match) as raised:
        parse(raw, OFFLOAD_SURFACE)
    assert str(raised.value).startswith(PREFIX), raised.value


@pytest.mark.parametrize("extra,match", [
    ({"canonical_layout": True}, "canonical_layout"),
    ({"sync_load_budget_bytes": 1 << 20}, "sync loads"),
])
def test_unsupported_vllm_features_are_refused_at_startup(vllm_env, extra, match):
    cfg = _offload_config(vllm_env, CASES["one_group"], **extra)
    with set_current_vllm_config(cfg):
        kcc, _ = _caches(cfg, CASES["one_group"], 24)
        with pytest.raises(ValueError, match=match):
            KvcopyOffloadingConnector(cfg, KVConnectorRole.WORKER, kcc)


def test_sync_loads_with_checksums_off_are_accepted(vllm_env):
    cfg = _offload_config(vllm_env, CASES["one_group"], sync_load_budget_bytes=1 << 20, kvcopy={"checksum": False})
    with set_current_vllm_config(cfg):
        kcc, _ = _caches(cfg, CASES["one_group"], 24)
        KvcopyOffloadingConnector(cfg, KVConnectorRole.WORKER, kcc).shutdown()


def test_the_lhbnc_layout_is_refused_at_registration(rigs):
    with pytest.raises(ValueError, match="LHBNC"):
        rigs(dict(CASES["one_group"], layout="LHBNC"))


def test_the_connector_needs_the_kvcopy_spec(vllm_env):
    cfg = _offload_config(vllm_env, CASES["one_group"])
    cfg.kv_transfer_config.kv_connector_extra_config["spec_name"] = "CPUOffloadingSpec"
    with set_current_vllm_config(cfg):
        kcc, _ = _caches(cfg, CASES["one_group"], 24)
        with pytest.raises(ValueError, match="needs spec_name KvcopyOffloadingSpec"):
            KvcopyOffloadingConnector(cfg, KVConnectorRole.WORKER, kcc)


# ---------------------------------------------------------------- vLLM's scheduler, end to end
def _row_bytes(name, pos, tokens, row):
    """The model's KV row of layer ``name`` at position ``pos`` (module docstring)."""
    seed = zlib.crc32(f"{name}/{pos}/".encode() + np.asarray(tokens[:pos + 1], np.int64).tobytes())
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (row.numel() * row.element_size(),), dtype=torch.uint8, generator=g)


class Engine:
    """vLLM's scheduler and one worker with the connector; the test is the model runner."""

    def __init__(self, model_config, case, num_blocks=16, bpc=1, **extra):
        self.case = case
        self.cfg = _offload_config(model_config, case, blocks_per_chunk=bpc, cpu_bytes=1 << 23, **extra)
        self.cfg.cache_config.num_gpu_blocks_override = self.cfg.cache_config.num_gpu_blocks = num_blocks
        self.cfg.cache_config.enable_prefix_caching = True
        with set_current_vllm_config(self.cfg):
            self.kcc, self.caches = _caches(self.cfg, case, num_blocks)
            self.conn = KvcopyOffloadingConnector(self.cfg, KVConnectorRole.WORKER, self.kcc)
            self.conn.register_kv_caches(self.caches)
            sizes = [g.kv_cache_spec.block_size for g in self.kcc.kv_cache_groups]
            self.block_size, hash_size = math.lcm(*sizes), math.gcd(*sizes)  # scheduling and hashing granules
            self.sched = Scheduler(vllm_config=self.cfg,
                                   kv_cache_config=generate_scheduler_kv_cache_config([self.kcc]),
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=self.block_size, hash_block_size=hash_size, log_stats=True)
        self.worker: KvcopyOffloadingWorker = self.conn.connector_worker.worker
        self.ref = VllmReference(self.worker, bpc)
        self.hasher = get_request_block_hasher(hash_size, sha256)
        self.computed = {}  # request -> positions the model computed
        self.outputs = []  # every KVConnectorOutput
        self.stats = []
        self.watch = set()  # requests whose KV rows are checked when their prompt is whole
        self.checked = {}  # ... and the rows that differed then
        self._replay()

    def _replay(self):
        """Every job the scheduler sends the worker is also run by vLLM's own worker;
        host bytes (store) or device bytes (load) must be the same."""
        w, ref = self.worker, self.ref
        store, load = w.submit_store, w.submit_load

        def submit_store(job_id, gpu, cpu):
            ref.sync_device_from_ours()
            ok = store(job_id, gpu, cpu)
            ref.store(job_id, gpu, cpu)
            assert ref.host_equal(w.cpu_tensors), f"store job {job_id}: host bytes differ from vLLM's"
            return ok

        def submit_load(job_id, cpu, gpu, expedited=False):
            ref.sync_device_from_ours()
            ok = load(job_id, cpu, gpu, expedited)
            ref.load(job_id, cpu, gpu)
            assert ref.device_equal(), f"load job {job_id}: device bytes differ from vLLM's"
            return ok

        w.submit_store, w.submit_load = submit_store, submit_load

    def add(self, rid, tokens):
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        self.sched.add_request(Request(rid, list(tokens), sp, None, block_hasher=self.hasher))

    def _layers(self):
        for g, group in enumerate(self.kcc.kv_cache_groups):
            for name in group.layer_names:
                yield g, name, group.kv_cache_spec.block_size

    def _forward(self, out):
        """The model: each scheduled position's KV row in every layer."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            tokens = req.all_token_ids
            table = self.sched.kv_cache_manager.get_block_ids(rid)
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                self.computed.setdefault(rid, []).append(pos)
                for g, name, bs in self._layers():
                    row = self._row(name, table[g], pos, bs)
                    if row is not None:
                        raw = row.view(torch.uint8)
                        raw.copy_(_row_bytes(name, pos, tokens, row).view(raw.shape))

    def _row(self, name, blocks, pos, bs):
        cache = self.caches[name]
        if pos // bs >= len(blocks) or blocks[pos // bs] == 0:  # null block: out of a sliding window
            return None
        ratio = cache.shape[0] // self.kcc.num_blocks
        kbs = bs // ratio
        return cache[blocks[pos // bs] * ratio + (pos % bs) // kbs, :, pos % kbs]

    def step(self):
        sched, conn = self.sched, self.conn
        with set_current_vllm_config(self.cfg):
            out = sched.schedule()
            conn.handle_preemptions(out.kv_connector_metadata)
            self._forward(out)
            for rid in out.num_scheduled_tokens:  # a prompt's KV is whole: check it before vLLM frees it
                req = sched.requests[rid]
                if rid in self.watch and rid not in self.checked and req.num_computed_tokens >= req.num_prompt_tokens:
                    self.checked[rid] = self.check_rows(rid, req.prompt_token_ids)
            kv_out = _worker_step(conn, out)  # bind, start_load_kv, wait_for_save, results, worker metadata
            ids = list(out.num_scheduled_tokens)
            sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
                       for r in ids]
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled, kv_connector_output=kv_out)
            for eco in sched.update_from_output(out, mro).values():
                if eco.scheduler_stats is not None:
                    self.stats.append(eco.scheduler_stats)
            self.outputs.append(kv_out)

    def run_until_idle(self, limit=400):
        for _ in range(limit):
            if not self.sched.requests and not self.sched.connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError("the engine did not go idle")

    def check_rows(self, rid, tokens):
        """Every non-null KV row the request's block table holds equals the model's."""
        table = self.sched.kv_cache_manager.get_block_ids(rid)
        bad = []
        for g, name, bs in self._layers():
            for pos in range(len(tokens) - 1):
                row = self._row(name, table[g], pos, bs)
                if row is not None and not torch.equal(row.view(torch.uint8).reshape(-1),
                                                       _row_bytes(name, pos, tokens, row)):
                    bad.append((name, pos))
        return bad

    def close(self):
        self.sched.shutdown()
        self.conn.shutdown()


def _prompts(n, length, seed):
    g = np.random.default_rng(seed)
    return [g.integers(1, 250, length).tolist() for _ in range(n)]


def _cycle(engine, prompt, others, rid):
    """Run ``prompt``, evict it from the device cache with ``others``, run it again as
    ``rid`` and stop it when its KV is in place (loaded, then its last token computed)."""
    engine.add("first", prompt)
    engine.run_until_idle()
    for i, toks in enumerate(others):
        engine.add(f"other{i}", toks)
        engine.run_until_idle()
    return _run_prompt(engine, rid, prompt)


@pytest.fixture
def engines(vllm_env):
    made = []

    def make(name, **kw):
        made.append(Engine(vllm_env, CASES[name], **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("name,bpc", [("one_group", 1), ("one_group", 2), ("hybrid_kv_sharing", 1),
                                      ("kernel_split_32_to_16", 2), ("mla", 1)])
def test_an_evicted_prompt_is_loaded_back_from_the_cpu_byte_for_byte(engines, name, bpc):
    e = engines(name, bpc=bpc)
    prompt, *others = _prompts(5, 4 * e.block_size + 3, seed=zlib.crc32(name.encode()))
    bad = _cycle(e, prompt, others, "again")
    assert bad == []
    loaded = [o for o in e.outputs if o.finished_recving and "again" in o.finished_recving]
    assert loaded and not any(o.failed_recving for o in e.outputs)
    computed_again = e.computed["again"]
    assert len(computed_again) < len(prompt) - e.block_size, "the prompt was recomputed, not loaded"
    hits = sum(s.connector_prefix_cache_stats.hits for s in e.stats if s.connector_prefix_cache_stats)
    assert hits >= 2 * e.block_size  # the offload hit, in vLLM's own stats
    loaded_bytes = sum(s.kv_connector_stats["data"].get("vllm:kv_offload_load_bytes", {}).get((), 0)
                       for s in e.stats if s.kv_connector_stats)
    assert loaded_bytes >= 2 * e.worker.copier.tables("h2d").group_block_bytes.min()  # and in the connector's


def _run_prompt(e, rid, prompt):
    """Add ``prompt`` as ``rid``; step until its prompt's KV is in place (loaded or
    computed, up to its last token): the rows that differ from the model's then."""
    e.watch.add(rid)
    e.add(rid, prompt)
    e.run_until_idle()
    assert rid in e.checked, f"{rid} never computed its prompt"
    return e.checked[rid]


def test_a_flipped_byte_in_a_stored_block_is_caught_at_reload_and_recomputed(engines):
    e = engines("hybrid_kv_sharing")
    prompt, *others = _prompts(9, 4 * e.block_size + 3, seed=11)
    e.add("first", prompt)
    e.run_until_idle()
    # The chunk of the prompt's first full-attention block, located through vLLM's manager.
    manager = e.sched.connector.connector_scheduler.manager
    g = next(i for i, grp in enumerate(e.kcc.kv_cache_groups) if not isinstance(grp.kv_cache_spec, SlidingWindowSpec))
    hashes = Request("probe", prompt, SamplingParams(max_tokens=1), None, block_hasher=e.hasher).block_hashes
    key = make_offload_key(hashes[0], g)
    chunk = manager._policy.get(key)
    assert chunk is not None and chunk.is_ready
    for tensors in (e.worker.cpu_tensors, e.ref.cpu_tensors):  # the reference holds the same bytes
        t = tensors[e.worker.kv_caches.group_data_refs[g][0].tensor_idx]
        t[chunk.chunk_id, 5] = int(t[chunk.chunk_id, 5]) ^ 0x01
    for i, toks in enumerate(others[:4]):
        e.add(f"other{i}", toks)
        e.run_until_idle()
    assert _run_prompt(e, "again", prompt) == []  # what it runs on is the model's KV, not the flipped byte
    failed = [o for o in e.outputs if "again" in (o.failed_recving or ())]
    assert len(failed) == 1, "the load's failure did not reach vLLM's failed_recving"
    assert sorted(set(e.computed["again"])) == list(range(len(prompt))), "the prompt was not recomputed"
    # The bad chunk left the manager; the recomputed prompt was stored again and loads cleanly.
    for i, toks in enumerate(others[4:]):
        e.add(f"more{i}", toks)
        e.run_until_idle()
    n = len(e.outputs)
    assert _run_prompt(e, "third", prompt) == []
    assert any("third" in (o.finished_recving or ()) for o in e.outputs[n:])
    assert not any(o.failed_recving for o in e.outputs[n:])
    assert len(e.computed["third"]) < len(prompt) - e.block_size, "the third run was recomputed, not loaded"


def test_the_offload_benchmark_times_vllms_own_worker_beside_kvcopy():
    from test_offload import run_offload_bench

    out = run_offload_bench()
    assert "vLLM rows: yes" in out
    for direction in ("store", "load"):
        for method in ("memcpy", "kvcopy", "kvcopy+sums", "kvcopy plan", "vllm", "vllm plan"):
            assert f"4 KiB {direction} {method} " in " ".join(out.split()), (direction, method, out)
