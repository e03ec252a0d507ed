"""kvcopy.vllm.checks: vLLM 0.33's configuration checks keyed on the name "NixlConnector",
for kvcopy's two connectors, against vLLM's own behaviour on the same configuration.

Each case builds one configuration twice, once with vLLM's ``NixlConnector`` and once with
a kvcopy connector: vLLM refuses (or changes) the first by itself; for the second its
check does not fire (its gate is the connector's name) and the kvcopy connector, when it
is made, refuses it naming the same cause. Run in the vLLM environment.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from test_vllm_mirror import CASES, _vllm_config, vllm_env  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig  # noqa: E402
from vllm.config.aux_output import AuxOutputConfig  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402

from kvcopy.vllm import KvcopyArenaConnector, KvcopyNixlConnector  # noqa: E402
from kvcopy.vllm.arena.meta import compatibility_hash  # noqa: E402
from kvcopy.vllm.checks import ARENA, MIRROR, check_config  # noqa: E402

assert vllm_env  # a fixture, used by name
KVCOPY = {MIRROR: KvcopyNixlConnector, ARENA: KvcopyArenaConnector}


def _kv_cache_config(cfg, case):
    groups = get_kv_cache_groups(cfg, case["specs"])
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    return get_kv_cache_config_from_groups(cfg, groups, page * len(case["specs"]) * 8)


def _config(model_config, connector, **kv_extra):
    cfg = _vllm_config(model_config, 16, connector, "kv_both")
    if kv_extra:
        cfg.kv_transfer_config = KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_buffer_device="cpu", kv_connector_extra_config=kv_extra,
            kv_connector_module_path="kvcopy.vllm" if connector.startswith("Kvcopy") else None)
    return cfg


@pytest.mark.parametrize("connector", [MIRROR, ARENA])
def test_return_routed_experts_is_refused_as_vllm_refuses_it_for_nixl(vllm_env, connector):
    vllm_cfg = _config(vllm_env, "NixlConnector")
    assert vllm_cfg.kv_transfer_config.has_connector("NixlConnector")  # vLLM's gate: its refusal fires
    cfg = _config(vllm_env, connector)
    assert not cfg.kv_transfer_config.has_connector("NixlConnector")  # ...and here it does not
    cfg.aux_output_config = AuxOutputConfig(enable_return_routed_experts=True)
    kcc = _kv_cache_config(cfg, CASES["one_group"])
    with pytest.raises(ValueError, match=f"--enable-return-routed-experts is incompatible with {connector}"):
        KVCOPY[connector](cfg, KVConnectorRole.SCHEDULER, kcc)


def _dcp(model_config, connector, dcp, tp=4):
    # TP above the model's 2 KV heads: vLLM's own GQA rule for DCP
    par = ParallelConfig(decode_context_parallel_size=dcp, tensor_parallel_size=tp)
    cfg = _vllm_config(model_config, 16, connector, "kv_both")
    return VllmConfig(model_config=cfg.model_config, cache_config=cfg.cache_config, parallel_config=par,
                      kv_transfer_config=cfg.kv_transfer_config, device_config=cfg.device_config,
                      scheduler_config=cfg.scheduler_config)


def test_a_dcp_size_vllm_refuses_for_nixl_is_refused_by_kvcopy(vllm_env):
    words = "must be 1 or equal to the NIXL transfer parallel size=4"
    with pytest.raises(ValueError, match=words):  # vLLM's assertion, inside pydantic's ValidationError
        _dcp(vllm_env, "NixlConnector", 2)
    for connector, says in ((MIRROR, words), (ARENA, "does not support context paral")):
        cfg = _dcp(vllm_env, connector, 2)  # vLLM builds it: its assertion is gated on the name
        with pytest.raises(ValueError, match=says):
            check_config(cfg, connector, _kv_cache_config(cfg, CASES["one_group"]))


def test_mirror_dcp_past_the_size_rule_needs_mla_and_vllms_interleave(vllm_env, monkeypatch):
    # This GQA model admits no DCP size vLLM's NIXL rule accepts (DCP <= TP / 2 KV heads, DCP = TP):
    # past it by hand, the MLA rule, then the interleave vLLM sets for NixlConnector.
    cfg = _dcp(vllm_env, MIRROR, 2)
    cfg.parallel_config.tensor_parallel_size = 2
    kcc = _kv_cache_config(cfg, CASES["one_group"])
    with pytest.raises(ValueError, match="only supported for MLA models"):
        check_config(cfg, MIRROR, kcc)
    monkeypatch.setattr(type(cfg.model_config), "use_mla", property(lambda self: True))
    cfg.parallel_config.cp_kv_cache_interleave_size = 1  # vLLM would set 16 (the block size) for NixlConnector
    with pytest.raises(ValueError, match="Start with --cp-kv-cache-interleave-size 16"):
        check_config(cfg, MIRROR, kcc)
    cfg.parallel_config.cp_kv_cache_interleave_size = 16
    check_config(cfg, MIRROR, kcc)  # what vLLM's adjustment leaves passes


def test_mirror_with_mamba_needs_the_ds_conv_layout_vllm_sets_for_nixl(vllm_env, monkeypatch):
    case = CASES["gdn_padded"]
    cfg = _config(vllm_env, MIRROR)
    kcc = _kv_cache_config(cfg, case)
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    get_conv_state_layout.cache_clear()
    try:
        with pytest.raises(ValueError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
            KvcopyNixlConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
        check_config(cfg, ARENA, kcc)  # the arena moves the state as it lies...
        sd = compatibility_hash(cfg, None, "SD")
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        get_conv_state_layout.cache_clear()
        check_config(cfg, MIRROR, kcc)
        assert compatibility_hash(cfg, None, "DS") != sd  # ...and refuses a peer of the other layout
    finally:
        get_conv_state_layout.cache_clear()


def test_arena_refuses_bidirectional_kv_xfer_which_vllms_connector_runs(vllm_env):
    cfg = _config(vllm_env, "NixlConnector", bidirectional_kv_xfer=True)
    kcc = _kv_cache_config(cfg, CASES["one_group"])
    NixlPullConnector(cfg, KVConnectorRole.SCHEDULER, kcc).shutdown()
    cfg = _config(vllm_env, ARENA, bidirectional_kv_xfer=True)
    with pytest.raises(ValueError, match="does not support bidirectional_kv_xfer"):
        KvcopyArenaConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
