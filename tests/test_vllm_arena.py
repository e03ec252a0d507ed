"""kvcopy.vllm.KvcopyArenaConnector against the real vLLM 0.33 package, on the CPU.

Each engine is vLLM's own: its config, ``get_kv_cache_config_from_groups`` and
``allocate_kv_cache`` (KV-sharing layers aliased as the model runner does), its
``Scheduler`` (which makes the connector's scheduler side through vLLM's connector
factory), and the connector's worker side with a real NIXL agent (UCX on loopback). The
test plays the model runner, as vLLM's ``KVConnectorModelRunnerMixin`` does each step:
``bind_connector_metadata``, ``start_load_kv``, (the forward: nothing; P's KV is random
bytes written up front), ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``, and feeds the
``ModelRunnerOutput`` to ``Scheduler.update_from_output``. P's requests come with
``do_remote_decode``; their ``kv_transfer_params`` go to D as a proxy passes them.

The expectation is built from vLLM's block tables alone (P's at the end of its prefill,
D's after the load), by token: every token row D holds for the prompt equals P's row of
the same token, for each layer of each transfer group (a state group: the whole state
row), rows of D's pages past the prompt are zero, and no other byte of D's backing buffer
changes. Where a pull fails, D's buffer must not change at all.

Run in the vLLM environment (``.ci/run``); skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm import (  # noqa: E402  (the model families and the distributed-state fixture)
    CASES, Kernel16Backend, _specs, _vllm_config, vllm_env,
)
from vllm.config import KVTransferConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheLayout, MambaSpec, iter_layer_specs  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes  # noqa: E402

from kvcopy.vllm import KvcopyArenaConnector  # noqa: E402
from kvcopy.vllm_arena import KvcopyArenaScheduler  # noqa: E402

assert vllm_env  # a fixture, used by name
init_none_hash(sha256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_group(kcc, g) -> bool:
    return any(isinstance(s, MambaSpec) for s in iter_layer_specs(kcc.transfer_groups[g].kv_cache_spec))


class ArenaEngine:
    """One engine built by vLLM's own code, with the arena connector on both sides."""

    def __init__(self, model_config, case, role, setenv, num_blocks=48, arena_bytes=1 << 22, engine_id=None,
                 policy="recompute", **kvcopy):
        self.block_size = case["block_size"]
        layout = case.get("layout", "LBHNC")
        self.config = cfg = _vllm_config(model_config, self.block_size, "KvcopyArenaConnector", role, layout)
        opts = {"arena_bytes": arena_bytes, "arena_ttl_s": 60, "pull_timeout_s": 20, "fetch_timeout_s": 30}
        opts.update(kvcopy)
        cfg.kv_transfer_config = KVTransferConfig(
            kv_connector="KvcopyArenaConnector", kv_connector_module_path="kvcopy.vllm", kv_role=role,
            kv_connector_extra_config={"kvcopy": opts}, engine_id=engine_id, kv_load_failure_policy=policy)
        cfg.cache_config.num_gpu_blocks_override = cfg.cache_config.num_gpu_blocks = num_blocks
        backend = case.get("backend", FlashAttentionBackend)
        if any(isinstance(s, MambaSpec) for s in case["specs"].values()):
            # vLLM caches Mamba prefixes only in its "align" mode; these specs keep one state block
            cfg.cache_config.enable_prefix_caching = False
            setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
            get_conv_state_layout.cache_clear()
        setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(_free_port()))
        with set_current_vllm_config(cfg):
            groups = get_kv_cache_groups(cfg, case["specs"])
            page = max(g.kv_cache_spec.page_size_bytes for g in groups)
            self.kcc = get_kv_cache_config_from_groups(cfg, groups, page * len(case["specs"]) * num_blocks)
            attn_groups = [[SimpleNamespace(backend=backend, kv_cache_spec=g.kv_cache_spec)]
                           for g in self.kcc.kv_cache_groups]
            kernel_sizes = prepare_kernel_block_sizes(self.kcc, attn_groups)
            sizes = [g.kv_cache_spec.block_size for g in self.kcc.kv_cache_groups]
            self.block_size, hash_size = math.lcm(*sizes), math.gcd(*sizes)  # scheduling and hashing granules
            self.caches = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout[layout], kernel_sizes)
            for layer, target in case.get("kv_sharing", {}).items():  # as the model runner does
                self.caches[layer] = self.caches[target]
            affinity = os.sched_getaffinity(0)
            self.worker = KvcopyArenaConnector(cfg, KVConnectorRole.WORKER, self.kcc)
            os.sched_setaffinity(0, affinity)  # vLLM's CPU worker pins a core per NUMA node
            if case.get("mla"):
                self.worker.arena_worker.use_mla, self.worker.arena_worker.total_kv_heads = True, None
            self.sched = None
            try:
                self.worker.register_kv_caches(self.caches)
                self.sched = Scheduler(vllm_config=cfg, kv_cache_config=generate_scheduler_kv_cache_config([self.kcc]),
                                       structured_output_manager=StructuredOutputManager(cfg),
                                       block_size=self.block_size, hash_block_size=hash_size)
                # what EngineCore does with its workers' handshake metadata
                self.sched.connector.set_xfer_handshake_metadata_pp_aware(
                    {(0, 0): self.worker.get_handshake_metadata()})
            except BaseException:
                self.close()
                raise
        assert isinstance(self.sched.connector.connector_scheduler, KvcopyArenaScheduler)
        storage = next(iter(self.caches.values())).untyped_storage()
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        self.tables = {}  # request -> vLLM's block table when its prompt was computed (P) or loaded (D)
        self.params = {}  # request -> kv_transfer_params of a finished request
        self.hasher = get_request_block_hasher(hash_size, sha256)

    @property
    def manager(self):
        return self.worker.arena_worker.manager

    def add(self, rid, tokens, params=None, max_tokens=1):
        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.sched.add_request(Request(rid, list(tokens), sp, None, block_hasher=self.hasher))

    def step(self):
        """One engine step, the model runner played by the test (see the module docstring)."""
        sched, conn = self.sched, self.worker
        with set_current_vllm_config(self.config):
            out = sched.schedule()
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.start_load_kv(None)
            conn.wait_for_save()
            res = conn.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving, invalid_block_ids=conn.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=conn.build_connector_worker_meta())
            conn.clear_connector_metadata()
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = sched.requests[rid]
                done = req.num_computed_tokens >= req.num_tokens  # the prompt (or the next token) computed
                if done and rid not in self.tables:
                    self.tables[rid] = sched.kv_cache_manager.get_block_ids(rid)
                sampled.append([7] if done else [])
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled, kv_connector_output=kv_out)
            for outs in sched.update_from_output(out, mro).values():
                for o in outs.outputs:
                    if o.finish_reason is not None:
                        self.params[o.request_id] = o.kv_transfer_params
        return kv_out

    def raw_bytes(self):
        return self.raw.clone()

    def close(self):
        if self.sched is not None:
            self.sched.shutdown()
        self.worker.shutdown()
        get_conv_state_layout.cache_clear()  # the next test reads its own environment


