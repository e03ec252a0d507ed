"""vLLM 0.33 engines with the arena connector, for tests/vllm/test_vllm_arena.py (not a test module).

Each engine is vLLM's own: its config, ``get_kv_cache_config_from_groups`` and
``allocate_kv_cache`` (KV-sharing layers aliased as the model runner does), its
``Scheduler`` (which makes the connector's scheduler side through vLLM's connector
factory; the scheduler gets ``generate_scheduler_kv_cache_config`` of the workers' config,
as vLLM's engine core does), and the connector's worker side with a real NIXL agent (UCX
on loopback). :meth:`ArenaEngine.step` plays the model runner, as vLLM's
``KVConnectorModelRunnerMixin`` does each step: ``bind_connector_metadata``,
``start_load_kv``, (the forward: nothing; P's KV is random bytes written up front),
``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``, and feeds the ``ModelRunnerOutput`` to
``Scheduler.update_from_output``. P's requests come with ``do_remote_decode``; their
``kv_transfer_params`` go to D as a proxy passes them (:func:`prefill`, :func:`decode`).

The expectation (:func:`expected_d`) is built from vLLM's block tables alone (P's at the
end of its prefill, D's when its load ended), by token: every token row D holds for the
prompt equals P's row of the same token, for each layer of each transfer group (a state
group: the whole state row), rows of D's pages past the prompt are zero, and no other
byte of D's backing buffer changes.

Imported by the tests after they checked that vLLM 0.33 is there; :func:`prefill_child`
runs P in a spawned process (the kill test).
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import time
from types import SimpleNamespace

import torch
from test_vllm_mirror import CASES, _vllm_config
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheLayout, MambaSpec, iter_layer_specs
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

from kvcopy.nixl.planning.pack_order import natural_key
from kvcopy.vllm import KvcopyArenaConnector
from kvcopy.vllm.arena.connector import KvcopyArenaScheduler
from kvcopy.vllm.arena.meta import agent_name

init_none_hash(sha256)


def ask_side_channel(port: int, question: bytes, timeout_ms: int = 5000):
    """One question to the side channel on ``port`` (loopback), as any client on the
    network could ask it: the reply's parts (``zmq.Again`` if none comes in time)."""
    import zmq

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, timeout_ms)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(question)
        return s.recv_multipart()
    finally:
        ctx.destroy(linger=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_step(conn, out, forward=None) -> KVConnectorOutput:
    """One worker's part of a step (vLLM's KVConnectorModelRunnerMixin; ``forward(conn)``
    plays the model's layers where given, else the forward is nothing)."""
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    if forward is not None:
        forward(conn)
    conn.wait_for_save()
    res = conn.get_transfer_results(out.finished_req_ids)
    kv_out = KVConnectorOutput(
        finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
        failed_recving=res.failed_recving, invalid_block_ids=conn.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=conn.build_connector_worker_meta())
    conn.clear_connector_metadata()
    return kv_out


def _state_group(kcc, g) -> bool:
    return any(isinstance(s, MambaSpec) for s in iter_layer_specs(kcc.transfer_groups[g].kv_cache_spec))


class _Rank:
    """One worker rank: its KV cache config, caches (one backing buffer) and connector."""

    def __init__(self, cfg, case, tp_rank, tp, num_blocks):
        specs = {n: dataclasses.replace(s, num_kv_heads=s.num_kv_heads // tp) if tp > 1 else s
                 for n, s in case["specs"].items()}  # each rank holds its share of the KV heads
        groups = get_kv_cache_groups(cfg, specs)
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        self.kcc = get_kv_cache_config_from_groups(cfg, groups, page * len(specs) * num_blocks)
        backend = case.get("backend", FlashAttentionBackend)
        attn_groups = [[SimpleNamespace(backend=backend, kv_cache_spec=g.kv_cache_spec)]
                       for g in self.kcc.kv_cache_groups]
        kernel_sizes = prepare_kernel_block_sizes(self.kcc, attn_groups)
        self.caches = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout[case.get("layout", "LBHNC")],
                                        kernel_sizes)
        for layer, target in case.get("kv_sharing", {}).items():  # as the model runner does
            self.caches[layer] = self.caches[target]
        affinity = os.sched_getaffinity(0)
        self.worker = KvcopyArenaConnector(cfg, KVConnectorRole.WORKER, self.kcc)
        os.sched_setaffinity(0, affinity)  # vLLM's CPU worker pins a core per NUMA node
        w = self.worker.arena_worker
        if tp > 1:  # what vLLM's parallel state would say in worker process tp_rank of tp
            w.tp_rank, w.tp_size, w.name = tp_rank, tp, agent_name(cfg.kv_transfer_config.engine_id, tp_rank)
        if case.get("mla"):
            w.use_mla, w.total_kv_heads = True, None
        storage = next(iter(self.caches.values())).untyped_storage()
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        self.truth = None  # layer-wise tests: the KV the forward writes, layer by layer (fill_layerwise)
        self.saves = True  # the forward calls save_kv_layer (False: as under a FULL CUDA graph's replay)
        state = {n for g in range(len(self.kcc.transfer_groups)) if _state_group(self.kcc, g)
                 for n in self.kcc.transfer_groups[g].layer_names}
        # (layer, whether vLLM calls save_kv_layer for it: attention yes, GDN/Mamba no) in forward order
        self.layers = [(n, n not in state) for n in sorted(self.caches, key=natural_key)]

    def forward(self, conn):
        """The model's layers, in order: each writes its KV (``truth``'s bytes of its
        tensor), then vLLM's decorator calls ``save_kv_layer`` (attention layers only)."""
        storage, truth = self.raw.untyped_storage(), self.truth.untyped_storage()
        for name, attention in self.layers:
            _view(self.caches, storage, name).copy_(_view(self.caches, truth, name))
            if attention and self.saves:
                conn.save_kv_layer(name, self.caches[name], None)


class ArenaEngine:
    """One engine built by vLLM's own code, with the arena connector on both sides:
    vLLM's scheduler and ``tp`` worker ranks (``tp > 1``: each rank's worker told its rank,
    as vLLM's parallel state would; their outputs merged by vLLM's ``KVOutputAggregator``)."""

    def __init__(self, model_config, case, role, setenv, num_blocks=48, arena_bytes=1 << 22, engine_id=None,
                 policy="recompute", tp=1, port=None, **kvcopy):
        layout = case.get("layout", "LBHNC")
        self.config = cfg = _vllm_config(model_config, case["block_size"], "KvcopyArenaConnector", role, layout)
        opts = {"arena_bytes": arena_bytes, "arena_ttl_s": 60, "pull_timeout_s": 20, "fetch_timeout_s": 30}
        opts.update(kvcopy)
        cfg.kv_transfer_config = KVTransferConfig(
            kv_connector="KvcopyArenaConnector", kv_connector_module_path="kvcopy.vllm", kv_role=role,
            kv_connector_extra_config={"kvcopy": opts}, engine_id=engine_id, kv_load_failure_policy=policy)
        cfg.parallel_config.tensor_parallel_size = tp
        cfg.cache_config.num_gpu_blocks_override = cfg.cache_config.num_gpu_blocks = num_blocks
        if any(isinstance(s, MambaSpec) for s in case["specs"].values()):
            # vLLM caches Mamba prefixes only in its "align" mode; these specs keep one state block
            cfg.cache_config.enable_prefix_caching = False
            setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
            get_conv_state_layout.cache_clear()
        setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port or free_port()))
        self.ranks, self.sched = [], None
        with set_current_vllm_config(cfg):
            try:
                for r in range(tp):
                    self.ranks.append(_Rank(cfg, case, r, tp, num_blocks))
                    self.ranks[-1].worker.register_kv_caches(self.ranks[-1].caches)
                sizes = [g.kv_cache_spec.block_size for g in self.kcc.kv_cache_groups]
                self.block_size, hash_size = math.lcm(*sizes), math.gcd(*sizes)  # scheduling and hashing granules
                self.sched = Scheduler(vllm_config=cfg,
                                       kv_cache_config=generate_scheduler_kv_cache_config([x.kcc for x in self.ranks]),
                                       structured_output_manager=StructuredOutputManager(cfg),
                                       block_size=self.block_size, hash_block_size=hash_size)
                # what EngineCore does with its workers' handshake metadata
                self.sched.connector.set_xfer_handshake_metadata_pp_aware(
                    {(0, r): x.worker.get_handshake_metadata() for r, x in enumerate(self.ranks)})
            except BaseException:
                self.close()
                raise
        assert isinstance(self.sched.connector.connector_scheduler, KvcopyArenaScheduler)
        self.aggregator = KVOutputAggregator(tp)
        self.tables = {}  # request -> vLLM's block table when its prompt was computed (P) or loaded (D)
        self.params = {}  # request -> kv_transfer_params of a finished request
        self.hasher = get_request_block_hasher(hash_size, sha256)

    # rank 0's, for the one-rank engines most tests use
    kcc = property(lambda self: self.ranks[0].kcc)
    caches = property(lambda self: self.ranks[0].caches)
    worker = property(lambda self: self.ranks[0].worker)
    raw = property(lambda self: self.ranks[0].raw)
    manager = property(lambda self: self.ranks[0].worker.arena_worker.manager)

    def stats(self, rank=0) -> dict:
        """Rank ``rank``'s manager stats, under its worker's lock (the worker's
        housekeeping thread drives the manager too, between steps)."""
        w = self.ranks[rank].worker.arena_worker
        with w.lock:
            return w.manager.stats()

    def staged(self, rank=0) -> list:
        """The requests rank ``rank``'s arena holds staged (under its worker's lock)."""
        w = self.ranks[rank].worker.arena_worker
        with w.lock:
            return sorted(w.manager.arena.staged)

    def add(self, rid, tokens, params=None, max_tokens=1):
        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.sched.add_request(Request(rid, list(tokens), sp, None, block_hasher=self.hasher))

    def step(self):
        """One engine step, the model runner played by the test (see the module docstring)."""
        sched = self.sched
        with set_current_vllm_config(self.config):
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = sched.requests[rid]
                done = req.num_computed_tokens >= req.num_tokens  # the prompt (or the next token) computed
                if done and rid not in self.tables:
                    self.tables[rid] = sched.kv_cache_manager.get_block_ids(rid)
                sampled.append([7] if done else [])
            outputs = [ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                         sampled_token_ids=sampled,
                                         kv_connector_output=_worker_step(
                                             x.worker, out, x.forward if x.truth is not None else None))
                       for x in self.ranks]
            mro = self.aggregator.aggregate(outputs) if len(self.ranks) > 1 else outputs[0]
            for outs in sched.update_from_output(out, mro).values():
                for o in outs.outputs:
                    if o.finish_reason is not None:
                        self.params[o.request_id] = o.kv_transfer_params
        return mro.kv_connector_output

    def raw_bytes(self):
        """D's buffer (rank 0), or with several ranks one per rank."""
        return self.raw.clone() if len(self.ranks) == 1 else [x.raw.clone() for x in self.ranks]

    def close(self):
        if self.sched is not None:
            self.sched.shutdown()
        for x in self.ranks:
            x.worker.shutdown()
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
    return land(d, p_engines, rids, limit_s)


