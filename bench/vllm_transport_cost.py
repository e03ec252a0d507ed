"""The arena connector against vLLM 0.33's NixlConnector with host buffers, same model, same requests.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 build/venv-vllm/bin/python bench/vllm_transport_cost.py \\
        [--rounds 20] [--blocks 6] [--num-blocks 64] [--report-blocks 4096] [--arena-gib 1]

(also ``bench/vllm_connector_cost.py --transport ...``). Runs in the vLLM environment.

Model: 48 layers, every 6th full attention and the others sliding window (1,024 tokens),
8 KV heads x head size 128 fp16 (vLLM packs K and V: 64 KiB pages of 16 tokens); vLLM
groups it into 6 KV cache groups of 8 layers overlaid from byte 0. A request is
``--blocks`` blocks per group (the window holds them all), the same block ids for both
paths. P and D are vLLM-built caches (``get_kv_cache_config_from_groups``,
``allocate_kv_cache``) in one process, NIXL over UCX on loopback:

* **vLLM**: ``NixlConnector`` workers with ``kv_buffer_device="cpu"`` (the worker harness of
  ``tests/vllm/test_vllm_mirror.py``: vLLM's registration, its host buffers, its stock
  ``copy_kv_blocks`` with the CUDA platform's copies): P's ``wait_for_save``
  (``save_kv_to_host``), D's ``start_load_kv`` (vLLM's READ) and ``get_finished`` until
  the request is done (``sync_recved_kv_to_device`` included).
* **KvcopyNixlConnector**: the same, with kvcopy's masked copies in place of vLLM's op
  (what the mirror connector changes: the copies, not the transport).
* **arena**: ``KvcopyArenaConnector`` workers (its registration: the arena is the only
  host memory) and their ``TransferManager``: P's ``save`` (one masked pack), D's
  ``plan_pull`` / ``pull`` / ``poll`` / ``complete`` (one READ, one scatter). The
  connector's one control-plane question per request (D asks P's side channel for the
  records) is timed apart, against a listener on loopback (``side channel``).

It reports, per request: host memory (vLLM: its host buffers, one per layer as large as
the layer's cache; arena: ``arena_bytes``), in GiB for ``--report-blocks`` blocks per
layer (computed from the pages; the run itself uses ``--num-blocks``); descriptors posted
(counted at NIXL's ``make_prepped_xfer`` for vLLM, the plan's for the arena); and the
median time of save + READ + sync over ``--rounds`` interleaved rounds, arena / vLLM.
Indicative only on a loaded machine: run it on an idle one for figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vllm"))  # the harness

import msgspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata, NixlConnectorMetadata,
)
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import test_vllm_mirror as harness  # noqa: E402  (tests/vllm/test_vllm_mirror.py: vLLM's worker built the way the tests build it)
from kvcopy.vllm import KvcopyArenaConnector, KvcopyNixlConnector  # noqa: E402
from kvcopy.vllm.arena.channel import RECORDS_MSG, MAX_RECORDS_REPLY, RecordStore, batch_of, serve  # noqa: E402
from kvcopy.vllm.arena.record_client import SideChannel  # noqa: E402
from kvcopy.vllm.arena.meta import KvcopyArenaWorkerMeta, notify_bytes  # noqa: E402
from kvcopy.vllm.groups import host_mirror_bytes, positions  # noqa: E402

LAYER = "model.layers.{}.self_attn.attn"


def _model(root):
    """The tiny model directory and vLLM's distributed state (TP 1, gloo)."""
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    model = os.path.join(root, "tiny-llama")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8,
                   "num_hidden_layers": 48, "vocab_size": 256, "max_position_embeddings": 4096,
                   "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 128}, f)
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    with set_current_vllm_config(VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{root}/dist")
        initialize_model_parallel(1, 1)
    return mc


def _specs():
    kw = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16)
    return {LAYER.format(i): FullAttentionSpec(**kw) if i % 6 == 5 else SlidingWindowSpec(sliding_window=1024, **kw)
            for i in range(48)}


def _arena_worker(mc, role, num_blocks, arena_bytes):
    cfg = harness._vllm_config(mc, 16, "KvcopyArenaConnector", role)
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="KvcopyArenaConnector", kv_connector_module_path="kvcopy.vllm", kv_role=role,
        kv_connector_extra_config={"kvcopy": {"arena_bytes": arena_bytes}})
    with set_current_vllm_config(cfg):
        groups = get_kv_cache_groups(cfg, _specs())
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        kcc = get_kv_cache_config_from_groups(cfg, groups, page * 48 * num_blocks)
        caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
        conn = KvcopyArenaConnector(cfg, KVConnectorRole.WORKER, kcc)
        conn.register_kv_caches(caches)
    return conn, kcc, caches


