"""vLLM 0.33's configuration checks keyed on the name ``"NixlConnector"``, for kvcopy's connectors.

vLLM runs these only when ``kv_transfer_config.has_connector("NixlConnector")`` (or its
pull/push aliases), so none of them fires for ``kv_connector="KvcopyNixlConnector"`` or
``"KvcopyArenaConnector"``. They run in vLLM's own processes before kvcopy is imported
(config construction, the CPU platform's ``check_and_update_config``, the engine core's
start), so kvcopy cannot make vLLM's adjustments in time; :func:`check_config` refuses,
when either connector is made (scheduler and worker side), each configuration that vLLM
would have refused or changed for its ``NixlConnector``, naming the setting that makes
it pass:

* ``--enable-return-routed-experts``: vLLM refuses it with NixlConnector
  (``_verify_aux_output_compatibility``); both connectors refuse it in the same words.
* DCP size: vLLM asserts it is 1 or the transfer TP size, and > 1 only for MLA
  (``VllmConfig.__post_init__``). The mirror connector refuses the same; the arena
  connector refuses DCP > 1 and PCP > 1 (not built: it moves whole token rows per rank).
* DCP interleave: with DCP > 1 vLLM sets ``cp_kv_cache_interleave_size`` to the smallest
  group block size (``adjust_dcp_kv_cache_interleave_size``) and ``validate_block_size``
  skips its interleave assertion. The mirror connector refuses any other interleave
  (start with ``--cp-kv-cache-interleave-size N``), so vLLM's checks and kvcopy's agree.
* CPU platform conv-state layout: vLLM sets ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` for NIXL
  (``platforms/cpu.py``; otherwise ``SD`` where AVX-512 BF16 is there) and its NIXL worker
  asserts ``DS`` for Mamba/GDN models. The mirror connector refuses such a model without
  ``DS``; the arena connector puts the layout into its compatibility hash
  (:func:`kvcopy.vllm.arena.meta.compatibility_hash`): P and D of different layouts
  refuse each other and D recomputes.

``bidirectional_kv_xfer`` (vLLM's turn-2 reads back from D) is vLLM's own code in the
mirror connector; the arena connector refuses it (:func:`check_arena_only`): its prefill
side would send a turn-2 request down the save path, where it waits in
``WAITING_FOR_REMOTE_KVS`` forever.
"""
from __future__ import annotations

from typing import Optional

MIRROR = "KvcopyNixlConnector"
ARENA = "KvcopyArenaConnector"


def has_mamba(kv_cache_config) -> bool:
    """Whether any KV cache group holds Mamba/GDN state (vLLM's ``MambaSpec``)."""
    if kv_cache_config is None:
        return False
    from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

    return any(isinstance(spec, MambaSpec) for g in kv_cache_config.kv_cache_groups
               for spec in iter_layer_specs(g.kv_cache_spec))


def conv_state_layout() -> str:
    """vLLM's SSM conv-state layout here (``"DS"`` or ``"SD"``)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def check_config(vllm_config, connector: str, kv_cache_config=None) -> None:
    """Refuse (``ValueError``) what vLLM refuses or changes for ``NixlConnector`` by name
    (the module docstring's table); ``connector`` is :data:`MIRROR` or :data:`ARENA`."""
    if connector not in (MIRROR, ARENA):
        raise ValueError(f"unknown kvcopy connector {connector!r}")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and aux.enabled:
        raise ValueError(f"--enable-return-routed-experts is incompatible with {connector}; "
                         "PD auxiliary output is not supported (vLLM refuses it for NixlConnector alike).")
    par = vllm_config.parallel_config
    dcp, pcp = par.decode_context_parallel_size, par.prefill_context_parallel_size
    if connector == ARENA:
        if dcp > 1 or pcp > 1:
            raise ValueError(f"{ARENA} does not support context parallelism (decode_context_parallel_size={dcp}, "
                             f"prefill_context_parallel_size={pcp}); use {MIRROR} or NixlConnector")
        return
    _check_mirror_dcp(vllm_config, dcp, pcp, kv_cache_config)
    if has_mamba(kv_cache_config) and conv_state_layout() != "DS":
        raise ValueError(f"{MIRROR} with Mamba/GDN layers needs VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM's NIXL worker "
                         f"requires it; vLLM's CPU platform sets it only for NixlConnector by name, and the layout "
                         f"here is {conv_state_layout()}): set VLLM_SSM_CONV_STATE_LAYOUT=DS on P and D")


def _check_mirror_dcp(vllm_config, dcp: int, pcp: int, kv_cache_config) -> None:
    par, model = vllm_config.parallel_config, vllm_config.model_config
    transfer_tp = max(par.tensor_parallel_size, pcp)
    if dcp not in (1, transfer_tp):
        raise ValueError(f"decode_context_parallel_size={dcp} must be 1 or equal to the NIXL transfer parallel "
                         f"size={transfer_tp} ({MIRROR}, as vLLM asserts for NixlConnector).")
    if dcp == 1:
        return
    if model is not None and not model.use_mla:
        raise ValueError(f"PD with decode_context_parallel_size > 1 is only supported for MLA models ({MIRROR}, "
                         "as vLLM asserts for NixlConnector).")
    want = _smallest_block(kv_cache_config)
    if want is not None and par.cp_kv_cache_interleave_size != want:
        raise ValueError(f"{MIRROR} with decode_context_parallel_size={dcp}: vLLM sets cp_kv_cache_interleave_size "
                         f"to the block size ({want}) for NixlConnector by name, before kvcopy is loaded; it is "
                         f"{par.cp_kv_cache_interleave_size} here. Start with --cp-kv-cache-interleave-size {want}")


def _smallest_block(kv_cache_config) -> Optional[int]:
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return None
    return min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)


def check_arena_only(kv_transfer_config) -> None:
    """The arena connector's own refusal: ``bidirectional_kv_xfer`` (module docstring)."""
    if kv_transfer_config.get_from_extra_config("bidirectional_kv_xfer", False):
        raise ValueError(f"{ARENA} does not support bidirectional_kv_xfer (turn-2 reads of KV back from D): a "
                         "prefill-side turn-2 request would wait for a load that never comes. Leave it off, or use "
                         f"{MIRROR} (vLLM's own transfers)")