def land(d, p_engines, rids, limit_s=60.0):
    """Step D (and P's engines) until the loads of D's requests ``rids`` ended; returns
    those that failed (:func:`decode`, for requests D has already)."""
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
def _view(caches, storage, name):
    t = caches[name]
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def expected_d(p, d, pairs, before, cached_tokens=0):
    """D's backing buffer after the loads of ``pairs`` ``[(P rid, D rid, tokens)]``, from
    vLLM's block tables alone (see the module docstring). ``before``: D's buffer before,
    or one per D rank (then one expectation per D rank: KV head ``h`` of D rank ``r`` is
    global head ``r * heads + h``, held by the P rank whose heads include it)."""
    befores = before if isinstance(before, list) else [before]
    out = []
    for r, (rank, prior) in enumerate(zip(d.ranks, befores)):
        exp = prior.clone()
        for p_rid, d_rid, n in pairs:
            _expect_request(p, d, rank, r, exp.untyped_storage(), p.tables[p_rid], d.tables[d_rid], n, cached_tokens)
        out.append(exp)
    return out if isinstance(before, list) else out[0]


def _expect_request(p, d, rank, r, storage, p_table, d_table, n, cached):
    for g, group in enumerate(rank.kcc.transfer_groups):
        p_ids, d_ids = p_table[p.kcc.transfer_group_ids[g]], d_table[d.kcc.transfer_group_ids[g]]
        state = _state_group(rank.kcc, g)
        for name in group.layer_names:
            if name not in rank.caches:
                continue
            dst = _view(rank.caches, storage, name)
            d_heads, p_heads = dst.shape[1], p.caches[name].shape[1]
            for h in range(1 if state else d_heads):
                head = r * d_heads + h
                src = p.ranks[head // p_heads].caches[name]
                if not state:
                    dst_h, src_h = dst[:, h:h + 1], src[:, head % p_heads:head % p_heads + 1]
                else:
                    dst_h, src_h = dst, src
                _expect_layer(src_h, dst_h, p_ids, d_ids, n, cached, state, group.kv_cache_spec.block_size,
                              p.kcc.transfer_groups[g].kv_cache_spec.block_size)


def _expect_layer(src, dst, p_ids, d_ids, n, cached, state, d_bs, p_bs):
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
    """D's buffer (or each D rank's, against a list) is byte for byte ``expected``."""
    for rank, exp in zip(d.ranks, expected if isinstance(expected, list) else [expected]):
        bad = (rank.raw != exp).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} bytes of D differ, first at {int(bad[0])}"