def _fill(caches, seed):
    s = next(iter(caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


class _VllmPath:
    """vLLM's NixlConnector, host buffers, its stock op: one request per ``run``."""

    def __init__(self, mc, num_blocks, mp, connector=NixlConnector):
        case = dict(block_size=16, specs=_specs())
        self.p = harness.Engine(mc, case, connector, "kv_producer", num_blocks, mp)
        self.d = harness.Engine(mc, case, connector, "kv_consumer", num_blocks, mp)
        payload = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(
            self.p.worker.xfer_handshake_metadata.agent_metadata_bytes)
        with set_current_vllm_config(self.d.config):
            agent = self.d.worker.add_remote_agent(payload, 0, 1)
        # what vLLM's own handshake records (else D releases the peer as "replaced" after a read)
        self.d.worker._remote_agents[self.p.worker.engine_id] = {(0, 0): agent}
        self.d.worker._engine_by_address[("127.0.0.1", 0)] = self.p.worker.engine_id
        self.descriptors = []
        wrapper = self.d.worker.nixl_wrapper
        real = wrapper.make_prepped_xfer

        def counted(op, local_h, local_ids, remote_h, remote_ids, *a, **kw):
            self.descriptors.append(len(local_ids))
            return real(op, local_h, local_ids, remote_h, remote_ids, *a, **kw)
        mp.setattr(wrapper, "make_prepped_xfer", counted)
        self.n = 0

    def run(self, p_ids, d_ids, num_tokens):
        rid = f"v{self.n}"
        self.n += 1
        t0 = time.perf_counter()
        save = NixlConnectorMetadata()
        save.add_new_req_to_save(rid, p_ids, {"tp_size": 1})
        with set_current_vllm_config(self.p.config):
            self.p.connector.bind_connector_metadata(save)
            self.p.connector.wait_for_save()
        recv = NixlConnectorMetadata()
        recv.add_new_req_to_recv(rid, d_ids, {
            "remote_block_ids": p_ids, "remote_engine_id": self.p.worker.engine_id, "remote_request_id": rid,
            "remote_host": "127.0.0.1", "remote_port": 0, "tp_size": 1, "remote_num_tokens": num_tokens})
        with set_current_vllm_config(self.d.config):
            self.d.connector.bind_connector_metadata(recv)
            self.d.connector.start_load_kv(None)
            while rid not in self.d.worker.get_finished()[1]:
                pass
        return time.perf_counter() - t0

    def close(self):
        self.p.close()
        self.d.close()


class _ArenaPath:
    """The arena connector's workers: P's save, D's plan / pull / poll / complete."""

    def __init__(self, mc, num_blocks, arena_bytes):
        self.p, self.kcc, self.p_caches = _arena_worker(mc, "kv_producer", num_blocks, arena_bytes)
        self.d, _, self.d_caches = _arena_worker(mc, "kv_consumer", num_blocks, arena_bytes)
        self.pm, self.dm = self.p.arena_worker.manager, self.d.arena_worker.manager
        self.peer = self.dm.add_peer(self.pm.metadata())
        self.descriptors, self.n = [], 0
        self.tokens = self.d.arena_worker.puller.tokens

    def run(self, p_ids, d_ids, num_tokens):
        rid = f"a{self.n}"
        self.n += 1
        t0 = time.perf_counter()
        record = self.pm.save(positions(self.tokens, p_ids, num_tokens), num_tokens=num_tokens, request_id=rid)
        plan = self.dm.plan_pull(self.peer, record.to_bytes(), num_tokens, positions(self.tokens, d_ids, num_tokens),
                                 request_id=rid)
        h = self.dm.pull(plan, notify=notify_bytes(rid, 1))
        while self.dm.poll(h) == "PROC":
            pass
        done = self.dm.complete(h)
        dt = time.perf_counter() - t0
        assert done.ok, done.error
        self.descriptors.append(plan.num_descriptors)
        self.pm.arena.release(rid)  # P's next step, on D's notification
        return dt

    def close(self):
        self.p.shutdown()
        self.d.shutdown()


def _side_channel_rtt(record, rounds):
    """One records question to a listener on loopback (the connector asks once per request)."""
    store = RecordStore(60)
    store.update(KvcopyArenaWorkerMeta(staged={"r": {0: record}}))
    ready, stop = threading.Event(), threading.Event()
    with socket_port() as port:
        pass
    t = threading.Thread(target=serve, args=({}, ready, stop, "127.0.0.1", port, store), daemon=True)
    t.start()
    ready.wait()
    client = SideChannel(None, "")
    question = msgspec.msgpack.encode((RECORDS_MSG, [["r", [0]]]))
    out = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            reply = client.ask("127.0.0.1", port, question, MAX_RECORDS_REPLY)
            while not reply.done:
                time.sleep(0)
            (got,) = batch_of(reply.parts, [[0]], "bench")
            assert got.state == "ready"
            out.append(time.perf_counter() - t0)
    finally:
        client.close()
        stop.set()
        t.join()
    return statistics.median(out)


class socket_port:
    """A free loopback port (released at once, then bound by the listener)."""

    def __enter__(self):
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc):
        self.s.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=6, help="blocks per group per request (16 tokens each)")
    ap.add_argument("--num-blocks", type=int, default=64, help="blocks per layer in the run")
    ap.add_argument("--report-blocks", type=int, default=4096, help="blocks per layer for the memory figure")
    ap.add_argument("--arena-gib", type=float, default=1.0, help="the arena size reported (the run uses 256 MiB)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    for name, fn in harness._cuda_platform_copy_fns().items():  # vLLM's stock op on the CPU platform
        mp.setattr(type(current_platform), name, classmethod(fn), raising=False)
    with tempfile.TemporaryDirectory() as root:
        mc = _model(root)
        vl = _VllmPath(mc, args.num_blocks, mp)
        kv = _VllmPath(mc, args.num_blocks, mp, KvcopyNixlConnector)
        ar = _ArenaPath(mc, args.num_blocks, 256 << 20)
        try:
            _report(args, vl, kv, ar)
        finally:
            ar.close()
            kv.close()
            vl.close()
            mp.undo()


def _report(args, vl, kv, ar):
    n_groups = len(ar.kcc.transfer_groups)
    p_ids = [list(range(1 + g * args.blocks, 1 + (g + 1) * args.blocks)) for g in range(n_groups)]
    d_ids = [list(range(args.num_blocks - 1 - g * args.blocks, args.num_blocks - 1 - (g + 1) * args.blocks, -1))
             for g in range(n_groups)]
    n_tok = 16 * args.blocks
    for caches, seed in ((vl.p.caches, 1), (kv.p.caches, 2), (ar.p_caches, 3)):
        _fill(caches, seed)
    paths = {"vLLM NixlConnector": vl, "KvcopyNixlConnector": kv, "arena": ar}
    times = {k: [] for k in paths}
    for _ in range(args.rounds + 2):  # interleaved, the first two dropped (warm-up)
        for k, path in paths.items():
            times[k].append(path.run(p_ids, d_ids, n_tok))
    page = next(iter(ar.p_caches.values()))[0].numel() * 2
    layers = len(ar.p_caches)
    mirror_run = host_mirror_bytes(vl.p.caches)
    mirror = layers * args.report_blocks * page
    request = n_groups * len(ar.kcc.transfer_groups[0].layer_names) * args.blocks * page
    print(f"{layers} layers, {n_groups} KV cache groups, {page >> 10} KiB pages, {args.blocks} blocks/group/request "
          f"({request / 2**20:.0f} MiB), {args.rounds} rounds, torch threads 1")
    print(f"  pinned host memory, {args.report_blocks} blocks/layer: vLLM host buffers {mirror / 2**30:.2f} GiB "
          f"(this run: {mirror_run / 2**30:.2f} GiB for {args.num_blocks}); arena {args.arena_gib:.2f} GiB "
          f"({int(args.arena_gib * 2**30 // request)} such requests in flight)")
    print(f"  descriptors per request: vLLM {statistics.median(vl.descriptors[2:]):.0f} (KvcopyNixlConnector: "
          f"vLLM's READ, the same), arena {statistics.median(ar.descriptors[2:]):.0f}")
    med = {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"  save + READ + sync, {k:20s} median {v:8.2f} ms  (min {min(times[k][2:]) * 1e3:.2f})")
    print(f"  arena / vLLM: {med['arena'] / med['vLLM NixlConnector']:.2f}x (goal <= 1.1x); side channel, one "
          f"records question: {_side_channel_rtt(b'x' * 200, 200) * 1e3:.2f} ms median")


if __name__ == "__main__":
    main()
