"""D's pull figures in the form of vLLM's NIXL connector stats.

The arena connector subclasses vLLM's ``NixlBaseConnector``, so vLLM builds its stats
container (``NixlKVConnectorStats``) and Prometheus metrics (``vllm:nixl_xfer_time_seconds``,
``vllm:nixl_bytes_transferred``, ``vllm:nixl_num_descriptors``,
``vllm:nixl_num_failed_transfers``, ...) and logs "KV Transfer metrics" from what the
worker reports in ``get_kv_connector_stats``. :class:`PullStats` collects, per request D
loaded, the same fields vLLM's worker takes from NIXL's telemetry: from posting the READ
to the request's completion (READ, scatter and, with checksums, their comparison), the
post itself, the bytes READ and the NIXL descriptors posted (one per P rank for equal
geometry); a failed load counts as a failed transfer. Requests D needs nothing of (a full
prefix hit, an abort) are not counted.
"""
from __future__ import annotations

from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats


class PullStats:
    """Figures since the last :meth:`take` (module docstring)."""

    def __init__(self):
        self._stats = NixlKVConnectorStats()

    def record(self, seconds: float, post_seconds: float, nbytes: int, descriptors: int) -> None:
        d = self._stats.data
        d["transfer_duration"].append(float(seconds))
        d["post_duration"].append(float(post_seconds))
        d["bytes_transferred"].append(int(nbytes))
        d["num_descriptors"].append(int(descriptors))

    def record_failed(self) -> None:
        self._stats.record_failed_transfer()

    def take(self) -> Optional[NixlKVConnectorStats]:
        """The figures so far (vLLM's container), or None when there are none; resets."""
        if self._stats.is_empty():
            return None
        return self._stats.clone_and_reset()