def run(engines, until, limit_s=60.0):
    """Step every engine until ``until()`` holds (a guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not until():
        assert time.monotonic() < deadline, "the engines did not get there"
        for e in engines:
            e.step()
        time.sleep(0.001)


def prefill(p, rids, tokens):
    """P computes each prompt and finishes it (max_tokens 1): its kv_transfer_params come back."""
    for rid, toks in zip(rids, tokens):
        p.add(rid, toks, {"do_remote_decode": True})
    run([p], lambda: all(r in p.params for r in rids))
    return [p.params[r] for r in rids]


def decode(d, p_engines, rids, tokens, params, limit_s=60.0):
    """D gets each request as a proxy sends it, and steps (P's engines too) until every
    load ended; returns the requests whose load failed. D's block tables are kept when
    the load ends (``finished_recving``)."""
    for rid, toks, prm in zip(rids, tokens, params):
        d.add(rid, toks, prm, max_tokens=2)
    ended, failed = set(), set()
    deadline = time.monotonic() + limit_s
    while not ended >= set(rids):
        assert time.monotonic() < deadline, f"D's loads did not end: {sorted(set(rids) - ended)}"
        out = d.step()
        for rid in out.finished_recving or ():
            if rid in d.sched.requests:  # (vLLM's "fail" policy ends a failed load's request at once)
                d.tables[rid] = d.sched.kv_cache_manager.get_block_ids(rid)
            ended.add(rid)
        failed |= set(out.failed_recving or ())
        for e in p_engines:
            e.step()
        time.sleep(0.001)
    return failed


# ------------------------------------------------------------------ the expectation
def _views(engine, storage, name):
    t = engine.caches[name]
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def expected_d(p, d, pairs, before, cached_tokens=0):
    """D's backing buffer after the loads of ``pairs`` ``[(P rid, D rid, tokens)]``, from
    vLLM's block tables alone (see the module docstring)."""
    exp = before.clone()
    st = exp.untyped_storage()
    for p_rid, d_rid, n in pairs:
        for g, group in enumerate(d.kcc.transfer_groups):
            pg, dg = p.kcc.transfer_group_ids[g], d.kcc.transfer_group_ids[g]
            p_ids, d_ids = p.tables[p_rid][pg], d.tables[d_rid][dg]
            for name in group.layer_names:
                if name not in d.caches:
                    continue
                _expect_layer(p, d, name, _views(d, st, name), p_ids, d_ids, n, cached_tokens,
                              _state_group(d.kcc, g), group.kv_cache_spec.block_size,
                              p.kcc.transfer_groups[g].kv_cache_spec.block_size)
    return exp


def _expect_layer(p, d, name, dst, p_ids, d_ids, n, cached, state, d_bs, p_bs):
    src = p.caches[name]
    if state:  # the running state: the last block of each table (no speculative scratch here)
        dst[d_ids[-1]] = src[p_ids[-1]]
        return
    d_tp, p_tp = dst.shape[2], src.shape[2]  # tokens per kernel page: [B, H, N, C] views
    d_r, p_r = d_bs // d_tp, p_bs // p_tp
    for k in range(cached // d_tp, -(-n // d_tp) if d_ids else 0):
        if k // d_r >= len(d_ids) or d_ids[k // d_r] == 0:
            continue  # a position D does not hold (sliding window)
        page = d_ids[k // d_r] * d_r + k % d_r
        for row in range(d_tp):
            t = k * d_tp + row
            start = max(k * d_tp, t // p_tp * p_tp)  # the piece this row is in, cut at both sides' pages
            if start >= n:
                dst[page, :, row] = 0
                continue
            pk = t // p_tp
            dst[page, :, row] = src[p_ids[pk // p_r] * p_r + pk % p_r, :, t % p_tp]
    # pages D allocated for the prompt past its end are zeroed
    for k in range(-(-n // d_tp), len(d_ids) * d_r):
        if k * d_tp < -(-n // d_bs) * d_bs and d_ids[k // d_r] != 0:
            dst[d_ids[k // d_r] * d_r + k % d_r] = 0


def assert_same(d, expected):
    got = d.raw_bytes()
    bad = (got != expected).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} bytes of D differ, first at {int(bad[0])}"


def _fill(p, d, seed):
    g = torch.Generator().manual_seed(seed)
    p.raw.copy_(torch.randint(0, 256, p.raw.shape, dtype=torch.uint8, generator=g))
    d.raw.fill_(0x5A)


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


def _prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (length,), generator=g).tolist() for length in lengths][:n]


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
    tokens = [(prefix or []) + t for t in _prompts(len(lengths), lengths, seed)]
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
        assert mem == "DRAM" and nbytes == e.manager.stats()["arena_bytes"] + e.manager.arena.arena.granule
    _fill(p, d, 1)
    tokens = _prompts(3, [40, 17, 64])
    rids = ["a", "b", "c"]
    params = prefill(p, rids, tokens)
    # P's KV blocks go back to its pool once staged, before D has read anything: the arena holds the KV
    run([p], lambda: not any(r in p.sched.requests for r in rids))
    assert p.manager.stats()["staged_requests"] == 3
    before = d.raw_bytes()
    assert decode(d, [p], rids, tokens, params) == set()
    assert_same(d, expected_d(p, d, [(r, r, len(t)) for r, t in zip(rids, tokens)], before))
    assert [pl.num_descriptors for pl in plans] == [1, 1, 1]  # equal geometry: one READ descriptor per request
    run([p], lambda: p.manager.stats()["staged_requests"] == 0)  # D's notifications freed P's spans
    assert d.manager.stats()["bytes_in_use"] == 0 and d.manager.stats()["live_transfer_handles"] == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_family_moves_every_group_exactly(engines, name):
    """Several groups overlaid from byte 0, KV-sharing layers, kernel-page splits, MLA,
    padded pages, unified block sizes, packed rows, attention + GDN state."""
    case = CASES[name]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    _fill(p, d, 2)
    _transfer(p, d, [70, 33], seed=2)


@pytest.mark.parametrize("layout", [x.name for x in KVCacheLayout])
def test_the_six_layouts(engines, layout):
    case = dict(CASES["hybrid_kv_sharing"], layout=layout)
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    _fill(p, d, 3)
    _transfer(p, d, [50], seed=3)


def test_prefix_hit_on_d_is_not_written(engines):
    """D computed a 32-token prefix before (its cached blocks keep D's own bytes); the
    request reads only the tokens after it."""
    case = CASES["hybrid_kv_sharing"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    _fill(p, d, 4)
    prefix = _prompts(1, [32], seed=40)[0]
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
    _fill(p, d, 5)
    _transfer(p, d, [70, 41], seed=5)


def test_kernel_page_split_on_p_only(engines):
    """P's 32-token blocks split into 16-token kernel pages, D's 16-token blocks: equal pages."""
    p = engines(dict(block_size=32, specs=_specs(4, block_size=32), backend=Kernel16Backend), "kv_producer")
    d = engines(dict(block_size=16, specs=_specs(4, block_size=16)), "kv_consumer")
    _fill(p, d, 6)
    _transfer(p, d, [45], seed=6)


# ------------------------------------------------------------------ back-pressure
# one_group: 4 layers, 2 KiB pages (2 heads x 16 tokens x 32 fp16 values); a 64-token
# prompt is a 32 KiB span. 40 KiB of arena (4 KiB granules, the first kept zero) holds one.
ONE_SPAN = 40 << 10


def test_p_arena_too_small_for_two_requests_the_second_waits_then_completes(engines):
    case = CASES["one_group"]
    p = engines(case, "kv_producer", arena_bytes=ONE_SPAN)
    d = engines(case, "kv_consumer")
    _fill(p, d, 7)
    tokens = _prompts(2, [64, 64], seed=7)
    params = prefill(p, ["x", "y"], tokens)  # both prefills end in one step
    st = p.manager.stats()
    assert st["staged_requests"] == 1 and st["failed_allocations"] >= 1  # the second is held back, not dropped
    assert {"x", "y"} <= set(p.sched.requests)  # and its KV blocks with it, until it is staged
    before = d.raw_bytes()
    assert decode(d, [p], ["x", "y"], tokens, params) == set()
    assert_same(d, expected_d(p, d, [("x", "x", 64), ("y", "y", 64)], before))
    assert p.manager.stats()["high_water"] <= ONE_SPAN


def test_d_arena_too_small_for_two_requests_the_second_waits_then_completes(engines):
    case = CASES["one_group"]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", arena_bytes=ONE_SPAN)
    _fill(p, d, 8)
    tokens = _prompts(2, [64, 64], seed=8)
    params = prefill(p, ["x", "y"], tokens)
    before = d.raw_bytes()
    assert decode(d, [p], ["x", "y"], tokens, params) == set()
    assert_same(d, expected_d(p, d, [("x", "x", 64), ("y", "y", 64)], before))
    assert d.manager.stats()["failed_allocations"] >= 1 and d.manager.stats()["bytes_in_use"] == 0


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
    _fill(p, d, 9)
    tokens = _prompts(1, [200], seed=9)[0]
    (params,) = prefill(p, ["big"], [tokens])
    _failed_load(d, "big", tokens, params, [p])
    run([p], lambda: "big" not in p.sched.requests)  # P's blocks freed too
    assert p.manager.stats()["staged_requests"] == 0


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_p_unreachable_fails_the_load_at_its_deadline(engines, name):
    case = CASES[name]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", fetch_timeout_s=1.0)
    _fill(p, d, 10)
    tokens = _prompts(1, [40], seed=10)[0]
    (params,) = prefill(p, ["lost"], [tokens])
    _failed_load(d, "lost", tokens, dict(params, remote_port=_free_port()))  # nothing listens there


def test_with_vllms_fail_policy_a_failed_load_ends_the_request_with_an_error(engines):
    """vLLM's default kv_load_failure_policy ("fail"): the same report ends the request."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer")
    d = engines(case, "kv_consumer", fetch_timeout_s=1.0, policy="fail")
    _fill(p, d, 12)
    tokens = _prompts(1, [40], seed=12)[0]
    (params,) = prefill(p, ["lost"], [tokens])
    before = d.raw_bytes()
    assert decode(d, [], ["lost"], [tokens], [dict(params, remote_port=_free_port())]) == {"lost"}
    assert "lost" not in d.sched.requests and d.params["lost"] is None  # finished (with an error)
    assert_same(d, before)


@pytest.mark.parametrize("name", ["one_group", "hybrid_kv_sharing"])
def test_a_completion_not_ok_of_any_cause_reaches_the_load_error_path(engines, monkeypatch, name):
    """kvcopy may report a pull as failed at ``complete`` (a checksum mismatch, for one):
    whatever the cause, D reports the request as a failed load and vLLM recomputes it."""
    case = CASES[name]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    _fill(p, d, 11)
    tokens = _prompts(1, [40], seed=11)[0]
    (params,) = prefill(p, ["bad"], [tokens])
    real = d.manager.complete

    def complete(h):
        done = real(h)  # the real one, so every span and handle is released as usual
        d.raw.copy_(before)  # a pull found bad writes nothing (kvcopy's contract); undo this one's
        return dataclasses.replace(done, ok=False, error="checksum mismatch (injected)")
    before = d.raw_bytes()
    monkeypatch.setattr(d.manager, "complete", complete)
    _failed_load(d, "bad", tokens, params, [p])


# ------------------------------------------------------------------ P in another process
def _prefill_child(conn, model_dir, root, case_name, engine_id, seed):
    """A spawned P engine (its own vLLM state: gloo, world size 1), driven over a pipe."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    with set_current_vllm_config(VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{root}/dist-child")
        initialize_model_parallel(1, 1)
    p = ArenaEngine(model_config, CASES[case_name], "kv_producer", os.environ.__setitem__, engine_id=engine_id)
    p.raw.copy_(torch.randint(0, 256, p.raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    conn.send("ready")
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            break
        conn.send(prefill(p, *args))
    p.close()


@pytest.fixture
def prefill_process(vllm_env, tmp_path):
    import multiprocessing as mp

    procs = []

    def start(case_name, engine_id, seed):
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=_prefill_child, args=(child, vllm_env.model, str(tmp_path), case_name, engine_id, seed),
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


def test_p_killed_mid_pull_fails_its_request_and_the_others_complete(engines, prefill_process, monkeypatch):
    """D loads one request from P2 (another process) and two from P1. P2 is stopped just
    before D posts its READ and killed right after: that request ends as a load error
    (its blocks reported, nothing written), D's other requests complete exactly."""
    case = CASES["one_group"]
    p2, pipe = prefill_process("one_group", "P2", 13)
    p1 = engines(case, "kv_producer", engine_id="P1")
    d = engines(case, "kv_consumer", engine_id="D", pull_timeout_s=3.0)
    _fill(p1, d, 14)
    (t_x,), (t_y, t_z) = _prompts(1, [48], seed=15), _prompts(2, [40, 56], seed=16)
    pipe.send(("prefill", (["x"], [t_x])))
    assert pipe.poll(120), "P2 did not prefill"
    (x_params,) = pipe.recv()
    y_params, z_params = prefill(p1, ["y", "z"], [t_y, t_z])
    real = d.manager.pull
    killed = []

    def pull(plan, *a, **kw):
        if any(name.startswith("kvcopy-arena-P2-") for name in plan.all_peers):
            os.kill(p2.pid, signal.SIGSTOP)  # P2 cannot serve the READ ...
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
    st = d.manager.stats()
    assert st["in_flight"] == 0 and st["live_transfer_handles"] == 0


def test_a_span_near_the_end_of_its_ttl_is_never_read(engines):
    """P's span lives ``arena_ttl_s``; a READ must end before P may hand the span to
    another request. P's side channel stops serving a record a margin before that
    (1 s here, of a 2 s TTL), and D fails the load instead of reading."""
    case = CASES["one_group"]
    p = engines(case, "kv_producer", arena_ttl_s=2.0)
    d = engines(case, "kv_consumer", fetch_timeout_s=3.0)
    _fill(p, d, 17)
    tokens = _prompts(1, [40], seed=17)[0]
    (params,) = prefill(p, ["old"], [tokens])
    time.sleep(1.2)  # the record is past its serving time, not yet past P's TTL
    _failed_load(d, "old", tokens, params, [p])


# ------------------------------------------------------------------ the parts, one by one
def test_options_are_checked():
    from kvcopy.vllm_arena_meta import ArenaOptions

    def opts(**kw):
        return ArenaOptions.from_config(KVTransferConfig(kv_connector="KvcopyArenaConnector", kv_role="kv_both",
                                                         kv_connector_extra_config={"kvcopy": kw}))
    assert opts(arena_bytes=1 << 20, pull_timeout_s=2).pull_timeout_s == 2
    for bad, match in [({"arena_bytes": 0}, "arena_bytes"), ({"arena_bytes": True}, "arena_bytes"),
                       ({"pull_timeout_s": float("nan")}, "pull_timeout_s"), ({"arena_ttl_s": "60"}, "arena_ttl_s"),
                       ({"arena_order": "row"}, "arena_order"), ({"arena_size": 1}, "unknown key"),
                       ({"key_env": ""}, "key_env")]:
        with pytest.raises(ValueError, match=match):
            opts(**bad)
    with pytest.raises(ValueError, match="KVCOPY_TEST_KEY.*not set"):
        opts(key_env="KVCOPY_TEST_KEY").key()


def test_reader_notifications_are_parsed_strictly():
    from kvcopy.vllm_arena_meta import notify_bytes, parse_notify

    assert parse_notify(notify_bytes("req-1", 4)) == ("req-1", 4)
    assert parse_notify(notify_bytes("a\0b", 2)) == ("a\0b", 2)  # the TP size is after the last NUL
    for bad in [b"req-1", b"kvcopy-arena\0req", b"kvcopy-arena\0req\0x", b"kvcopy-arena\0req\x000",
                b"kvcopy-arena\0req\x0099999", b"kvcopy-arena\0\xff\xfe\x001", b"kvcopy-arena\0\x001", "str"]:
        assert parse_notify(bad) is None, bad


def test_worker_reports_merge_over_tp_ranks():
    from kvcopy.vllm_arena_meta import KvcopyArenaWorkerMeta

    a = KvcopyArenaWorkerMeta(staged={"r": {0: b"x"}}, released={"q": {0}})
    b = KvcopyArenaWorkerMeta(staged={"r": {1: b"y"}}, failed={"s": {1: "full"}}, released={"q": {1}})
    m = a.aggregate(b)
    assert m.staged == {"r": {0: b"x", 1: b"y"}} and m.failed == {"s": {1: "full"}} and m.released == {"q": {0, 1}}
    assert not KvcopyArenaWorkerMeta() and m


@pytest.mark.parametrize("p_tp,d_tp,heads,expected", [
    (1, 1, 2, [1]), (2, 4, 8, [2, 2]), (4, 2, 8, [1, 1, 1, 1]), (2, 1, 8, [1, 1]),
    (4, 1, None, [1, 0, 0, 0]),  # MLA: one D rank reads one P rank; the others keep their span to the TTL
])
def test_each_p_rank_counts_the_d_ranks_that_read_it(p_tp, d_tp, heads, expected):
    from kvcopy.nixl import remote_ranks
    from kvcopy.vllm_arena_stage import readers_of

    assert [readers_of(r, p_tp, d_tp, heads) for r in range(p_tp)] == expected
    assert sum(expected) == sum(len(remote_ranks(r, d_tp, p_tp, heads)) for r in range(d_tp))


def test_record_store_answers():
    from kvcopy.vllm_arena_channel import RecordStore
    from kvcopy.vllm_arena_meta import KvcopyArenaWorkerMeta

    s = RecordStore(ttl_s=60, margin_s=5)
    assert s.lookup("r", [0, 1], now=0)["state"] == "pending"  # not reported yet
    s.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"a"}}), now=10)
    assert s.lookup("r", [0, 1], now=11)["state"] == "pending"  # rank 1 still staging
    s.update(KvcopyArenaWorkerMeta(staged={"r": {1: b"b"}}), now=12)
    got = s.lookup("r", [0, 1], now=20)
    assert got["state"] == "ready" and got["records"] == [[0, b"a"], [1, b"b"]] and got["ttl_left"] == 60 - 10 - 5
    assert s.lookup("r", [0, 1], now=66)["state"] == "expired"  # within the margin of P's TTL
    s.update(KvcopyArenaWorkerMeta(released={"r": {1}}), now=21)  # freed: never served again
    assert s.lookup("r", [0, 1], now=22)["state"] == "failed" and s.lookup("r", [0], now=22)["state"] == "ready"
    s.update(KvcopyArenaWorkerMeta(failed={"f": {0: "arena full"}}), now=22)
    assert "arena full" in s.lookup("f", [0], now=23)["error"]
    s.fail("g", "aborted on P")
    assert s.lookup("g", [0])["error"] == "aborted on P"
    s.purge(now=100)
    assert len(s) == 1  # only "g" (reported now) is younger than the TTL


def test_side_channel_answers_malformed_questions_without_raising():
    import msgspec

    from kvcopy.vllm_arena_channel import RECORDS_MSG, RecordStore, answer
    from kvcopy.vllm_arena_meta import KvcopyArenaWorkerMeta

    store = RecordStore(60)
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: b"rec"}}))
    enc = msgspec.msgpack.encode
    (ok,) = answer(enc((RECORDS_MSG, "r", [0])), {}, store)
    assert msgspec.msgpack.decode(ok)["records"] == [[0, b"rec"]]
    for q in [b"\xc1", enc(1), enc((RECORDS_MSG, "r")), enc((RECORDS_MSG, "", [0])), enc((RECORDS_MSG, "r", [])),
              enc((RECORDS_MSG, "r", [-1])), enc((RECORDS_MSG, "r", [True])), enc((RECORDS_MSG, "r", [1 << 20])),
              enc((RECORDS_MSG, "x" * 2000, [0])), enc((b"other", "r", [0]))]:
        (reply,) = answer(q, {}, store)
        assert msgspec.msgpack.decode(reply) == {"state": "failed", "records": [], "ttl_left": 0.0,
                                                 "error": "malformed question"}, q


def _one_reply_server(reply_parts):
    """A ROUTER on loopback that answers one question with ``reply_parts``."""
    import threading

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve_once():
        ident, empty, _ = sock.recv_multipart()
        sock.send_multipart([ident, empty] + reply_parts)
        sock.close(linger=1000)
        ctx.term()
    threading.Thread(target=serve_once, daemon=True).start()
    return port


@pytest.mark.parametrize("reply", [
    [b"\xc1"], [b"a", b"b"], {"state": "done", "records": [], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [], "ttl_left": 1.0, "error": ""},  # no record for rank 0
    {"state": "ready", "records": [[1, b"r"]], "ttl_left": 1.0, "error": ""},  # a rank not asked for
    {"state": "ready", "records": [[0, "r"]], "ttl_left": 1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": float("inf"), "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": -1.0, "error": ""},
    {"state": "ready", "records": [[0, b"r"]], "ttl_left": 1.0},
], ids=range(9))
def test_d_checks_p_s_records_reply(reply):
    import msgspec
    import zmq

    from kvcopy.vllm_arena_channel import fetch_records

    parts = reply if isinstance(reply, list) else [msgspec.msgpack.encode(reply)]
    port = _one_reply_server(parts)
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="malformed|records of ranks"):
            fetch_records(ctx, "127.0.0.1", port, "r", [0], 5.0)
    finally:
        ctx.destroy(linger=0)


def test_a_request_d_aborts_before_loading_frees_ps_span(engines):
    """vLLM's D scheduler hands an aborted remote-prefill request to the worker with no
    blocks, so P can free its KV: here D pulls nothing (a plan of holes) and its READ's
    notification frees P's span long before P's TTL."""
    case = CASES["one_group"]
    p, d = engines(case, "kv_producer"), engines(case, "kv_consumer")
    _fill(p, d, 18)
    tokens = _prompts(1, [40], seed=18)[0]
    (params,) = prefill(p, ["gone"], [tokens])
    run([p], lambda: "gone" not in p.sched.requests)
    assert p.manager.stats()["staged_requests"] == 1
    before = d.raw_bytes()
    d.add("gone", tokens, params, max_tokens=2)
    d.sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    run([d, p], lambda: p.manager.stats()["staged_requests"] == 0)
    assert_same(d, before)
    assert d.manager.stats()["bytes_in_use"] == 0 and not d.worker.arena_worker.puller.jobs
