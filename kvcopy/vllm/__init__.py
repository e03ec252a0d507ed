"""kvcopy's vLLM 0.33 connectors, all under ``kv_connector_module_path: "kvcopy.vllm"``.

* ``KvcopyNixlConnector`` (:mod:`.mirror`): vLLM's NIXL connector, with its host-buffer
  copies done by one masked :class:`~kvcopy.core.copier.BlockCopier` call per request.
* ``KvcopyArenaConnector`` (:mod:`.arena`): vLLM's scheduler, kvcopy's transport (a NIXL
  arena, one READ descriptor per request, page sums checked).
* ``KvcopyOffloadingConnector`` with ``KvcopyOffloadingSpec`` (:mod:`.offload`,
  ``spec_module_path: "kvcopy.vllm"``): vLLM's KV offloading with kvcopy's copies.

The rest: :mod:`.config` (the one parser of ``kv_connector_extra_config["kvcopy"]`` and
each connector's options), :mod:`.groups` (vLLM's KV cache groups as the copier's layer groups),
:mod:`.checks` (the vLLM settings each connector refuses or changes), :mod:`.affinity`
(transfer threads on vLLM's KV-transfer cores). Importing this package checks the vLLM
version first (:mod:`.version`); ``import kvcopy`` never imports vLLM.
"""
from .version import SUPPORTED_VLLM, VLLM_VERSION  # first: the version gate, before any vLLM import

from .arena.connector import KvcopyArenaConnector
from .groups import transfer_layer_groups
from .mirror import KvcopyNixlConnector, KvcopyNixlScheduler, KvcopyNixlWorker
from .offload import KvcopyOffloadingConnector, KvcopyOffloadingSpec

__all__ = [
    "KvcopyArenaConnector",
    "KvcopyNixlConnector",
    "KvcopyNixlScheduler",
    "KvcopyNixlWorker",
    "KvcopyOffloadingConnector",
    "KvcopyOffloadingSpec",
    "SUPPORTED_VLLM",
    "VLLM_VERSION",
    "transfer_layer_groups",
]