def fill(p, d, seed):
    """P's KV random (every rank), D's poisoned."""
    g = torch.Generator().manual_seed(seed)
    for rank in p.ranks:
        rank.raw.copy_(torch.randint(0, 256, rank.raw.shape, dtype=torch.uint8, generator=g))
    for rank in d.ranks:
        rank.raw.fill_(0x5A)


def fill_layerwise(p, d, seed):
    """P's KV poisoned, the bytes its forward writes layer by layer random (every rank);
    D's poisoned. A copy made before its layer ran would carry P's poison to D."""
    g = torch.Generator().manual_seed(seed)
    for rank in p.ranks:
        rank.truth = torch.randint(0, 256, rank.raw.shape, dtype=torch.uint8, generator=g)
        rank.raw.fill_(0xC3)
    for rank in d.ranks:
        rank.raw.fill_(0x5A)


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (length,), generator=g).tolist() for length in lengths][:n]


def engine_process(model_dir, dist_file):
    """This process's vLLM state for one engine of ``model_dir`` (gloo, world size 1, its
    rendezvous in ``dist_file``): the model config, as a spawned engine process sets it up."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    with set_current_vllm_config(VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{dist_file}")
        initialize_model_parallel(1, 1)
    return model_config


def prefill_child(conn, model_dir, root, case_name, engine_id, seed, opts=None):
    """A spawned P engine (its own vLLM state: gloo, world size 1), driven over a pipe as
    vLLM's engine core drives its engine: stepped while its scheduler has requests
    (``has_requests``, which asks the connector too), otherwise idle, blocked on the pipe
    as the engine core blocks on its input queue (:func:`serve_commands`). ``opts``: the
    engine's (``port``: its side channel's) and the connector's options, and the test hook
    ``kill_after_post``: the process SIGKILLs itself right after posting its first push
    WRITE (before it could say the WRITE ended)."""
    model_config = engine_process(model_dir, f"{root}/dist-child")
    opts = dict(opts or {})
    kill_after_post = opts.pop("kill_after_post", False)
    p = ArenaEngine(model_config, CASES[case_name], "kv_producer", os.environ.__setitem__, engine_id=engine_id,
                    **opts)
    if kill_after_post:
        agent = p.worker.arena_worker.manager.push_writes._agent
        real_post = agent.post_read_descs

        def post_then_die(*a, **kw):
            out = real_post(*a, **kw)
            os.kill(os.getpid(), signal.SIGKILL)
            return out
        agent.post_read_descs = post_then_die
    p.raw.copy_(torch.randint(0, 256, p.raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    conn.send("ready")
    serve_commands(conn, p)
    p.close()


def serve_commands(conn, p):
    """The child's loop. Commands: ``("prefill", (rids, tokens))`` -> the requests'
    ``kv_transfer_params`` once P finished them; ``("stats", None)`` -> what P holds
    (:func:`p_state`); ``("snapshot", rids)`` -> (P's buffer, its block tables of ``rids``);
    ``("stop", None)``."""
    owed = []
    while True:
        busy = bool(owed) or p.sched.has_requests()
        if not busy or conn.poll(0):
            cmd, args = conn.recv()  # idle: nothing but a command wakes P (no step)
            if cmd == "stop":
                return
            if cmd == "prefill":
                for rid, toks in zip(*args):
                    p.add(rid, toks, {"do_remote_decode": True})
                owed.append(list(args[0]))
            elif cmd == "stats":
                conn.send(p_state(p))
            elif cmd == "snapshot":
                conn.send((p.raw.numpy().tobytes(), {r: p.tables[r] for r in args}))
        if p.sched.has_requests():
            p.step()
        while owed and all(r in p.params for r in owed[0]):
            conn.send([p.params[r] for r in owed.pop(0)])
        time.sleep(0.001)


def p_state(p) -> dict:
    """What a P engine holds (one rank): staged spans, requests waiting for arena space,
    requests its scheduler keeps, stagings skipped or spans freed because every reader
    gave up, and its manager's stats."""
    w = p.worker.arena_worker
    with w.lock:
        return {"staged": sorted(w.manager.arena.staged), "pending": sorted(w.stager.pending),
                "requests": sorted(p.sched.requests), "gave_up": w.stager.gave_up, "stats": w.manager.stats()}
